// Plan-guided placement, plans across runs (export, import, the prologue): see planned.hpp for the design.
#include "planned.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <numeric>
#include <optional>
#include <sstream>

#include "errors.hpp"
#include "packing.hpp"
#include "planned_internal.hpp"

namespace pymemplan {

using namespace planned_internal;

// ---------------------------------------------------------------------------------------------
// The prologue: the run's first requests, laid out in advance by a run that loads them

void PlannedAllocator::close_prologue() {
  prologue_open_ = false;
  prologue_events_ = base_ + events_.size();
  for (PrologueSlot& q : prologue_) {
    if (q.life == 0) q.life = prologue_events_ - q.start;
  }
}

void* PlannedAllocator::serve_prologue(std::size_t rounded, std::int64_t size, StreamId stream) {
  const std::size_t end = std::min(loaded_.size(), loaded_cursor_ + kPrologueWindow);
  std::size_t j = loaded_cursor_;
  while (j < end && !(loaded_[j].size == rounded && loaded_[j].stream == stream)) ++j;
  if (j == end) {
    // Not the run the prologue was recorded from (other shapes, other data), or not here.
    if (++loaded_misses_ > kPrologueMisses) {
      prologue_dropped_ = true;
      end_prologue(false);
    }
    return nullptr;
  }
  loaded_misses_ = 0;
  loaded_skipped_ += j - loaded_cursor_;
  loaded_cursor_ = j + 1;
  // A range still taken (a block that lives longer in this run) or not safe for the stream:
  // the pool serves the request.
  void* out = pool_->allocate_at(loaded_arena_, loaded_[j].offset, rounded, size, stream);
  if (out != nullptr) ++prologue_hits_;
  if (loaded_skipped_ > kPrologueMisses && loaded_skipped_ * 8 > loaded_cursor_) {
    prologue_dropped_ = true;
    end_prologue(false);
  } else if (loaded_cursor_ == loaded_.size()) {
    end_prologue(true);
  }
  return out;
}

namespace {

// The most pages of `page` bytes that the blocks alive at one time touch, laid out at
// `offsets` (the first blocks.size() of them).
std::size_t touched_peak(const std::vector<PackBlock>& blocks, const std::vector<std::size_t>& offsets,
                         std::size_t page) {
  std::vector<std::pair<std::size_t, std::size_t>> edges;  // (2 time + 1 if it starts, block)
  edges.reserve(2 * blocks.size());
  std::size_t pages = 0;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    edges.push_back({2 * blocks[i].start + 1, i});
    edges.push_back({2 * (blocks[i].start + blocks[i].life), i});
    pages = std::max(pages, (offsets[i] + blocks[i].size + page - 1) / page);
  }
  std::sort(edges.begin(), edges.end());  // at one time, ends before starts
  std::vector<std::uint32_t> users(pages, 0);
  std::size_t touched = 0, peak = 0;
  for (const auto& [key, i] : edges) {
    const bool starts = (key & 1) != 0;
    for (std::size_t q = offsets[i] / page; q < (offsets[i] + blocks[i].size + page - 1) / page; ++q) {
      if (starts) {
        touched += users[q]++ == 0 ? 1 : 0;
      } else {
        touched -= --users[q] == 0 ? 1 : 0;
      }
    }
    peak = std::max(peak, touched);
  }
  return peak;
}

}  // namespace

