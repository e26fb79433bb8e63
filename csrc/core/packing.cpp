#include "packing.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <string>
#include <utility>

namespace pymemplan {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

// Range max over elementary time intervals, with a range raise to a value that is at least
// every value in the range (a placed block's top is above the skyline under it). Bottom-up: a
// raise tags the nodes covering the range and lifts the maxima on the two boundary paths; a
// query takes the maxima of the covering nodes and the tags on the two boundary paths (every
// covering node hangs off them).
class MaxTree {
 public:
  explicit MaxTree(std::size_t n) : n_(std::max<std::size_t>(n, 1)), mx_(2 * n_, 0), tag_(2 * n_, 0) {}
  std::size_t query(std::size_t l, std::size_t r) const {
    std::size_t out = 0;
    for (std::size_t a = l + n_, b = r + n_; a < b; a >>= 1, b >>= 1) {
      if (a & 1) out = std::max(out, mx_[a++]);
      if (b & 1) out = std::max(out, mx_[--b]);
    }
    for (std::size_t k = (l + n_) >> 1; k > 0; k >>= 1) out = std::max(out, tag_[k]);
    for (std::size_t k = (r - 1 + n_) >> 1; k > 0; k >>= 1) out = std::max(out, tag_[k]);
    return out;
  }
  void raise(std::size_t l, std::size_t r, std::size_t v) {
    for (std::size_t a = l + n_, b = r + n_; a < b; a >>= 1, b >>= 1) {
      if (a & 1) {
        mx_[a] = std::max(mx_[a], v);
        tag_[a] = std::max(tag_[a], v);
        ++a;
      }
      if (b & 1) {
        --b;
        mx_[b] = std::max(mx_[b], v);
        tag_[b] = std::max(tag_[b], v);
      }
    }
    for (std::size_t k = (l + n_) >> 1; k > 0; k >>= 1) mx_[k] = std::max(mx_[k], v);
    for (std::size_t k = (r - 1 + n_) >> 1; k > 0; k >>= 1) mx_[k] = std::max(mx_[k], v);
  }

