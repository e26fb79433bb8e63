#include "packing.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

namespace pymemplan {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

// Greedy placement in `order`. Fixed bins (capacities) are tried first, the smallest fitting
// gap wins; otherwise the block goes to the arena (bin == capacities.size()), best fit or on
// top. Returns the arena; fills offsets, bins and the block that sets the arena's top.
// `limit`: give up once the arena reaches it (no improvement possible).
std::size_t place(const std::vector<PackBlock>& blocks, std::size_t period,
                  const std::vector<std::size_t>& capacities,
                  const std::vector<std::size_t>& order, std::vector<std::size_t>& offsets,
                  std::vector<std::size_t>& bins, std::size_t* top_block, std::size_t limit) {
  const std::size_t nbins = capacities.size() + 1;
  offsets.assign(blocks.size(), kNone);
  bins.assign(blocks.size(), kNone);
  std::vector<std::vector<std::size_t>> placed(nbins);
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  std::size_t arena = 0;
  for (std::size_t i : order) {
    const PackBlock& b = blocks[i];
    std::size_t best = kNone, best_gap = kNone, best_bin = kNone;
    for (std::size_t bin = 0; bin < nbins; ++bin) {
      const bool fixed = bin < capacities.size();
      if (fixed && capacities[bin] < b.size) continue;
      if (!fixed && best != kNone) break;  // a fixed bin holds it
      ranges.clear();
      for (std::size_t j : placed[bin]) {
        if (lifetimes_overlap(b, blocks[j], period)) {
          ranges.emplace_back(offsets[j], offsets[j] + blocks[j].size);
        }
      }
      std::sort(ranges.begin(), ranges.end());
      std::size_t end = 0, bin_best = kNone, bin_gap = kNone;
      for (const auto& [lo, hi] : ranges) {
        if (lo > end) {
          const std::size_t gap = lo - end;
          if (gap >= b.size && gap < bin_gap) {
            bin_best = end;
            bin_gap = gap;
          }
        }
        end = std::max(end, hi);
      }
      if (fixed) {
        if (capacities[bin] >= end + b.size && capacities[bin] - end < bin_gap) {
          bin_best = end;
          bin_gap = capacities[bin] - end;
        }
      } else if (bin_best == kNone) {
        bin_best = end;
        bin_gap = kNone;
      }
      if (bin_best != kNone && (best == kNone || bin_gap < best_gap)) {
        best = bin_best;
        best_gap = bin_gap;
        best_bin = bin;
      }
    }
    offsets[i] = best;
    bins[i] = best_bin;
    placed[best_bin].push_back(i);
    if (best_bin == capacities.size() && best + b.size > arena) {
      arena = best + b.size;
      *top_block = i;
      if (arena >= limit) return arena;
    }
  }
  return arena;
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
  std::vector<long long> delta(period + 1, 0);
  for (const PackBlock& b : blocks) {
    const auto s = static_cast<long long>(b.size);
    const std::size_t end = b.start + b.life;
    delta[b.start] += s;
    if (end <= period) {
      delta[end] -= s;
    } else {  // wraps: alive from 0 to end - period as well
      delta[period] -= s;
      delta[0] += s;
      delta[end - period] -= s;
    }
  }
  long long live = 0, peak = 0;
  for (std::size_t t = 0; t < period; ++t) {
    live += delta[t];
    peak = std::max(peak, live);
  }
  return static_cast<std::size_t>(peak);
}

PackResult pack_blocks(const std::vector<PackBlock>& blocks, std::size_t period,
                       std::size_t search_rounds) {
  PackResult r = pack_blocks_into(blocks, period, {}, search_rounds);
  r.bins.clear();
  return r;
}

PackResult pack_blocks_into(const std::vector<PackBlock>& blocks, std::size_t period,
                            const std::vector<std::size_t>& capacities,
                            std::size_t search_rounds) {
  for (const PackBlock& b : blocks) {
    if (b.start >= period || b.life == 0 || b.life > period) {
      throw std::invalid_argument("pack_blocks: block [" + std::to_string(b.start) + ", +" +
                                  std::to_string(b.life) + ") does not fit a period of " +
                                  std::to_string(period));
    }
  }
  PackResult r;
  r.bound = live_bound(blocks, period);
  const std::size_t n = blocks.size();
  if (n == 0) return r;

  std::vector<std::size_t> by_size(n), by_area(n), by_start(n);
  std::iota(by_size.begin(), by_size.end(), std::size_t{0});
  by_area = by_start = by_size;
  std::stable_sort(by_size.begin(), by_size.end(), [&](std::size_t a, std::size_t b) {
    return blocks[a].size != blocks[b].size ? blocks[a].size > blocks[b].size
                                            : blocks[a].life > blocks[b].life;
  });
  std::stable_sort(by_area.begin(), by_area.end(), [&](std::size_t a, std::size_t b) {
    return static_cast<double>(blocks[a].size) * static_cast<double>(blocks[a].life) >
           static_cast<double>(blocks[b].size) * static_cast<double>(blocks[b].life);
  });
  std::stable_sort(by_start.begin(), by_start.end(), [&](std::size_t a, std::size_t b) {
    return blocks[a].start < blocks[b].start;
  });

  std::vector<std::size_t> offsets, best_order, bins;
  std::size_t top = 0, best_top = 0;
  std::size_t best = kNone;
  for (const auto* order : {&by_size, &by_area, &by_start}) {
    const std::size_t arena = place(blocks, period, capacities, *order, offsets, bins, &top, best);
    if (arena < best || r.offsets.empty()) {
      best = arena;
      best_order = *order;
      best_top = top;
      r.offsets = offsets;
      r.bins = bins;
    }
    if (best == 0 || (capacities.empty() && best == r.bound)) break;
  }
  // Local search: the block that sets the top goes earlier in the order (to the front, or a
  // random earlier place), so it is placed before the blocks that pushed it up. Each round is
  // O(n^2); skip the search where that would cost too much.
  const double cost = static_cast<double>(n) * static_cast<double>(n);
  if (cost * static_cast<double>(search_rounds) > 4e7) {
    search_rounds = static_cast<std::size_t>(4e7 / std::max(cost, 1.0));
  }
  std::mt19937_64 rng(12345);
  const std::size_t target = capacities.empty() ? r.bound : 0;
  for (std::size_t round = 0; round < search_rounds && best > target; ++round) {
    std::vector<std::size_t> order = best_order;
    auto pos = static_cast<std::size_t>(
        std::find(order.begin(), order.end(), best_top) - order.begin());
    if (pos == 0) {
      // The top block is first already: perturb the order elsewhere instead.
      if (n < 3) break;
      const std::size_t a = 1 + rng() % (n - 1), b = 1 + rng() % (n - 1);
      std::swap(order[a], order[b]);
    } else {
      const std::size_t to = round % 2 == 0 ? 0 : rng() % pos;
      const std::size_t moved = order[pos];
      order.erase(order.begin() + static_cast<std::ptrdiff_t>(pos));
      order.insert(order.begin() + static_cast<std::ptrdiff_t>(to), moved);
    }
    const std::size_t arena = place(blocks, period, capacities, order, offsets, bins, &top, best);
    if (arena < best) {
      best = arena;
      best_order = std::move(order);
      best_top = top;
      r.offsets = offsets;
      r.bins = bins;
    }
  }
  r.arena = best;
  return r;
}

}  // namespace pymemplan
