// The one interface through which the allocator touches memory. The policy in core/ never
// knows whether it runs over a simulated address space or a CUDA device.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pymemplan {

// Opaque stream identity (a cudaStream_t cast to an integer on CUDA; any number in simulation).
using StreamId = std::uint64_t;
// Opaque event handle owned by the device.
using EventHandle = std::uintptr_t;

class Device {
 public:
  virtual ~Device() = default;

  // Bytes of memory the device has in all.
  virtual std::size_t capacity() const = 0;
  // Physical allocation granularity: a segment of n bytes occupies n rounded up to this.
  virtual std::size_t granularity() const = 0;

  // A new segment of `bytes` (a multiple of granularity() when the caller wants no hidden
  // waste). Returns nullptr when the device is out of memory; throws DeviceError on any
  // other failure.
  virtual void* allocate_segment(std::size_t bytes) = 0;
  // Returns a segment obtained from allocate_segment. The device waits for outstanding work
  // on it before the memory can be handed out again (cudaFree semantics).
  virtual void free_segment(void* ptr, std::size_t bytes) = 0;

  // Events mark a point in a stream's queue of work; query tells whether it has been reached.
  virtual EventHandle create_event() = 0;
  virtual void destroy_event(EventHandle event) = 0;
  virtual void record_event(EventHandle event, StreamId stream) = 0;
  virtual bool query_event(EventHandle event) = 0;   // true once complete
  virtual void synchronize_event(EventHandle event) = 0;  // blocks until complete
};

}  // namespace pymemplan
