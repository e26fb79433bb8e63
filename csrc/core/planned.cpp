// Plan-guided placement: see planned.hpp for the design.
#include "planned.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <numeric>
#include <optional>
#include <sstream>

#include "errors.hpp"
#include "packing.hpp"

namespace pymemplan {
namespace {

constexpr std::uint64_t kHashBase = 1099511628211ULL;  // odd: arithmetic mod 2^64 stays invertible
constexpr std::size_t kAlign = 512;
// A candidate period is planned only if at least this share of the bytes allocated during it
// have a lifetime known and within the period (the rest would bypass the plan).
constexpr double kMinCoverage = 0.5;
// Candidate periods examined per detection (newest occurrences of the window, plus the oldest
// reached within kMaxChain steps of its chain).
constexpr std::size_t kMaxCandidates = 64;
constexpr std::size_t kMaxChain = 256;
// Detection runs at most once per (its work / kDetectBudget) events.
constexpr std::size_t kDetectBudget = 32;
// Candidate periods whose coverage is within this of the best one's are tied (see detect()).
constexpr double kTieMargin = 0.02;
// Two candidates predict the same period if this share of their events (sampled) are equal:
// the rest are frees whose distance depends on the step before.
constexpr double kSameShare = 0.95;
// Validation: a plan is armed at its cut only after a pass (cut to cut, or from adoption to
// the cut) in which requests of less than arena / kArmShare bytes failed to match it; an armed
// plan lets its arena go once mismatched requests exceed arena / kDisarmShare bytes in a pass.
constexpr std::size_t kArmShare = 32;
// Smallest share of the highest live (requested) bytes a plan's bound must reach to be armed.
constexpr double kMinPlanShare = 0.2;
constexpr std::size_t kDisarmShare = 16;
// A plan just made arms for the rest of the pass it was found in (arm_mid_pass()) if no more
// than kMidPassWindows match windows and 1/kMidPassShare of that pass have gone by: as soon
// as detection could tell. Deeper in, blocks of the pass that the plan does not place count
// in what it is said to need (llama_6l, 509 events in: 1,129 MiB for a peak of 877).
constexpr std::size_t kMidPassWindows = 2;
constexpr std::size_t kMidPassShare = 4;
// A request that would carry a serving plan's cursor past planned slots holding more than
// kHeldJump times its own bytes is served there, but the cursor waits for the next request
// (match_plan()).
constexpr std::size_t kHeldJump = 16;
// An arming keeps mapped what the plans that served within the last kRecentPeriods of their
// periods took, and what the steps between their passes had live.
constexpr std::uint64_t kRecentPeriods = 16;

std::uint64_t mix(std::uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t alloc_token(std::size_t rounded, StreamId stream) {
  return mix(mix(static_cast<std::uint64_t>(rounded)) ^ (stream * 0x2545f4914f6cdd1dULL));
}

std::uint64_t free_token(std::uint64_t distance) { return mix(distance ^ 0xf1ee5eedf1ee5eedULL); }

std::uint64_t pow_base(std::uint64_t e) {
  std::uint64_t r = 1, b = kHashBase;
  while (e != 0) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return r;
}

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

std::string to_hex(std::uintptr_t addr) {
  std::ostringstream s;
  s << "0x" << std::hex << addr;
  return s.str();
}

struct PlannedKey {
  const char* key;
  std::size_t PlannedConfig::*field;
  std::size_t lo, hi;
};
constexpr PlannedKey kPlannedKeys[] = {
    {"min_period", &PlannedConfig::min_period, 2, std::size_t{1} << 24},
    {"match_window", &PlannedConfig::match_window, 4, std::size_t{1} << 16},
    {"max_period", &PlannedConfig::max_period, 2, std::size_t{1} << 24},
    {"max_plans", &PlannedConfig::max_plans, 1, 1024},
    {"resync_window", &PlannedConfig::resync_window, 0, std::size_t{1} << 20},
    {"search_rounds", &PlannedConfig::search_rounds, 0, 100000},
    {"plan_slack", &PlannedConfig::plan_slack, 0, 1000},
    {"holes", &PlannedConfig::holes, 0, 1},
    {"prologue", &PlannedConfig::prologue, 0, std::size_t{1} << 18},
};

std::string planned_keys() {
  std::string out;
  for (const auto& k : kPlannedKeys) {
    out += out.empty() ? "" : ", ";
    out += std::string(k.key) + " (an integer in [" + std::to_string(k.lo) + ", " +
           std::to_string(k.hi) + "])";
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config

PlannedConfig PlannedConfig::parse(const std::string& conf) {
  PlannedConfig c;
  std::string rest;  // keys of the pool, parsed by PolicyConfig
  for (std::string item : split_config_items(conf)) {
    item = trim_space(item);
    if (item.empty()) continue;
    const auto colon = item.find(':');
    const std::string key = trim_space(item.substr(0, colon));
    const PlannedKey* known = nullptr;
    for (const auto& k : kPlannedKeys) {
      if (colon != std::string::npos && key == k.key) known = &k;
    }
    if (known == nullptr) {
      rest += (rest.empty() ? "" : ",") + item;
      continue;
    }
    const std::string value = trim_space(item.substr(colon + 1));
    const std::string expected = "an integer in [" + std::to_string(known->lo) + ", " +
                                 std::to_string(known->hi) + "]";
    const long long v = parse_config_int(key, value, expected);
    if (v < 0 || static_cast<unsigned long long>(v) < known->lo ||
        static_cast<unsigned long long>(v) > known->hi) {
      bad_config_value(key, value, expected);
    }
    c.*(known->field) = static_cast<std::size_t>(v);
  }
  try {
    c.pool = PolicyConfig::parse("pymemplan-vmm", rest);
  } catch (const AllocatorError& e) {
    // The pool's keys are checked as pymemplan-vmm's: name the policy the user gave.
    std::string what = e.what();
    const std::string pool = "policy 'pymemplan-vmm'";
    for (auto at = what.find(pool); at != std::string::npos; at = what.find(pool, at)) {
      what.replace(at, pool.size(), "policy 'pymemplan-planned'");
    }
    throw AllocatorError(what + "; policy 'pymemplan-planned' also takes: " + planned_keys());
  }
  if (c.min_period > c.max_period) {
    throw AllocatorError("allocator config: min_period (" + std::to_string(c.min_period) +
                         ") is above max_period (" + std::to_string(c.max_period) + ")");
  }
  return c;
}

std::string PlannedConfig::to_string() const {
  std::ostringstream out;
  for (const auto& k : kPlannedKeys) out << k.key << ':' << this->*(k.field) << ',';
  out << pool.to_string();
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Construction

PlannedAllocator::PlannedAllocator(std::shared_ptr<Device> device, PlannedConfig config)
    : device_(std::move(device)), config_(std::move(config)) {
  if (!device_) throw AllocatorError("PlannedAllocator needs a device");
  pool_ = std::make_unique<CachingAllocator>(device_, config_.pool);
  prefix_.push_back(0);
  prologue_open_ = config_.prologue != 0;
}

std::size_t PlannedAllocator::page() const { return std::max<std::size_t>(device_->granularity(), 1); }

// ---------------------------------------------------------------------------------------------
// Public entry points: the pool's, with the plan in front of malloc

void* PlannedAllocator::malloc(std::int64_t size, StreamId stream) {
  void* p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    p = allocate_locked(checked_request_size(size), stream);
  }
  if (p == nullptr) throw OutOfMemoryError(pool_->last_error());
  return p;
}

void* PlannedAllocator::try_malloc(std::int64_t size, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocate_locked(checked_request_size(size), stream);
}

void PlannedAllocator::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    pool_->free(ptr);  // throws AllocatorError with the pool's diagnosis
    throw AllocatorError("free: pointer " + to_hex(addr) + " was not allocated by this allocator");
  }
  pool_->free(ptr);
  const Live l = it->second;
  live_.erase(it);
  Event e;
  e.token = free_token(allocs_ - l.id);
  e.live_before = live_bytes_;
  live_bytes_ -= static_cast<std::int64_t>(l.size);
  const std::uint64_t g = record_event(e);
  if (l.event >= base_) ev(l.event).free_at = g;
  if (prologue_open_ && l.id < prologue_.size()) prologue_[l.id].life = g - prologue_[l.id].start;
  detect();
}

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

void PlannedAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_->record_stream(ptr, stream);
}

bool PlannedAllocator::owns(const void* ptr) const { return pool_->owns(ptr); }

void PlannedAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_->empty_cache();  // pending frees complete first
  lent_arena_ = 0;  // gone back with the pool's free segments, if it was free
  if (arena_ != 0 && !pool_->arena_in_use(arena_)) {
    // Idle: it becomes a segment of the pool and goes back too (a new one is made when a
    // plan arms again).
    pool_->retire_arena(arena_);
    pool_->trim(0, 0);
    arena_ = 0;
    arena_size_ = 0;
    stop_serving();
  }
}

void PlannedAllocator::set_memory_limit(std::size_t bytes) { pool_->set_memory_limit(bytes); }

void PlannedAllocator::set_memory_fraction(double fraction) { pool_->set_memory_fraction(fraction); }

std::size_t PlannedAllocator::memory_limit() const { return pool_->memory_limit(); }

Stats PlannedAllocator::stats() const { return pool_->stats(); }

void PlannedAllocator::reset_peak_stats() { pool_->reset_peak_stats(); }

void PlannedAllocator::reset_accumulated_stats() { pool_->reset_accumulated_stats(); }

std::vector<SegmentInfo> PlannedAllocator::snapshot() const { return pool_->snapshot(); }

std::string PlannedAllocator::last_error() const { return pool_->last_error(); }

std::size_t PlannedAllocator::round_size(std::size_t size) const { return pool_->round_size(size); }

std::string PlannedAllocator::config_string() const { return config_.to_string(); }

std::int64_t PlannedAllocator::reserved_bytes() const { return pool_->reserved_bytes(); }

std::uint64_t PlannedAllocator::first_planned_request() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_planned_;
}

double PlannedAllocator::planning_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pack_seconds_;
}

std::vector<std::pair<std::string, double>> PlannedAllocator::plan_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::string, double>> out;
  auto put = [&](const char* k, double v) { out.emplace_back(k, v); };
  auto num = [](auto v) { return static_cast<double>(v); };
  put("plan_hits", num(plan_hits_));
  put("fallbacks", num(fallbacks_));
  put("slot_busy", num(slot_busy_));
  put("divergences", num(divergences_));
  put("plans", num(plans_.size()));
  put("plans_built", num(plans_built_));
  put("plan_switches", num(plan_switches_));
  put("arms", num(arms_));
  put("arm_refusals", num(arm_refusals_));
  put("refinements", num(refinements_));
  put("remakes", num(remakes_));
  put("detection_ties", num(ties_));
  put("layouts_kept", num(layouts_kept_));
  put("tail_layouts", num(tail_layouts_));
  put("packings_reused", num(packings_reused_));
  put("full_rearms", num(full_rearms_));
  put("first_request_cuts", num(first_request_cuts_));
  put("busy_arenas_retired", num(busy_arenas_retired_));
  put("arenas_made", num(arenas_made_));
  put("arenas_reclaimed", num(arenas_reclaimed_));
  put("mid_pass_arms", num(mid_pass_arms_));
  put("marks", num(marks_));
  put("plans_imported", num(imported_));
  put("prologue_recorded", num(prologue_.size()));
  put("prologue_hits", num(prologue_hits_));
  put("prologue_serving", loaded_arena_ != 0 ? 1.0 : 0.0);
  put("prologue_dropped", prologue_dropped_ ? 1.0 : 0.0);
  put("prologue_handover", prologue_handover_ ? 1.0 : 0.0);
  put("prologue_ahead", num(prologue_ahead_));
  put("armed", armed_ ? 1.0 : 0.0);
  put("active_plan_period", active_ == kNoOffset ? 0.0 : num(plans_[active_].period));
  put("plan_coverage", last_coverage_);
  put("plan_arena_bytes", num(last_arena_));
  put("plan_bound_bytes", num(last_bound_));
  put("plan_ratio", last_ratio_);
  put("plan_hole_bytes", num(last_hole_bytes_));
  put("hole_hits", num(hole_hits_));
  put("plan_hole_cost_bytes", num(last_hole_cost_));
  put("pack_seconds", pack_seconds_);
  put("arm_held_bytes", num(last_held_));
  put("shared_page_bytes", num(shared_bytes_));
  put("arm_footprint_bytes", num(last_footprint_));
  put("live_hwm_bytes", num(live_hwm_));
  put("reserved_high_water_bytes", num(pool_->reserved_high_water()));
  put("arena_bytes", num(arena_size_));
  put("arena_mapped_bytes", num(arena_ != 0 ? pool_->arena_mapped(arena_) : 0));
  put("first_planned_request", first_planned_ == kNever ? -1.0 : num(first_planned_));
  return out;
}

