/* Control API of libfakecuda.so, a fake CUDA driver for tests.
 *
 * libfakecuda.so exports, with C linkage and the driver's own names and signatures, the
 * subset of the CUDA driver API (libcuda.so.1) that CudaDevice uses, over host memory:
 * cuMemAlloc hands out real, readable and writable host memory (2 MiB aligned), and the
 * virtual-memory calls (cuMemAddressReserve, cuMemCreate, cuMemMap, ...) work over memfd and
 * mmap, so two ranges mapped to one physical handle alias each other. Tests point
 * PYMEMPLAN_LIBCUDA at the library so the real CUDA code path runs on CPUs, and drive it
 * through the functions below (ctypes loading the same file shares the same state).
 *
 * The driver functions are not declared here, so this header can sit next to cuda.h.
 *
 * Configuration at the first cuInit after the library is loaded or reset: each of these
 * environment variables, when set, replaces the corresponding setting (a malformed value
 * makes cuInit fail with CUDA_ERROR_INVALID_VALUE and a message on stderr):
 *   FAKECUDA_DEVICE_COUNT     devices (default 1; 0 makes cuInit return CUDA_ERROR_NO_DEVICE)
 *   FAKECUDA_CAPACITY         bytes per device (default 16 GiB); suffixes K, M, G, T, KiB,
 *                             MiB, GiB, TiB (all binary) are accepted: "64MiB"
 *   FAKECUDA_FAIL_ALLOC_AT    as fakecuda_fail_alloc_at
 *   FAKECUDA_FAIL_ALLOC_ERROR as fakecuda_fail_alloc_error
 *   FAKECUDA_FAIL_CREATE_AT   as fakecuda_fail_create_at
 *   FAKECUDA_EVENT_DELAY      as fakecuda_set_event_delay
 *   FAKECUDA_MANUAL_EVENTS    as fakecuda_set_manual_events (0 or 1)
 *   FAKECUDA_VMM_SUPPORTED    as fakecuda_set_vmm_supported (0 or 1; default 1)
 *   FAKECUDA_PEER_ACCESS      as fakecuda_set_peer_access (0 or 1; default 1)
 *   FAKECUDA_RDMA_VMM         1: the devices report GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
 *                             (default 0: cuMemCreate then refuses allocFlags.gpuDirectRDMACapable)
 *
 * Capacity is a budget: bytes are counted exactly as requested (cuMemAlloc sizes and
 * cuMemCreate sizes, per device), and host memory is touched only when written.
 */
#ifndef PYMEMPLAN_FAKE_CUDA_H
#define PYMEMPLAN_FAKE_CUDA_H

#include <stddef.h>

#if defined(__GNUC__)
#define FAKECUDA_API __attribute__((visibility("default")))
#else
#define FAKECUDA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Forget everything: allocations, handles, mappings and reservations are released, events
 * destroyed, counters zeroed, settings back to their defaults, not initialized (the next
 * cuInit reads the environment again). Every thread's current context becomes NULL. */
FAKECUDA_API void fakecuda_reset(void);

/* Number of devices (0..64). Each device has a distinct primary context. */
FAKECUDA_API void fakecuda_set_device_count(int n);
/* Capacity of every device, in bytes. */
FAKECUDA_API void fakecuda_set_capacity(size_t bytes);

/* The n-th cuMemAlloc call from now (n = 1: the next one) fails, once, with
 * CUDA_ERROR_OUT_OF_MEMORY or the code set by fakecuda_fail_alloc_error. n <= 0 disarms. */
FAKECUDA_API void fakecuda_fail_alloc_at(int n);
/* The code injected failures return (default CUDA_ERROR_OUT_OF_MEMORY = 2); it stays set
 * until changed or reset. Shared by fakecuda_fail_alloc_at and fakecuda_fail_create_at. */
FAKECUDA_API void fakecuda_fail_alloc_error(int code);
/* The same for cuMemCreate: the n-th call from now fails once. n <= 0 disarms. */
FAKECUDA_API void fakecuda_fail_create_at(int n);
/* The n-th cuEventRecord call from now fails once with CUDA_ERROR_INVALID_HANDLE, as the
 * driver answers for a stream of another context (another device). n <= 0 disarms. */
FAKECUDA_API void fakecuda_fail_record_at(int n);
/* The n-th cuMemMap call from now fails once, with CUDA_ERROR_INVALID_VALUE or the code set
 * by fakecuda_fail_map_error. n <= 0 disarms. */
FAKECUDA_API void fakecuda_fail_map_at(int n);
/* The same for cuMemSetAccess. */
FAKECUDA_API void fakecuda_fail_access_at(int n);
/* The code injected cuMemMap and cuMemSetAccess failures return (default
 * CUDA_ERROR_INVALID_VALUE = 1; CUDA_ERROR_OUT_OF_MEMORY = 2: the page tables could not grow). */
FAKECUDA_API void fakecuda_fail_map_error(int code);
/* A stream of `device`'s primary context (an opaque handle, nothing runs on it).
 * cuStreamGetCtx reports that context for it, and cuEventRecord refuses, with
 * CUDA_ERROR_INVALID_HANDLE, an event created in another context, as the driver does.
 * Any other stream value counts as a stream of the calling thread's current context. */
FAKECUDA_API void* fakecuda_stream_create(int device);