 private:
  std::size_t n_;
  std::vector<std::size_t> mx_, tag_;  // mx_: max in the subtree; tag_: raise of the whole subtree
};

// A block's lifetime as at most two ranges of elementary intervals (it may wrap around).
struct Spans {
  std::size_t lo[2] = {0, 0}, hi[2] = {0, 0};
  int n = 0;
};

// One skyline run: blocks in the order of the lazy queue (lowest key first, then `rank`).
// Returns the arena; stops early once it reaches `limit` (it cannot beat the best then).
// Queue entries are (key, rank) pairs, packed into one 64-bit word when keys in units of
// `unit` (the gcd of the sizes: every key is a sum of sizes) fit 32 bits.
// With a capacity, a block whose lowest offset would take it past the capacity is left out
// (offset kNone): keys only rise, so it would never fit later.
template <bool kPacked>
std::size_t skyline(const std::vector<PackBlock>& blocks, const std::vector<Spans>& spans,
                    std::size_t intervals, const std::vector<std::size_t>& order,
                    std::vector<std::size_t>& offsets, std::size_t limit, std::size_t unit,
                    std::size_t capacity = kNone) {
  MaxTree sky(intervals);
  auto key_of = [&](std::size_t i) {
    std::size_t k = 0;
    for (int s = 0; s < spans[i].n; ++s) k = std::max(k, sky.query(spans[i].lo[s], spans[i].hi[s]));
    return k;
  };
  using Entry = std::conditional_t<kPacked, std::uint64_t, std::pair<std::size_t, std::size_t>>;
  auto make = [&](std::size_t key, std::size_t rank) -> Entry {
    if constexpr (kPacked) {
      return (static_cast<std::uint64_t>(key / unit) << 32) | rank;
    } else {
      return {key, rank};
    }
  };
  auto key_at = [&](const Entry& e) -> std::size_t {
    if constexpr (kPacked) {
      return static_cast<std::size_t>(e >> 32) * unit;
    } else {
      return e.first;
    }
  };
  auto rank_at = [&](const Entry& e) -> std::size_t {
    if constexpr (kPacked) {
      return static_cast<std::size_t>(e & 0xffffffffu);
    } else {
      return e.second;
    }
  };
  std::vector<Entry> heap;
  heap.reserve(order.size());
  for (std::size_t r = 0; r < order.size(); ++r) heap.push_back(make(0, r));
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue(
      std::greater<Entry>(), std::move(heap));
  offsets.assign(blocks.size(), capacity == kNone ? 0 : kNone);
  std::size_t arena = 0;
  // Keys only rise: a block found too high once (past the capacity, or reaching the limit)
  // stays too high, and is settled at once rather than queued again.
  auto too_high = [&](std::size_t key, std::size_t i) {
    return key + blocks[i].size > capacity || key + blocks[i].size >= limit;
  };
  while (!queue.empty()) {
    Entry e = queue.top();
    queue.pop();
    bool lowest = true;  // e is the lowest block left (false: found too high on the way)
    for (;;) {
      const std::size_t key = key_of(order[rank_at(e)]);
      if (key == key_at(e)) break;
      e = make(key, rank_at(e));
      if (too_high(key, order[rank_at(e)])) {
        lowest = false;
        break;
      }
      // The skyline rose under it since it was queued. Still the lowest: place it at once.
      if (queue.empty() || !(queue.top() < e)) break;
      queue.push(e);
      e = queue.top();
      queue.pop();
    }
    const std::size_t i = order[rank_at(e)];
    const std::size_t key = key_at(e);
    if (lowest && capacity != kNone && key >= capacity) break;  // full: nothing else fits
    if (too_high(key, i)) {
      if (key + blocks[i].size >= limit) return key + blocks[i].size;  // this run cannot win
      continue;  // past the capacity: left out
    }
    offsets[i] = key;
    const std::size_t top = key + blocks[i].size;
    for (int s = 0; s < spans[i].n; ++s) sky.raise(spans[i].lo[s], spans[i].hi[s], top);
    arena = std::max(arena, top);
    if (arena >= limit) return arena;
  }
  return arena;
}

// Each block's lifetime as ranges of the elementary intervals between the distinct start
// and end times.
struct Timeline {
  std::vector<Spans> spans;
  std::size_t intervals = 0;
  Timeline(const std::vector<PackBlock>& blocks, std::size_t period) {
    std::vector<std::size_t> cuts = {0, period};
    for (const PackBlock& b : blocks) {
      cuts.push_back(b.start);
      cuts.push_back((b.start + b.life) % period);
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    auto index = [&](std::size_t t) {
      return static_cast<std::size_t>(std::lower_bound(cuts.begin(), cuts.end(), t) - cuts.begin());
    };
    intervals = cuts.size() - 1;
    spans.resize(blocks.size());
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const std::size_t end = blocks[i].start + blocks[i].life;
      Spans& s = spans[i];
      if (end <= period) {
        s.lo[0] = index(blocks[i].start);
        s.hi[0] = index(end);
        s.n = 1;
      } else {
        s.lo[0] = index(blocks[i].start);
        s.hi[0] = intervals;
        s.lo[1] = 0;
        s.hi[1] = index(end - period);
        s.n = s.hi[1] > 0 ? 2 : 1;
      }
    }
  }
};

void check_blocks(const std::vector<PackBlock>& blocks, std::size_t period, const char* who) {
  for (const PackBlock& b : blocks) {
    if (b.start >= period || b.life == 0 || b.life > period) {
      throw std::invalid_argument(std::string(who) + ": block [" + std::to_string(b.start) +
                                  ", +" + std::to_string(b.life) + ") does not fit a period of " +
                                  std::to_string(period));
    }
  }
}

}  // namespace

bool lifetimes_overlap(const PackBlock& a, const PackBlock& b, std::size_t period) {
  // On the circle: b starts while a is alive, or a starts while b is alive.
  const std::size_t ba = (b.start + period - a.start) % period;
  const std::size_t ab = (a.start + period - b.start) % period;
  return ba < a.life || ab < b.life;
}

std::size_t live_bound(const std::vector<PackBlock>& blocks, std::size_t period) {
  if (blocks.empty() || period == 0) return 0;
  std::vector<std::pair<std::size_t, long long>> delta;  // (time, change), sorted below
  delta.reserve(3 * blocks.size());
  long long at_zero = 0;  // blocks wrapping around are alive at time 0
  for (const PackBlock& b : blocks) {
    const auto s = static_cast<long long>(b.size);
    const std::size_t end = b.start + b.life;
    delta.emplace_back(b.start, s);
    if (end <= period) {
      delta.emplace_back(end, -s);
    } else {
      delta.emplace_back(period, -s);
      at_zero += s;
      delta.emplace_back(end - period, -s);
    }
  }
  delta.emplace_back(0, at_zero);
  std::sort(delta.begin(), delta.end());
  long long live = 0, peak = 0;
  for (std::size_t k = 0; k < delta.size();) {
    const std::size_t t = delta[k].first;
    for (; k < delta.size() && delta[k].first == t; ++k) live += delta[k].second;
    if (t < period) peak = std::max(peak, live);
  }
  return static_cast<std::size_t>(peak);
}

