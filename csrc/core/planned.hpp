// Plan-guided placement (policy "pymemplan-planned"): training repeats the same allocation
// sequence every iteration. This allocator finds that period in the live stream of requests by
// itself, packs one period's blocks offline into one arena (packing.hpp), and serves the next
// iterations from the plan, checking each request against it. Everything else — requests
// before any plan exists, requests that diverge from the plan, blocks that outlive an
// iteration — goes to an online pool: a CachingAllocator with policy "pymemplan".
//
// Design (details at each function in planned.cpp):
// - Detection. Each allocation is a token (512-rounded size, stream); each free is a token
//   (number of allocations since the freed one was made). A rolling hash of the last
//   `match_window` tokens finds earlier places where the same window occurred; each gives a
//   candidate period P >= min_period. A candidate is scored by its coverage: the share of the
//   bytes allocated in the last P events whose lifetime is known (freed, or predicted from the
//   same allocation one period earlier) and at most P (>= 50% to be planned). Confirmed
//   candidates (the last P events equal the P before) win ties. Detection runs while there is
//   no plan or the active plan diverged within its last period; a plan is built from the last
//   P events, so with an optimizer whose state appears in iteration 1 only, the plan of
//   iteration 1 (its one-off long-lived allocations excluded) serves from iteration 3 on.
// - Cut. The plan's period is rotated to start where the fewest planned bytes are alive (the
//   iteration boundary in training); blocks alive across it wrap around the circle. Blocks
//   living longer than a period (parameters, optimizer state) stay with the pool.
// - Arming. A plan gets memory at its cut ("boundary"), after a pass in which requests of
//   less than 1/32 of its arena failed to match it, and only if its bound is >= 20% of the
//   highest live bytes (periods of repeated layers are not worth an arena). Arming first
//   returns the pool's cached segments, then borrows the pool's free holes (> 1 MiB) between
//   its long-lived blocks as bins, packs the plan into those holes first and the rest into one
//   arena (a device segment), and never raises the highest reserved so far: if it would, the
//   plan waits. One arena serves all plans (it grows when a larger plan arms).
// - Serving. A cursor walks the plan's allocations. A request that matches the slot at the
//   cursor (same rounded size and stream) gets bin + offset if that range is free now
//   (otherwise the pool serves it: memory is never handed out twice). A mismatch looks ahead:
//   slots of one-off long-lived allocations are skipped freely, planned ones up to
//   `resync_window`; failing that the request goes to the pool and the pass counts as
//   diverged (which lets detection re-plan). Mismatched bytes above 1/16 of the arena in a
//   pass disarm the plan. While no plan is armed, requests are placed in the free gaps of the
//   arena and borrowed holes first (best fit), so held memory keeps serving. While arenas are
//   held, the pool may grow past the highest reserved so far only after those gaps are full.
//   At every boundary of an armed plan the pool's wholly free segments go back to the device.
// - Several plans, keyed by the signature (hash) of their token sequence from the cut, up to
//   `max_plans` (least recently used evicted). The first `kPrefix` allocations of each plan
//   index it: after a mismatch, the last kPrefix requests select the plan that applies
//   (alternating shapes); a plan seen again is recognised by its signature and not re-packed.
// - Streams. A planned slot freed after record_stream waits on events like a pool block. An
//   arena (or borrowed hole) used by one stream frees ranges without events; the first request
//   of another stream starts a drain (an event on the first stream) and, from then on, every
//   freed range waits on an event on its stream before any request may reuse it.
// - Stats are the pool's plus the arenas' (an arena is a large-pool segment; a borrowed hole's
//   pool block is replaced by the planned blocks inside it, in stats and snapshot), with the
//   peaks of the sum tracked here. num_ooms counts requests the caller saw fail.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator.hpp"
#include "allocator_api.hpp"
#include "config.hpp"
#include "packing.hpp"

namespace pymemplan {

// Config keys of "pymemplan-planned" (all keys of "pymemplan" are accepted too and configure
// the online pool):
//   min_period       shortest period believed, in events (allocs + frees)      default 16
//   match_window     events that must repeat before a period is considered     default 32
//   max_period       longest period, in events (history kept: 2x this)         default 65536
//   max_plans        plans kept (least recently used evicted)                  default 8
//   resync_window    plan slots searched ahead after a mismatch                default 64
//   search_rounds    local-search rounds of the packer per plan                default 4
//                    (each is a full greedy pass, O(blocks^2); on the benchmark traces it did
//                    not improve on the best of the three greedy orders, so it is kept short)
struct PlannedConfig {
  PolicyConfig pool;
  std::size_t min_period = 16;
  std::size_t match_window = 32;
  std::size_t max_period = std::size_t{1} << 16;
  std::size_t max_plans = 8;
  std::size_t resync_window = 64;
  std::size_t search_rounds = 4;

