#include "cuda_device.hpp"

#include <string>

#include "../core/errors.hpp"

namespace pymemplan {

using namespace cuda;

class CudaDevice::InContext {
 public:
  explicit InContext(const CudaDevice& d) : InContext(d.driver_, d.context_) {}
  InContext(const Driver& driver, CUcontext context) : driver_(driver) {
    driver_.check(driver_.cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
    if (previous_ != context) {
      driver_.check(driver_.cuCtxSetCurrent(context), "cuCtxSetCurrent");
      switched_ = true;
    }
  }
  ~InContext() {
    if (switched_) driver_.cuCtxSetCurrent(previous_);  // best effort: cannot throw here
  }
  InContext(const InContext&) = delete;
  InContext& operator=(const InContext&) = delete;

 private:
  const Driver& driver_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

CudaDevice::CudaDevice(int ordinal) : driver_(Driver::get()), ordinal_(ordinal) {
  int count = 0;
  driver_.check(driver_.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    throw DeviceError("CUDA device " + std::to_string(ordinal) + " does not exist (the driver reports " +
                      std::to_string(count) + " device" + (count == 1 ? "" : "s") + ")");
  }
  driver_.check(driver_.cuDeviceGet(&device_, ordinal), "cuDeviceGet");
  driver_.check(driver_.cuDeviceTotalMem(&capacity_, device_), "cuDeviceTotalMem");
  driver_.check(driver_.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain");
  prop_.type = 1;           // CU_MEM_ALLOCATION_TYPE_PINNED
  prop_.location.type = 1;  // CU_MEM_LOCATION_TYPE_DEVICE
  prop_.location.id = device_;
  vmm_ = driver_.has_vmm();
  if (vmm_ && driver_.cuDeviceGetAttribute != nullptr) {
    int supported = 1;
    if (driver_.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                     device_) == CUDA_SUCCESS &&
        supported == 0) {
      vmm_ = false;
    }
  }
  if (vmm_ && driver_.cuDeviceGetAttribute != nullptr) {
    // Pages that NICs can read and write directly (NCCL buffer registration), as PyTorch's
    // expandable segments make them; asking where the device cannot fails cuMemCreate.
    int rdma = 0;
    if (driver_.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                     device_) == CUDA_SUCCESS &&
        rdma == 1) {
      prop_.allocFlags.gpuDirectRDMACapable = 1;
    }
  }
  if (vmm_) {
    // A device that cannot say its granularity has no usable virtual memory; the policies
    // without it still work on it.
    std::size_t g = 0;
    if (driver_.cuMemGetAllocationGranularity(&g, &prop_, 0) == CUDA_SUCCESS && g != 0) {
      granularity_ = g;
    } else {
      vmm_ = false;
    }
  }
  if (vmm_) {
    access_.push_back({prop_.location, 3});  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    for (int other = 0; other < count && driver_.cuDeviceCanAccessPeer != nullptr; ++other) {
      CUdevice peer = 0;
      int can = 0;
      if (other == ordinal || driver_.cuDeviceGet(&peer, other) != CUDA_SUCCESS) continue;
      // Whether `peer` can access memory on this device.
      if (driver_.cuDeviceCanAccessPeer(&can, peer, device_) == CUDA_SUCCESS && can != 0) {
        access_.push_back({{1, peer}, 3});
      }
    }
  }
}

CudaDevice::~CudaDevice() { driver_.cuDevicePrimaryCtxRelease(device_); }

void* CudaDevice::allocate_segment(std::size_t bytes) {
  InContext in(*this);
  CUdeviceptr ptr = 0;
  const CUresult r = driver_.cuMemAlloc(&ptr, bytes);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  driver_.check(r, "cuMemAlloc");
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
}

void CudaDevice::free_segment(void* ptr, std::size_t) {
  InContext in(*this);
  driver_.check(driver_.cuMemFree(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr))),
                "cuMemFree");
}