std::vector<long long> live_profile(const std::vector<PackBlock>& blocks, std::size_t period) {
  std::vector<long long> delta(period + 1, 0);
  for (const PackBlock& b : blocks) {
    const auto sz = static_cast<long long>(b.size);
    const std::size_t end = b.start + b.life;
    delta[b.start] += sz;
    if (end <= period) {
      delta[end] -= sz;
    } else {  // wraps around the circle
      delta[period] -= sz;
      delta[0] += sz;
      delta[end - period] -= sz;
    }
  }
  std::vector<long long> live(period, 0);
  long long now = 0;
  for (std::size_t t = 0; t < period; ++t) live[t] = now += delta[t];
  return live;
}

PackResult pack_blocks(const std::vector<PackBlock>& blocks, std::size_t period,
                       std::size_t search_rounds, std::size_t granule, std::size_t give_up) {
  check_blocks(blocks, period, "pack_blocks");
  PackResult r;
  r.bound = live_bound(blocks, period);
  const std::size_t n = blocks.size();
  if (n == 0) return r;
  if (give_up != 0 && r.bound > give_up) {  // no run can: every arena holds the bound
    r.arena = give_up + 1;
    return r;
  }
  const Timeline tl(blocks, period);
  const std::vector<Spans>& spans = tl.spans;
  const std::size_t intervals = tl.intervals;

  // Tie rules: the largest size x lifetime first, the largest first, the longest-lived first
  // (the slowest: a long block placed raises the skyline under most others); then the same
  // with random perturbations. An arena within the granule of the bound is as good as the bound.
  auto life = [&](std::size_t i) { return static_cast<double>(blocks[i].life); };
  auto size = [&](std::size_t i) { return static_cast<double>(blocks[i].size); };
  auto area = [&](std::size_t i) { return life(i) * size(i); };
  const std::function<double(std::size_t)> rules[] = {area, size, life};
  granule = std::max<std::size_t>(granule, 1);
  const std::size_t good = (r.bound + granule - 1) / granule * granule;
  // Keys are sums of sizes: multiples of their gcd.
  std::size_t unit = 0, total = 0;
  for (const PackBlock& b : blocks) {
    unit = std::gcd(unit, b.size);
    total += b.size;
  }
  unit = std::max<std::size_t>(unit, 1);
  const bool packed = total / unit < (std::uint64_t{1} << 32) && n < (std::uint64_t{1} << 32);
  std::mt19937_64 rng(12345);
  std::uniform_real_distribution<double> noise(1.0, 1.3);
  std::vector<std::size_t> order(n), offsets;
  std::vector<double> weight(n);
  std::size_t best = kNone;
  for (std::size_t run = 0; run < 3 + search_rounds && best > good; ++run) {
    const auto& rule = rules[run % 3];
    for (std::size_t i = 0; i < n; ++i) weight[i] = rule(i) * (run < 3 ? 1.0 : noise(rng));
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      if (weight[a] != weight[b]) return weight[a] > weight[b];
      return blocks[a].size > blocks[b].size;
    });
    // A run stops once it cannot beat the best so far (or the caller's give_up level).
    const std::size_t stop = give_up != 0 && give_up < best ? give_up + 1 : best;
    const std::size_t arena =
        packed ? skyline<true>(blocks, spans, intervals, order, offsets, stop, unit)
               : skyline<false>(blocks, spans, intervals, order, offsets, stop, unit);
    ++r.runs;
    if (arena < stop) {  // a complete run (an early stop returns at least `stop`)
      best = arena;
      r.offsets = offsets;
    }
  }
  if (best == kNone) {  // every run passed give_up: no offsets
    r.offsets.clear();
    r.arena = give_up + 1;
    return r;
  }
  r.arena = best;
  return r;
}

namespace {

// The blocks placed in one hole, by the stretches of time (buckets) their lifetimes cover: the
// blocks whose lifetimes may overlap a block's are those in its buckets, so a query looks at
// the blocks near it in time, not at all of them (plans of tens of thousands of blocks made
// hole filling quadratic). Only the work depends on the bucket count, not the result.
class PlacedIndex {
 public:
  PlacedIndex(std::size_t period, std::size_t blocks)
      : period_(std::max<std::size_t>(period, 1)),
        width_((period_ + kBuckets - 1) / kBuckets),
        buckets_((period_ + width_ - 1) / width_),
        seen_(blocks, 0) {}

