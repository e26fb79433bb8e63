// Replays an allocation trace through an allocator and measures what it reserved.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "allocator_api.hpp"

namespace pymemplan {

// Trace actions, as in pymemplan/traces/trace.py.
enum TraceAction : std::uint8_t { kTraceAlloc = 0, kTraceFree = 1, kTraceAllocFailure = 2 };

struct ReplayResult {
  std::int64_t events = 0;
  std::int64_t peak_live_bytes = 0;  // peak of the sum of requested sizes: the lower bound
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t peak_reserved_bytes = 0;
  std::int64_t device_allocs = 0;
  std::int64_t device_frees = 0;
  std::int64_t ooms = 0;         // requests refused at the device's capacity
  double ns_per_event = 0.0;     // wall time of the replay loop per event
  double planning_seconds = 0.0;  // of which computing plans (plan-guided allocators)
  // Plan-guided allocators: the event at which a plan first served a request (-1: never).
  std::int64_t first_planned_event = -1;
  // With steady_from >= 0: the peaks over events [steady_from, n) only (-1 otherwise).
  std::int64_t steady_peak_reserved_bytes = -1;
  std::int64_t steady_peak_live_bytes = -1;
  // With steady_from >= 0: device allocations and frees over events [steady_from, n) (-1
  // otherwise). A caching allocator's steady state should make none; each one is a driver
  // call, and a cudaFree waits for the whole device.
  std::int64_t steady_device_allocs = -1;
  std::int64_t steady_device_frees = -1;
  // Page unmaps that waited for a stream's queued work (Stats::num_unmap_waits), in all and
  // over [steady_from, n) (-1 without steady_from).
  std::int64_t unmap_waits = 0;
  std::int64_t steady_unmap_waits = -1;
};

// Events are parallel arrays. A free names the ptr of an earlier alloc; frees of allocations
// that failed with OOM are skipped (the program would have crashed; the replay continues to
// show how far each policy gets). Throws AllocatorError naming the event index for a free of
// a pointer that is not live or an unknown action.
// steady_from >= 0 also tracks the peaks from that event on, polling reserved memory after
// every event (which slows the loop: time a run without it).
// after_event, when given, is called after every event (the simulated device's clock).
// initial: blocks the allocator holds already (adopted from a recorded layout), by the trace
// pointer that frees them; address nullptr for one it could not take (its free is skipped).
struct InitialBlock {
  std::int64_t ptr = 0;
  void* address = nullptr;
  std::int64_t size = 0;  // requested
};
ReplayResult replay(Allocator& allocator, const std::uint8_t* action, const std::int64_t* ptr,
                    const std::int64_t* size, const std::int64_t* stream, std::size_t n,
                    std::int64_t steady_from = -1,
                    const std::function<void()>& after_event = nullptr,
                    const std::vector<InitialBlock>& initial = {});

}  // namespace pymemplan
