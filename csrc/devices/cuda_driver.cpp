#include "cuda_driver.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "../core/errors.hpp"

namespace pymemplan::cuda {
namespace {

using GetProcAddress = CUresult (*)(const char*, void**, int, unsigned long long);
// Entry points whose stream 0 is the legacy default stream, as PyTorch's stream 0 is: said
// explicitly rather than left to CU_GET_PROC_ADDRESS_DEFAULT (0), whose meaning the docs tie
// to the caller's compile flags.
constexpr unsigned long long CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1;

// Resolves `name` (a base name such as "cuMemAlloc"; the driver returns the current version
// of the entry point) through cuGetProcAddress when the driver has it, else through dlsym
// with the versioned symbol.
template <typename F>
void resolve(void* lib, GetProcAddress gpa, F& out, const char* name, const char* versioned,
             const std::string& path) {
  void* fn = nullptr;
  if (gpa != nullptr && gpa(name, &fn, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM) != CUDA_SUCCESS) fn = nullptr;
  if (fn == nullptr) fn = dlsym(lib, versioned);
  if (fn == nullptr) {
    throw DeviceError("CUDA driver " + path + " has no " + versioned +
                      "; it is too old or not a CUDA driver");
  }
  out = reinterpret_cast<F>(fn);
}

// As resolve, but a missing entry point leaves `out` null.
template <typename F>
void resolve_optional(void* lib, GetProcAddress gpa, F& out, const char* name, const char* versioned) {
  void* fn = nullptr;
  if (gpa != nullptr && gpa(name, &fn, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM) != CUDA_SUCCESS) fn = nullptr;
  if (fn == nullptr) fn = dlsym(lib, versioned);
  out = reinterpret_cast<F>(fn);
}

Driver load() {
  const char* env = std::getenv("PYMEMPLAN_LIBCUDA");
  const std::string path = env != nullptr && *env != '\0' ? env : "libcuda.so.1";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    throw DeviceError("cannot load the CUDA driver " + path + ": " + (why ? why : "unknown") +
                      ". Is an NVIDIA driver installed? PYMEMPLAN_LIBCUDA may name the library.");
  }
  auto gpa = reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress"));
  Driver d;
  resolve(lib, gpa, d.cuInit, "cuInit", "cuInit", path);
  resolve(lib, gpa, d.cuDeviceGetCount, "cuDeviceGetCount", "cuDeviceGetCount", path);
  resolve(lib, gpa, d.cuDeviceGet, "cuDeviceGet", "cuDeviceGet", path);
  resolve(lib, gpa, d.cuDeviceTotalMem, "cuDeviceTotalMem", "cuDeviceTotalMem_v2", path);
  resolve(lib, gpa, d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",
          "cuDevicePrimaryCtxRetain", path);
  resolve(lib, gpa, d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease",
          "cuDevicePrimaryCtxRelease_v2", path);
  resolve(lib, gpa, d.cuCtxGetCurrent, "cuCtxGetCurrent", "cuCtxGetCurrent", path);
  resolve(lib, gpa, d.cuCtxSetCurrent, "cuCtxSetCurrent", "cuCtxSetCurrent", path);
  resolve(lib, gpa, d.cuMemAlloc, "cuMemAlloc", "cuMemAlloc_v2", path);
  resolve(lib, gpa, d.cuMemFree, "cuMemFree", "cuMemFree_v2", path);
  resolve(lib, gpa, d.cuEventCreate, "cuEventCreate", "cuEventCreate", path);
  resolve(lib, gpa, d.cuEventDestroy, "cuEventDestroy", "cuEventDestroy_v2", path);
  resolve(lib, gpa, d.cuEventRecord, "cuEventRecord", "cuEventRecord", path);
  resolve(lib, gpa, d.cuEventQuery, "cuEventQuery", "cuEventQuery", path);
  resolve(lib, gpa, d.cuEventSynchronize, "cuEventSynchronize", "cuEventSynchronize", path);
  resolve(lib, gpa, d.cuGetErrorName, "cuGetErrorName", "cuGetErrorName", path);
  resolve_optional(lib, gpa, d.cuDeviceGetAttribute, "cuDeviceGetAttribute", "cuDeviceGetAttribute");
  resolve_optional(lib, gpa, d.cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", "cuDeviceCanAccessPeer");
  resolve_optional(lib, gpa, d.cuMemGetInfo, "cuMemGetInfo", "cuMemGetInfo_v2");
  resolve_optional(lib, gpa, d.cuStreamGetCtx, "cuStreamGetCtx", "cuStreamGetCtx");
  resolve_optional(lib, gpa, d.cuStreamIsCapturing, "cuStreamIsCapturing", "cuStreamIsCapturing");
  resolve_optional(lib, gpa, d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",
                   "cuMemGetAllocationGranularity");
  resolve_optional(lib, gpa, d.cuMemAddressReserve, "cuMemAddressReserve", "cuMemAddressReserve");
  resolve_optional(lib, gpa, d.cuMemAddressFree, "cuMemAddressFree", "cuMemAddressFree");
  resolve_optional(lib, gpa, d.cuMemCreate, "cuMemCreate", "cuMemCreate");
  resolve_optional(lib, gpa, d.cuMemRelease, "cuMemRelease", "cuMemRelease");
  resolve_optional(lib, gpa, d.cuMemMap, "cuMemMap", "cuMemMap");
  resolve_optional(lib, gpa, d.cuMemUnmap, "cuMemUnmap", "cuMemUnmap");
  resolve_optional(lib, gpa, d.cuMemSetAccess, "cuMemSetAccess", "cuMemSetAccess");
  if (!(d.cuMemGetAllocationGranularity && d.cuMemAddressReserve && d.cuMemAddressFree &&
        d.cuMemCreate && d.cuMemRelease && d.cuMemMap && d.cuMemUnmap)) {
    d.cuMemSetAccess = nullptr;  // all or nothing: has_vmm() is false
  }
  resolve_optional(lib, gpa, d.cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize");
  resolve_optional(lib, gpa, d.cuMemcpyDtoD, "cuMemcpyDtoD", "cuMemcpyDtoD_v2");
  d.check(d.cuInit(0), "cuInit");
  return d;
}

}  // namespace

const Driver& Driver::get() {
  // A failed load is retried on the next call (the user may fix the environment), a good
  // one is kept for the life of the process.
  static std::mutex mutex;
  static Driver* driver = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (driver == nullptr) driver = new Driver(load());  // never freed: used until exit
  return *driver;
}

std::string Driver::error_name(CUresult r) const {
  const char* name = nullptr;
  if (cuGetErrorName != nullptr && cuGetErrorName(r, &name) == CUDA_SUCCESS && name != nullptr) {
    return name;
  }
  return "CUDA error " + std::to_string(r);
}

void Driver::check(CUresult r, const char* call) const {
  if (r == CUDA_ERROR_OUT_OF_MEMORY) throw DeviceOutOfMemory(std::string(call) + " failed: " + error_name(r));
  if (r != CUDA_SUCCESS) throw DeviceError(std::string(call) + " failed: " + error_name(r));
}

}  // namespace pymemplan::cuda
