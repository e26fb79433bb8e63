// Device memory from the CUDA driver API: segments with cuMemAlloc/cuMemFree, events for
// cross-stream reuse. Each call runs in the device's primary context (the one the CUDA
// runtime, and so PyTorch, uses) and restores the caller's context afterwards.
#pragma once

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
  // cudaMalloc hands out whole 2 MiB pages for large allocations.
  std::size_t granularity() const override { return std::size_t{2} << 20; }
  void* allocate_segment(std::size_t bytes) override;
  // cuMemFree waits for work queued on the memory, as cudaFree does.
  void free_segment(void* ptr, std::size_t bytes) override;
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;

  int ordinal() const { return ordinal_; }

 private:
  class InContext;  // RAII: makes this device's context current for one call

  const cuda::Driver& driver_;
  int ordinal_;
  cuda::CUdevice device_ = 0;
  cuda::CUcontext context_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace pymemplan