  void add(std::size_t j, const PackBlock& b) {
    for_each_bucket(b, [&](std::size_t k) { buckets_[k].push_back(j); });
  }
  // The blocks whose lifetimes cover time `t`, and others near it, in the order added.
  const std::vector<std::size_t>& around(std::size_t t) const { return buckets_[(t % period_) / width_]; }
  // The blocks sharing a bucket with `b`, each once.
  const std::vector<std::size_t>& near(const PackBlock& b) {
    ++stamp_;
    out_.clear();
    for_each_bucket(b, [&](std::size_t k) {
      for (std::size_t j : buckets_[k]) {
        if (seen_[j] != stamp_) {
          seen_[j] = stamp_;
          out_.push_back(j);
        }
      }
    });
    return out_;
  }

 private:
  static constexpr std::size_t kBuckets = 256;
  template <class F>
  void for_each_bucket(const PackBlock& b, F f) const {
    if (b.life >= period_) {
      for (std::size_t k = 0; k < buckets_.size(); ++k) f(k);
      return;
    }
    const std::size_t first = b.start / width_;
    const std::size_t last = ((b.start + b.life - 1) % period_) / width_;
    for (std::size_t k = first;; k = (k + 1) % buckets_.size()) {
      f(k);
      if (k == last) break;
    }
  }
  std::size_t period_, width_;
  std::vector<std::vector<std::size_t>> buckets_;
  std::vector<std::uint32_t> seen_;
  std::uint32_t stamp_ = 0;
  std::vector<std::size_t> out_;
};

// The lowest offset of hole `h` where `b` fits under `capacity`, clear of the blocks already
// there (`placed`) whose lifetimes overlap its own; kNone if there is none.
std::size_t lowest_fit(const std::vector<PackBlock>& blocks, std::size_t period, const PackBlock& b,
                       PlacedIndex& placed, const std::vector<std::size_t>& offset,
                       std::size_t capacity, std::vector<std::pair<std::size_t, std::size_t>>& taken) {
  if (b.size > capacity) return kNone;
  taken.clear();
  for (std::size_t j : placed.near(b)) {
    if (lifetimes_overlap(b, blocks[j], period)) taken.emplace_back(offset[j], offset[j] + blocks[j].size);
  }
  std::sort(taken.begin(), taken.end());
  std::size_t at = 0;
  for (const auto& [lo, hi] : taken) {
    if (lo >= at + b.size) break;
    at = std::max(at, hi);
  }
  return at + b.size <= capacity ? at : kNone;
}

// Live bytes per time step under range additions, with their maximum and where it is: the
// arena's profile as blocks move out of it, in O(log period) a move.
class AddMaxTree {
 public:
  explicit AddMaxTree(const std::vector<long long>& v) {
    while (n_ < v.size()) n_ <<= 1;
    mx_.assign(2 * n_, kFloor);
    add_.assign(2 * n_, 0);
    for (std::size_t i = 0; i < v.size(); ++i) mx_[n_ + i] = v[i];
    for (std::size_t k = n_ - 1; k >= 1; --k) mx_[k] = std::max(mx_[2 * k], mx_[2 * k + 1]);
  }
  void add(std::size_t l, std::size_t r, long long d) { add(1, 0, n_, l, r, d); }
  long long max() const { return mx_[1]; }
  std::size_t argmax() const {
    std::size_t k = 1;
    while (k < n_) k = mx_[2 * k] == mx_[k] - add_[k] ? 2 * k : 2 * k + 1;
    return k - n_;
  }