EventHandle CudaDevice::create_event() {
  InContext in(*this);
  CUevent e = nullptr;
  driver_.check(driver_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  return reinterpret_cast<EventHandle>(e);
}

void CudaDevice::destroy_event(EventHandle event) {
  {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    deferred_.erase(event);
  }
  {
    std::lock_guard<std::mutex> lock(foreign_mutex_);
    auto it = foreign_.find(event);
    if (it != foreign_.end()) {
      InContext in(driver_, it->second.context);
      driver_.cuEventDestroy(it->second.event);  // best effort: the handle goes either way
      foreign_.erase(it);
    }
  }
  InContext in(*this);
  driver_.check(driver_.cuEventDestroy(reinterpret_cast<CUevent>(event)), "cuEventDestroy");
}

bool CudaDevice::stream_capturing(StreamId stream) {
  if (driver_.cuStreamIsCapturing == nullptr) return false;
  InContext in(*this);
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE, _ACTIVE, _INVALIDATED
  const CUresult r = driver_.cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &status);
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;  // the legacy stream, joined to one
  return r == CUDA_SUCCESS && status != 0;  // an invalidated capture has not ended either
}

std::size_t CudaDevice::free_memory() const {
  if (driver_.cuMemGetInfo == nullptr) return 0;
  InContext in(*this);
  std::size_t free_bytes = 0, total_bytes = 0;
  if (driver_.cuMemGetInfo(&free_bytes, &total_bytes) != CUDA_SUCCESS) return 0;
  return free_bytes;
}

void CudaDevice::record_event(EventHandle event, StreamId stream) {
  // Recorded into a capture, the event would mark a node of the graph, and querying it
  // would fail (CUDA_ERROR_CAPTURED_EVENT) until recorded again: the allocator would wait on
  // it forever. Recorded once the capture has ended, it waits for the same work and more.
  if (stream_capturing(stream)) {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    deferred_[event] = stream;
    return;
  }
  {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    deferred_.erase(event);
  }
  const auto s = reinterpret_cast<CUstream>(stream);
  if (record_foreign(event, s)) return;
  InContext in(*this);
  driver_.check(driver_.cuEventRecord(reinterpret_cast<CUevent>(event), s), "cuEventRecord");
}

