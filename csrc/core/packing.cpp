#include "packing.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

namespace pymemplan {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

// A block's lifetime as at most two ranges of elementary intervals (it may wrap around).
struct Spans {
  std::size_t lo[2] = {0, 0}, hi[2] = {0, 0};
  int n = 0;
};

// The skyline's keys, kept exact. A block's key (the lowest offset it can take, the highest
// placed top over its lifetime) rises when a block placed over an overlapping time range tops
// it. Lazily re-keying blocks as they come up (a priority queue) costs a re-key per block each
// time the skyline rises under it before its turn: for lifetimes nested as deep as a model's
// layers, work that grew as the square of the blocks (a 96-layer GPT-2's step: 24,753 blocks,
// ~150 re-keys each). Here a block is the point (first interval, interval past its end) of a
// 2-d tree, and placing a block raises, to its top, the keys of every point in a rectangle
// (those overlapping it) at once, with the lowest (key, rank) of each subtree and the next
// lowest key kept (Ji's "segment tree beats": a raise is tagged on a subtree where it lifts
// only the lowest key, and goes down otherwise).
class KeyTree {
 public:
  struct Point {
    std::uint32_t x = 0, y = 0;  // the rectangle coordinates
    std::uint32_t block = 0;
  };
  explicit KeyTree(std::vector<Point> points) : points_(std::move(points)) {
    if (!points_.empty()) {
      nodes_.reserve(2 * points_.size());
      build(0, points_.size());
    }
  }
  static constexpr std::uint32_t kNoRank = std::numeric_limits<std::uint32_t>::max();
  bool empty() const { return nodes_.empty() || nodes_[0].min1 == kNone; }
  std::size_t min_key() const { return nodes_.empty() ? kNone : nodes_[0].min1; }
  std::uint32_t min_rank() const { return nodes_.empty() ? kNoRank : nodes_[0].r1; }
  // Every point keyed 0 and ranked by rank_of[block], but those ranked kNoRank: they are out
  // (never taken, never raised).
  void reset(const std::vector<std::uint32_t>& rank_of) {
    for (std::size_t v = nodes_.size(); v-- > 0;) {
      Node& n = nodes_[v];
      n.lz = 0;
      if (n.left == kLeaf) {
        n.r1 = rank_of[points_[n.point].block];
        n.min1 = n.r1 == kNoRank ? kNone : 0;
        n.min2 = kNone;
      } else {
        pull(n);
      }
    }
  }
  // Takes out the point with the lowest (key, rank); returns its block.
  std::uint32_t take() {
    path_.clear();
    std::uint32_t v = 0;
    while (nodes_[v].left != kLeaf) {
      path_.push_back(v);
      push(nodes_[v]);
      const Node& l = nodes_[nodes_[v].left];
      v = l.min1 == nodes_[v].min1 && l.r1 == nodes_[v].r1 ? nodes_[v].left : nodes_[v].right;
    }
    Node& leaf = nodes_[v];
    leaf.min1 = leaf.min2 = kNone;
    leaf.r1 = kNoRank;
    for (std::size_t k = path_.size(); k-- > 0;) pull(nodes_[path_[k]]);
    return points_[leaf.point].block;
  }
  // Keys of the points with x0 <= x <= x1 and y0 <= y <= y1: at least `key`.
  void raise(std::uint32_t x0, std::uint32_t x1, std::uint32_t y0, std::uint32_t y1, std::size_t key) {
    if (!nodes_.empty() && x0 <= x1 && y0 <= y1) raise(0, x0, x1, y0, y1, key);
  }