std::pair<std::size_t, std::vector<PackBlock>> PlannedAllocator::last_plan_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {last_period_, last_blocks_};
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

// ---------------------------------------------------------------------------------------------
// Allocation

void* PlannedAllocator::allocate_locked(std::size_t size, StreamId stream) {
  const std::size_t rounded = pool_->round_size(size);
  const std::uint64_t id = allocs_++;
  const std::uint64_t token = alloc_token(rounded, stream);
  recent_[id % kPrefix] = token;

  const Slot* slot = nullptr;
  Slot matched;
  std::uint64_t arm_after = 0;  // id of a plan to arm once this request is served
  if (active_ != kNoOffset && !armed_ && !at_cut_ && ever_diverged_ && pass_matches_ < kPrefix &&
      live_bytes_ <= live_at_cut_) {
    // The stream diverged from the plan at its cut (an evaluation step between training
    // steps; a few of its requests may have matched slots by their size), the pool served
    // that, and what it made is freed again. The plan's first request now starts a pass: the
    // plan arms for it at once rather than at the end of a pass the pool would serve
    // (evaluation loop 0 of alloc_random: 112 MiB in each training step after an evaluation,
    // against 108 in the others).
    const Plan& p = plans_[active_];
    if (p.validated && !p.slots.empty() && p.slots[0].size == rounded && p.slots[0].stream == stream) {
      cursor_ = 0;
      at_cut_ = true;
      ++first_request_cuts_;
    }
  }
  if (active_ != kNoOffset) {
    if (at_cut_ && boundary(false)) {
      // The plan arms at its cut. Where the pool, not the plan, will serve the request that
      // starts the pass (a block that outlives the period, such as the next input batch made
      // before the last is released), it arms once that request is served, so that what the
      // pool holds then is what the plan is accepted against.
      const std::size_t cursor = cursor_, skipped = pass_skipped_bytes_, held = held_slot_;
      const bool cut = at_cut_;
      bool x = false;
      const Slot* first = match_plan(rounded, stream, &x);
      held_slot_ = held;
      cursor_ = cursor;
      pass_skipped_bytes_ = skipped;
      at_cut_ = cut;
      if (first == nullptr || first->planned) {
        arm_at_cut();
      } else if (!armed_ || variant_ == 1) {  // arming is due (an armed plan's pass goes on)
        arm_after = plans_[active_].id;
      }
    }
    bool crossed = false;
    slot = match_plan(rounded, stream, &crossed);
    if (crossed && slot != nullptr) {
      // A new pass began with this request. boundary() may pack the plan as it arms (the
      // slot then gets its offset), or make it again (refine, remake), freeing its slots: the
      // new plan, which lays out the arena from now on, serves this request then.
      const std::size_t plan = active_, index = static_cast<std::size_t>(slot - plans_[plan].slots.data());
      const std::uint64_t plan_id = plans_[plan].id;
      matched = *slot;
      slot = &matched;
      boundary();
      if (active_ == plan && plans_[plan].id == plan_id) {
        slot = &plans_[plan].slots[index];
      } else if (active_ == plan) {
        // Made again from the pass that just ended: its offsets are the arena's layout now,
        // and its cursor is at this request.
        bool again = false;
        slot = match_plan(rounded, stream, &again);
      }
    } else if (crossed) {
      boundary();
    }
    in_step_ = slot != nullptr;
    if (slot == nullptr) {
      ever_diverged_ = true;
      last_divergence_ = base_ + events_.size();
      ++divergences_;
      // The plan no longer describes the stream (a new shape, or the end of repeated layers):
      // stop serving from it; its idle pages go back as the pool needs them.
      pass_miss_bytes_ += rounded;
      if (armed_ && pass_miss_bytes_ * kDisarmShare > plans_[active_].bound[0]) disarm();
    } else {
      ++pass_matches_;
      if (ever_diverged_ && cursor_ == kPrefix && plans_[active_].validated &&
          recent_prefix_hash() == plans_[active_].prefix) {
        // Back in step from its start after a divergence (an evaluation pass, a shape that
        // came and went): the plan describes the stream again, so detection stops. Left on,
        // it would find a "period" spanning the divergence and the plan's first requests,
        // which happened once, and replace the plan with it.
        ever_diverged_ = false;
      }
    }
  }
  if ((slot == nullptr || !armed_) && allocs_ >= kPrefix) {
    // Which stored plan starts with the last kPrefix requests? (alternating shapes, shapes that
    // come back). Also while the active plan is not armed: a plan of the iteration seen before
    // serves at once, where the active one waits for its cut.
    const std::uint64_t h = recent_prefix_hash();
    for (std::size_t i = 0; i < plans_.size(); ++i) {
      // A plan too small to arm is not adopted: it would only take the cursor from the plan
      // of the iteration while that one waits for its cut. Nor is a plan whose last pass
      // skipped many of its slots (a wrong period, likely) while the active plan matches.
      // Without virtual memory a plan of an earlier run waits for detection to find it in
      // this one: its arena, a segment of its own made early, is memory the pool cannot take
      // pages from as it grows (a random training loop held 1.065 of live, 1.050 without).
      if (plans_[i].imported && !config_.pool.vmm) continue;
      // The active plan that matched this request is not adopted again: where its first
      // requests recur inside its period (identical layers), that would move a cursor that
      // is in step to one that is not.
      if (plans_[i].prefix == h && plans_[i].slots.size() > kPrefix &&
          (i != active_ || (cursor_ != kPrefix && slot == nullptr)) && worth_an_arena(plans_[i]) &&
          (slot == nullptr || !plans_[i].passed_over)) {
        adopt(i, kPrefix);
        ++plan_switches_;
        in_step_ = true;
        break;
      }
    }
  }

  void* out = nullptr;
  const bool in_arena = slot != nullptr && armed_ && arena_ != 0 && slot->offset[variant_] != kNoOffset;
  const bool in_hole = slot != nullptr && armed_ && slot->hole[variant_] != 0;
  if (in_arena || in_hole) {
    out = in_arena ? pool_->allocate_at(arena_, slot->offset[variant_], rounded,
                                        static_cast<std::int64_t>(size), stream)
                   : pool_->allocate_in_hole(slot->hole[variant_], rounded,
                                             static_cast<std::int64_t>(size), stream);
    if (out != nullptr) {
      ++plan_hits_;
      if (in_hole && !in_arena) ++hole_hits_;
      // The steady state starts with the first pass a plan serves from its start (not the
      // rest of a pass it armed in: arm_mid_pass()).
      if (first_planned_ == kNever && !mid_pass_) first_planned_ = id;
    } else {
      ++slot_busy_;
    }
  }
  if (out == nullptr && loaded_arena_ != 0) {
    out = serve_prologue(rounded, static_cast<std::int64_t>(size), stream);
  } else if (out == nullptr && slot != nullptr && !slot->planned && armed_) {
    // A slot the plan has no offset for (its lifetime was unknown when the plan was made):
    // counted, so that the plan is made again from a pass where every lifetime is known.
    pass_unplanned_bytes_ += rounded;
  }
  if (out == nullptr) {
    out = pool_->try_malloc(static_cast<std::int64_t>(size), stream);
    ++fallbacks_;
  }
  if (!config_.pool.vmm && arena_ == 0) {  // see arm()
    pool_only_high_ = std::max(pool_only_high_, static_cast<std::int64_t>(pool_->reserved_bytes()));
  }

  Event e;
  e.token = token;
  e.size = rounded;
  e.stream = stream;
  e.alloc = true;
  e.live_before = live_bytes_;
  const std::uint64_t g = record_event(e);
  if (prologue_open_) {
    // It ends in boundary(), or at kPrologueCap requests, or before a request that failed
    // (no lifetime to record).
    if (out == nullptr || id != prologue_.size() || prologue_.size() >= kPrologueCap) {
      close_prologue();
    } else {
      prologue_.push_back({rounded, stream, g, 0, 0});
    }
  }
  if (out == nullptr) pass_failed_ = true;  // its free will not come: the pass is cut short
  if (out != nullptr) {
    live_.emplace(reinterpret_cast<std::uintptr_t>(out), Live{id, g, size});
    live_bytes_ += static_cast<std::int64_t>(size);
    live_hwm_ = std::max(live_hwm_, live_bytes_);
    if (!armed_ && !recent_passes_.empty()) {
      between_high_ = std::max(between_high_, static_cast<std::size_t>(live_bytes_));
    }
  }
  detect();
  if (arm_after != 0 && active_ != kNoOffset && plans_[active_].id == arm_after) {
    // The block this request replaces: the oldest live one of its token, made about a period
    // ago (a loop variable rebound to a new batch before the last is released).
    const std::size_t period = plans_[active_].period;
    const std::uint64_t now = base_ + events_.size();
    replaced_bytes_ = 0;
    std::uint64_t oldest = now;
    for (const auto& [addr, l] : live_) {
      if (l.event >= base_ && l.event < oldest && now - l.event >= period / 2 &&
          now - l.event <= 2 * static_cast<std::uint64_t>(period) && ev(l.event).token == token) {
        oldest = l.event;
        replaced_bytes_ = pool_->round_size(l.size);
      }
    }
    arm_at_cut();
    replaced_bytes_ = 0;
  }
  return out;
}

const PlannedAllocator::Slot* PlannedAllocator::match_plan(std::size_t rounded, StreamId stream,
                                                           bool* crossed) {
  // The slot at the cursor, or a later one: slots that outlive the period (kNoOffset) are
  // skipped freely (one-off allocations of the iteration the plan was made from, such as an
  // optimizer's state), planned ones up to resync_window. The search may cross the plan's end
  // once (the next iteration starts).
  // Passing over planned slots means they are missing from this pass, or that this request is
  // one the plan lacks: a loss kept for logging, whose size rounds to that of a later slot.
  // Taken for the first, such a request moved the cursor past the step's next blocks, whose
  // requests then matched later slots in turn, and the pass fell out of step (vit_b_16 with
  // a 512 B tensor added per step: steady state 1.004 -> 1.020). So where a serving plan
  // would pass over more than kHeldJump times the request's bytes, the request is served at
  // that slot but the cursor stays: the next request matching at the cursor says the held
  // one was an addition; matching further on, that the slots before the held one are missing,
  // and the cursor goes past it. Within kHeldJump, or for a plan of an earlier run (whose
  // slots are this run's requests only nearly), the cursor moves at once, as the plans'
  // own passes need (vit_b_16 jumps past 34 slots, 7.8 times the request, in every step).
  const Plan& p = plans_[active_];
  const std::size_t n = p.slots.size();
  const std::size_t held = held_plan_ == p.id ? held_slot_ : kNoOffset;
  held_slot_ = kNoOffset;
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::size_t c = cursor_, skipped = 0, skipped_bytes = 0;
    bool wrapped = false;
    for (std::size_t steps = 0; steps < n; ++steps) {
      const Slot& s = p.slots[c];
      if (s.size == rounded && s.stream == stream) {
        // (Not the plan's last slot: going past it would start a pass without its boundary.)
        if (skipped > 0 && !wrapped && c + 1 < n && armed_ && !p.imported &&
            skipped_bytes > kHeldJump * rounded) {
          if (held == kNoOffset) {
            held_slot_ = c;
            held_plan_ = p.id;
            return &s;
          }
          if (attempt == 0) break;  // a second one: the held request was the plan's
        }
        cursor_ = c + 1 == n ? 0 : c + 1;
        // The held request took the slot right after this one: the two came swapped.
        if (held != kNoOffset && cursor_ == held && !wrapped) cursor_ = held + 1;
        at_cut_ = cursor_ == 0;  // the next request starts a pass
        *crossed = wrapped;      // this one did (slots at the end were skipped)
        pass_skipped_bytes_ += skipped_bytes;  // judged at the cut (boundary())
        return &s;
      }
      if (s.planned) {
        if (++skipped > config_.resync_window) break;
        skipped_bytes += s.size;
      }
      if (++c == n) {
        c = 0;
        wrapped = true;
      }
    }
    if (held == kNoOffset || attempt == 1) break;
    // Not in step at the cursor either: the slots before the held one are missing from this
    // pass. The search goes on past it.
    for (std::size_t k = cursor_; k != held; k = k + 1 == n ? 0 : k + 1) {
      if (p.slots[k].planned) pass_skipped_bytes_ += p.slots[k].size;
    }
    cursor_ = held + 1;
  }
  return nullptr;
}

