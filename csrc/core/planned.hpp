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
//   same allocation one period earlier) and at most P. Repeated layers inside one iteration
//   give short periods with poor coverage (their saved activations live longer); the iteration
//   gives coverage near 1, so it wins. Confirmed candidates (the whole last P events equal the
//   P before) win ties.
// - Cut. The plan's period is rotated to start where the fewest planned bytes are alive (the
//   iteration boundary in training); blocks alive across it wrap around the circle.
// - Serving. A cursor walks the plan's allocations. A request that matches the slot at the
//   cursor (same rounded size and stream) gets arena + offset if that range of the arena is
//   free now (otherwise the pool serves it: memory is never handed out twice). A mismatch
//   looks ahead `resync_window` slots for a match (extra or missing requests); failing that
//   the request goes to the pool and the iteration counts as diverged, which lets detection
//   re-plan. A plan is armed (gets its arena) at its cut, when the pool holds the least.
// - Several plans, keyed by the signature (hash) of their token sequence, up to `max_plans`
//   (least recently used evicted). The first `kPrefix` allocations of each plan index it: after
//   a mismatch, the last kPrefix requests select the plan that applies (alternating shapes).
// - One arena, sized to the largest plan armed so far. While a plan is armed, the pool's
//   wholly free cached segments are returned to the device at every iteration boundary.
// - Streams. A planned slot freed after record_stream waits on events like a pool block; if
//   the arena has served more than one stream, every freed range waits on an event recorded
//   on its stream before any request may reuse it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <list>
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

namespace pymemplan {

// Config keys of "pymemplan-planned" (all keys of "pymemplan" are accepted too and configure
// the online pool):
//   min_period       shortest period believed, in events (allocs + frees)      default 16
//   match_window     events that must repeat before a period is considered     default 32
//   max_period       longest period, in events (history kept: 2x this)         default 1048576
//   max_plans        plans kept (least recently used evicted)                  default 8
//   resync_window    plan slots searched ahead after a mismatch                default 64
//   search_rounds    local-search rounds of the packer per plan                default 16
struct PlannedConfig {
  PolicyConfig pool;
  std::size_t min_period = 16;
  std::size_t match_window = 32;
  std::size_t max_period = std::size_t{1} << 20;
  std::size_t max_plans = 8;
  std::size_t resync_window = 64;
  std::size_t search_rounds = 16;

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

  // Ordinal (0-based, among allocation requests) of the first request served from a plan, or
  // UINT64_MAX if none was.
  std::uint64_t first_planned_request() const;
  // Figures about plans for benchmarks and tests: plans, arena_bytes, plan_arena_bytes,
  // plan_bound_bytes, plan_ratio (arena / bound of the last plan built), planned_requests,
  // pool_requests, divergences, plans_built, plan_switches, first_planned_request, ...
  std::vector<std::pair<std::string, double>> plan_stats() const;

 private:
  static constexpr std::size_t kNoOffset = std::numeric_limits<std::size_t>::max();
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::size_t kPrefix = 8;

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
  };
  struct Plan {
    std::uint64_t signature = 0;
    std::uint64_t prefix = 0;  // hash of the first kPrefix slots
    std::vector<Slot> slots;
    std::size_t period = 0;  // events
    std::size_t arena = 0;   // bytes the offsets need
    std::size_t bound = 0;   // peak of live planned bytes
    std::uint64_t last_used = 0;
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
  void on_wrap();
  bool arm();
  bool range_free(const Arena& a, std::size_t off, std::size_t size) const;
  void occupy(Arena& a, std::size_t off, std::size_t size, std::size_t requested);
  void release_range(Arena& a, std::size_t off);
  void maybe_retire(Arena* a);
  void release_arena(Arena* a);
  void process_events();
  void synchronize_events();

  void record_event(const Event& e);
  std::uint64_t range_hash(std::uint64_t lo, std::uint64_t hi) const;
  const Event& ev(std::uint64_t g) const { return events_[static_cast<std::size_t>(g - base_)]; }
  Event& ev(std::uint64_t g) { return events_[static_cast<std::size_t>(g - base_)]; }
  void detect();
  double coverage(std::size_t period, std::vector<std::size_t>* lifetimes) const;
  void build_plan(std::size_t period, const std::vector<std::size_t>& lifetimes);
  void adopt(std::size_t plan_index, std::size_t cursor);
  std::uint64_t recent_prefix_hash() const;

  std::int64_t arenas_bytes() const;
  void sync_stats();
  void apply_limit();
  Stats arena_stats_now() const;

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
  Arena* arena_ = nullptr;           // the current arena
  std::vector<std::unique_ptr<Arena>> arenas_;  // current and retired ones with live blocks
  std::unordered_map<std::uintptr_t, Live> live_;
  std::vector<Pending> pending_;
  std::vector<EventHandle> event_pool_;

  // Figures.
  std::uint64_t first_planned_ = kNever;
  std::uint64_t planned_requests_ = 0, pool_requests_ = 0, divergences_ = 0;
  std::uint64_t plans_built_ = 0, plan_switches_ = 0, arms_ = 0;
  double last_ratio_ = 0.0;
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
