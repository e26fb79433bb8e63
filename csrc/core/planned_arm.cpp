// Plan-guided placement, arming plans (packing, footprints, the arena): see planned.hpp for the design.
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
// Arming: packing a plan, weighing its footprint, the arena

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