 private:
  static constexpr std::uint32_t kLeaf = std::numeric_limits<std::uint32_t>::max();
  struct Node {
    std::uint32_t x0, x1, y0, y1;  // the bounding box of the subtree's points
    std::uint32_t left, right, point;
    std::uint32_t r1;             // the lowest rank among the points keyed min1
    std::size_t min1, min2, lz;   // lowest key, next lowest distinct key, raise owed below
  };
  std::uint32_t build(std::size_t lo, std::size_t hi) {
    const auto v = static_cast<std::uint32_t>(nodes_.size());
    nodes_.push_back({});
    Node n{};
    n.x0 = n.y0 = std::numeric_limits<std::uint32_t>::max();
    n.x1 = n.y1 = 0;
    for (std::size_t i = lo; i < hi; ++i) {
      n.x0 = std::min(n.x0, points_[i].x);
      n.x1 = std::max(n.x1, points_[i].x);
      n.y0 = std::min(n.y0, points_[i].y);
      n.y1 = std::max(n.y1, points_[i].y);
    }
    if (hi - lo == 1) {
      n.left = n.right = kLeaf;
      n.point = static_cast<std::uint32_t>(lo);
    } else {
      const std::size_t mid = lo + (hi - lo) / 2;
      const bool by_x = n.x1 - n.x0 >= n.y1 - n.y0;  // split the wider side
      std::nth_element(points_.begin() + static_cast<std::ptrdiff_t>(lo),
                       points_.begin() + static_cast<std::ptrdiff_t>(mid),
                       points_.begin() + static_cast<std::ptrdiff_t>(hi),
                       [by_x](const Point& a, const Point& b) { return by_x ? a.x < b.x : a.y < b.y; });
      n.left = build(lo, mid);
      n.right = build(mid, hi);
    }
    nodes_[v] = n;
    return v;
  }
  void pull(Node& n) {
    const Node& l = nodes_[n.left];
    const Node& r = nodes_[n.right];
    if (l.min1 < r.min1) {
      n.min1 = l.min1;
      n.r1 = l.r1;
      n.min2 = std::min(l.min2, r.min1);
    } else if (r.min1 < l.min1) {
      n.min1 = r.min1;
      n.r1 = r.r1;
      n.min2 = std::min(r.min2, l.min1);
    } else {
      n.min1 = l.min1;
      n.r1 = std::min(l.r1, r.r1);
      n.min2 = std::min(l.min2, r.min2);
    }
  }
  // Raises the subtree's keys below `key` to it, where only its lowest key is below
  // (key < min2): the order inside the subtree does not change.
  static void tag(Node& n, std::size_t key) {
    if (key <= n.min1) return;
    n.min1 = key;
    n.lz = std::max(n.lz, key);
  }
  void push(Node& n) {
    if (n.lz == 0 || n.left == kLeaf) return;
    tag(nodes_[n.left], n.lz);
    tag(nodes_[n.right], n.lz);
    n.lz = 0;
  }
  void raise(std::uint32_t v, std::uint32_t x0, std::uint32_t x1, std::uint32_t y0,
             std::uint32_t y1, std::size_t key) {
    Node& n = nodes_[v];
    if (n.min1 >= key || n.x1 < x0 || n.x0 > x1 || n.y1 < y0 || n.y0 > y1) return;
    const bool inside = x0 <= n.x0 && n.x1 <= x1 && y0 <= n.y0 && n.y1 <= y1;
    if (n.left == kLeaf || (inside && key < n.min2)) {
      tag(n, key);
      return;
    }
    push(n);
    raise(n.left, x0, x1, y0, y1, key);
    raise(n.right, x0, x1, y0, y1, key);
    pull(n);
  }
  std::vector<Point> points_;
  std::vector<Node> nodes_;
  std::vector<std::uint32_t> path_;
};

// The keys of a set of blocks: those whose lifetime is one range of intervals [x, y) are the
// points (x, y) of one tree, and overlap [a, b) where x < b and y > a; those that wrap around
// the circle ([x, end) and [0, y)) are the points (x, y) of another, and overlap [a, b) where
// x < b or y > a (two rectangles: raising twice is raising once).
class KeyIndex {
 public:
  explicit KeyIndex(const std::vector<Spans>& spans) : spans_(spans), plain_(points(spans, false)),
                                                        wrapped_(points(spans, true)) {}
  // The blocks of `order`, ranked in that order; any others are out.
  void reset(const std::vector<std::size_t>& order) {
    rank_of_.assign(spans_.size(), KeyTree::kNoRank);
    for (std::size_t r = 0; r < order.size(); ++r) rank_of_[order[r]] = static_cast<std::uint32_t>(r);
    plain_.reset(rank_of_);
    wrapped_.reset(rank_of_);
  }
  bool empty() const { return plain_.empty() && wrapped_.empty(); }
  // The block with the lowest key (ties: the lowest rank), taken out, and its key.
  std::pair<std::size_t, std::size_t> take() {
    const bool plain = std::make_pair(plain_.min_key(), plain_.min_rank()) <
                       std::make_pair(wrapped_.min_key(), wrapped_.min_rank());
    const std::size_t key = plain ? plain_.min_key() : wrapped_.min_key();
    return {plain ? plain_.take() : wrapped_.take(), key};
  }
  std::size_t min_key() const { return std::min(plain_.min_key(), wrapped_.min_key()); }
  // Block i placed with its top at `top`.
  void raise(std::size_t i, std::size_t top) {
    constexpr std::uint32_t kAll = std::numeric_limits<std::uint32_t>::max();
    const Spans& s = spans_[i];
    for (int k = 0; k < s.n; ++k) {
      const auto a = static_cast<std::uint32_t>(s.lo[k]);
      const auto b = static_cast<std::uint32_t>(s.hi[k]);
      plain_.raise(0, b - 1, a + 1, kAll, top);
      wrapped_.raise(0, b - 1, 0, kAll, top);
      wrapped_.raise(0, kAll, a + 1, kAll, top);
    }
  }

