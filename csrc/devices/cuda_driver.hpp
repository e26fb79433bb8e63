// The few CUDA driver API types and entry points CudaDevice uses, resolved at run time from
// libcuda.so.1 (or the library named by PYMEMPLAN_LIBCUDA), so nothing links against CUDA
// and the plugin builds where no toolkit is installed. Values match the driver's cuda.h.
#pragma once

#include <cstddef>
#include <string>

namespace pymemplan::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

using CUmemGenericAllocationHandle = unsigned long long;

// Layouts as in cuda.h (CUDA 10.2 and later); enum members are ints.
struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int id;    // device ordinal
};
struct CUmemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED = 1
  int requestedHandleTypes;  // CU_MEM_HANDLE_TYPE_NONE = 0
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
};

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
// Graph capture: a call unsafe during a capture in global mode; a query of an event last
// recorded into a capture; a legacy-stream query while another stream captures.
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900;
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906;
constexpr CUresult CUDA_ERROR_CAPTURED_EVENT = 907;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
constexpr int CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110;

// The resolved entry points. Loaded once per process; load() throws DeviceError naming the
// library and the missing symbol when the driver cannot be used.
struct Driver {
  CUresult (*cuInit)(unsigned int) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceTotalMem)(std::size_t*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, std::size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned int) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  // Optional: without them every device counts as having virtual memory where the driver
  // has the calls, and no peer gets access to its pages.
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceCanAccessPeer)(int*, CUdevice, CUdevice) = nullptr;
  // Optional: without it the memory a device has free is not known (0 is reported).
  CUresult (*cuMemGetInfo)(std::size_t*, std::size_t*) = nullptr;
  // Optional: without it every stream counts as one of the device's own context.
  CUresult (*cuStreamGetCtx)(CUstream, CUcontext*) = nullptr;
  // Optional (CUDA 10+): without it no stream counts as capturing a CUDA graph.
  CUresult (*cuStreamIsCapturing)(CUstream, int*) = nullptr;
  // Virtual memory management: optional, null when the driver lacks it.
  CUresult (*cuMemGetAllocationGranularity)(std::size_t*, const CUmemAllocationProp*, int) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t) = nullptr;
  bool has_vmm() const { return cuMemSetAccess != nullptr; }
  // Page sharing (Device::synchronize_device, Device::copy): optional too.
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, std::size_t) = nullptr;
  bool has_page_sharing() const {
    return has_vmm() && cuCtxSynchronize != nullptr && cuMemcpyDtoD != nullptr;
  }

  static const Driver& get();  // thread-safe, loads on first call
  // "CUDA_ERROR_OUT_OF_MEMORY" (or the number when the driver does not know it).
  std::string error_name(CUresult r) const;
  // Throws DeviceError "<call> failed: <error name>" unless r is CUDA_SUCCESS.
  void check(CUresult r, const char* call) const;
};

}  // namespace pymemplan::cuda
