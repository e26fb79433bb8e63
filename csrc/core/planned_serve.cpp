// Plan-guided placement, serving requests from the active plan (the cursor, the cut): see planned.hpp for the design.
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

}  // namespace pymemplan
