// Device memory from the CUDA driver API: segments with cuMemAlloc/cuMemFree, events for
// cross-stream reuse. Each call runs in the device's primary context (the one the CUDA
// runtime, and so PyTorch, uses) and restores the caller's context afterwards.
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "../core/device.hpp"
#include "cuda_driver.hpp"

namespace pymemplan {

class CudaDevice : public Device {
 public:
  // Throws DeviceError when the driver cannot be loaded or the ordinal does not exist.
  explicit CudaDevice(int ordinal);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::size_t capacity() const override { return capacity_; }
  // cudaMalloc hands out whole 2 MiB pages for large allocations; with virtual memory, the
  // driver's minimum granularity for this device (2 MiB on current GPUs).
  std::size_t granularity() const override { return granularity_; }
  void* allocate_segment(std::size_t bytes) override;
  // cuMemFree waits for work queued on the memory, as cudaFree does.
  void free_segment(void* ptr, std::size_t bytes) override;
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;

  // The driver has the calls and this device supports them (vGPU profiles and WSL may not).
  bool supports_vmm() const override { return vmm_; }
  void* reserve_address(std::size_t bytes) override;
  void release_address(void* ptr, std::size_t bytes) override;
  PageHandle create_page() override;  // 0 on CUDA_ERROR_OUT_OF_MEMORY
  void release_page(PageHandle page) override;
  void map_page(void* addr, PageHandle page) override;
  void unmap_page(void* addr) override;
  void map_pages(void* addr, const PageHandle* pages, std::size_t n) override;
  void unmap_pages(void* addr, std::size_t n) override;
  // Page sharing: cuCtxSynchronize, and cuMemcpyDtoD followed by one (the copy may return
  // before it completes). cuCtxSynchronize fails during a CUDA graph capture.
  bool supports_page_sharing() const override { return vmm_ && driver_.has_page_sharing(); }
  void synchronize_device() override;
  void copy(void* dst, const void* src, std::size_t bytes) override;

  int ordinal() const { return ordinal_; }
  // What the driver reports free on the device now (cuMemGetInfo), whoever holds the rest:
  // this allocator, the CUDA context, NCCL, other processes. 0 where it cannot say.
  std::size_t free_memory() const;
  // Whether `stream` is capturing a CUDA graph (cuStreamIsCapturing; false where the driver
  // cannot say). An event recorded there would be a node of the graph, not a point in the
  // stream's work: record_event defers it until the capture has ended.
  bool stream_capturing(StreamId stream);

 private:
  class InContext;  // RAII: makes a context current for one call
  // An event that must be recorded on a stream of another context (record_stream with
  // another GPU's stream): cuEventRecord takes only events of the stream's own context, so
  // the handle handed out by create_event stands for one made there.
  struct Foreign {
    cuda::CUevent event = nullptr;
    cuda::CUcontext context = nullptr;
    bool active = false;  // its last record_event went to the foreign event
  };
  bool record_foreign(EventHandle event, cuda::CUstream stream);
  // The event to query or wait on for `event`, and its context: the foreign one standing
  // for it, or itself in this device's context.
  Foreign active_foreign(EventHandle event);
  // An event whose recording was deferred (its stream was capturing) is recorded now if
  // the capture has ended; false while it has not (the event then stands for nothing yet).
  bool record_deferred(EventHandle event);

  const cuda::Driver& driver_;
  int ordinal_;
  cuda::CUdevice device_ = 0;
  cuda::CUcontext context_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t granularity_ = std::size_t{2} << 20;
  cuda::CUmemAllocationProp prop_{};
  bool vmm_ = false;
  // Who may read and write a mapped page: this device, and every peer that can reach it
  // (cuMemMap memory is not covered by cudaDeviceEnablePeerAccess, unlike cuMemAlloc's).
  std::vector<cuda::CUmemAccessDesc> access_;
  std::mutex foreign_mutex_;
  std::unordered_map<EventHandle, Foreign> foreign_;
  std::mutex deferred_mutex_;
  std::unordered_map<EventHandle, StreamId> deferred_;  // event -> the capturing stream
};

}  // namespace pymemplan
