// Compile-only check (tests/test_cuda_abi.py): the CUDA driver types and values that
// csrc/devices/cuda_driver.hpp declares by hand, so that nothing links against CUDA, are
// those of the toolkit's cuda.h. A mismatch would pass every test over the fake driver and
// corrupt memory on a real GPU.
#include <cuda.h>

#include <cstddef>

#include "cuda_driver.hpp"

namespace p = pymemplan::cuda;
static_assert(sizeof(::CUmemAllocationProp) == sizeof(p::CUmemAllocationProp), "CUmemAllocationProp size");
static_assert(offsetof(::CUmemAllocationProp, location) == offsetof(p::CUmemAllocationProp, location), "CUmemAllocationProp.location");
static_assert(offsetof(::CUmemAllocationProp, win32HandleMetaData) == offsetof(p::CUmemAllocationProp, win32HandleMetaData), "CUmemAllocationProp.win32HandleMetaData");
static_assert(offsetof(::CUmemAllocationProp, allocFlags) == offsetof(p::CUmemAllocationProp, allocFlags), "CUmemAllocationProp.allocFlags");
static_assert(offsetof(::CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) == offsetof(p::CUmemAllocationProp, allocFlags.gpuDirectRDMACapable), "allocFlags.gpuDirectRDMACapable");
static_assert(sizeof(::CUmemAccessDesc) == sizeof(p::CUmemAccessDesc), "CUmemAccessDesc");
static_assert(sizeof(::CUmemLocation) == sizeof(p::CUmemLocation), "CUmemLocation");
static_assert(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED == p::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "attr vmm");
static_assert(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED == p::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, "attr rdma");
static_assert(CUDA_ERROR_NOT_READY == p::CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY");
static_assert(CU_EVENT_DISABLE_TIMING == p::CU_EVENT_DISABLE_TIMING, "CU_EVENT_DISABLE_TIMING");
static_assert(CU_MEM_ACCESS_FLAGS_PROT_READWRITE == 3, "CU_MEM_ACCESS_FLAGS_PROT_READWRITE (cuda_device.cpp)");
static_assert(CU_MEM_LOCATION_TYPE_DEVICE == 1 && CU_MEM_ALLOCATION_TYPE_PINNED == 1, "location and allocation types (cuda_device.cpp)");
static_assert(CUDA_SUCCESS == p::CUDA_SUCCESS && CUDA_ERROR_OUT_OF_MEMORY == p::CUDA_ERROR_OUT_OF_MEMORY,
              "results");
// Handles and results passed by value: same sizes as the driver's.
static_assert(sizeof(::CUresult) == sizeof(p::CUresult), "CUresult");
static_assert(sizeof(::CUdevice) == sizeof(p::CUdevice), "CUdevice");
static_assert(sizeof(::CUdeviceptr) == sizeof(p::CUdeviceptr), "CUdeviceptr");
static_assert(sizeof(::CUmemGenericAllocationHandle) == sizeof(p::CUmemGenericAllocationHandle),
              "CUmemGenericAllocationHandle");