bool PlannedAllocator::boundary(bool arm_now) {
  // The cursor is at the plan's cut: the fewest planned bytes are alive. A pass that matched
  // validates the plan; a validated plan that is not armed yet arms now (arm_now), or when
  // the caller says (arm_at_cut). False: the plan was dropped and must not arm now.
  at_cut_ = false;
  // The rest of a pass that a plan armed in (arm_mid_pass()) holds what that pass's start left
  // in the pool: it is not what the plan's passes take, and no memory is kept for it.
  const bool partial = mid_pass_;
  mid_pass_ = false;
  live_at_cut_ = live_bytes_;
  Plan& p = plans_[active_];
  const std::uint64_t n = base_ + events_.size();
  const std::int64_t pass_peak = pool_->take_window_peak();
  if (armed_) p.served_peak = static_cast<std::size_t>(std::max<std::int64_t>(pass_peak, 0));
  const std::uint64_t pass_start = pass_start_;
  pass_start_ = n;
  p.passed_over = pass_skipped_bytes_ * kArmShare > p.bound[0];
  // Where the last period repeats the one before it event for event, yet left more live bytes
  // than it found (by over 1/32 of the plan's bound), its passes keep what they make: a
  // model's constructor building its layers one after another, each keeping its weights
  // (neox_ckpt: GPT-NeoX's causal-mask buffers, a plan armed while the model was built, 1.055
  // of live over the whole trace against 1.045 for the pool alone). That does not validate
  // the plan. Judged only over an exact repetition: elsewhere two points a period apart need
  // not be the same point of a step (a plan made from a window that held the first step's
  // one-off requests, about to be made again), and what lies between them says nothing of
  // what its passes keep.
  bool keeps = false;
  if (!p.validated && n >= base_ + 2 * p.period &&
      range_hash(n - p.period, n) == range_hash(n - 2 * p.period, n - p.period)) {
    const std::int64_t growth = live_bytes_ - ev(n - p.period).live_before;
    keeps = growth * static_cast<std::int64_t>(kArmShare) > static_cast<std::int64_t>(p.bound[0]);
  }
  if (pass_matches_ > 0 && pass_miss_bytes_ * kArmShare <= p.bound[0] && !p.passed_over && !keeps) {
    p.validated = true;
  }
  // Every request of the pass matched, yet the pass took another number of events than the
  // plan's period: the window the plan was made from held one-off events that it now passes
  // over at each pass (the first step's optimizer state and gradients, or a window that paired
  // the parameters with the optimizer state made in their image). The pass is then the
  // iteration as it repeats, and the plan is made again from it, if the events that end it
  // also ended the stretch one pass earlier: where one-off slots lie at the cut, a pass may
  // begin a few events late, and is not the period.
  const std::uint64_t pass = pass_start == kNever ? 0 : n - pass_start;
  const std::uint64_t w = std::min<std::uint64_t>(config_.match_window, pass);
  const bool stale = pass_matches_ > 0 && pass_miss_bytes_ == 0 && !pass_failed_ &&
                     !p.keep_layout && pass != p.period && pass >= config_.min_period &&
                     pass <= config_.max_period && n >= base_ + pass + w &&
                     range_hash(n - w, n) == range_hash(n - pass - w, n - pass);
  const std::size_t unplanned = pass_unplanned_bytes_;
  pass_failed_ = false;
  pass_matches_ = 0;
  pass_miss_bytes_ = 0;
  pass_unplanned_bytes_ = 0;
  if (p.passed_over) {
    // The pass passed over many planned slots: the plan may have the wrong period (a step of
    // identical layers repeats within itself). Detection looks again; serving goes on.
    ever_diverged_ = true;
    last_divergence_ = base_ + events_.size();
  }
  pass_skipped_bytes_ = 0;
  if (!armed_ && p.awaiting_pool_pass) {  // dropped at the last cut (below): the pool's pass
    p.awaiting_pool_pass = false;
    const auto took = static_cast<std::size_t>(std::max<std::int64_t>(pass_peak, 0));
    p.drop_cap = took > page() ? took - page() : 0;
  }
  if (armed_ && pool_->reserved_high_water() > arm_limit_) {
    // The plan took memory past what it was accepted against (the pool served what the plan
    // did not describe): the pool alone does better, drop it.
    disarm();
    // Refused until the highest reserved rises, and until then armed again only for less
    // than the pool takes without it (arm()): packed at a later cut, against the holes of
    // then, it may hold less. Restarted with its plans, gru_seq2seq's step plan was armed by
    // its first requests and went a page past its footprint (the pool maps a page for the
    // last of them, served after the arming); the highest reserved then stayed where that
    // pass left it, and the pool held 74 MiB to the end, where the plan holds 68. Allowed
    // any footprint below the highest reserved, it went past it again on an evaluation loop
    // (seed 749: 1.082 -> 1.127).
    p.refused_at[0] = p.refused_at[1] = pool_->reserved_high_water();
    p.dropped_at = p.refused_at[0];
    p.awaiting_pool_pass = true;
    ++arm_refusals_;
    return false;
  }
  if (armed_ && !partial) {
    note_pass(n, p.period);
    // Past `prologue` requests (config), the prologue ends with the next pass a plan served
    // whole: at a cut, where the plans of the steps arm in a run that imports it.
    if (prologue_open_ && prologue_.size() >= config_.prologue) {
      close_prologue();
      prologue_plan_ = p.signature;
    }
    if (kept_floor_ > armed_footprint_) trim_kept();
  }
  // Made again from the pass that just ended (a remake, or a refinement), the plan arms anew
  // and its layout changes: packed against the holes of now, it may hold more than the one
  // that served the pass. Where that one served the whole pass, the new layout replaces it
  // only if it holds no more than that pass did; otherwise the plan stays as it was and is
  // not made again (its passes still match). But where the old layout left requests of the
  // pass to the pool (slots it has no offset for: a window that held the first step's
  // optimizer state has none for the later steps' temporaries), it would leave them at every
  // pass for good, and the pool serves them around the arena by moving pages at each step
  // (GPT-2 small at 12 x 1024 on CUDA: 960 page maps and unmaps a step, 2 GB moved, for a
  // layout made again 6 MiB larger): the new layout may then take the run up to its highest
  // reserved, no further.
  auto make_again = [&](std::size_t period) {
    if (!(arm_now && armed_ && variant_ == 0)) {
      refine(period);
      return;
    }
    Plan old = p;
    const std::size_t cursor = cursor_;
    const bool cut = at_cut_;
    const std::uint64_t start = pass_start_;
    refine(period);
    arm_cap_ = static_cast<std::size_t>(unplanned != 0 ? std::max(pass_peak, pool_->reserved_high_water())
                                                        : pass_peak);
    arm_at_cut();
    arm_cap_ = std::numeric_limits<std::size_t>::max();
    if (armed_) return;
    plans_[active_] = std::move(old);
    Plan& kept = plans_[active_];
    kept.keep_layout = true;
    cursor_ = cursor;
    at_cut_ = cut;
    pass_start_ = start;
    // It serves on as it did (the refused arming gave its claims back).
    armed_ = true;
    variant_ = 0;
    if (kept.holes[0]) pool_->claim(kept.claims[0]);
    pool_->take_window_peak();  // the refused arming gave pages back
    ++layouts_kept_;
  };
  if (stale) {
    make_again(static_cast<std::size_t>(pass));
    ++remakes_;
  } else if (armed_ && unplanned * kArmShare > p.bound[0] && !p.keep_layout) {
    // Requests whose lifetime was unknown when the plan was made went to the pool; the pass
    // that just ended knows them all: make the plan again from it, and arm it now.
    make_again(p.period);
    ++refinements_;
    // Blocks of the pass that live across its cut are not freed yet, so their lifetimes are
    // known only from the pass before, one period back; where steps of other shapes come
    // between, that pass is another shape's, and the plan made again lacks them as the first
    // did: a plan of one batch size, taking turns with two others, left its 148 gradients to
    // the pool at every step and was made again at each. Its next arming looks them up.
    plans_[active_].refresh_at_arming = true;
  }
  pool_pass_ = !armed_ && pass_start != kNever && pass >= p.period;  // read by arm()
  if (arm_now) arm_at_cut();
  pool_pass_ = false;
  return true;
}

std::size_t PlannedAllocator::recent_floor(std::size_t footprint) {
  const std::uint64_t now = base_ + events_.size();
  recent_passes_.erase(std::remove_if(recent_passes_.begin(), recent_passes_.end(),
                                      [&](const RecentPass& a) { return now - a.event > kRecentPeriods * a.period; }),
                       recent_passes_.end());
  for (const auto& a : recent_passes_) footprint = std::max(footprint, a.footprint);
  return footprint;
}

void PlannedAllocator::note_pass(std::uint64_t event, std::size_t period) {
  recent_floor(0);  // drops the old ones: one entry per plan that served lately, at most
  for (auto& a : recent_passes_) {
    if (a.footprint == armed_footprint_ && a.period == period) {
      a.event = event;
      return;
    }
  }
  recent_passes_.push_back({event, armed_footprint_, period});
}

void PlannedAllocator::trim_kept() {
  // Only what was kept for plans that have not served lately goes back (not what the pool took
  // since).
  const std::size_t floor = recent_floor(armed_footprint_);
  const std::size_t dropped = kept_floor_ > floor ? kept_floor_ - floor : 0;
  kept_floor_ = floor;
  const auto reserved = static_cast<std::size_t>(pool_->reserved_bytes());
  if (dropped < page() || reserved <= floor) return;
  const std::size_t want = std::min(dropped, reserved - floor) / page() * page();
  pool_->trim(arena_, round_up(plans_[active_].arena[variant_], page()), want);
}

void PlannedAllocator::arm_at_cut() {
  Plan& p = plans_[active_];
  if (!armed_ && p.validated) arm(0);
  if (armed_ && variant_ == 1) {
    // Armed when its first requests were recognised, the plan left those to the pool (they
    // had been served already). A whole pass is ahead now: its whole layout serves it, or, if
    // that is refused, the partial one goes on as it was.
    armed_ = false;
    if (arm(0)) {
      ++full_rearms_;
    } else if (p.skip != kPrefix) {
      // Armed in the pass it was found in (arm_mid_pass()), it left that pass's first
      // requests to the pool, many more than a plan recognised by them leaves: each pass would
      // take those from the pool beside the arena (an evaluation loop: 1.029 -> 1.050).
      disarm();
    } else {
      armed_ = true;
      variant_ = 1;
      if (p.holes[1]) pool_->claim(p.claims[1]);  // arm(0) gave the claims back
    }
  }
}