PackResult PlannedAllocator::lay_out_prologue(const std::vector<PackBlock>& blocks, std::uint64_t events,
                                              const std::vector<PackBlock>& continued,
                                              std::uint64_t continued_events, bool takes_over,
                                              bool* ahead) const {
  const std::size_t rounds = std::max<std::size_t>(config_.search_rounds, kPrologueRounds);
  const PackResult plain = pack_blocks(blocks, events, rounds, page());
  // A run restarted as the one that wrote the text stops where it stopped: a layout made for
  // what may come after is kept only where the prologue's own blocks touch no more pages at
  // once than in the layout of the prologue alone.
  const std::size_t floor = touched_peak(blocks, plain.offsets, page());
  *ahead = false;
  if (!continued.empty()) {
    const PackResult joint = pack_blocks(continued, continued_events, rounds, page());
    if (touched_peak(blocks, joint.offsets, page()) <= floor) {
      *ahead = true;
      return joint;
    }
  }
  if (takes_over) return plain;
  // No plan takes over where the prologue ends (a short run with none in step at its end):
  // the pool serves what comes next, around the blocks alive then. Where the layout leaves
  // them spread over the arena, the pool fits the next steps into what is left between
  // them (random training loops restarted after a trial run of a third of their events: 49
  // of 200 above their first run). Packed again with a block after the end that takes all
  // of the arena but the pages they need, they leave the pool one free range (30 of 200).
  std::size_t alive = 0;
  for (const PackBlock& b : blocks) {
    if (b.start + b.life == events) alive += b.size;
  }
  const std::size_t pages = round_up(plain.arena, page()), need = round_up(alive, page());
  if (alive == 0 || pages <= need) return plain;
  std::vector<PackBlock> together = blocks;
  for (PackBlock& b : together) {
    if (b.start + b.life == events) ++b.life;
  }
  together.push_back({static_cast<std::size_t>(events), 1, pages - need});
  PackResult t = pack_blocks(together, events + 1, rounds, page(), pages);
  if (t.arena > pages || touched_peak(blocks, t.offsets, page()) > floor) return plain;
  t.offsets.pop_back();
  return t;
}

void PlannedAllocator::continue_prologue(std::vector<PrologueSlot>& prologue, std::uint64_t& events,
                                         const Plan& p, std::size_t cursor) {
  const std::size_t n = p.slots.size(), t0 = p.slots[cursor].time;
  // Slot `cursor` is at e + 1, the cut at `end`; the free of a block the plan frees before
  // that slot, at e.
  const std::uint64_t e = events, end = e + 1 + (p.period - t0);
  // Blocks alive at the prologue's end live to the cut, unless the plan says when they go:
  // the prologue's last requests, back from the cursor on the plan's circle, while they match.
  for (PrologueSlot& q : prologue) {
    if (q.start + q.life == e) q.life = end - q.start;
  }
  std::size_t j = cursor;
  for (std::size_t i = prologue.size(), steps = 0; i-- > 0 && steps < n; ++steps) {
    j = j == 0 ? n - 1 : j - 1;
    const Slot& s = p.slots[j];
    PrologueSlot& q = prologue[i];
    if (s.size != q.size || s.stream != q.stream) break;
    if (q.start + q.life != end || !s.planned) continue;  // freed already, or outlives the pass
    // Its free, on the plan's time from slot `cursor` (a slot at or past the cursor is of
    // the pass before).
    const std::size_t freed = s.time + p.blocks[p.slot_block[j]].life;
    const std::size_t shift = j < cursor ? 0 : p.period;
    if (freed <= t0 + shift) {
      q.life = e + 1 - q.start;
    } else if (freed - shift - t0 < end - e - 1) {
      q.life = e + 1 + (freed - shift - t0) - q.start;
    }
  }
  for (std::size_t k = cursor; k < n; ++k) {
    // Slots that outlive the period are the pool's, as when the plan serves: one-off requests
    // of the pass it was made from (an optimizer's state made lazily) are often not made again,
    // and a run of them missing would drop the prologue.
    const Slot& s = p.slots[k];
    if (!s.planned) continue;
    PrologueSlot q;
    q.size = s.size;
    q.stream = s.stream;
    q.start = e + 1 + (s.time - t0);
    const std::uint64_t to_cut = end - q.start;
    q.life = std::min<std::uint64_t>(p.blocks[p.slot_block[k]].life, to_cut);
    prologue.push_back(q);
  }
  events = end;
}

void PlannedAllocator::end_prologue(bool whole) {
  if (loaded_arena_ == 0) return;
  pool_->retire_arena(loaded_arena_);
  loaded_arena_ = 0;
  loaded_.clear();
  loaded_.shrink_to_fit();
  if (!whole || loaded_plan_ == 0) return;
  // The prologue ended where a pass of this plan ended in the run it comes from: the next
  // request starts its next pass. Left to detection, the plan adopted by the stream's last
  // requests arms at its own cut, which need not be here: a plan of one step armed before an
  // evaluation step that the plan of a cycle of steps served in the earlier run.
  for (std::size_t i = 0; i < plans_.size(); ++i) {
    if (plans_[i].signature != loaded_plan_) continue;
    plans_[i].validated = true;  // it served the pass that ends here, and this run matched
    adopt(i, 0);
    prologue_handover_ = true;
    break;
  }
}


