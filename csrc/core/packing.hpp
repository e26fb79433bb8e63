// Offline offset assignment for plan-guided placement: blocks with known (circular) lifetimes
// get offsets in one arena so that blocks alive at the same time never share bytes.
//
// The problem is dynamic storage allocation (NP-hard). We run greedy placement (each block in
// turn goes into the best-fitting gap left by the already placed blocks it conflicts with, as
// in TFLite's greedy_by_size_assignment.cc) under a few orders — by size, by size x lifetime,
// by start — then a local search that moves the blocks that set the arena's top earlier in the
// order and keeps an order only when the arena shrinks.
//
// Bound. `bound` is the peak, over time, of the sum of the sizes of the blocks alive then.
// Proven: bound <= arena for every valid assignment (at the peak time all alive blocks pairwise
// conflict, so their ranges are disjoint and lie inside the arena). Greedy reaches the bound
// (a sufficient condition, proven) when the conflict graph is a disjoint union of cliques
// (blocks that never overlap, or groups that live and die together): a clique's blocks stack
// from offset 0 without gaps, so the arena is the largest clique's sum, the bound. On other
// inputs we report the ratio arena / bound measured and claim nothing more (measured on the
// benchmark traces' iterations: 1.000-1.011). The search stops as soon as arena == bound.
// With fixed bins (pack_blocks_into) the arena is what the bins cannot hold; bound still
// bounds bins + arena together.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pymemplan {

// A block alive during [start, start + life) on a circle of `period` time steps (an iteration
// repeats), 0 <= start < period, 1 <= life <= period. A plain (non-repeating) schedule is the
// special case period >= max(start + life).
struct PackBlock {
  std::size_t start = 0;
  std::size_t life = 1;
  std::size_t size = 0;
};

struct PackResult {
  std::vector<std::size_t> offsets;  // one per block, in the input order
  // With fixed bins: the bin of each block (bins.size() = the arena). Empty without bins.
  std::vector<std::size_t> bins;
  std::size_t arena = 0;             // max(offset + size) over the blocks in the arena
  std::size_t bound = 0;             // peak of live bytes: no assignment can do better
  double ratio() const { return bound ? static_cast<double>(arena) / static_cast<double>(bound) : 1.0; }
};

// Whether two blocks are alive at a common time step.
bool lifetimes_overlap(const PackBlock& a, const PackBlock& b, std::size_t period);
// The peak over time of the sum of the sizes of the alive blocks.
std::size_t live_bound(const std::vector<PackBlock>& blocks, std::size_t period);
// Offsets for `blocks` (sizes should be multiples of the alignment the caller wants: offsets
// are sums of sizes). `search_rounds` bounds the local search. Throws std::invalid_argument for
// a block outside the circle.
PackResult pack_blocks(const std::vector<PackBlock>& blocks, std::size_t period,
                       std::size_t search_rounds = 16);
// As pack_blocks, with fixed bins of the given capacities (free holes of memory held already)
// filled first: each block goes to the smallest gap that holds it in any fixed bin, else into
// the arena, whose size is what is minimized. Bound as above (over all bins together).
PackResult pack_blocks_into(const std::vector<PackBlock>& blocks, std::size_t period,
                            const std::vector<std::size_t>& capacities,
                            std::size_t search_rounds = 16);

}  // namespace pymemplan