 private:
  static std::vector<KeyTree::Point> points(const std::vector<Spans>& spans, bool wrapped) {
    std::vector<KeyTree::Point> out;
    for (std::size_t i = 0; i < spans.size(); ++i) {
      if ((spans[i].n == 2) != wrapped) continue;
      const Spans& s = spans[i];
      out.push_back({static_cast<std::uint32_t>(s.lo[0]),
                     static_cast<std::uint32_t>(wrapped ? s.hi[1] : s.hi[0]),
                     static_cast<std::uint32_t>(i)});
    }
    return out;
  }
  const std::vector<Spans>& spans_;
  KeyTree plain_, wrapped_;
  std::vector<std::uint32_t> rank_of_;
};

// One skyline run: the blocks of `keys`, lowest key first (ties: the lowest rank in `order`),
// each placed at its key. Returns the arena; stops early once it reaches `limit` (it cannot
// beat the best then).
std::size_t skyline_kd(const std::vector<PackBlock>& blocks, KeyIndex& keys,
                       const std::vector<std::size_t>& order, std::vector<std::size_t>& offsets,
                       std::size_t limit) {
  keys.reset(order);
  offsets.assign(blocks.size(), 0);
  std::size_t arena = 0;
  while (!keys.empty()) {
    const auto [i, key] = keys.take();
    const std::size_t top = key + blocks[i].size;
    if (top >= limit) return top;  // this run cannot win
    offsets[i] = key;
    keys.raise(i, top);
    arena = std::max(arena, top);
  }
  return arena;
}

// A skyline run into a hole of `capacity` bytes: a block whose lowest offset would take it
// past the capacity is left out (offset kNone), as keys only rise. It is given up as
// soon as the area (size x lifetime) it has placed plus all it has yet to try falls short of
// `beat`: it cannot place more area than the best run so far then. Returns whether it ran
// to the end.
bool fill_one_hole(const std::vector<PackBlock>& blocks, KeyIndex& keys,
                   const std::vector<std::size_t>& order, const std::vector<double>& area,
                   std::size_t capacity, double beat, std::vector<std::size_t>& offsets) {
  keys.reset(order);
  offsets.assign(blocks.size(), kNone);
  double open = 0.0;  // placed, plus what is not tried yet
  for (std::size_t i : order) open += area[i];
  // The margin keeps rounding (the sums here run in another order than the caller's) from
  // giving up a run that ties.
  const double stop = beat * (1.0 - 1e-9);
  while (!keys.empty()) {
    if (keys.min_key() >= capacity) break;  // full: nothing else fits
    const auto [i, key] = keys.take();
    const std::size_t top = key + blocks[i].size;
    if (top > capacity) {  // past the capacity: left out, and never fits later
      open -= area[i];
      if (open < stop) return false;
      continue;
    }
    offsets[i] = key;
    keys.raise(i, top);
  }
  return true;
}

// The distinct times at which blocks start or end (0 and the period included), sorted.
std::vector<std::size_t> cut_times(const std::vector<PackBlock>& blocks, std::size_t period) {
  std::vector<std::size_t> cuts = {0, period};
  for (const PackBlock& b : blocks) {
    cuts.push_back(b.start);
    cuts.push_back((b.start + b.life) % period);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

// Each block's lifetime as ranges of the elementary intervals between the distinct start
// and end times.
struct Timeline {
  std::vector<Spans> spans;
  std::size_t intervals = 0;
  Timeline(const std::vector<PackBlock>& blocks, std::size_t period) {
    const std::vector<std::size_t> cuts = cut_times(blocks, period);
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
  constexpr std::size_t kMaxTotal = kMaxPackTotal;
  std::size_t total = 0;
  for (const PackBlock& b : blocks) {
    if (b.start >= period || b.life == 0 || b.life > period) {
      throw std::invalid_argument(std::string(who) + ": block [" + std::to_string(b.start) +
                                  ", +" + std::to_string(b.life) + ") does not fit a period of " +
                                  std::to_string(period));
    }
    if (b.size > kMaxTotal - total) {
      throw std::invalid_argument(std::string(who) + ": the sizes add up past " +
                                  std::to_string(kMaxTotal) + " bytes (a block of " +
                                  std::to_string(b.size) + "): no arena holds them");
    }
    total += b.size;
  }
}

// The live bytes of the blocks placed in one hole, at each time a block starts: a Fenwick
// tree over the distinct start and end times of all the blocks (BlockTimes), not the period.
struct BlockTimes {
  std::vector<std::uint32_t> start, stop;  // per block: indices of its start and end times
  std::vector<char> wraps;                 // per block: alive past the period's end, from 0 on
  std::size_t count = 0;                   // distinct times
  BlockTimes(const std::vector<PackBlock>& blocks, std::size_t period) {
    const std::vector<std::size_t> times = cut_times(blocks, period);
    count = times.size();
    auto index = [&](std::size_t t) {
      return static_cast<std::uint32_t>(std::lower_bound(times.begin(), times.end(), t) - times.begin());
    };
    for (const PackBlock& b : blocks) {
      const std::size_t end = b.start + b.life;
      start.push_back(index(b.start));
      stop.push_back(index(end <= period ? end : end - period));
      wraps.push_back(end > period ? 1 : 0);
    }
  }
};

}  // namespace

bool lifetimes_overlap(const PackBlock& a, const PackBlock& b, std::size_t period) {
  // On the circle: b starts while a is alive, or a starts while b is alive.
  const std::size_t ba = (b.start + period - a.start) % period;
  const std::size_t ab = (a.start + period - b.start) % period;
  return ba < a.life || ab < b.life;
}

std::size_t live_bound(const std::vector<PackBlock>& blocks, std::size_t period, std::size_t* at) {
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
  std::size_t when = 0;
  for (std::size_t k = 0; k < delta.size();) {
    const std::size_t t = delta[k].first;
    for (; k < delta.size() && delta[k].first == t; ++k) live += delta[k].second;
    if (t < period && live > peak) {
      peak = live;
      when = t;
    }
  }
  if (at != nullptr) *at = when;
  return static_cast<std::size_t>(peak);
}

std::vector<PackBlock> in_time_order(const std::vector<PackBlock>& blocks, std::size_t period) {
  check_blocks(blocks, period, "in_time_order");
  const Timeline tl(blocks, period);
  std::vector<PackBlock> out;
  out.reserve(blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const Spans& s = tl.spans[i];
    const std::size_t life = s.n == 2 ? tl.intervals - s.lo[0] + s.hi[1] : s.hi[0] - s.lo[0];
    out.push_back({s.lo[0], life, blocks[i].size});
  }
  return out;
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

struct Packer::Index {
  Timeline timeline;
  KeyIndex keys;
  Index(const std::vector<PackBlock>& blocks, std::size_t period)
      : timeline(blocks, period), keys(timeline.spans) {}
};

Packer::Packer(const std::vector<PackBlock>& blocks, std::size_t period, const char* who)
    : blocks_(blocks), period_(period) {
  check_blocks(blocks, period, who);
}

Packer::Index& Packer::index() {
  if (!index_) index_ = std::make_unique<Index>(blocks_, period_);
  return *index_;
}

struct Packer::Times {
  BlockTimes of;
  Times(const std::vector<PackBlock>& blocks, std::size_t period) : of(blocks, period) {}
};

Packer::Times& Packer::times() {
  if (!times_) times_ = std::make_unique<Times>(blocks_, period_);
  return *times_;
}

Packer::~Packer() = default;

PackResult pack_blocks(const std::vector<PackBlock>& blocks, std::size_t period,
                       std::size_t search_rounds, std::size_t granule, std::size_t give_up) {
  std::vector<std::size_t> all(blocks.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  return Packer(blocks, period, "pack_blocks").pack(all, search_rounds, granule, give_up);
}

PackResult Packer::pack(const std::vector<std::size_t>& subset, std::size_t search_rounds,
                        std::size_t granule, std::size_t give_up) {
  std::vector<PackBlock> blocks;  // the subset's, in its order: what the rules weigh
  blocks.reserve(subset.size());
  for (std::size_t i : subset) blocks.push_back(blocks_[i]);
  PackResult r;
  r.bound = live_bound(blocks, period_);
  const std::size_t n = blocks.size();
  if (n == 0) return r;
  if (give_up != 0 && r.bound > give_up) {  // no run can: every arena holds the bound
    r.arena = give_up + 1;
    return r;
  }
  KeyIndex& keys = index().keys;

  // Tie rules: the largest size x lifetime first, the largest first, the longest-lived first
  // (the slowest: a long block placed raises the skyline under most others); then the same
  // with random perturbations. An arena within the granule of the bound is as good as the bound.
  auto life = [&](std::size_t i) { return static_cast<double>(blocks[i].life); };
  auto size = [&](std::size_t i) { return static_cast<double>(blocks[i].size); };
  auto area = [&](std::size_t i) { return life(i) * size(i); };
  const std::function<double(std::size_t)> rules[] = {area, size, life};
  granule = std::max<std::size_t>(granule, 1);
  const std::size_t good = (r.bound + granule - 1) / granule * granule;
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
    for (std::size_t& i : order) i = subset[i];  // the index knows blocks by their place in all
    // A run stops once it cannot beat the best so far (or the caller's give_up level).
    const std::size_t stop = give_up != 0 && give_up < best ? give_up + 1 : best;
    const std::size_t arena = skyline_kd(blocks_, keys, order, offsets, stop);
    ++r.runs;
    if (arena < stop) {  // a complete run (an early stop returns at least `stop`)
      best = arena;
      r.offsets.resize(n);
      for (std::size_t j = 0; j < n; ++j) r.offsets[j] = offsets[subset[j]];
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
  long long max(std::size_t l, std::size_t r) const { return max(1, 0, n_, l, r); }
  std::size_t argmax() const {
    std::size_t k = 1;
    while (k < n_) k = mx_[2 * k] == mx_[k] - add_[k] ? 2 * k : 2 * k + 1;
    return k - n_;
  }

 private:
  static constexpr long long kFloor = std::numeric_limits<long long>::min() / 4;  // padding
  long long max(std::size_t k, std::size_t lo, std::size_t hi, std::size_t l, std::size_t r) const {
    if (r <= lo || hi <= l) return kFloor;
    if (l <= lo && hi <= r) return mx_[k];
    const std::size_t mid = (lo + hi) / 2;
    return std::max(max(2 * k, lo, mid, l, r), max(2 * k + 1, mid, hi, l, r)) + add_[k];
  }
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

class LiveBytes {
 public:
  explicit LiveBytes(const BlockTimes& times) : times_(&times) {}
  void place(std::size_t j, std::size_t size) {
    if (tree_.empty()) tree_.assign(times_->count + 1, 0);  // most holes never get a block
    const auto d = static_cast<long long>(size);
    bump(times_->start[j], d);
    bump(times_->stop[j], -d);
    if (times_->wraps[j]) bump(0, d);
  }
  // The bytes alive at the start of block j.
  long long at_start(std::size_t j) const {
    long long sum = 0;
    if (tree_.empty()) return 0;
    for (std::size_t i = times_->start[j] + 1; i > 0; i -= i & (~i + 1)) sum += tree_[i];
    return sum;
  }

 private:
  void bump(std::size_t at, long long d) {
    for (std::size_t i = at + 1; i < tree_.size(); i += i & (~i + 1)) tree_[i] += d;
  }
  const BlockTimes* times_;
  std::vector<long long> tree_;
};

// The blocks placed in one hole, by the stretches of time (buckets) their lifetimes cover: the
// blocks whose lifetimes may overlap a block's are those in its buckets, so a query looks at
// the blocks near it in time, not at all of them (plans of tens of thousands of blocks made
// hole filling quadratic). Only the work depends on the bucket count, not the result.
class PlacedIndex {
 public:
  // With `times`, it also keeps the live bytes at each block's start (full_at_start()).
  PlacedIndex(std::size_t period, std::size_t blocks, const BlockTimes* times = nullptr)
      : period_(std::max<std::size_t>(period, 1)),
        width_((period_ + kBuckets - 1) / kBuckets),
        buckets_((period_ + width_ - 1) / width_),
        starts_(buckets_.size()),
        covered_(std::vector<long long>(buckets_.size(), 0)),
        seen_(blocks, 0) {
    if (times != nullptr) live_.emplace(*times);
  }

  void add(std::size_t j, const PackBlock& b) {
    if (live_) live_->place(j, b.size);
    for_each_bucket(b, [&](std::size_t k) { buckets_[k].push_back(j); });
    starts_[bucket(b.start)].push_back(j);
    for_whole_buckets(b, [&](std::size_t lo, std::size_t hi) {
      covered_.add(lo, hi, static_cast<long long>(b.size));
    });
  }
  // Whether the blocks placed cover every offset but fewer than `size` bytes of `capacity`
  // throughout a bucket that b's lifetime spans whole: then b fits nowhere. It only saves
  // gathering the blocks near a long-lived b (a plan of 25,000 blocks, 46 holes: half the
  // packer's time went to holes where it could not fit).
  bool surely_full(const PackBlock& b, std::size_t capacity) const {
    bool full = false;
    for_whole_buckets(b, [&](std::size_t lo, std::size_t hi) {
      full = full || covered_.max(lo, hi) + static_cast<long long>(b.size) > static_cast<long long>(capacity);
    });
    return full;
  }
  // Whether the blocks placed leave fewer than `size` bytes of `capacity` free when block j
  // starts: then it fits nowhere. Of the hole fillers' searches that gathered and sorted the
  // blocks around, most found no gap (on a 96-layer GPT-2's step, 2.6 of 2.8 million), and
  // 2.5 million of those for this reason.
  bool full_at_start(std::size_t j, std::size_t size, std::size_t capacity) const {
    return live_ && live_->at_start(j) + static_cast<long long>(size) > static_cast<long long>(capacity);
  }
  // The blocks whose lifetimes cover time `t`, and others near it, in the order added.
  const std::vector<std::size_t>& around(std::size_t t) const { return buckets_[bucket(t)]; }
  // Blocks whose lifetimes may overlap that of `b`, each once: a block overlaps it if it is
  // alive when b starts (so it covers that bucket) or starts while b is alive (in one of b's
  // buckets). Not every block sharing a bucket with b: a long-lived block is listed in every
  // bucket it covers, and was gathered once per bucket (most of the packer's time on a plan
  // of 25,000 blocks).
  const std::vector<std::size_t>& near(const PackBlock& b) {
    ++stamp_;
    out_.clear();
    auto take = [&](std::size_t j) {
      if (seen_[j] != stamp_) {
        seen_[j] = stamp_;
        out_.push_back(j);
      }
    };
    for (std::size_t j : buckets_[bucket(b.start)]) take(j);
    for_each_bucket(b, [&](std::size_t k) {
      for (std::size_t j : starts_[k]) take(j);
    });
    return out_;
  }

 private:
  static constexpr std::size_t kBuckets = 256;
  std::size_t bucket(std::size_t t) const { return (t % period_) / width_; }
  // Calls f(lo, hi) for the ranges of buckets that b's lifetime spans whole.
  template <class F>
  void for_whole_buckets(const PackBlock& b, F f) const {
    const std::size_t n = buckets_.size();
    if (b.life >= period_) {
      f(0, n);
      return;
    }
    auto piece = [&](std::size_t from, std::size_t to) {  // times [from, to), to <= period_
      const std::size_t lo = (from + width_ - 1) / width_;
      const std::size_t hi = to == period_ ? n : to / width_;
      if (lo < hi) f(lo, hi);
    };
    const std::size_t end = b.start + b.life;
    if (end <= period_) {
      piece(b.start, end);
    } else {
      piece(b.start, period_);
      piece(0, end - period_);
    }
  }
  template <class F>
  void for_each_bucket(const PackBlock& b, F f) const {
    if (b.life >= period_) {
      for (std::size_t k = 0; k < buckets_.size(); ++k) f(k);
      return;
    }
    const std::size_t n = buckets_.size();
    const std::size_t first = b.start / width_;
    const std::size_t end = b.start + b.life - 1;  // its last step, past the period if it wraps
    if (end < period_) {
      for (std::size_t k = first; k <= end / width_; ++k) f(k);
      return;
    }
    // Wrapping around, it may end in its first bucket or past it: then it touches them all.
    const std::size_t last = (end - period_) / width_;
    for (std::size_t k = last >= first ? 0 : first; k < n; ++k) f(k);
    for (std::size_t k = 0; k <= last && last < first; ++k) f(k);
  }
  std::size_t period_, width_;
  std::vector<std::vector<std::size_t>> buckets_;  // the blocks alive in each stretch
  std::vector<std::vector<std::size_t>> starts_;   // the blocks starting in each
  AddMaxTree covered_;  // bytes of the blocks alive throughout each
  std::optional<LiveBytes> live_;
  std::vector<std::uint32_t> seen_;
  std::uint32_t stamp_ = 0;
  std::vector<std::size_t> out_;
};

// The lowest offset of hole `h` where `b` fits under `capacity`, clear of the blocks already
// there (`placed`) whose lifetimes overlap its own; kNone if there is none.
std::size_t lowest_fit(const std::vector<PackBlock>& blocks, std::size_t period, std::size_t i,
                       PlacedIndex& placed, const std::vector<std::size_t>& offset,
                       std::size_t capacity, std::vector<std::pair<std::size_t, std::size_t>>& taken) {
  const PackBlock& b = blocks[i];
  if (b.size > capacity || placed.full_at_start(i, b.size, capacity) ||
      placed.surely_full(b, capacity)) {
    return kNone;
  }
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

void shave_peak(const std::vector<PackBlock>& blocks, std::size_t period, const BlockTimes& times,
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
  // A block that fits nowhere in a hole never will while that hole only fills up: it is
  // not tried there again (each new peak time asked again for every block alive at it).
  std::vector<std::size_t> full_for(blocks.size(), HoleFill::kNone);
  for (std::size_t h : holes) {
    const long long before = live.max();
    std::vector<std::size_t> moved;
    PlacedIndex here(period, blocks.size(), &times);
    std::size_t top = 0;
    for (;;) {
      const std::size_t t = live.argmax();
      bool placed = false;
      for (std::size_t i : by_time.around(t)) {
        if (r.hole[i] != HoleFill::kNone || blocks[i].size == 0 || blocks[i].size > hole_sizes[h] ||
            full_for[i] == h || !alive_at(blocks[i], t)) {
          continue;
        }
        const std::size_t at = lowest_fit(blocks, period, i, here, r.offset, hole_sizes[h], taken);
        if (at == kNone) {
          full_for[i] = h;
          continue;
        }
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

void fill_by_skyline(const std::vector<PackBlock>& blocks, std::size_t period, KeyIndex& keys,
                     const std::vector<std::size_t>& hole_sizes, HoleFill& r) {
  std::vector<std::size_t> holes(hole_sizes.size());
  std::iota(holes.begin(), holes.end(), std::size_t{0});
  std::stable_sort(holes.begin(), holes.end(),
                   [&](std::size_t a, std::size_t b) { return hole_sizes[a] > hole_sizes[b]; });
  // One index and one order per tie rule for every hole: a hole's run takes the blocks still
  // left that fit it, in the rule's order (the rest are out of the index). Built again for
  // each hole, they were most of an arming's time on plans of thousands of blocks and dozens
  // of holes.
  auto life = [&](std::size_t i) { return static_cast<double>(blocks[i].life); };
  auto size = [&](std::size_t i) { return static_cast<double>(blocks[i].size); };
  auto area = [&](std::size_t i) { return life(i) * size(i); };
  const std::function<double(std::size_t)> rules[] = {area, size, life};
  std::vector<double> areas(blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) areas[i] = area(i);
  std::vector<std::vector<std::size_t>> orders;
  for (const auto& rule : rules) {
    std::vector<std::size_t> order(blocks.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      const double wa = rule(a), wb = rule(b);
      if (wa != wb) return wa > wb;
      return blocks[a].size > blocks[b].size;
    });
    orders.push_back(std::move(order));
  }
  // The index the runs use: the one over all blocks, then, once the blocks left are under a
  // quarter of those it holds, one over those alone (each run resets every point it holds).
  // Local indices keep the blocks' order, so every sum below runs in the same order.
  struct Local {
    std::vector<std::size_t> ids;  // local -> global, increasing
    std::vector<PackBlock> blocks;
    std::vector<double> areas;
    std::unique_ptr<Timeline> timeline;
    std::unique_ptr<KeyIndex> keys;
  } local;
  std::vector<std::size_t> to_local(blocks.size());
  std::iota(to_local.begin(), to_local.end(), std::size_t{0});
  const std::vector<PackBlock>* in = &blocks;
  const std::vector<double>* in_areas = &areas;
  KeyIndex* in_keys = &keys;
  auto global = [&](std::size_t k) { return local.ids.empty() ? k : local.ids[k]; };
  std::vector<char> left(blocks.size(), 1);
  std::size_t left_count = blocks.size();
  std::vector<std::size_t> order, offsets, best;
  for (std::size_t h : holes) {
    if (left_count * 4 < in->size()) {
      local.keys.reset();  // it refers to the timeline's spans
      local.ids.clear();
      local.blocks.clear();
      local.areas.clear();
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (!left[i]) continue;
        to_local[i] = local.ids.size();
        local.ids.push_back(i);
        local.blocks.push_back(blocks[i]);
        local.areas.push_back(areas[i]);
      }
      local.timeline = std::make_unique<Timeline>(local.blocks, period);
      local.keys = std::make_unique<KeyIndex>(local.timeline->spans);
      in = &local.blocks;
      in_areas = &local.areas;
      in_keys = local.keys.get();
    }
    double best_area = 0.0;
    best.clear();
    for (const auto& all : orders) {
      order.clear();
      for (std::size_t i : all) {
        if (left[i] && blocks[i].size != 0 && blocks[i].size <= hole_sizes[h]) order.push_back(to_local[i]);
      }
      if (order.empty()) break;
      if (!fill_one_hole(*in, *in_keys, order, *in_areas, hole_sizes[h], best_area, offsets)) continue;
      double placed = 0.0;
      for (std::size_t k = 0; k < in->size(); ++k) placed += offsets[k] != kNone ? (*in_areas)[k] : 0.0;
      if (placed > best_area) {
        best_area = placed;
        best = offsets;
      }
    }
    if (best.empty()) continue;
    for (std::size_t k = 0; k < in->size(); ++k) {
      const std::size_t i = global(k);
      if (!left[i] || best[k] == kNone) continue;
      r.hole[i] = h;
      r.offset[i] = best[k];
      r.placed_bytes += blocks[i].size;
      left[i] = 0;
      --left_count;
    }
  }
}

}  // namespace

HoleFill fill_holes(const std::vector<PackBlock>& blocks, std::size_t period,
                    const std::vector<std::size_t>& hole_sizes, HoleRule rule, const HoleCost& cost) {
  return Packer(blocks, period, "fill_holes").fill_holes(hole_sizes, rule, cost);
}

HoleFill Packer::fill_holes(const std::vector<std::size_t>& hole_sizes, HoleRule rule,
                            const HoleCost& cost) {
  const std::vector<PackBlock>& blocks = blocks_;
  const std::size_t period = period_;
  HoleFill r;
  r.hole.assign(blocks.size(), HoleFill::kNone);
  r.offset.assign(blocks.size(), 0);
  if (blocks.empty() || hole_sizes.empty() || period == 0) return r;
  if (rule == HoleRule::kSkyline) {
    fill_by_skyline(blocks, period, index().keys, hole_sizes, r);
    return r;
  }
  if (rule == HoleRule::kPeakShave) {
    shave_peak(blocks, period, times().of, hole_sizes, cost, r);
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
  std::vector<PlacedIndex> in_hole(hole_sizes.size(), PlacedIndex(period, blocks.size(), &times().of));
  std::vector<std::pair<std::size_t, std::size_t>> taken;  // (offset, end) of conflicting blocks
  for (std::size_t i : order) {
    const PackBlock& b = blocks[i];
    for (std::size_t h : holes) {
      const std::size_t at = lowest_fit(blocks, period, i, in_hole[h], r.offset, hole_sizes[h], taken);
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
