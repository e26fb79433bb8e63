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
// Opaque handle of one physical page (0: none).
using PageHandle = std::uintptr_t;

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

  // --- Virtual memory (optional): address ranges whose pages of granularity() bytes are
  // backed by physical pages mapped on demand (cuMemAddressReserve, cuMemCreate, cuMemMap).
  // The defaults say the device has none.
  virtual bool supports_vmm() const { return false; }
  // An address range of `bytes` (a multiple of granularity()) with nothing behind it.
  virtual void* reserve_address(std::size_t bytes);
  // Returns a range from reserve_address; no page may still be mapped in it.
  virtual void release_address(void* ptr, std::size_t bytes);
  // One physical page of granularity() bytes; 0 when the device is out of memory.
  virtual PageHandle create_page();
  virtual void release_page(PageHandle page);  // the page must not be mapped
  // Maps `page` at `addr` (granularity-aligned, inside a reserved range) for reading and
  // writing. unmap_page does not wait for queued work: the caller synchronizes first.
  virtual void map_page(void* addr, PageHandle page);
  virtual void unmap_page(void* addr);
  // A run of n pages: pages[k] at addr + k * granularity(). All or nothing: when map_pages
  // throws, none of them is mapped. The defaults go page by page; on CUDA a run costs one
  // cuMemSetAccess and one cuMemUnmap, as a range of torch's expandable segments does.
  virtual void map_pages(void* addr, const PageHandle* pages, std::size_t n);
  virtual void unmap_pages(void* addr, std::size_t n);

  // --- Page sharing (optional, with vmm): one physical page mapped at several addresses
  // (map_page of a page already mapped elsewhere; release_page once it is mapped nowhere),
  // and the two calls that move live bytes between pages.
  virtual bool supports_page_sharing() const { return false; }
  // Blocks until all work queued on the device, on every stream, has completed.
  virtual void synchronize_device();
  // Copies `bytes` from `src` to `dst` (mapped device memory, not overlapping) and returns
  // once the copy has completed.
  virtual void copy(void* dst, const void* src, std::size_t bytes);
};

}  // namespace pymemplan
