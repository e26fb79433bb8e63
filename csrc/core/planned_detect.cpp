// Plan-guided placement, detection of the period and the making of plans: see planned.hpp for the design.
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

}  // namespace pymemplan