/* Each event recorded from now on reports CUDA_ERROR_NOT_READY for its first k queries,
 * then CUDA_SUCCESS (k = 0: complete as soon as recorded). */
FAKECUDA_API void fakecuda_set_event_delay(int k);
/* on != 0: events recorded from now on never complete by being queried; only
 * fakecuda_complete_stream, fakecuda_complete_all, cuEventSynchronize or
 * cuStreamSynchronize complete them. */
FAKECUDA_API void fakecuda_set_manual_events(int on);
/* Complete every pending event recorded on `stream` (a CUstream; NULL is the default
 * stream), or on every stream. */
FAKECUDA_API void fakecuda_complete_stream(void* stream);
FAKECUDA_API void fakecuda_complete_all(void);
/* A kernel's use of [ptr, ptr + size) queued on `stream` (a test's stand-in for a launch). The
 * use stays pending until the stream is known done with it: an event recorded on it after the
 * launch completes, the stream or the context is synchronized, cuMemFree runs (it synchronizes
 * the device), or fakecuda_complete_stream / fakecuda_complete_all. A hazard is counted when a
 * launch touches memory that is not device memory (unmapped pages included) or that another
 * stream's pending use overlaps (memory handed out before the last user was done), and when
 * cuMemUnmap or cuMemcpyDtoD touches memory any pending use overlaps. Returns 1 if this
 * launch counted a hazard, else 0. */
FAKECUDA_API int fakecuda_launch(void* stream, const void* ptr, size_t size);
FAKECUDA_API long long fakecuda_hazards(void);
/* The last hazard in words ("" if none); valid until the next hazard or reset. */
FAKECUDA_API const char* fakecuda_last_hazard(void);
/* Stream `stream` begins (on != 0) or ends capturing a CUDA graph, in the default global
 * mode: meanwhile cuMemAlloc, cuMemFree, cuEventQuery, cuEventSynchronize, cuStreamSynchronize
 * and cuCtxSynchronize fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (each counted by
 * fakecuda_capture_violations), and an event recorded on the stream is captured: querying or
 * waiting for it fails with CUDA_ERROR_CAPTURED_EVENT until it is recorded outside a capture. */
FAKECUDA_API void fakecuda_set_capturing(void* stream, int on);
FAKECUDA_API long long fakecuda_capture_violations(void);

/* Counters. bytes_in_use counts cuMemAlloc and cuMemCreate bytes of that device (a released
 * handle counts until its last mapping is unmapped); live_allocations counts cuMemAlloc
 * blocks not yet freed. num_allocs / num_frees count successful cuMemAlloc / cuMemFree since
 * the last reset. live_events: created and not destroyed; pending_events: recorded and not
 * yet complete. An out-of-range device gives 0. */
FAKECUDA_API size_t fakecuda_bytes_in_use(int device);
FAKECUDA_API int fakecuda_live_allocations(int device);
FAKECUDA_API long long fakecuda_num_allocs(void);
FAKECUDA_API long long fakecuda_num_frees(void);
FAKECUDA_API int fakecuda_live_events(void);
FAKECUDA_API int fakecuda_pending_events(void);
/* cuCtxSynchronize calls, and bytes copied by cuMemcpyDtoD, since the last reset. */
FAKECUDA_API long long fakecuda_ctx_synchronizations(void);
FAKECUDA_API long long fakecuda_bytes_copied(void);
/* cuMemCreate, cuMemMap, cuMemSetAccess and cuMemUnmap calls (successful or not) since the
 * last reset. */
FAKECUDA_API long long fakecuda_create_calls(void);
FAKECUDA_API long long fakecuda_map_calls(void);
FAKECUDA_API long long fakecuda_set_access_calls(void);
FAKECUDA_API long long fakecuda_unmap_calls(void);

/* Virtual-memory counters: physical handles not yet released and unmapped (of one device),
 * mapped ranges, address reservations not yet freed. */
FAKECUDA_API int fakecuda_live_handles(int device);
FAKECUDA_API int fakecuda_live_mappings(void);
/* Devices allowed to access the mapped range holding ptr, one bit per device (bit d: device d),
 * as the last cuMemSetAccess over it set them; 0 if ptr is not mapped. */
FAKECUDA_API unsigned long long fakecuda_access_mask(const void* ptr);
/* 1 if the physical handle mapped at ptr was made with allocFlags.gpuDirectRDMACapable,
 * 0 if not, -1 if ptr is not mapped. */
FAKECUDA_API int fakecuda_rdma_capable(const void* ptr);
/* on == 0: the devices report no virtual memory management
 * (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0), and cuMemCreate and
 * cuMemGetAllocationGranularity return CUDA_ERROR_NOT_SUPPORTED, as on some vGPU profiles. */
FAKECUDA_API void fakecuda_set_vmm_supported(int on);
/* on == 0: cuDeviceCanAccessPeer reports that no device can access another's memory. */
FAKECUDA_API void fakecuda_set_peer_access(int on);
FAKECUDA_API int fakecuda_live_reservations(void);
/* Retain count of a device's primary context (cuDevicePrimaryCtxRetain minus Release). */
FAKECUDA_API int fakecuda_primary_ctx_refcount(int device);
/* 1 after a successful cuInit, 0 before it and after a reset. */
FAKECUDA_API int fakecuda_initialized(void);

#ifdef __cplusplus
}
#endif

#endif /* PYMEMPLAN_FAKE_CUDA_H */