bool PlannedAllocator::refresh(Plan& p) {
  const std::uint64_t n = p.built_at;
  if (n < base_ + p.period) return false;  // the window left the history
  std::vector<std::size_t> lifetimes;
  coverage(n, p.period, &lifetimes);
  bool changed = false;
  std::size_t k = 0;
  for (std::uint64_t g = n - p.period; g < n; ++g) {
    const Event& e = ev(g);
    if (!e.alloc) continue;
    const std::size_t life = lifetimes[k];
    Slot& slot = p.slots[p.slot_of_alloc[k++]];
    if (life == 0 || slot.planned) continue;
    const auto t = static_cast<std::size_t>(g - (n - p.period));
    slot.planned = true;
    p.slot_block[static_cast<std::size_t>(&slot - p.slots.data())] = p.blocks.size();
    p.blocks.push_back({(t + p.period - p.cut) % p.period, life, e.size});
    changed = true;
  }
  if (changed) {
    p.bound[0] = live_bound(p.blocks, p.period);
    p.bound[1] = 0;
  }
  return changed;
}

void PlannedAllocator::stop_serving() {
  armed_ = false;
  mid_pass_ = false;
  pool_->unclaim_all();  // the holes of the plan that served go back to best fit
}

void PlannedAllocator::disarm() {
  stop_serving();
  if (arena_ == 0) return;
  // Without virtual memory an idle arena holds its whole size: it goes back now (a plan that
  // arms again gets a new one).
  if (!config_.pool.vmm && !pool_->arena_in_use(arena_)) {
    pool_->retire_arena(arena_);
    arena_ = 0;
    arena_size_ = 0;
  }
  retire_busy_arena();
}

void PlannedAllocator::retire_busy_arena() {
  // With virtual memory an idle arena costs nothing (its pages go back as the pool needs them,
  // the grow mark); but one whose planned blocks are still live keeps their pages mapped, and
  // best fit never searches it: the pool would grow around free space it cannot use (a new
  // shape mid-iteration). Its free space joins the pool instead.
  if (arena_ != 0 && config_.pool.vmm && pool_->arena_in_use(arena_)) {
    pool_->retire_arena(arena_);
    lent_arena_ = arena_;
    arena_ = 0;
    arena_size_ = 0;
    ++busy_arenas_retired_;
  }
}

void PlannedAllocator::refine(std::size_t period) {
  const std::uint64_t n = base_ + events_.size();
  if (n - base_ < period) return;
  std::vector<std::size_t> lifetimes;
  if (coverage(n, period, &lifetimes) < kMinCoverage) return;
  build_plan(n, period, lifetimes, active_);
}

std::vector<PackBlock> PlannedAllocator::variant_blocks(const Plan& p, int v,
                                                      std::vector<std::size_t>* slot_of) const {
  std::vector<PackBlock> blocks;
  for (std::size_t j = v == 0 ? 0 : std::min(p.skip, p.slots.size()); j < p.slots.size(); ++j) {
    if (p.slot_block[j] == kNoOffset) continue;
    blocks.push_back(p.blocks[p.slot_block[j]]);
    if (slot_of != nullptr) slot_of->push_back(j);
  }
  return blocks;
}

std::uint64_t PlannedAllocator::holes_key(const Ranges& holes) const {
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a over the words
  auto mix = [&](std::uint64_t x) {
    h ^= x;
    h *= 1099511628211ULL;
  };
  for (const auto& [addr, size] : holes) {
    mix(addr);
    mix(size);
  }
  mix(holes.empty() ? 0 : pool_->unkept_bytes(holes));
  return h;
}

std::vector<PlannedAllocator::Candidate> PlannedAllocator::candidates(
    const std::vector<PackBlock>& all, std::size_t period, std::size_t give_up, const Ranges& holes,
    Packed& memo, std::size_t* last_bound) {
  std::vector<std::size_t> hole_sizes;
  for (const auto& h : holes) hole_sizes.push_back(h.second);
  std::vector<Candidate> made;
  constexpr HoleRule kRules[] = {HoleRule::kSkyline, HoleRule::kGreedy, HoleRule::kGreedyByArea,
                                 HoleRule::kGreedyByLife, HoleRule::kPeakShave};
  constexpr int kNoHoles = 5;
  const HoleCost pages_added = [&](std::size_t h, std::size_t top) {
    return pool_->unkept_bytes({{holes[h].first, top}});
  };
  memo.tries.resize(kNoHoles + 1);
  std::optional<Packer> packer;  // made at the first packing not known from the memo
  auto the_packer = [&]() -> Packer& {
    if (!packer) packer.emplace(all, period);
    return *packer;
  };
  for (int use = 0; use <= kNoHoles; ++use) {  // holes by each rule, then no holes
    if (use < kNoHoles && hole_sizes.empty()) continue;
    Try& t = memo.tries[use];
    if (!t.filled) {
      t.c.fill = use == kNoHoles ? the_packer().fill_holes({})
                                 : the_packer().fill_holes(hole_sizes, kRules[use], pages_added);
      std::vector<std::pair<std::uintptr_t, std::size_t>> placed;
      for (std::size_t k = 0; k < all.size(); ++k) {
        if (t.c.fill.hole[k] != HoleFill::kNone) {
          placed.emplace_back(holes[t.c.fill.hole[k]].first + t.c.fill.offset[k], all[k].size);
        } else {
          t.c.arena_block.push_back(k);
        }
      }
      t.c.hole_cost = placed.empty() ? 0 : pool_->unkept_bytes(placed);
      t.filled = true;
    }
    if (t.c.hole_cost > give_up) continue;
    const std::size_t level = give_up - t.c.hole_cost;
    const std::size_t n = t.c.arena_block.size();
    // Known from an earlier packing at another level: above the bound's page, pack_blocks
    // makes the same runs at any level and keeps the lowest arena if it is under the level.
    PackResult r;
    bool known = false;
    if (t.packed) {
      const std::size_t good = round_up(t.result.bound, page());
      const bool fitted = t.result.offsets.size() == n;
      if (t.level == level) {
        known = true;
        r = t.result;
      } else if (t.level >= good && level >= good && (fitted || level < t.level)) {
        known = true;
        r = t.result;
        if (!fitted || r.arena > level) {  // none of its runs is under this level
          r.offsets.clear();
          r.arena = level + 1;
        }
      }
    }
    if (known) {
      ++packings_reused_;
    } else {
      r = the_packer().pack(t.c.arena_block, config_.search_rounds, page(), level);
      t.result = r;
      t.level = level;
      t.packed = true;
    }
    *last_bound = r.bound;
    if (r.offsets.size() != n) continue;  // no packing within give_up
    Candidate c = t.c;
    c.packed = std::move(r);
    c.raw_arena = c.packed.arena;
    c.packed.arena = round_up(c.packed.arena, page());
    made.push_back(std::move(c));
  }
  return made;
}

bool PlannedAllocator::pack(Plan& p, int v, std::size_t give_up, const Ranges& holes) {
  // Offsets are computed only for a plan that arms: detection builds many plans (of repeated
  // layers, of iterations seen once) that never do. Variant 1 leaves out the first p.skip
  // slots: it serves a pass whose first requests the pool served already (the plan was
  // recognised by them, or made from a window that holds them), so no room is kept for them.
  // Blocks may first go to holes of the pool (page_holes: free parts of pages that blocks
  // outliving the period keep mapped, such as parameters and optimizer state), which cost only
  // the pages they need beyond those (unkept_bytes); the rest go to the arena. Taking blocks
  // out can also make the rest pack worse, so the plan is packed with holes filled by each
  // rule of fill_holes and without holes, and the smallest footprint wins. Holes are those of now: a plan using some is packed again
  // at each arming.
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::size_t> slot_of;
  const std::vector<PackBlock> all = variant_blocks(p, v, &slot_of);
  const std::uint64_t key = holes_key(holes);
  const std::vector<PackBlock> order = in_time_order(all, p.period);
  auto same = [&](const Packed& m) {
    return m.holes_key == key && m.holes == holes &&
           std::equal(m.blocks.begin(), m.blocks.end(), order.begin(), order.end(),
                      [](const PackBlock& a, const PackBlock& b) {
                        return a.start == b.start && a.life == b.life && a.size == b.size;
                      });
  };
  auto memo = std::find_if(packed_.begin(), packed_.end(), same);
  if (memo == packed_.end()) {
    std::size_t kept_blocks = order.size();
    for (const Packed& m : packed_) kept_blocks += m.blocks.size();
    while (packed_.size() >= kPackedMost ||
           (packed_.size() >= kPackedKept && kept_blocks > kPackedBlocks)) {
      kept_blocks -= packed_.front().blocks.size();
      packed_.erase(packed_.begin());
    }
    packed_.push_back({order, holes, key, {}});
  } else {
    std::rotate(memo, std::next(memo), packed_.end());  // the most recently used last
  }
  memo = std::prev(packed_.end());
  std::size_t bound = last_bound_;
  std::vector<Candidate> made = candidates(all, p.period, give_up, holes, *memo, &bound);
  last_bound_ = bound;
  pack_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (made.empty()) {
    last_arena_ = 0;
    last_ratio_ = 0.0;
    return false;
  }
  Candidate& c = *std::min_element(made.begin(), made.end(), [](const Candidate& a, const Candidate& b) {
    return a.footprint() < b.footprint();
  });
  // The part of each hole the plan uses is claimed from the pool when the plan arms.
  std::vector<std::size_t> top(holes.size(), 0);
  for (std::size_t k = 0; k < all.size(); ++k) {
    if (c.fill.hole[k] != HoleFill::kNone) {
      top[c.fill.hole[k]] = std::max(top[c.fill.hole[k]], c.fill.offset[k] + all[k].size);
    }
  }
  // An arena is a range of its own, so its last page is partly used wherever its size is not
  // a whole number of pages. Laid out instead from the free tail of a page the pool keeps
  // anyway (the parameters' last page, typically), where that tail begins a free block that
  // runs on over pages nobody keeps, the same layout shares that page with the pool, and
  // saves one where the arena's overhang past its last whole page fits the tail
  // (lstm_cls_sgd: the step's blocks peak 28 KiB over 61 pages, beside 0.5 MiB free at the
  // end of the parameters' last page). Its blocks are then served as holes' are.
  // Only where no arena holds pages: an arena an earlier plan filled (a larger shape's) goes
  // back page by page as the pool needs them, and is reused by the next layout that needs one.
  std::uintptr_t tail = 0;
  std::size_t tail_hole = 0, tail_cost = 0;
  if (c.raw_arena != 0 && (arena_ == 0 || pool_->arena_mapped(arena_) == 0)) {
    for (const auto& [addr, bytes] : pool_->page_tails()) {
      // The whole tail of its page must be a hole here (sharing pages may have taken part
      // of it); the layout starts past what the chosen fill put there.
      const auto h = std::find_if(holes.begin(), holes.end(), [a = addr](const auto& x) { return x.first == a; });
      const std::uintptr_t page_end = round_up(addr + 1, page());
      if (h == holes.end() || h->first + h->second < page_end) continue;
      const auto hole = static_cast<std::size_t>(h - holes.begin());
      const std::uintptr_t start = addr + round_up(top[hole], kMinBlockSize);
      if (start >= page_end || start + c.raw_arena > addr + bytes) continue;
      const std::size_t cost = pool_->unkept_bytes({{start, c.raw_arena}});
      if (cost + page() <= c.packed.arena && (tail == 0 || cost < tail_cost)) {
        tail = start;
        tail_hole = hole;
        tail_cost = cost;
      }
    }
  }
  for (std::size_t k = 0; k < all.size(); ++k) {
    Slot& slot = p.slots[slot_of[k]];
    slot.offset[v] = kNoOffset;
    slot.hole[v] = c.fill.hole[k] == HoleFill::kNone ? 0 : holes[c.fill.hole[k]].first + c.fill.offset[k];
  }
  for (std::size_t k = 0; k < c.arena_block.size(); ++k) {
    Slot& slot = p.slots[slot_of[c.arena_block[k]]];
    if (tail != 0) {
      slot.hole[v] = tail + c.packed.offsets[k];  // the arena's layout, from the tail on
    } else {
      slot.offset[v] = c.packed.offsets[k];
    }
  }
  p.holes[v] = c.fill.placed_bytes != 0 || tail != 0;
  p.holes_key[v] = p.holes[v] ? holes_key(holes) : 0;
  p.claims[v].clear();
  for (std::size_t h = 0; h < holes.size(); ++h) {
    if (tail != 0 && h == tail_hole) {
      p.claims[v].emplace_back(holes[h].first, tail - holes[h].first + c.raw_arena);  // one range
    } else if (top[h] != 0) {
      p.claims[v].emplace_back(holes[h].first, top[h]);
    }
  }
  if (tail != 0) {
    c.hole_cost += tail_cost;
    c.packed.arena = 0;
    ++tail_layouts_;
  }
  p.hole_cost[v] = c.hole_cost;
  p.arena[v] = c.packed.arena;
  p.bound[v] = live_bound(all, p.period);
  p.packed[v] = true;
  last_bound_ = c.packed.bound;
  last_hole_bytes_ = c.fill.placed_bytes;
  last_hole_cost_ = c.hole_cost;
  last_arena_ = c.packed.arena;
  last_ratio_ = c.packed.ratio();
  return true;
}