 private:
  static constexpr long long kFloor = std::numeric_limits<long long>::min() / 4;  // padding
  void add(std::size_t k, std::size_t lo, std::size_t hi, std::size_t l, std::size_t r, long long d) {
    if (r <= lo || hi <= l) return;
    if (l <= lo && hi <= r) {
      mx_[k] += d;
      add_[k] += d;
      return;
    }
    const std::size_t mid = (lo + hi) / 2;
    add(2 * k, lo, mid, l, r, d);
    add(2 * k + 1, mid, hi, l, r, d);
    mx_[k] = std::max(mx_[2 * k], mx_[2 * k + 1]) + add_[k];
  }
  std::size_t n_ = 1;
  std::vector<long long> mx_, add_;  // mx_: max of the subtree, its own add_ included
};

void shave_peak(const std::vector<PackBlock>& blocks, std::size_t period,
                const std::vector<std::size_t>& hole_sizes, const HoleCost& cost, HoleFill& r) {
  AddMaxTree live(live_profile(blocks, period));  // of the blocks left for the arena
  auto add = [&](const PackBlock& b, long long sign) {
    const long long d = sign * static_cast<long long>(b.size);
    const std::size_t end = b.start + b.life;  // the lifetime may wrap around the circle
    live.add(b.start, std::min(end, period), d);
    if (end > period) live.add(0, end - period, d);
  };
  auto alive_at = [&](const PackBlock& b, std::size_t t) { return (t + period - b.start) % period < b.life; };
  std::vector<std::size_t> holes(hole_sizes.size());
  std::iota(holes.begin(), holes.end(), std::size_t{0});
  // Smallest first: the free parts of pages kept anyway take blocks off the peak for nothing,
  // and the large holes that cost pages then get only what is still worth them.
  std::stable_sort(holes.begin(), holes.end(),
                   [&](std::size_t a, std::size_t b) { return hole_sizes[a] < hole_sizes[b]; });
  std::vector<std::size_t> by_size(blocks.size());
  std::iota(by_size.begin(), by_size.end(), std::size_t{0});
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](std::size_t a, std::size_t b) { return blocks[a].size > blocks[b].size; });
  PlacedIndex by_time(period, blocks.size());  // every block, largest first in each bucket
  for (std::size_t i : by_size) by_time.add(i, blocks[i]);
  std::vector<std::pair<std::size_t, std::size_t>> taken;
  for (std::size_t h : holes) {
    const long long before = live.max();
    std::vector<std::size_t> moved;
    PlacedIndex here(period, blocks.size());
    std::size_t top = 0;
    for (;;) {
      const std::size_t t = live.argmax();
      bool placed = false;
      for (std::size_t i : by_time.around(t)) {
        if (r.hole[i] != HoleFill::kNone || blocks[i].size == 0 || blocks[i].size > hole_sizes[h] ||
            !alive_at(blocks[i], t)) {
          continue;
        }
        const std::size_t at = lowest_fit(blocks, period, blocks[i], here, r.offset, hole_sizes[h], taken);
        if (at == kNone) continue;
        r.hole[i] = h;
        r.offset[i] = at;
        moved.push_back(i);
        here.add(i, blocks[i]);
        top = std::max(top, at + blocks[i].size);
        add(blocks[i], -1);
        placed = true;
        break;
      }
      if (!placed) break;
    }
    if (moved.empty()) continue;
    const long long gain = before - live.max();
    const auto paid = static_cast<long long>(cost ? cost(h, top) : 0);
    if (gain > paid || (gain == paid && paid == 0)) {
      for (std::size_t i : moved) r.placed_bytes += blocks[i].size;
      continue;
    }
    for (std::size_t i : moved) {  // not worth its pages: the blocks go back to the arena
      r.hole[i] = HoleFill::kNone;
      r.offset[i] = 0;
      add(blocks[i], +1);
    }
  }
}