bool CudaDevice::record_foreign(EventHandle event, CUstream stream) {
  // 0 is the legacy default stream and 0x1 / 0x2 the legacy and per-thread handles: they are
  // resolved in the current context, which is this device's here.
  CUcontext context = nullptr;
  if (reinterpret_cast<std::uintptr_t>(stream) > 2 && driver_.cuStreamGetCtx != nullptr) {
    InContext in(*this);
    if (driver_.cuStreamGetCtx(stream, &context) != CUDA_SUCCESS) context = nullptr;
  }
  std::lock_guard<std::mutex> lock(foreign_mutex_);
  auto it = foreign_.find(event);
  if (context == nullptr || context == context_) {
    if (it != foreign_.end()) it->second.active = false;  // recorded natively from now on
    return false;
  }
  Foreign& f = foreign_[event];
  InContext in(driver_, context);
  if (f.event != nullptr && f.context != context) {
    driver_.cuEventDestroy(f.event);  // best effort: made in a context now left behind
    f.event = nullptr;
  }
  if (f.event == nullptr) {
    driver_.check(driver_.cuEventCreate(&f.event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  }
  f.context = context;
  driver_.check(driver_.cuEventRecord(f.event, stream), "cuEventRecord");
  f.active = true;
  return true;
}

CudaDevice::Foreign CudaDevice::active_foreign(EventHandle event) {
  std::lock_guard<std::mutex> lock(foreign_mutex_);
  auto it = foreign_.find(event);
  if (it != foreign_.end() && it->second.active) return it->second;
  return Foreign{reinterpret_cast<CUevent>(event), context_, false};
}

bool CudaDevice::record_deferred(EventHandle event) {
  StreamId stream = 0;
  {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    auto it = deferred_.find(event);
    if (it == deferred_.end()) return true;
    stream = it->second;
  }
  if (stream_capturing(stream)) return false;
  record_event(event, stream);
  return true;
}

bool CudaDevice::query_event(EventHandle event) {
  if (!record_deferred(event)) return false;
  const Foreign f = active_foreign(event);
  InContext in(driver_, f.context);
  const CUresult r = driver_.cuEventQuery(f.event);
  // Not done, or not known now: during another thread's capture in global mode queries
  // are refused, and an event recorded into a capture by a race with its beginning cannot
  // be queried. Either way the memory it guards stays unused, and nothing is left broken.
  if (r == CUDA_ERROR_NOT_READY || r == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ||
      r == CUDA_ERROR_CAPTURED_EVENT) {
    return false;
  }
  driver_.check(r, "cuEventQuery");
  return true;
}

void CudaDevice::synchronize_event(EventHandle event) {
  if (!record_deferred(event)) {
    throw DeviceError("cannot wait for work queued on a stream that is capturing a CUDA graph");
  }
  const Foreign f = active_foreign(event);
  InContext in(driver_, f.context);
  driver_.check(driver_.cuEventSynchronize(f.event), "cuEventSynchronize");
}

}  // namespace pymemplan

namespace pymemplan {

namespace {
CUdeviceptr device_ptr(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}
}  // namespace

void* CudaDevice::reserve_address(std::size_t bytes) {
  InContext in(*this);
  CUdeviceptr ptr = 0;
  driver_.check(driver_.cuMemAddressReserve(&ptr, bytes, 0, 0, 0), "cuMemAddressReserve");
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
}

void CudaDevice::release_address(void* ptr, std::size_t bytes) {
  InContext in(*this);
  driver_.check(driver_.cuMemAddressFree(device_ptr(ptr), bytes), "cuMemAddressFree");
}

PageHandle CudaDevice::create_page() {
  InContext in(*this);
  CUmemGenericAllocationHandle h = 0;
  const CUresult r = driver_.cuMemCreate(&h, granularity_, &prop_, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return 0;
  driver_.check(r, "cuMemCreate");
  return static_cast<PageHandle>(h);
}

void CudaDevice::release_page(PageHandle page) {
  InContext in(*this);
  driver_.check(driver_.cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page)), "cuMemRelease");
}

void CudaDevice::map_page(void* addr, PageHandle page) {
  InContext in(*this);
  driver_.check(driver_.cuMemMap(device_ptr(addr), granularity_, 0,
                                 static_cast<CUmemGenericAllocationHandle>(page), 0),
                "cuMemMap");
  const CUresult r = driver_.cuMemSetAccess(device_ptr(addr), granularity_, access_.data(), access_.size());
  if (r != CUDA_SUCCESS) {
    driver_.cuMemUnmap(device_ptr(addr), granularity_);  // leave nothing half-mapped
    driver_.check(r, "cuMemSetAccess");
  }
}

void CudaDevice::unmap_page(void* addr) {
  InContext in(*this);
  driver_.check(driver_.cuMemUnmap(device_ptr(addr), granularity_), "cuMemUnmap");
}

void CudaDevice::map_pages(void* addr, const PageHandle* pages, std::size_t n) {
  // Each physical page is its own allocation: one cuMemMap each, then one cuMemSetAccess for
  // the run (the costly call: it updates the device's page tables).
  InContext in(*this);
  const CUdeviceptr base = device_ptr(addr);
  CUresult r = CUDA_SUCCESS;
  const char* call = "cuMemMap";
  std::size_t k = 0;
  while (k < n) {
    r = driver_.cuMemMap(base + k * granularity_, granularity_, 0,
                         static_cast<CUmemGenericAllocationHandle>(pages[k]), 0);
    if (r != CUDA_SUCCESS) break;
    ++k;
  }
  if (r == CUDA_SUCCESS) {
    call = "cuMemSetAccess";
    r = driver_.cuMemSetAccess(base, n * granularity_, access_.data(), access_.size());
    if (r == CUDA_SUCCESS) return;
  }
  if (k != 0) driver_.cuMemUnmap(base, k * granularity_);  // leave nothing half-mapped
  driver_.check(r, call);
}

void CudaDevice::unmap_pages(void* addr, std::size_t n) {
  InContext in(*this);
  driver_.check(driver_.cuMemUnmap(device_ptr(addr), n * granularity_), "cuMemUnmap");
}

void CudaDevice::synchronize_device() {
  InContext in(*this);
  driver_.check(driver_.cuCtxSynchronize(), "cuCtxSynchronize");
}

void CudaDevice::copy(void* dst, const void* src, std::size_t bytes) {
  InContext in(*this);
  driver_.check(driver_.cuMemcpyDtoD(device_ptr(dst), device_ptr(src), bytes), "cuMemcpyDtoD");
  driver_.check(driver_.cuCtxSynchronize(), "cuCtxSynchronize");
}

}  // namespace pymemplan