PlannedAllocator::Packing PlannedAllocator::save_packing(const Plan& p, int v) const {
  Packing k;
  k.offset.reserve(p.slots.size());
  k.hole.reserve(p.slots.size());
  for (const Slot& slot : p.slots) {
    k.offset.push_back(slot.offset[v]);
    k.hole.push_back(slot.hole[v]);
  }
  k.arena = p.arena[v];
  k.bound = p.bound[v];
  k.packed = p.packed[v];
  k.holes = p.holes[v];
  k.hole_cost = p.hole_cost[v];
  k.claims = p.claims[v];
  k.holes_key = p.holes_key[v];
  return k;
}

void PlannedAllocator::restore_packing(Plan& p, int v, Packing&& k) const {
  // Slots are assigned in place: a request being served may point at one.
  for (std::size_t i = 0; i < p.slots.size(); ++i) {
    p.slots[i].offset[v] = k.offset[i];
    p.slots[i].hole[v] = k.hole[i];
  }
  p.arena[v] = k.arena;
  p.bound[v] = k.bound;
  p.packed[v] = k.packed;
  p.holes[v] = k.holes;
  p.hole_cost[v] = k.hole_cost;
  p.claims[v] = std::move(k.claims);
  p.holes_key[v] = k.holes_key;
}

bool PlannedAllocator::worth_an_arena(const Plan& p) const {
  return static_cast<double>(p.bound[0]) >= kMinPlanShare * static_cast<double>(live_hwm_);
}

std::size_t PlannedAllocator::freed_before_peak(const Plan& p) const {
  // Variant 1 (a plan recognised by its first p.skip requests, or armed in the pass it was
  // found in) leaves those requests to the pool, which served them: their blocks are among
  // what the pool holds now. Those the pass frees before its peak hold nothing there (their
  // pages go idle, and the grow mark lends them to the arena), yet counted as held for good
  // they doubled the bytes of the step's first activations wherever the peak comes after
  // those are freed (the end of backward, the optimizer's step): random training loop 9 over
  // 40 steps, batch sizes drawn from three, refused its largest size's plan at every step
  // (16,987 MB weighed against a pool that held 16,813), the pool served those steps, and the
  // next planned step mapped back the arena pages they took: 78,249 page maps and unmaps over
  // the second half, against 8,486 now, at a lower peak. Counted: the whole pages inside each
  // such block (a page it shares with another block may stay in use: counting bytes, an
  // evaluation loop's plan was accepted 3 pages too low and went 2 MiB past the pool's peak).
  const std::size_t skipped = std::min(p.skip, p.slots.size());
  if (skipped == 0 || allocs_ < skipped) return 0;
  std::size_t now = 0;  // the plan's time just after its last skipped request
  for (std::size_t j = 0; j < skipped; ++j) {
    if (p.slot_block[j] != kNoOffset) now = std::max(now, p.blocks[p.slot_block[j]].start + 1);
  }
  auto alive_at = [&](const PackBlock& b, std::size_t t) {
    return (t + p.period - b.start) % p.period < b.life;
  };
  std::vector<PackBlock> blocks = variant_blocks(p, 1, nullptr);
  const std::size_t variant = blocks.size();
  for (std::size_t j = 0; j < skipped; ++j) {
    if (p.slot_block[j] == kNoOffset) continue;  // no lifetime known: held
    const PackBlock& b = p.blocks[p.slot_block[j]];
    if (b.start + b.life > now) blocks.push_back(b);
  }
  if (blocks.size() == variant) return 0;
  std::size_t peak = 0;
  live_bound(blocks, p.period, &peak);
  // Slot j is request allocs_ - skipped + j (recognised by them, the plan arms before the last
  // is served; armed mid-pass, after).
  const std::uint64_t first = allocs_ - skipped;
  std::size_t gone = 0;
  for (const auto& [addr, l] : live_) {
    if (l.id < first) continue;
    const std::size_t j = static_cast<std::size_t>(l.id - first);
    if (p.slot_block[j] == kNoOffset) continue;
    const PackBlock& b = p.blocks[p.slot_block[j]];
    if (b.start + b.life <= now || alive_at(b, peak)) continue;
    const std::uintptr_t lo = round_up(addr, page());
    const std::uintptr_t hi = (addr + pool_->round_size(l.size)) / page() * page();
    if (hi > lo) gone += hi - lo;
  }
  return gone;
}

