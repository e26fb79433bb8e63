// Statistics with the names and meanings of torch.cuda.memory_stats().
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pymemplan {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // cumulative increases
  std::int64_t freed = 0;      // cumulative decreases

  void increase(std::int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

// Index into a StatArray, as PyTorch's StatType: the aggregate, then per pool.
enum StatType : int { kAllPools = 0, kSmallPool = 1, kLargePool = 2 };
using StatArray = std::array<Stat, 3>;

// Adds delta (or takes -delta) to the aggregate and to the small or large pool's stat.
inline void update_stat(StatArray& a, bool small, std::int64_t delta) {
  Stat& pool = a[small ? kSmallPool : kLargePool];
  if (delta >= 0) {
    a[kAllPools].increase(delta);
    pool.increase(delta);
  } else {
    a[kAllPools].decrease(-delta);
    pool.decrease(-delta);
  }
}

struct Stats {
  StatArray allocation;            // live allocations (malloc'd, not yet freed)
  StatArray segment;               // segments obtained from the device
  StatArray active;                // allocated blocks plus freed ones still waiting on events
  StatArray inactive_split;        // free blocks inside segments that are not wholly free
  StatArray allocated_bytes;       // bytes of allocated blocks (rounded sizes)
  StatArray reserved_bytes;        // bytes of segments
  StatArray active_bytes;
  StatArray inactive_split_bytes;
  StatArray requested_bytes;       // bytes the callers asked for (unrounded)
  Stat oversize_allocations;       // allocations of blocks >= max_split_size
  Stat oversize_segments;
  std::int64_t num_alloc_retries = 0;   // device allocations retried after releasing cache
  std::int64_t num_ooms = 0;            // requests that failed after the whole OOM ladder
  // Of those, the ones the memory limit refused (set_memory_fraction, set_memory_limit),
  // as PyTorch 2.14 counts requests its per-process memory fraction refuses.
  std::int64_t num_oom_rejections = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  std::int64_t max_split_size = 0;
  // Not a torch key (items() leaves it out): the times a page unmap waited for a stream's
  // queued work (vmm); the epochs of CachingAllocator make most unmaps wait for nothing.
  std::int64_t num_unmap_waits = 0;

  // Flattened with PyTorch's keys: "allocated_bytes.all.peak", "num_ooms", ...
  std::vector<std::pair<std::string, std::int64_t>> items() const;
  void reset_peak();
  void reset_accumulated();
};

}  // namespace pymemplan
