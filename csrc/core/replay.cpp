#include "replay.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <unordered_map>

#include "errors.hpp"
#include "stats.hpp"

namespace pymemplan {

ReplayResult replay(Allocator& allocator, const std::uint8_t* action, const std::int64_t* ptr,
                    const std::int64_t* size, const std::int64_t* stream, std::size_t n,
                    std::int64_t steady_from, const std::function<void()>& after_event,
                    const std::vector<InitialBlock>& initial) {
  struct Live {
    void* address;  // nullptr: the allocation failed
    std::int64_t size;
  };
  std::unordered_map<std::int64_t, Live> live;
  live.reserve(1024);
  ReplayResult r;
  std::int64_t live_bytes = 0;
  for (const InitialBlock& b : initial) {
    if (!live.emplace(b.ptr, Live{b.address, b.size}).second) {
      throw AllocatorError("replay: initial block " + std::to_string(b.ptr) + " given twice");
    }
    live_bytes += b.size;
  }
  r.peak_live_bytes = live_bytes;
  const Stats before = allocator.stats();
  const double planning_before = allocator.planning_seconds();
  std::uint64_t requests = 0;
  std::int64_t steady_allocs_before = 0, steady_frees_before = 0, steady_waits_before = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    if (steady_from >= 0 && static_cast<std::int64_t>(i) == steady_from) {
      const Stats at = allocator.stats();
      steady_allocs_before = at.num_device_alloc;
      steady_frees_before = at.num_device_free;
      steady_waits_before = at.num_unmap_waits;
    }
    switch (action[i]) {
      case kTraceAlloc: {
        void* p = allocator.try_malloc(size[i], static_cast<StreamId>(stream[i]));
        if (p == nullptr) ++r.ooms;
        if (r.first_planned_event < 0 && allocator.first_planned_request() <= requests) {
          r.first_planned_event = static_cast<std::int64_t>(i);
        }
        ++requests;
        if (!live.emplace(ptr[i], Live{p, size[i]}).second) {
          throw AllocatorError("trace event " + std::to_string(i) + ": pointer " +
                               std::to_string(ptr[i]) + " allocated again while still live");
        }
        live_bytes += size[i];
        if (live_bytes > r.peak_live_bytes) r.peak_live_bytes = live_bytes;
        break;
      }
      case kTraceFree: {
        auto it = live.find(ptr[i]);
        if (it == live.end()) {
          throw AllocatorError("trace event " + std::to_string(i) + ": free of pointer " +
                               std::to_string(ptr[i]) + " that is not live");
        }
        if (it->second.address != nullptr) allocator.free(it->second.address);
        live_bytes -= it->second.size;
        live.erase(it);
        break;
      }
      case kTraceAllocFailure:
        break;  // the recorded allocator refused it; the program did not get the memory
      default:
        throw AllocatorError("trace event " + std::to_string(i) + ": unknown action " +
                             std::to_string(action[i]));
    }
    if (after_event) after_event();
    if (steady_from >= 0 && static_cast<std::int64_t>(i) >= steady_from) {
      r.steady_peak_reserved_bytes = std::max(r.steady_peak_reserved_bytes, allocator.reserved_bytes());
      r.steady_peak_live_bytes = std::max(r.steady_peak_live_bytes, live_bytes);
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  const Stats after = allocator.stats();
  r.events = static_cast<std::int64_t>(n);
  r.peak_allocated_bytes = after.allocated_bytes[kAllPools].peak;
  r.peak_reserved_bytes = after.reserved_bytes[kAllPools].peak;
  r.device_allocs = after.num_device_alloc - before.num_device_alloc;
  r.device_frees = after.num_device_free - before.num_device_free;
  r.unmap_waits = after.num_unmap_waits - before.num_unmap_waits;
  if (steady_from >= 0 && static_cast<std::size_t>(steady_from) < n) {
    r.steady_device_allocs = after.num_device_alloc - steady_allocs_before;
    r.steady_device_frees = after.num_device_free - steady_frees_before;
    r.steady_unmap_waits = after.num_unmap_waits - steady_waits_before;
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(stop - start).count();
  r.ns_per_event = n ? static_cast<double>(ns) / static_cast<double>(n) : 0.0;
  r.planning_seconds = allocator.planning_seconds() - planning_before;
  return r;
}

}  // namespace pymemplan