bool PlannedAllocator::arm(int v) {
  Plan& p = plans_[active_];
  if (p.bound[0] == 0) return false;
  // A plan that covers a small share of the peak (a period of repeated layers, of the
  // optimizer's loop over parameter groups, ...) is not worth an arena: it would only shuffle
  // the pool's layout. The iteration's plan covers the activations, a large share.
  if (!worth_an_arena(p)) return false;
  const std::int64_t high = pool_->reserved_high_water();
  // Dropped at this highest reserved (boundary()), it may arm again for a page less than the
  // pool's pass after the drop took; otherwise nothing changed since it was refused.
  const bool after_drop = p.dropped_at == high;
  if (after_drop && p.awaiting_pool_pass) return false;
  if (p.refused_at[v] == high && !after_drop) return false;
  // No plan arms while the prologue serves: it lays out the run up to the end of a pass a
  // plan served whole in the run it was recorded from, a cut where plans arm (ended earlier
  // by an arming, its layout, made for what was to come, held more than the plans' did:
  // bloom_4l restarted 1.014 -> 1.069).
  if (loaded_arena_ != 0) return false;
  const bool after_prologue = prologue_hits_ != 0 && armed_footprint_ == 0;
  pool_->unclaim_all();  // holes of an earlier arming are free space again
  if (arena_ == 0 && lent_arena_ != 0 && config_.pool.vmm) {
    // The arena retired with live blocks (retire_busy_arena) is the arena again once nothing
    // is allocated in it, with the pages it still has mapped: a new one would map them all
    // again.
    const std::size_t size = pool_->reclaim_arena(lent_arena_);
    if (size != 0) {
      ++arenas_reclaimed_;
      arena_ = lent_arena_;
      arena_size_ = size;
      lent_arena_ = 0;
    }
  }
  // What the pool holds beyond its live blocks goes back (and the arena's pages beyond what
  // this plan needs), so that the steady state holds live pool blocks plus the arena.
  if (!p.packed[0] && !p.packed[1]) {
    refresh(p);
  } else if (p.refresh_at_arming && refresh(p)) {
    // Its layouts lack the blocks whose lifetimes are known now: packed again below.
    unpack(p, 0);
    unpack(p, 1);
  }
  if (p.bound[v] == 0) p.bound[v] = live_bound(variant_blocks(p, v, nullptr), p.period);
  const std::size_t at_least = round_up(p.bound[v], page());
  const std::size_t keep = p.packed[v] ? round_up(p.arena[v], page()) : at_least;
  const std::size_t gone = v == 1 ? freed_before_peak(p) : 0;
  // Weighed as if trimmed, trimmed only if used: a plan refused after giving the pool's
  // unused pages back had them mapped again by the next steps (a loop whose plans never
  // armed: 782 page maps and unmaps against 238 for pymemplan-vmm, at the same peak).
  const std::optional<std::size_t> trimmable = pool_->trimmable_outside(arena_);
  if (!trimmable) pool_->trim(arena_, keep);
  std::size_t mapped = arena_ != 0 ? pool_->arena_mapped(arena_) : 0;
  const auto pool_bytes = static_cast<std::size_t>(pool_->reserved_bytes()) - mapped -
                          trimmable.value_or(0);
  // Pages of a block the pass's first request replaces (see allocate_locked) are not held
  // for good: it is released within the pass.
  const std::size_t replaced = std::min(replaced_bytes_ / page() * page(), pool_bytes);
  const auto held = pool_bytes - replaced - std::min(gone, pool_bytes - replaced);  // whole pages
  last_held_ = held;
  last_footprint_ = held + at_least;
  // The plan is used if its steady footprint (what the pool holds for live blocks, plus the
  // arena) is at most the highest reserved so far (it never raises the peak), or within
  // plan_slack (per mille) of the highest live bytes (it is nearly optimal, if a little above
  // what the pool alone reached so far).
  // A plan made again while its old layout served is held to what that layout took (arm_cap_).
  const double slack = 1.0 + static_cast<double>(config_.plan_slack) / 1000.0;
  auto limit = std::min(arm_cap_, std::max(static_cast<std::size_t>(high),
                        static_cast<std::size_t>(static_cast<double>(live_hwm_) * slack)));
  if (!config_.pool.vmm) {
    // Without virtual memory an arena is a segment of its own, beside the pool's cached
    // ones: the highest reserved so far counts earlier arenas, and limits measured against
    // it rose with each arming (a random loop at 1.51 of live, against 1.001 for the pool
    // alone). Held to what the pool reached with no arena.
    limit = std::min(limit, static_cast<std::size_t>(pool_only_high_));
  }
  if (p.imported) {
    // A plan of an earlier run, early in this one: the peak so far (a first step, before the
    // optimizer made its state) is no measure of what the steps ahead will take. It may take
    // this run as high as the run it comes from went, no higher.
    limit = std::max(limit, p.cap);
  }
  if (after_prologue) {
    // The first plan after an imported prologue: the prologue's layout, made knowing the run,
    // held less than the pool had, and the plan packed around what it leaves may need more.
    // It may take this run as high as the run the prologue comes from went.
    limit = std::max(limit, loaded_cap_);
  }
  if (mid_pass_need_ != 0) {
    // A plan just made, armed for the rest of the pass it was found in (arm_mid_pass()): held
    // to what that pass needs, within plan_slack of it (as a plan at its cut may go that far
    // past the highest live bytes), to the end of the page that allowance ends in. At the page
    // floor of the need, as first built, it left resnet50's second step to the pool: 1.015 of
    // live over the whole trace, against 1.005 when the plan serves it.
    // Or within what the pool held over the live bytes when the pass began (its highest
    // reserved over the highest live bytes then), where that is more: the need is above the
    // highest reserved (arm_mid_pass()), so the pool serving the pass takes the run higher,
    // and by its own measure that much over live. It is what a plan at its cut has in the
    // highest reserved, scaled to the need. gpt2_4l_bf16's plan, found 34 events into the
    // second step, packs 432 MiB for a need of 411.5 (5% over: the pool held 1.05 of live
    // after the first step); held to plan_slack it waited, and the pool took that step to 430
    // (1.045 of live), the plan serving it holds 420 (1.021); maml_mlp 1.066 -> 1.045, which
    // was above PyTorch's allocator. Measured at the arming instead, after the pool grew for
    // the pass's first requests, it let through plans a page above what the pool then took
    // (5 of the test suite's loops, and one of its tests, higher).
    const auto allowed =
        static_cast<std::size_t>(static_cast<double>(mid_pass_need_) * std::max(slack, mid_pass_over_));
    limit = std::min(arm_cap_, round_up(allowed, page()));
  }
  if (after_drop) limit = std::min(limit, p.drop_cap);
  if (pool_pass_ && v == 0 && mid_pass_need_ == 0 && !p.imported && !after_prologue) {
    // The pool has just served a whole pass of this period: the highest reserved measures what
    // a pass takes without the plan, and plan_slack, meant for where it does not yet (a first
    // step, before the optimizer's state), does not apply. A plan made from a window that held
    // the first step's one-off requests packs above it (BERT-base at 32 x 512 on CUDA: 16,900
    // MiB where the pool's pass took 16,754, 1.0093 of live); held to it, that plan waits, and
    // the plan made again from the next pass serves at 16,748.
    limit = std::min(limit, static_cast<std::size_t>(high));
  }
  auto refuse = [&] {
    p.refused_at[v] = high;
    p.dropped_at = -1;  // once
    ++arm_refusals_;
    return false;
  };
  const Ranges holes = config_.holes != 0 ? pool_->page_holes() : Ranges{};
  // The packer gives up on a run as soon as it needs more than the limit leaves. Holes are
  // those of now: a plan that used some is packed again, unless they are the holes it was
  // packed with (each arming of an iteration's plan, in steady state): packing them again
  // gave the same layout, at a cost that grew with the pool's fragments.
  const bool repack = !p.packed[v] || (p.holes[v] && holes_key(holes) != p.holes_key[v]);
  // Sharing pages (CachingAllocator::share_pages) that blocks outliving the period keep
  // partly used: the held pages shrink, and so does the free space in them that the plan
  // could fill. Whether that pays is known only once the plan is packed both ways, so it
  // is weighed only where the plan is packed anyway.
  std::vector<SharePair> pairs;
  if (config_.pool.share_pages && repack) {
    // Blocks younger than a period may be freed within the next one: pages they touch are
    // left alone. Older ones (parameters, optimizer state) hold pages for good.
    const std::uint64_t now = base_ + events_.size();
    std::vector<std::uintptr_t> young;
    for (const auto& [addr, l] : live_) {
      if (l.event + p.period > now) young.push_back(addr);
    }
    std::sort(young.begin(), young.end());
    pairs = pool_->share_candidates(young);
  }
  const std::size_t saved = pairs.size() * page();
  const Ranges shared_holes = pairs.empty() || holes.empty() ? Ranges{} : pool_->holes_after_sharing(holes, pairs);
  // Not even with a perfect packing, holes of the pool filled to the last byte.
  auto hopeless = [&](const Ranges& h, std::size_t held_then) {
    std::size_t hole_bytes = 0;
    for (const auto& x : h) hole_bytes += x.second;
    return held_then + (at_least > hole_bytes ? round_up(at_least - hole_bytes, page()) : 0) > limit;
  };
  const bool without = !hopeless(holes, held);
  const bool with = !pairs.empty() && !hopeless(shared_holes, held - saved);
  if (!without && !with) return refuse();
  auto footprint_of = [&](const Plan& q, std::size_t held_then) {
    return held_then + round_up(q.arena[v], page()) + q.hole_cost[v];
  };
  bool share = false;
  if (with && repack) {
    const bool fits_shared = pack(p, v, (limit - (held - saved)) / page() * page(), shared_holes);
    const std::size_t shared_footprint = fits_shared ? footprint_of(p, held - saved) : 0;
    Packing shared_packing = save_packing(p, v);
    const bool fits = without && pack(p, v, (limit - held) / page() * page(), holes);
    // Sharing must save a page: it costs a device-wide synchronize and copies, once per
    // arming. A one-page gain can be lost later, in the pool (gpt2_4l_accum3: 1.0072 ->
    // 1.0085), but asking for two gave up more than it kept: over the recorded traces and
    // 400 random loops, one page made 22 steady states lower and 2 higher (t5_4l: 1.0105
    // -> 1.0051).
    if (fits_shared && (!fits || shared_footprint + page() <= footprint_of(p, held))) {
      restore_packing(p, v, std::move(shared_packing));
      share = true;
    } else if (!fits) {
      return refuse();
    }
  } else if (!without || (repack && !pack(p, v, (limit - held) / page() * page(), holes))) {
    return refuse();
  }
  const std::size_t need = round_up(p.arena[v], page());
  std::size_t footprint = footprint_of(p, share ? held - saved : held);
  last_footprint_ = footprint;
  if (footprint > limit) return refuse();
  // Memory goes back only below what the plans that served lately took: where plans of
  // several shapes take turns (batch sizes drawn at random, a sampling loop between training
  // steps), what one gave back the next mapped again, page by page (random training loops of
  // 40 steps: 10% fewer driver calls over their second halves, at the same memory). So do
  // the live bytes of the steps the pool served between their passes (a shape whose own plan
  // was refused): given back at each arming, their pages were mapped again at the next such
  // step (random loop 5 over 60 steps: reserved fell from 1,048 to 370 MiB and rose again;
  // 27,894 driver calls, now 24,306, at the same peak).
  if (between_high_ != 0) {
    recent_passes_.push_back({base_ + events_.size(), round_up(between_high_, page()), p.period});
    between_high_ = 0;
  }
  const std::size_t floor = trimmable ? recent_floor(footprint) : footprint;
  kept_floor_ = floor;
  auto above_floor = [&] {
    if (floor <= footprint) return std::numeric_limits<std::size_t>::max();  // all unused pages
    const auto r = static_cast<std::size_t>(pool_->reserved_bytes());
    return r > floor ? (r - floor) / page() * page() : 0;
  };
  if (trimmable) {
    // Where every unused page goes back (no plan that served lately took more), the pages of
    // the holes a plan that served before fills stay, as far as its last pass went: given
    // back, its pass maps them again, page by page (mistral_smooth: 182 page maps and unmaps
    // at a plan's arming). Not all of them: the footprint counts every page its holes use over
    // a pass, more than it holds at once (a hole's page goes idle, and the grow mark moves it
    // where the next block needs one).
    const bool keep_holes = p.holes[v] && p.served_peak != 0 && floor <= footprint;
    pool_->trim(arena_, keep, above_floor(), keep_holes ? p.claims[v] : Ranges{});
    const auto r = static_cast<std::size_t>(pool_->reserved_bytes());
    if (keep_holes && r > p.served_peak) {
      pool_->trim(arena_, keep, (r - p.served_peak + page() - 1) / page() * page());
    }
    mapped = arena_ != 0 ? pool_->arena_mapped(arena_) : 0;
  }
  if (arena_ != 0 && arena_size_ < need) {
    pool_->retire_arena(arena_);  // too small for this plan: its free space joins the pool
    arena_ = 0;
    arena_size_ = 0;
  } else if (arena_ != 0 && mapped > need) {
    pool_->trim(arena_, need, above_floor());
  }
  if (arena_ == 0) {
    // With virtual memory an arena's address range holds every plan the device could: address
    // space costs nothing, and a plan larger than the arena needs a new one, into which every
    // page moves (unmapped from the old range, mapped in the new): where shapes vary, a plan
    // of a longer sequence moved thousands of pages each time it followed a shorter one.
    const std::size_t bytes = config_.pool.vmm ? std::max({need, config_.pool.vmm_segment, device_->capacity()}) : need;
    try {
      arena_ = pool_->create_arena(bytes);
    } catch (const DeviceError&) {
      arena_ = 0;  // no address range for it: the pool goes on alone
    }
    if (arena_ == 0) return false;
    arena_size_ = round_up(bytes, page());
    ++arenas_made_;
  }
  if (share) {
    // The plan's holes avoid what sharing takes. A driver error, or a pair no longer valid,
    // only leaves pages unshared: the footprint is that much higher.
    std::size_t shared = 0;
    try {
      shared = pool_->share_pages(pairs);
    } catch (const DeviceError&) {
    }
    shared_bytes_ += shared;
    footprint += saved - shared;
    last_footprint_ = footprint;
  }
  // Armed mid-pass, the footprint counts the pages of the pass's first blocks, which the pool
  // serves and frees within the pass: the arena takes idle pages before new ones.
  pool_->set_grow_mark(mid_pass_need_ != 0 ? static_cast<std::size_t>(pool_->reserved_bytes()) : footprint);
  armed_footprint_ = footprint;
  // A pass is held to what the plan was accepted against, not to its own footprint: a plan
  // of an earlier run, accepted up to that run's peak, went a page past its footprint in the
  // second step of gpt2_4l_bf16 and was dropped, and the pool alone then took 12 MiB more.
  arm_limit_ = std::max({high, static_cast<std::int64_t>(footprint), static_cast<std::int64_t>(limit)});
  ++p.arms_here;
  if (p.holes[v]) pool_->claim(p.claims[v]);
  armed_ = true;
  variant_ = v;
  ++arms_;
  pool_->take_window_peak();  // the pass it serves is measured from what it holds now
  return true;
}

// ---------------------------------------------------------------------------------------------
// Detection and planning

std::uint64_t PlannedAllocator::record_event(const Event& e) {
  const std::uint64_t g = base_ + events_.size();
  events_.push_back(e);
  events_.back().reserved_high = pool_->reserved_high_water_unlocked();  // calls are serialized by mutex_
  events_.back().live_high = live_hwm_;
  prefix_.push_back(prefix_.back() * kHashBase + e.token);
  // Keep two periods of history (and the window) at most; trim in halves so it is amortized.
  const std::size_t keep = 2 * config_.max_period + config_.match_window + 1;
  if (events_.size() > 2 * keep) {
    const std::size_t drop = events_.size() - keep;
    events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(drop));
    prefix_.erase(prefix_.begin(), prefix_.begin() + static_cast<std::ptrdiff_t>(drop));
    base_ += drop;
    indexed_ = std::max(indexed_, base_);
  }
  return g;
}

std::uint64_t PlannedAllocator::range_hash(std::uint64_t lo, std::uint64_t hi) const {
  return prefix_[static_cast<std::size_t>(hi - base_)] -
         prefix_[static_cast<std::size_t>(lo - base_)] * pow_base(hi - lo);
}

std::uint64_t PlannedAllocator::recent_prefix_hash() const {
  std::uint64_t h = 0;
  for (std::size_t j = 0; j < kPrefix; ++j) {
    h = h * kHashBase + recent_[(allocs_ + j) % kPrefix];  // oldest first
  }
  return h;
}

bool PlannedAllocator::should_plan(std::uint64_t n) const {
  // Plan when there is no plan, or when the active one diverged within its last period, or
  // when it is too small to arm: a period of repeated layers matches for long stretches, and
  // detection must not sleep through them, or it misses where the iteration repeats.
  if (active_ == kNoOffset || !worth_an_arena(plans_[active_])) return true;
  return ever_diverged_ && last_divergence_ + plans_[active_].period >= n;
}

void PlannedAllocator::index_windows(std::uint64_t n) {
  // Hash chains: for each window end m, the previous end of an equal window. Indexed lazily:
  // while a plan matches, nothing is, and detection catches up when it resumes.
  const std::size_t w = config_.match_window;
  if (last_end_.size() > 4 * config_.max_period) last_end_.clear();
  const std::uint64_t pw = pow_base(w);
  for (std::uint64_t m = std::max(indexed_ + 1, base_ + w); m <= n; ++m) {
    const std::uint64_t h = prefix_[static_cast<std::size_t>(m - base_)] -
                            prefix_[static_cast<std::size_t>(m - w - base_)] * pw;
    auto [it, fresh] = last_end_.try_emplace(h, m);
    ev(m - 1).chain = fresh ? kNever : it->second;
    it->second = m;
  }
  indexed_ = std::max(indexed_, n);
}