  // Throws AllocatorError naming the bad key or value and listing the valid keys.
  static PlannedConfig parse(const std::string& conf);
  std::string to_string() const;
};

class PlannedAllocator : public Allocator {
 public:
  PlannedAllocator(std::shared_ptr<Device> device, PlannedConfig config);
  ~PlannedAllocator() override;
  PlannedAllocator(const PlannedAllocator&) = delete;
  PlannedAllocator& operator=(const PlannedAllocator&) = delete;

  void* malloc(std::int64_t size, StreamId stream) override;
  void* try_malloc(std::int64_t size, StreamId stream) override;
  void free(void* ptr) override;
  void record_stream(void* ptr, StreamId stream) override;
  bool owns(const void* ptr) const override;
  // Waits for pending frees, returns the pool's wholly free segments and an arena with no
  // live block (it is obtained again at the next iteration boundary).
  void empty_cache() override;

  void set_memory_limit(std::size_t bytes) override;
  void set_memory_fraction(double fraction) override;
  std::size_t memory_limit() const override;

  Stats stats() const override;
  void reset_peak_stats() override;
  void reset_accumulated_stats() override;
  std::vector<SegmentInfo> snapshot() const override;
  std::string last_error() const override;
  // The pool's rounding; planned blocks are rounded to 512 B.
  std::size_t round_size(std::size_t size) const override;
  std::string policy_name() const override { return "pymemplan-planned"; }
  std::string config_string() const override;
  std::int64_t reserved_bytes() const override;

  // Ordinal (0-based, among allocation requests) of the first request served from a plan, or
  // UINT64_MAX if none was.
  std::uint64_t first_planned_request() const override;
  // Figures about plans for benchmarks and tests: plans, arena_bytes, plan_arena_bytes,
  // plan_bound_bytes, plan_ratio (arena / bound of the last plan built), planned_requests,
  // pool_requests, divergences, plans_built, plan_switches, first_planned_request, ...
  std::vector<std::pair<std::string, double>> plan_stats() const;

 private:
  static constexpr std::size_t kNoOffset = std::numeric_limits<std::size_t>::max();
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::size_t kPrefix = 8;
  static constexpr std::size_t kArenaBin = std::numeric_limits<std::size_t>::max() - 1;

  struct Event {
    std::uint64_t token = 0;
    std::size_t size = 0;  // allocation: 512-rounded size; free: 0
    StreamId stream = 0;
    std::uint64_t free_at = kNever;  // allocation: event index of its free
    bool alloc = false;
  };
  struct Slot {
    std::size_t size = 0;
    StreamId stream = 0;
    std::size_t offset = kNoOffset;  // kNoOffset: outlives the period, served by the pool
    std::size_t time = 0;            // events since the plan's cut
    std::size_t bin = 0;             // kArenaBin, or an index into borrowed_
  };
  struct Plan {
    std::uint64_t signature = 0;
    std::uint64_t prefix = 0;  // hash of the first kPrefix slots
    std::vector<Slot> slots;
    std::size_t period = 0;  // events
    std::size_t arena = 0;   // bytes the offsets need
    std::size_t bound = 0;   // peak of live planned bytes
    std::uint64_t last_used = 0;
    bool validated = false;  // a pass over it matched (see kArmShare)
    std::vector<PackBlock> blocks;        // the planned blocks, for packing into bins
    std::vector<std::size_t> slot_block;  // per slot: its block, or kNoOffset
    std::uint64_t packed_for = kNever;    // bins_version_ the slots' (bin, offset) are for
    std::size_t need = 0;                 // arena bytes the packing into those bins needs
    bool bins_packed = false;             // packed with the borrowed holes (else all in the arena)
  };
  struct Range {  // an occupied range of an arena
    std::size_t size = 0;
    bool allocated = false;  // false: freed, waiting on events
    int pending_events = 0;
    std::size_t requested = 0;
  };
  struct Arena {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
    std::map<std::size_t, Range> ranges;  // by offset
    std::size_t gaps = 1;                 // maximal free intervals
    std::size_t occupied = 0;
    bool multi_stream = false;
    StreamId first_stream = 0;
    bool has_stream = false;
    bool draining = false;  // became multi-stream; cross-stream reuse waits for this drain
    // A free hole of the pool, held as a pool block (the pool counts it as reserved; its
    // allocated/active/requested are replaced by the planned blocks inside).
    bool borrowed = false;
    std::size_t requested = 0;  // what was asked of the pool for it
  };
  struct Live {
    std::uint64_t id = 0;          // allocation ordinal
    std::uint64_t event = 0;       // event index of the allocation
    Arena* arena = nullptr;        // nullptr: the pool's block
    std::size_t offset = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    StreamId stream = 0;
    std::vector<StreamId> uses;    // record_stream
  };
  struct Pending {
    EventHandle event;
    Arena* arena;
    std::size_t offset;
  };