// ---------------------------------------------------------------------------------------------
// Plans across runs. The text: a header line ("pymemplan-plans 4"), "peak <bytes>" (the
// highest reserved of the run that wrote it), the number of plans, then per plan a line
// "plan <period> <signature> <slots>" and one line per slot, "<size> <stream> <time> <life>"
// (rounded size; time since the cut; life 0: the pool serves it). Blocks are the slots with
// a life; the signature is the hash detection keys plans by (build_plan). Then the prologue:
// "prologue <events> <slots> <plan> <cursor>" and one line per slot, "<size> <stream> <event>
// <life>" (the event index of the request; life >= 1, to the prologue's end at most). <plan>
// is the signature of the plan whose pass ended the prologue; where the run stopped before a
// prologue's end, that of the plan whose pass it stopped in, and <cursor> the slot its next
// request would have matched (0: at the plan's cut); 0 where that plan is not among those
// written. Versions 1 (no prologue), 2 (no <plan>) and 3 (no <cursor>) are still read.

namespace {
constexpr const char* kPlansHeader = "pymemplan-plans";
constexpr int kPlansVersion = 4;
}  // namespace

std::string PlannedAllocator::export_plans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const Plan*> out;
  for (const Plan& p : plans_) {
    if (p.arms_here != 0 && worth_an_arena(p) && p.slots.size() > kPrefix) out.push_back(&p);
  }
  std::ostringstream o;
  o << kPlansHeader << ' ' << kPlansVersion << '\n'
    << "peak " << pool_->reserved_high_water() << '\n' << out.size() << '\n';
  for (const Plan* p : out) {
    o << "plan " << p->period << ' ' << p->signature << ' ' << p->slots.size() << '\n';
    for (std::size_t j = 0; j < p->slots.size(); ++j) {
      const Slot& slot = p->slots[j];
      const std::size_t life = p->slot_block[j] == kNoOffset ? 0 : p->blocks[p->slot_block[j]].life;
      o << slot.size << ' ' << slot.stream << ' ' << slot.time << ' ' << life << '\n';
    }
  }
  // Still recording: the prologue is the run so far.
  const std::uint64_t events = prologue_open_ ? base_ + events_.size() : prologue_events_;
  const std::size_t n = prologue_.size() > kPrefix ? prologue_.size() : 0;
  auto written = [&](std::uint64_t signature) {
    return std::any_of(out.begin(), out.end(), [&](const Plan* p) { return p->signature == signature; });
  };
  // Closed, the prologue ends at the cut of the plan whose pass closed it; still recording
  // (a run shorter than a prologue), where the stream is in a pass of the active plan.
  std::uint64_t plan = 0, cursor = 0;
  if (n != 0 && !prologue_open_ && written(prologue_plan_)) {
    plan = prologue_plan_;
  } else if (n != 0 && prologue_open_ && in_step_ && active_ != kNoOffset && plans_[active_].validated &&
             written(plans_[active_].signature)) {
    plan = plans_[active_].signature;
    cursor = cursor_;
  }
  o << "prologue " << (n != 0 ? events : 0) << ' ' << n << ' ' << plan << ' ' << cursor << '\n';
  for (std::size_t j = 0; j < n; ++j) {
    const PrologueSlot& q = prologue_[j];
    o << q.size << ' ' << q.stream << ' ' << q.start << ' ' << (q.life != 0 ? q.life : events - q.start)
      << '\n';
  }
  return o.str();
}