void PlannedAllocator::detect() {
  const std::uint64_t n = base_ + events_.size();
  const std::size_t w = config_.match_window;
  if (!tied_.empty()) {
    if (!should_plan(n)) {
      tied_.clear();  // a plan matches the stream again
    } else {
      narrow_tie(n);
      return;
    }
  }
  if (events_.size() < w || n < next_detect_ || !should_plan(n)) return;
  index_windows(n);
  std::size_t best_p = 0;
  double best_score = -1.0, best_cov = 0.0;
  struct Scored {
    std::size_t period;
    double score, uncovered;
    bool confirmed;
  };
  std::size_t examined = 0, largest = 0, work = 0;
  std::uint64_t oldest = kNever;
  std::size_t repeats = 0;  // the shortest confirmed period among the candidates so far
  std::vector<Scored> scored;  // in the order examined: shortest first
  auto consider = [&](std::uint64_t end) {
    const std::uint64_t p64 = n - end;
    if (p64 < config_.min_period || p64 > config_.max_period || n - base_ < p64) return;
    const auto p = static_cast<std::size_t>(p64);
    // Inside repeated layers the window recurs at every multiple k of the layers' period. Where
    // the last p events are all that repetition, a longer multiple differs only in covering
    // lifetimes that span more layers, so only k = 1, 2, 4, ... are examined: enough to cover
    // them, and cheap, so that detection's pauses (below) do not make it miss the start of
    // the next iteration.
    if (repeats != 0 && p % repeats == 0) {
      const std::size_t k = p / repeats;
      if ((k & (k - 1)) != 0 && range_hash(n - p, n - repeats) == range_hash(n - p + repeats, n)) return;
    }
    ++examined;
    largest = std::max(largest, p);
    const bool confirmed =
        n - base_ >= 2 * p64 && range_hash(n - p, n) == range_hash(n - 2 * p64, n - p);
    if (confirmed && repeats == 0) repeats = p;
    // Scored on a sample of at most ~1024 allocations (exact for the winner, below).
    const std::size_t stride = std::max<std::size_t>(1, p / 2048);
    work += p / stride;
    double uncovered = 0.0;
    const double cov = coverage(n, p, nullptr, stride, &uncovered);
    const double score = cov + (confirmed ? 0.01 : 0.0);
    scored.push_back({p, score, uncovered, confirmed});
    if (score > best_score) {
      best_score = score;
      best_p = p;
    }
  };
  std::size_t steps = 0;
  for (std::uint64_t end = ev(n - 1).chain; end != kNever && end > base_ + w && steps < kMaxChain;
       end = ev(end - 1).chain, ++steps) {
    if (examined < kMaxCandidates) {
      consider(end);
    } else {
      oldest = end;
    }
  }
  if (oldest != kNever) consider(oldest);
  // The best candidate covers the largest share of its bytes. A shorter one that leaves no
  // more bytes of unknown lifetime is as good: the best's larger share is the same blocks
  // among more bytes. A request the iteration does not usually make (a loss logged on the
  // GPU, kept) turns a confirmed period of layers into unconfirmed multiples of it that all
  // hold that one block; the longest won, and detection slept for half of it past the start
  // of the next step (mamba_4l, bloom_4l, qwen2_bf16 with the loss logged at a step's start:
  // the first step's plan missed the second, 1.010 -> 1.040 of live). Never a longer one
  // than the best: chosen as candidates came, a period of many iterations won over one.
  const auto best = std::find_if(scored.begin(), scored.end(), [&](const Scored& c) { return c.period == best_p; });
  for (auto c = scored.begin(); c != best; ++c) {
    if (c->confirmed == best->confirmed && c->uncovered <= best->uncovered) {
      best_p = c->period;
      break;
    }
  }
  if (best_p != 0) {  // exact, where candidates were scored on a sample
    best_cov = coverage(n, best_p, nullptr);
    work += best_p;
  }
  // The next detection waits for at least work / kDetectBudget more events, so that detection
  // costs O(kDetectBudget) steps per event at most, amortized.
  const std::size_t pause = work / kDetectBudget;
  if (best_p != 0 && best_cov >= kMinCoverage && repeats == 0 && large_window(n, best_p)) {
    // Where steps of several shapes come in any order, the window at a step's start may hold
    // nothing of the new step's shape (the end of the last step, its first requests of a
    // fixed size): it recurs at the start of every step, and candidates one, two, three
    // steps back cover their bytes alike (a longer period covers at least what a shorter one
    // does). They predict different steps. The choice waits for the requests that follow,
    // which tell them apart (narrow_tie()). Confirmed candidates (the period repeated just
    // before) are not in doubt, and nor are windows too small to make a plan worth an arena.
    std::vector<std::size_t> tied;
    bool differ = false;
    for (const Scored& c : scored) {
      const std::size_t p = c.period;
      if (c.score + kTieMargin < best_score) continue;
      tied.push_back(p);
      differ = differ || !same_period(n, p, best_p);
    }
    if (differ) {
      ++ties_;
      tied_ = std::move(tied);
      tie_since_ = tie_checked_ = n;
      tie_unit_ = *std::min_element(tied_.begin(), tied_.end());
      const auto whole = [&](std::size_t p) { return p % tie_unit_ == 0; };
      if (!std::all_of(tied_.begin(), tied_.end(), whole)) tie_unit_ = 0;
      tie_pause_ = std::max(w, pause);
      return;
    }
  }
  if (best_p != 0 && best_cov >= kMinCoverage) {
    std::vector<std::size_t> lifetimes;
    coverage(n, best_p, &lifetimes);
    build_plan(n, best_p, lifetimes);
    next_detect_ = n + std::max({best_p / 2, w, pause});
  } else if (examined > 0) {
    next_detect_ = n + std::max({largest / 4, w, pause});
  }
}

bool PlannedAllocator::same_period(std::uint64_t n, std::size_t p, std::size_t q) const {
  // Whether periods p and q, read from their start (what each predicts comes next), hold the
  // same events over the shorter of the two, on a sample of at most ~256 of them.
  const std::size_t a = std::min(p, q);
  const std::size_t stride = std::max<std::size_t>(1, a / 256);
  std::size_t same = 0, all = 0;
  for (std::size_t i = 0; i < a; i += stride, ++all) {
    if (ev(n - p + i).token == ev(n - q + i).token) ++same;
  }
  return static_cast<double>(same) >= kSameShare * static_cast<double>(all);
}

bool PlannedAllocator::large_window(std::uint64_t n, std::size_t period) const {
  // Whether the bytes allocated in the last `period` events could make a plan worth an arena.
  double total = 0.0;
  for (std::uint64_t g = n - period; g < n; ++g) {
    if (ev(g).alloc) total += static_cast<double>(ev(g).size);
  }
  return total >= kMinPlanShare * static_cast<double>(live_hwm_);
}

void PlannedAllocator::narrow_tie(std::uint64_t n) {
  // Each event since the last call drops the tied periods that did not predict it.
  const std::size_t before = tied_.size();
  for (std::uint64_t g = tie_checked_; g < n && !tied_.empty(); ++g) {
    const auto missed = [&](std::size_t p) {
      return g < base_ + p || ev(g).token != ev(g - p).token;
    };
    tied_.erase(std::remove_if(tied_.begin(), tied_.end(), missed), tied_.end());
  }
  tie_checked_ = n;
  if (tied_.empty()) {
    // None predicted the stream (a shape not seen within the tie's reach). Where the tied
    // periods were whole steps, the last step is a step of some shape: planned alone, it is
    // a stored plan for when that shape comes back.
    if (tie_unit_ != 0) {
      std::vector<std::size_t> lifetimes;
      if (coverage(tie_since_, tie_unit_, &lifetimes) >= kMinCoverage) {
        build_plan(tie_since_, tie_unit_, lifetimes, kNoOffset, false,
                   static_cast<std::size_t>(n - tie_since_));
        next_detect_ = n + std::max(tie_unit_ / 2, tie_pause_);
        return;
      }
    }
    next_detect_ = n;  // detection starts afresh
    return;
  }
  const std::size_t shortest = *std::min_element(tied_.begin(), tied_.end());
  const std::size_t longest = *std::max_element(tied_.begin(), tied_.end());
  bool agree = tied_.size() == 1;
  if (!agree && tied_.size() < before) {
    const auto alike = [&](std::size_t p) { return same_period(n, p, longest); };
    agree = std::all_of(tied_.begin(), tied_.end(), alike);
  }
  // Undecided after half the shortest period: decided on coverage alone, as without a tie.
  if (!agree && n - tie_since_ < shortest / 2) return;
  std::size_t best_p = 0;
  double best_cov = -1.0;
  // Planned from the window the tie was found at (the periods were scored there), with the
  // cursor where the stream is now.
  const std::uint64_t at = tie_since_;
  for (std::size_t p : tied_) {
    const double cov = coverage(at, p, nullptr);
    if (cov > best_cov) {
      best_cov = cov;
      best_p = p;
    }
  }
  const std::size_t work = std::accumulate(tied_.begin(), tied_.end(), std::size_t{0});
  tied_.clear();
  if (best_cov >= kMinCoverage) {
    // Where the tied periods were whole numbers of one step (steps of equal length taking
    // turns), the plan is the first step of the period that predicted the stream: the step
    // of the shape now coming, alone, not the steps that followed it then.
    std::uint64_t end = at;
    std::size_t period = best_p;
    if (tie_unit_ != 0 && best_p > tie_unit_) {
      end = at - best_p + tie_unit_;
      period = tie_unit_;
    }
    std::vector<std::size_t> lifetimes;
    const double c = coverage(end, period, &lifetimes);
    if (c < kMinCoverage) {
      end = at;
      period = best_p;
      lifetimes.clear();
      coverage(end, period, &lifetimes);
    }
    build_plan(end, period, lifetimes, kNoOffset, false, static_cast<std::size_t>(n - end));
    next_detect_ = n + std::max({best_p / 2, tie_pause_, work / kDetectBudget});
  } else {
    next_detect_ = n + std::max(tie_pause_, work / kDetectBudget);
  }
}

double PlannedAllocator::coverage(std::uint64_t n, std::size_t period,
                                  std::vector<std::size_t>* lifetimes, std::size_t stride,
                                  double* uncovered) const {
  // Lifetime of each allocation of the last `period` events: known if freed (and within the
  // period); for one still alive, predicted from the same allocation one period earlier.
  // With stride > 1 (scoring candidates), every stride-th event only.
  double total = 0.0, covered = 0.0;
  if (lifetimes != nullptr) stride = 1;
  for (std::uint64_t g = n - period; g < n; g += stride) {
    const Event& e = ev(g);
    if (!e.alloc) continue;
    std::size_t life = 0;
    if (e.free_at != kNever) {
      if (e.free_at - g <= period) life = static_cast<std::size_t>(e.free_at - g);
    } else if (g >= base_ + period) {
      const Event& before = ev(g - period);
      if (before.alloc && before.token == e.token && before.free_at != kNever) {
        const std::uint64_t l = before.free_at - (g - period);
        if (l >= n - g && l <= period) life = static_cast<std::size_t>(l);
      }
    }
    total += static_cast<double>(e.size);
    if (life != 0) covered += static_cast<double>(e.size);
    if (lifetimes != nullptr) lifetimes->push_back(life);
  }
  if (uncovered != nullptr) *uncovered = (total - covered) * static_cast<double>(stride);
  return total > 0.0 ? covered / total : 0.0;
}

