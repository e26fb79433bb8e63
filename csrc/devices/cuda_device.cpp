#include "cuda_device.hpp"

#include <string>

#include "../core/errors.hpp"

namespace pymemplan {

using namespace cuda;

class CudaDevice::InContext {
 public:
  explicit InContext(const CudaDevice& d) : driver_(d.driver_) {
    driver_.check(driver_.cuCtxGetCurrent(&previous_), "cuCtxGetCurrent");
    if (previous_ != d.context_) {
      driver_.check(driver_.cuCtxSetCurrent(d.context_), "cuCtxSetCurrent");
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
  InContext in(*this);
  driver_.check(driver_.cuEventDestroy(reinterpret_cast<CUevent>(event)), "cuEventDestroy");
}

void CudaDevice::record_event(EventHandle event, StreamId stream) {
  InContext in(*this);
  driver_.check(driver_.cuEventRecord(reinterpret_cast<CUevent>(event),
                                      reinterpret_cast<CUstream>(stream)),
                "cuEventRecord");
}

bool CudaDevice::query_event(EventHandle event) {
  InContext in(*this);
  const CUresult r = driver_.cuEventQuery(reinterpret_cast<CUevent>(event));
  if (r == CUDA_ERROR_NOT_READY) return false;
  driver_.check(r, "cuEventQuery");
  return true;
}

void CudaDevice::synchronize_event(EventHandle event) {
  InContext in(*this);
  driver_.check(driver_.cuEventSynchronize(reinterpret_cast<CUevent>(event)), "cuEventSynchronize");
}

}  // namespace pymemplan