void fill_by_skyline(const std::vector<PackBlock>& blocks, std::size_t period,
                     const std::vector<std::size_t>& hole_sizes, HoleFill& r) {
  std::vector<std::size_t> holes(hole_sizes.size());
  std::iota(holes.begin(), holes.end(), std::size_t{0});
  std::stable_sort(holes.begin(), holes.end(),
                   [&](std::size_t a, std::size_t b) { return hole_sizes[a] > hole_sizes[b]; });
  std::vector<std::size_t> left(blocks.size());
  std::iota(left.begin(), left.end(), std::size_t{0});
  for (std::size_t h : holes) {
    std::vector<PackBlock> sub;
    std::vector<std::size_t> of;
    std::size_t unit = 0, total = 0;
    for (std::size_t i : left) {
      if (blocks[i].size == 0 || blocks[i].size > hole_sizes[h]) continue;
      sub.push_back(blocks[i]);
      of.push_back(i);
      unit = std::gcd(unit, blocks[i].size);
      total += blocks[i].size;
    }
    if (sub.empty()) continue;
    unit = std::max<std::size_t>(unit, 1);
    const bool packed = total / unit < (std::uint64_t{1} << 32) && sub.size() < (std::uint64_t{1} << 32);
    const Timeline tl(sub, period);
    auto life = [&](std::size_t i) { return static_cast<double>(sub[i].life); };
    auto size = [&](std::size_t i) { return static_cast<double>(sub[i].size); };
    auto area = [&](std::size_t i) { return life(i) * size(i); };
    const std::function<double(std::size_t)> rules[] = {area, size, life};
    std::vector<std::size_t> order(sub.size()), offsets, best;
    double best_area = 0.0;
    for (const auto& rule : rules) {
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
        const double wa = rule(a), wb = rule(b);
        if (wa != wb) return wa > wb;
        return sub[a].size > sub[b].size;
      });
      if (packed) {
        skyline<true>(sub, tl.spans, tl.intervals, order, offsets, kNone, unit, hole_sizes[h]);
      } else {
        skyline<false>(sub, tl.spans, tl.intervals, order, offsets, kNone, unit, hole_sizes[h]);
      }
      double placed = 0.0;
      for (std::size_t k = 0; k < sub.size(); ++k) placed += offsets[k] != kNone ? area(k) : 0.0;
      if (placed > best_area) {
        best_area = placed;
        best = offsets;
      }
    }
    if (best.empty()) continue;
    std::vector<std::size_t> still;
    std::vector<char> taken(blocks.size(), 0);
    for (std::size_t k = 0; k < sub.size(); ++k) {
      if (best[k] == kNone) continue;
      r.hole[of[k]] = h;
      r.offset[of[k]] = best[k];
      r.placed_bytes += sub[k].size;
      taken[of[k]] = 1;
    }
    for (std::size_t i : left) {
      if (!taken[i]) still.push_back(i);
    }
    left.swap(still);
  }
}

}  // namespace

HoleFill fill_holes(const std::vector<PackBlock>& blocks, std::size_t period,
                    const std::vector<std::size_t>& hole_sizes, HoleRule rule, const HoleCost& cost) {
  HoleFill r;
  r.hole.assign(blocks.size(), HoleFill::kNone);
  r.offset.assign(blocks.size(), 0);
  if (blocks.empty() || hole_sizes.empty() || period == 0) return r;
  check_blocks(blocks, period, "fill_holes");
  if (rule == HoleRule::kSkyline) {
    fill_by_skyline(blocks, period, hole_sizes, r);
    return r;
  }
  if (rule == HoleRule::kPeakShave) {
    shave_peak(blocks, period, hole_sizes, cost, r);
    return r;
  }
  // Greedy.
  const std::vector<long long> live = live_profile(blocks, period);
  const auto peak_t = static_cast<std::size_t>(std::max_element(live.begin(), live.end()) - live.begin());
  const PackBlock at_peak{peak_t, 1, 0};
  std::size_t largest_hole = 0;
  for (std::size_t h : hole_sizes) largest_hole = std::max(largest_hole, h);
  std::vector<std::size_t> order;
  std::vector<char> hot(blocks.size(), 0);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].size == 0 || blocks[i].size > largest_hole) continue;
    hot[i] = lifetimes_overlap(blocks[i], at_peak, period) ? 1 : 0;
    order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (hot[a] != hot[b]) return hot[a] > hot[b];
    const PackBlock& x = blocks[a];
    const PackBlock& y = blocks[b];
    switch (rule) {
      case HoleRule::kGreedyByArea:
        if (x.size * x.life != y.size * y.life) return x.size * x.life > y.size * y.life;
        break;
      case HoleRule::kGreedyByLife:
        if (x.life != y.life) return x.life > y.life;
        break;
      default:
        break;
    }
    return x.size > y.size;
  });
  std::vector<std::size_t> holes(hole_sizes.size());
  std::iota(holes.begin(), holes.end(), std::size_t{0});
  std::stable_sort(holes.begin(), holes.end(),
                   [&](std::size_t a, std::size_t b) { return hole_sizes[a] < hole_sizes[b]; });
  std::vector<PlacedIndex> in_hole(hole_sizes.size(), PlacedIndex(period, blocks.size()));
  std::vector<std::pair<std::size_t, std::size_t>> taken;  // (offset, end) of conflicting blocks
  for (std::size_t i : order) {
    const PackBlock& b = blocks[i];
    for (std::size_t h : holes) {
      const std::size_t at = lowest_fit(blocks, period, b, in_hole[h], r.offset, hole_sizes[h], taken);
      if (at == kNone) continue;
      r.hole[i] = h;
      r.offset[i] = at;
      r.placed_bytes += b.size;
      in_hole[h].add(i, b);
      break;
    }
  }
  return r;
}

}  // namespace pymemplan