void PlannedAllocator::build_plan(std::uint64_t n, std::size_t period,
                                  const std::vector<std::size_t>& lifetimes, std::size_t replace,
                                  bool at_mark, std::size_t ahead) {
  const std::uint64_t s = n - period;
  struct A {
    std::size_t t, life, size;
    StreamId stream;
  };
  std::vector<A> allocs;
  allocs.reserve(lifetimes.size());
  std::size_t k = 0;
  for (std::uint64_t g = s; g < n; ++g) {
    const Event& e = ev(g);
    if (e.alloc) allocs.push_back({static_cast<std::size_t>(g - s), lifetimes[k++], e.size, e.stream});
  }
  // The cut: the first time step where the fewest planned bytes are alive (at a mark: there).
  std::size_t cut = 0;
  if (!at_mark) {
    std::vector<PackBlock> planned;
    for (const A& a : allocs) {
      if (a.life != 0) planned.push_back({a.t, a.life, a.size});
    }
    const std::vector<long long> live = live_profile(planned, period);
    cut = static_cast<std::size_t>(std::min_element(live.begin(), live.end()) - live.begin());
  }
  // Signature: the token sequence rotated to start at the cut.
  const std::uint64_t signature =
      range_hash(s + cut, n) * pow_base(cut) + range_hash(s, s + cut);
  auto rotated = [&](std::size_t t) { return (t + period - cut) % period; };
  // The next request is at time `period + ahead` (mod period) of the window.
  const std::size_t now = rotated(ahead % period);
  for (std::size_t i = 0; i < plans_.size() && replace == kNoOffset; ++i) {
    if (plans_[i].signature == signature) {
      // Seen before (alternating shapes come back): no packing, continue from `now`. A plan
      // of an earlier run that detection finds in this one is a plan of this run from now on.
      plans_[i].imported = false;
      if (i != active_) {
        const auto& slots = plans_[i].slots;
        auto at = std::lower_bound(slots.begin(), slots.end(), now,
                                   [](const Slot& x, std::size_t t) { return x.time < t; });
        adopt(i, at == slots.end() ? 0 : static_cast<std::size_t>(at - slots.begin()));
        ++plan_switches_;
      }
      ever_diverged_ = false;
      return;
    }
  }

  // Blocks on the circle that starts at the cut.
  std::vector<std::size_t> by_time(allocs.size());
  for (std::size_t i = 0; i < by_time.size(); ++i) by_time[i] = i;
  std::stable_sort(by_time.begin(), by_time.end(), [&](std::size_t a, std::size_t b) {
    return rotated(allocs[a].t) < rotated(allocs[b].t);
  });
  std::vector<PackBlock> blocks;
  std::vector<std::size_t> block_of(allocs.size(), kNoOffset);
  for (std::size_t i = 0; i < allocs.size(); ++i) {
    if (allocs[i].life == 0) continue;
    block_of[i] = blocks.size();
    blocks.push_back({rotated(allocs[i].t), allocs[i].life, allocs[i].size});
  }
  Plan plan;
  plan.id = ++plan_ids_;
  plan.signature = signature;
  plan.period = period;
  plan.bound[0] = live_bound(blocks, period);
  const std::vector<std::size_t>& order = by_time;
  plan.built_at = n;
  plan.cut = cut;
  plan.slot_of_alloc.assign(allocs.size(), 0);
  for (std::size_t j = 0; j < order.size(); ++j) plan.slot_of_alloc[order[j]] = j;
  std::size_t cursor = order.size();
  for (std::size_t j = 0; j < order.size(); ++j) {
    const A& a = allocs[order[j]];
    Slot slot;
    slot.size = a.size;
    slot.stream = a.stream;
    slot.time = rotated(a.t);
    slot.planned = block_of[order[j]] != kNoOffset;
    plan.slots.push_back(slot);
    plan.slot_block.push_back(block_of[order[j]]);
    if (cursor == order.size() && rotated(a.t) >= now) cursor = j;
  }
  if (cursor == order.size()) cursor = 0;
  if (plan.slots.size() >= kPrefix) {
    std::uint64_t h = 0;
    for (std::size_t j = 0; j < kPrefix; ++j) {
      h = h * kHashBase + alloc_token(plan.slots[j].size, plan.slots[j].stream);
    }
    plan.prefix = h;
  }
  ++plans_built_;
  last_period_ = period;
  last_blocks_ = blocks;
  plan.blocks = std::move(blocks);
  last_coverage_ = static_cast<double>(std::count_if(lifetimes.begin(), lifetimes.end(),
                                                     [](std::size_t l) { return l != 0; })) /
                   static_cast<double>(std::max<std::size_t>(lifetimes.size(), 1));
  if (at_mark) plan.validated = true;  // the step repeated the one before it (mark_step)
  if (replace != kNoOffset) {
    // The same plan, made again from a pass where more lifetimes are known.
    plan.validated = true;
    plans_[replace] = std::move(plan);
    stop_serving();
    active_ = replace;
    cursor_ = cursor;
    at_cut_ = false;
    pass_start_ = kNever;  // the new cut may lie elsewhere: the next pass is measured from it
    return;
  }
  if (plans_.size() >= config_.max_plans) {
    // Evict the least recently used plan that is not the active one.
    std::size_t victim = kNoOffset;
    for (std::size_t i = 0; i < plans_.size(); ++i) {
      if (i == active_) continue;
      if (victim == kNoOffset || plans_[i].last_used < plans_[victim].last_used) victim = i;
    }
    if (victim == kNoOffset) {
      victim = active_;
      active_ = kNoOffset;
      stop_serving();
    }
    plans_.erase(plans_.begin() + static_cast<std::ptrdiff_t>(victim));
    if (active_ != kNoOffset && active_ > victim) --active_;
  }
  plans_.push_back(std::move(plan));
  const bool replaces = armed_;
  adopt(plans_.size() - 1, cursor);
  // The window ends a little way into a pass of the plan (the pool served its first requests):
  // rather than wait a whole pass for its cut, the plan serves the rest of this one. Found at
  // the start of the second step, the plan of the first serves the step whose peak is the
  // highest of the run (the first with the optimizer's state): mamba_4l 1.030 -> 1.010 of
  // live over the whole trace. Only over virtual memory: without it an arena is a segment
  // of its own, which the pool cannot take pages from.
  Plan& fresh = plans_.back();
  if (config_.pool.vmm && !armed_ && cursor != 0 && now <= std::min(kMidPassWindows * config_.match_window, period / kMidPassShare) &&
      worth_an_arena(fresh)) {
    arm_mid_pass(fresh, cursor, n, replaces, n + ahead - now);
  }
}

void PlannedAllocator::unpack(Plan& p, int v) {
  p.packed[v] = p.holes[v] = false;
  p.arena[v] = p.hole_cost[v] = 0;
  p.holes_key[v] = 0;
  p.refused_at[v] = -1;
  p.claims[v].clear();
  for (Slot& slot : p.slots) {
    slot.offset[v] = kNoOffset;
    slot.hole[v] = 0;
  }
}

void PlannedAllocator::set_skip(Plan& p, std::size_t skip) {
  if (p.skip == skip) return;
  p.skip = skip;
  p.bound[1] = 0;
  unpack(p, 1);
}

void PlannedAllocator::arm_mid_pass(Plan& p, std::size_t cursor, std::uint64_t n, bool replaces,
                                    std::uint64_t began) {
  // What the rest of the pass holds at least: the live blocks that are not the plan's (the
  // parameters, the optimizer's state: they stay) beside the plan's own peak. The plan's are
  // those made in its window with a lifetime within the period: the pass's first requests,
  // which the pool served, and blocks of the last pass that wrap round into this one.
  const std::uint64_t s = n - p.period;
  std::vector<char> planned(p.period, 0);
  std::size_t k = 0;
  for (std::uint64_t g = s; g < n; ++g) {
    if (ev(g).alloc) planned[g - s] = p.slots[p.slot_of_alloc[k++]].planned ? 1 : 0;
  }
  std::int64_t others = live_bytes_;
  for (const auto& [addr, l] : live_) {
    if (l.event >= s && l.event < n && planned[l.event - s] != 0) others -= static_cast<std::int64_t>(l.size);
  }
  const std::size_t need = static_cast<std::size_t>(std::max<std::int64_t>(others, 0)) + p.bound[0];
  // Only where that pass needs more than the pool ever held (the first one with the optimizer's
  // state, typically), so that the peak rises whoever serves it, or where the plan replaces
  // one that was serving. Where the pool had held as much, it was let arm below that highest
  // reserved, and random training runs lost more than they gained (seed 153: 1.006 -> 1.028).
  if (need <= static_cast<std::size_t>(pool_->reserved_high_water()) && !replaces) return;
  set_skip(p, cursor);
  p.refused_at[1] = -1;  // adopt() may have refused it at the limits of a plan it recognised
  mid_pass_need_ = need;
  // What the pool held over the live bytes when this pass began (arm() may allow as much).
  mid_pass_over_ = 1.0;
  if (began >= base_ && began < base_ + events_.size() && ev(began).live_high > 0) {
    mid_pass_over_ = static_cast<double>(ev(began).reserved_high) / static_cast<double>(ev(began).live_high);
  }
  if (arm(1)) {
    ++mid_pass_arms_;
    mid_pass_ = true;
  }
  mid_pass_need_ = 0;
}

std::size_t PlannedAllocator::share_pages() {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t n = pool_->share_pages();
  shared_bytes_ += n;
  return n;
}

bool PlannedAllocator::stop_automatic_page_sharing() {
  std::lock_guard<std::mutex> lock(mutex_);
  config_.pool.share_pages = false;
  return pool_->stop_automatic_page_sharing();
}

std::string PlannedAllocator::self_check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pool_->self_check();
}

void PlannedAllocator::mark_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t n = base_ + events_.size();
  const std::uint64_t prev = last_mark_;
  last_mark_ = n;
  ++marks_;
  if (prev == kNever || prev < base_ || n - prev < config_.min_period ||
      n - prev > config_.max_period) {
    return;
  }
  if (active_ != kNoOffset && !should_plan(n)) return;  // a plan serves the stream already
  const auto period = static_cast<std::size_t>(n - prev);
  // Only a step that repeated the one before it: marks at odd places (twice, mid-step) then
  // make no plan, and detection goes on as without marks.
  if (n - base_ < 2 * static_cast<std::uint64_t>(period) ||
      range_hash(n - period, n) != range_hash(n - 2 * period, n - period)) {
    return;
  }
  std::vector<std::size_t> lifetimes;
  if (coverage(n, period, &lifetimes) < kMinCoverage) return;
  build_plan(n, period, lifetimes, kNoOffset, true);
}

void PlannedAllocator::adopt(std::size_t index, std::size_t cursor) {
  // Another plan's offsets would be served from an arena packed for the previous one: the
  // new plan arms at its own cut (or now, see below), after trimming for its needs.
  if (index != active_) {
    // Leaving a plan mid-iteration (a new plan was found, another one recognised): its
    // blocks alive in the arena must not make the pool grow around the arena's free space.
    // But a plan recognised by its first requests arms in the arena at once (below), and the
    // few blocks alive there (the last pass's, the first requests of this one) only keep
    // their ranges from it: retired, its every page would move to a new arena.
    if (arena_ != 0 && (!arms_at_once(index, cursor) ||
                        pool_->arena_busy_bytes(arena_) * kArmShare > plans_[index].bound[0])) {
      retire_busy_arena();
    }
    stop_serving();
  }
  active_ = index;
  cursor_ = cursor;
  at_cut_ = cursor == 0;
  ever_diverged_ = false;
  pass_start_ = kNever;
  pass_failed_ = false;
  Plan& p = plans_[index];
  p.last_used = allocs_;
  pass_matches_ = 0;
  pass_miss_bytes_ = 0;
  pass_skipped_bytes_ = 0;
  // Adopted at the start of an iteration (its first kPrefix requests matched a stored plan, as
  // when shapes alternate or come back): the pool holds little now, so the plan arms at once.
  // If the rest of the iteration does not follow, the divergence rule disarms it.
  // A plan of an earlier run does so only once a pass of this run has matched it, and only
  // where its first requests select it alone. Where stored plans begin alike (the plan of a
  // step, and that of a cycle of steps and an evaluation, which begins with one) it waits for
  // its cut: armed at once there, on the 300 evaluation loops of alloc_random it held a page
  // more than the run's own plans on 41 of them.
  if (!armed_ && arms_at_once(index, cursor)) {
    set_skip(p, kPrefix);
    if (!arm(1)) retire_busy_arena();
  }
}

bool PlannedAllocator::arms_at_once(std::size_t index, std::size_t cursor) const {
  const Plan& p = plans_[index];
  const bool alone = std::count_if(plans_.begin(), plans_.end(),
                                   [&](const Plan& q) { return q.prefix == p.prefix; }) == 1;
  return cursor == kPrefix && (!p.imported || (p.validated && alone));
}

}  // namespace pymemplan