  void* allocate_locked(std::size_t size, StreamId stream, bool* oom);
  void free_locked(void* ptr);
  Slot* match_plan(std::size_t rounded, StreamId stream);
  void boundary();
  bool arm();
  void disarm();
  bool stream_ok(Arena& a, StreamId stream);
  void guard(Arena& a, std::size_t offset, StreamId stream);
  std::size_t best_gap(const Arena& a, std::size_t size) const;
  bool range_free(const Arena& a, std::size_t off, std::size_t size) const;
  void occupy(Arena& a, std::size_t off, std::size_t size, std::size_t requested);
  void release_range(Arena& a, std::size_t off);
  void maybe_retire(Arena* a);
  void release_arena(Arena* a);
  void borrow_holes();
  bool return_idle_borrowed();
  bool repack(Plan& p);
  Arena* bin_arena(const Slot& s) const {
    return s.bin == kArenaBin ? arena_ : (s.bin < borrowed_.size() ? borrowed_[s.bin] : nullptr);
  }
  void* serve_from_gaps(std::size_t rounded, std::size_t size, StreamId stream, Live& l);
  void offset_pool_stats(const Arena& a, int sign);
  void process_events();
  void synchronize_events();

  std::uint64_t record_event(const Event& e);
  bool should_plan(std::uint64_t n) const;
  std::uint64_t range_hash(std::uint64_t lo, std::uint64_t hi) const;
  const Event& ev(std::uint64_t g) const { return events_[static_cast<std::size_t>(g - base_)]; }
  Event& ev(std::uint64_t g) { return events_[static_cast<std::size_t>(g - base_)]; }
  void detect();
  double coverage(std::uint64_t n, std::size_t period, std::vector<std::size_t>* lifetimes) const;
  void build_plan(std::uint64_t n, std::size_t period, const std::vector<std::size_t>& lifetimes);
  void adopt(std::size_t plan_index, std::size_t cursor);
  std::uint64_t recent_prefix_hash() const;

  std::int64_t arenas_bytes() const;
  void sync_stats();
  void apply_limit();

  std::shared_ptr<Device> device_;
  PlannedConfig config_;
  std::unique_ptr<CachingAllocator> pool_;
  mutable std::mutex mutex_;

  // Request stream.
  std::vector<Event> events_;
  std::vector<std::uint64_t> prefix_;  // prefix_[k]: hash of events [.., base_ + k)
  std::uint64_t base_ = 0;             // global index of events_[0]
  std::uint64_t allocs_ = 0;           // allocation requests so far
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> windows_;  // hash -> ends
  std::uint64_t next_detect_ = 0;
  std::uint64_t recent_[kPrefix] = {};  // last kPrefix allocation tokens (ring)

  // Plans and serving.
  std::vector<Plan> plans_;
  std::size_t active_ = kNoOffset;  // index into plans_
  std::size_t cursor_ = 0;
  bool armed_ = false;
  bool diverged_ = false;            // this pass over the plan saw a mismatch
  std::uint64_t last_divergence_ = 0;  // event index
  bool ever_diverged_ = false;
  std::uint64_t pass_matches_ = 0;   // requests matched since the last boundary
  std::size_t pass_miss_bytes_ = 0;  // bytes of requests not matched since then
  Arena* arena_ = nullptr;           // the current arena
  std::vector<Arena*> borrowed_;     // holes of the pool held as bins (owned by arenas_)
  std::uint64_t bins_version_ = 0;   // changes whenever borrowed_ does
  std::vector<std::unique_ptr<Arena>> arenas_;  // current and retired ones with live blocks
  std::unordered_map<std::uintptr_t, Live> live_;
  std::vector<Pending> pending_;
  std::vector<EventHandle> event_pool_;

  // Figures.
  std::uint64_t first_planned_ = kNever;
  std::uint64_t gap_requests_ = 0;
  std::uint64_t planned_requests_ = 0, pool_requests_ = 0, divergences_ = 0;
  std::uint64_t plans_built_ = 0, plan_switches_ = 0, arms_ = 0;
  double last_ratio_ = 0.0, last_coverage_ = 0.0;
  std::uint64_t arm_refusals_ = 0;
  std::size_t refused_pool_bytes_ = 0, refused_need_bytes_ = 0;  // at the last refusal
  std::int64_t reserved_hwm_ = 0;  // highest reserved ever (not reset with the peak stats)
  std::int64_t live_hwm_ = 0;      // highest requested bytes ever
  std::size_t last_bound_ = 0, last_arena_ = 0;

  // Stats: the pool's plus the arenas', with peaks of the sum tracked here.
  std::size_t limit_ = 0;
  Stats stats_;
  Stats last_pool_;
  Stats arena_acc_;  // the arenas' counters (current, cumulative)
  std::int64_t device_allocs_ = 0, device_frees_ = 0, ooms_ = 0;
  std::string last_error_;
};

}  // namespace pymemplan
