// Offline offset assignment for plan-guided placement: blocks with known (circular) lifetimes
// get offsets in one arena so that blocks alive at the same time never share bytes.
//
// The problem is dynamic storage allocation (NP-hard). The packer is a skyline ("lowest
// placement first") greedy: it repeatedly places, among the blocks not placed yet, the one that
// can go lowest (ties: the longest-lived, or the largest, or the largest size x lifetime) on top
// of what is placed over its lifetime, and raises the skyline there. Placements then come in
// non-decreasing offsets, so above the current level each time step holds one contiguous
// occupied range and the lowest feasible offset of a block (its key) is the maximum of the
// skyline over its lifetime. Keys are kept exact in a 2-d tree of the blocks' lifetimes: a
// placement raises the keys of all the blocks it overlaps at once (O(sqrt n) nodes, amortized),
// so a run costs O(n sqrt n) where re-keying blocks one by one as they came up grew as n^2
// where lifetimes nest deeply (benchmarks/plan_scaling.py).
// Each tie rule gives one packing; then `search_rounds` more runs with randomly perturbed ties
// (seeded: the result is deterministic); the best is kept, and the search stops at the bound
// (rounded up to the page granularity the arena is mapped with).
// Greedy orderings by size (TFLite's greedy_by_size_assignment.cc) were tried first: the skyline
// is better on every benchmark iteration (e.g. 1.0000 instead of 1.0444 of the bound on
// synthetic_many_sizes, 1.0000 instead of 1.0301 on synthetic_two_streams).
//
// Bound. `bound` is the peak, over time, of the sum of the sizes of the blocks alive then.
// Proven: bound <= arena for every valid assignment (at the peak time all alive blocks pairwise
// conflict, so their ranges are disjoint and lie inside the arena). The skyline reaches the bound
// (a sufficient condition, proven) when the lifetimes are nested or disjoint (a laminar family,
// as a stack of activations freed in reverse): each block then sits exactly on the blocks that
// contain its lifetime, so the arena is the heaviest chain of nested blocks, which is alive at
// one time. On other inputs we report the ratio arena / bound measured and claim nothing more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
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

// The most the sizes of the blocks of one packing may add up to: offsets are sums of sizes,
// and their total must leave room to add one more (no overflow).
constexpr std::size_t kMaxPackTotal = std::numeric_limits<std::size_t>::max() / 4;

struct PackResult {
  std::vector<std::size_t> offsets;  // one per block, in the input order
  std::size_t arena = 0;             // max(offset + size) over the blocks
  std::size_t bound = 0;             // peak of live bytes: no assignment can do better
  std::size_t runs = 0;              // skyline runs made
  double ratio() const { return bound ? static_cast<double>(arena) / static_cast<double>(bound) : 1.0; }
};

// Whether two blocks are alive at a common time step.
bool lifetimes_overlap(const PackBlock& a, const PackBlock& b, std::size_t period);
// The peak over time of the sum of the sizes of the alive blocks; `at`, if given, gets the
// first time step it is reached at.
std::size_t live_bound(const std::vector<PackBlock>& blocks, std::size_t period,
                       std::size_t* at = nullptr);
// The sum of the sizes of the alive blocks at each time step 0 .. period - 1.
std::vector<long long> live_profile(const std::vector<PackBlock>& blocks, std::size_t period);
// The blocks with their times replaced by ranks among the distinct start and end times (and
// the period by their count): what decides which blocks overlap in time. Two block sets equal
// in this form (a plan made again from a pass with other requests between the same ones) have
// the same conflicts and sizes: a packing of one is a valid packing of the other.
std::vector<PackBlock> in_time_order(const std::vector<PackBlock>& blocks, std::size_t period);
// Offsets for `blocks` (sizes should be multiples of the alignment the caller wants: offsets
// are sums of sizes). `search_rounds` randomized runs follow the three deterministic ones; the
// search stops once the arena is within `granule` of the bound (rounded up to it, both take
// the same pages). With give_up != 0, runs stop as soon as their arena exceeds it; if every
// run does, the result has no offsets and arena = give_up + 1. Throws std::invalid_argument for
// a block outside the circle.
PackResult pack_blocks(const std::vector<PackBlock>& blocks, std::size_t period,
                       std::size_t search_rounds = 2, std::size_t granule = 1,
                       std::size_t give_up = 0);