std::size_t PlannedAllocator::import_plans(const std::string& text) {
  std::istringstream in(text);
  auto fail = [](const std::string& what) -> AllocatorError {
    return AllocatorError("import_plans: " + what + "; the text must be what export_plans() wrote");
  };
  auto number = [&](const char* what, std::uint64_t lo, std::uint64_t hi) {
    std::string word;
    if (!(in >> word)) throw fail(std::string("it ends where ") + what + " was expected");
    std::size_t pos = 0;
    unsigned long long v = 0;
    try {
      v = std::stoull(word, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (pos != word.size() || word[0] == '-' || v < lo || v > hi) {
      throw fail(std::string("bad ") + what + " '" + word + "' (expected an integer in [" +
                 std::to_string(lo) + ", " + std::to_string(hi) + "])");
    }
    return static_cast<std::uint64_t>(v);
  };
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  std::string header;
  if (!(in >> header) || header != kPlansHeader) {
    throw fail("it does not start with '" + std::string(kPlansHeader) + "'");
  }
  const std::uint64_t version = number("version", 0, kMax);
  if (version < 1 || version > kPlansVersion) {
    throw fail("its version is not 1 to " + std::to_string(kPlansVersion));
  }
  std::string word0;
  if (!(in >> word0) || word0 != "peak") throw fail("the line after the header does not start with 'peak'");
  const std::uint64_t peak = number("peak", 0, std::numeric_limits<std::int64_t>::max());
  const std::uint64_t count = number("number of plans", 0, 1024);
  // Everything is read and checked before anything is added.
  std::vector<Plan> read;
  for (std::uint64_t i = 0; i < count; ++i) {
    std::string word;
    if (!(in >> word) || word != "plan") throw fail("plan " + std::to_string(i) + " does not start with 'plan'");
    Plan p;
    p.period = number("period", config_.min_period, config_.max_period);
    p.signature = number("signature", 0, kMax);
    const std::uint64_t n = number("number of slots", kPrefix + 1, p.period);
    std::size_t last_time = 0;
    for (std::uint64_t j = 0; j < n; ++j) {
      Slot slot;
      slot.size = number("slot size", kAlign, std::numeric_limits<std::int64_t>::max());
      if (slot.size % kAlign != 0) {
        throw fail("slot size " + std::to_string(slot.size) + " is not a multiple of " + std::to_string(kAlign));
      }
      slot.stream = number("stream", 0, kMax);
      slot.time = number("slot time", last_time, p.period - 1);  // in order, on the period
      last_time = slot.time;
      const std::uint64_t life = number("lifetime", 0, p.period);
      slot.planned = life != 0;
      p.slot_block.push_back(life == 0 ? kNoOffset : p.blocks.size());
      if (life != 0) p.blocks.push_back({slot.time, static_cast<std::size_t>(life), slot.size});
      p.slots.push_back(slot);
    }
    read.push_back(std::move(p));
  }
  std::vector<PrologueSlot> prologue;
  std::uint64_t prologue_events = 0, prologue_plan = 0, prologue_cursor = 0;
  if (version >= 2) {
    std::string word;
    if (!(in >> word) || word != "prologue") {
      throw fail("the line after the plans does not start with 'prologue'");
    }
    // (A quarter of the range: events past the prologue's (a pass it stopped in) and twice
    // an event (touched_peak()) stay within it.)
    prologue_events = number("prologue events", 0, kMax / 4);
    const std::uint64_t n =
        number("number of prologue slots", 0, std::min<std::uint64_t>(kPrologueCap, prologue_events));
    if (version >= 3) prologue_plan = number("prologue plan", 0, kMax);
    if (version >= 4) prologue_cursor = number("prologue cursor", 0, kMax);
    std::uint64_t next = 0, total = 0;
    for (std::uint64_t j = 0; j < n; ++j) {
      PrologueSlot q;
      q.size = number("prologue slot size", kAlign, std::numeric_limits<std::int64_t>::max());
      if (q.size > kMaxPackTotal - total) {  // the packer's bound: no layout holds more
        throw fail("the prologue's slot sizes add up past " + std::to_string(kMaxPackTotal) + " bytes");
      }
      total += q.size;
      if (q.size % kAlign != 0) {
        throw fail("prologue slot size " + std::to_string(q.size) + " is not a multiple of " +
                   std::to_string(kAlign));
      }
      q.stream = number("stream", 0, kMax);
      q.start = number("prologue event", next, prologue_events - 1);  // one request per event, in order
      next = q.start + 1;
      q.life = number("prologue lifetime", 1, prologue_events - q.start);
      prologue.push_back(q);
    }
  }
  std::string rest;
  if (in >> rest) {
    throw fail("it goes on after its " + std::to_string(count) +
               (version >= 2 ? " plans and prologue ('" : " plans ('") + rest + "')");
  }

  // The prologue and the rest of the pass the run that wrote it stopped in (continue_prologue()).
  std::vector<PrologueSlot> continued;
  std::uint64_t continued_events = prologue_events;
  if (prologue_cursor != 0) {
    const auto named = std::find_if(read.begin(), read.end(),
                                    [&](const Plan& p) { return p.signature == prologue_plan; });
    if (named == read.end()) {
      throw fail("the prologue ends within a pass of plan " + std::to_string(prologue_plan) +
                 ", which is not among its plans");
    }
    if (prologue_cursor >= named->slots.size()) {
      throw fail("prologue cursor " + std::to_string(prologue_cursor) + " is past the last of plan " +
                 std::to_string(prologue_plan) + "'s " + std::to_string(named->slots.size()) + " slots");
    }
    if (prologue.size() > kPrefix) {
      continued = prologue;
      continue_prologue(continued, continued_events, *named, prologue_cursor);
    }
  }

  std::lock_guard<std::mutex> lock(mutex_);
  // Whether a plan takes over where the recorded prologue ends, at its cut (end_prologue()).
  auto named = [&](const Plan& p) { return p.signature == prologue_plan; };
  const bool takes_over = prologue_plan != 0 && prologue_cursor == 0 &&
                          (std::any_of(read.begin(), read.end(), named) ||
                           std::any_of(plans_.begin(), plans_.end(), named));
  std::size_t added = 0;
  for (Plan& p : read) {
    const bool known = std::any_of(plans_.begin(), plans_.end(),
                                   [&](const Plan& q) { return q.signature == p.signature; });
    if (known || plans_.size() >= config_.max_plans) continue;
    std::uint64_t h = 0;
    for (std::size_t j = 0; j < kPrefix; ++j) h = h * kHashBase + alloc_token(p.slots[j].size, p.slots[j].stream);
    p.prefix = h;
    p.id = ++plan_ids_;
    p.bound[0] = live_bound(p.blocks, p.period);
    // Validated as a plan of this run is: by a pass that matches it (a first step may hold
    // one-off requests the earlier run's steps did not).
    p.imported = true;
    p.cap = static_cast<std::size_t>(peak);
    p.built_at = 0;  // no window of this run's history: refresh() leaves it as it is
    plans_.push_back(std::move(p));
    ++added;
  }
  imported_ += added;
  // Laid out only before this run's first request (it describes a run from its start), and
  // with virtual memory: its arena maps pages as its blocks come, as the pool's segments do.
  if (prologue.size() > kPrefix && allocs_ == 0 && loaded_arena_ == 0 && config_.pool.vmm &&
      config_.prologue != 0) {
    auto blocks_of = [](const std::vector<PrologueSlot>& slots) {
      std::vector<PackBlock> blocks;
      blocks.reserve(slots.size());
      for (const PrologueSlot& q : slots) blocks.push_back({q.start, q.life, q.size});
      return blocks;
    };
    const auto t0 = std::chrono::steady_clock::now();
    bool ahead = false;
    const PackResult r = lay_out_prologue(blocks_of(prologue), prologue_events, blocks_of(continued),
                                          continued_events, takes_over, &ahead);
    pack_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::size_t recorded = prologue.size();
    if (ahead) prologue = std::move(continued);
    std::uintptr_t arena = 0;
    try {
      arena = pool_->create_arena(r.arena);
    } catch (const DeviceError&) {
      arena = 0;  // no address range for it: the pool serves the run, as without a prologue
    }
    if (arena != 0) {
      for (std::size_t j = 0; j < prologue.size(); ++j) prologue[j].offset = r.offsets[j];
      loaded_ = std::move(prologue);
      loaded_arena_ = arena;
      loaded_cap_ = static_cast<std::size_t>(peak);
      loaded_plan_ = takes_over || ahead ? prologue_plan : 0;
      prologue_ahead_ = loaded_.size() - recorded;
    }
  }
  return added;
}

}  // namespace pymemplan