// Holes: address ranges [0, size) free for the whole period, outside the arena. In the
// allocator they are free space next to pages that long-lived blocks keep mapped anyway, which
// a block placed there uses for little or no memory. Two rules:
// - kGreedy (by size), kGreedyByArea (size x lifetime), kGreedyByLife: blocks alive at the
//   peak of live bytes first (moving them lowers the bound the arena is measured against),
//   then by that key, largest first; each goes to the smallest hole where it fits at the
//   lowest offset not used, during its lifetime, by the blocks placed there before it.
// - kSkyline: holes largest first; each is filled by the skyline packer (as pack_blocks, its
//   three deterministic tie rules, the one placing the most size x lifetime kept) with the
//   blocks left, those that would rise above the hole left out.
// Sizes (block and hole) should be multiples of the caller's alignment.
// - kPeakShave: aimed at what a plan costs, the arena's peak plus the pages its holes add.
//   Holes one at a time (smallest first): while a block alive at the arena's peak of live
//   bytes fits the hole (at its lowest offset not used during its lifetime), the largest such
//   block moves there, and the peak is found again. A hole keeps its blocks only if the peak
//   fell by more than `cost(hole, top)`, the bytes of pages that using [0, top) of the hole
//   adds (the allocator's unkept pages; no cost function: nothing); otherwise they go back.
enum class HoleRule { kGreedy, kGreedyByArea, kGreedyByLife, kSkyline, kPeakShave };
struct HoleFill {
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::vector<std::size_t> hole;    // per block: its hole, or kNone (it goes to the arena)
  std::vector<std::size_t> offset;  // per block placed in a hole: its offset inside it
  std::size_t placed_bytes = 0;
};
using HoleCost = std::function<std::size_t(std::size_t hole, std::size_t top)>;
HoleFill fill_holes(const std::vector<PackBlock>& blocks, std::size_t period,
                    const std::vector<std::size_t>& hole_sizes, HoleRule rule = HoleRule::kGreedy,
                    const HoleCost& cost = nullptr);

// One set of blocks packed and fitted into holes several ways (an arming weighs a dozen
// packings of the same plan): the index of their lifetimes is built once, not per packing.
// `blocks` must outlive the Packer. Throws std::invalid_argument as pack_blocks does.
class Packer {
 public:
  Packer(const std::vector<PackBlock>& blocks, std::size_t period, const char* who = "Packer");
  ~Packer();
  Packer(const Packer&) = delete;
  Packer& operator=(const Packer&) = delete;
  // pack_blocks of the blocks at `subset` (distinct indices) alone, as if given in that order
  // (it breaks ties): offsets in subset order.
  PackResult pack(const std::vector<std::size_t>& subset, std::size_t search_rounds = 2,
                  std::size_t granule = 1, std::size_t give_up = 0);
  // fill_holes of all the blocks.
  HoleFill fill_holes(const std::vector<std::size_t>& hole_sizes, HoleRule rule = HoleRule::kGreedy,
                      const HoleCost& cost = nullptr);

 private:
  struct Index;  // the skyline's: lifetimes as intervals, keys in 2-d trees
  struct Times;  // the hole fillers': start and end times, to count live bytes in a hole
  Index& index();  // each built at first use
  Times& times();
  const std::vector<PackBlock>& blocks_;
  std::size_t period_;
  std::unique_ptr<Index> index_;
  std::unique_ptr<Times> times_;
};

}  // namespace pymemplan
