/* libpymemplan_alloc.so: pymemplan's caching allocator as a PyTorch pluggable allocator.
 *
 * The first group has the exact signatures torch.cuda.memory.CUDAPluggableAllocator calls
 * (torch/csrc/cuda/CUDAPluggableAllocator.cpp). The second is a small C API that
 * pymemplan reads with ctypes. One allocator per device, created on first use.
 *
 * No function lets a C++ exception escape, except pymemplan_alloc when the config says
 * oom_action:raise (the default): PyTorch turns a NULL from a pluggable allocator into a
 * tensor with a null data pointer and no error, so on OOM we throw std::runtime_error
 * carrying our message, which PyTorch's Python bindings turn into a RuntimeError. With
 * oom_action:null the function returns NULL instead and leaves the message for
 * pymemplan_last_error(). Errors elsewhere return -1 (or NULL) and set the last error.
 */
#ifndef PYMEMPLAN_ALLOC_H
#define PYMEMPLAN_ALLOC_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* pymemplan_stream_t; /* cudaStream_t */

/* --- The PyTorch CUDAPluggableAllocator interface --- */
void* pymemplan_alloc(ssize_t size, int device, pymemplan_stream_t stream);
/* `size` is the requested size PyTorch recorded; `stream` the allocation stream. */
void pymemplan_free(void* ptr, ssize_t size, int device, pymemplan_stream_t stream);
void pymemplan_init(int device_count);
void pymemplan_reset(void); /* torch.cuda.empty_cache() */
void pymemplan_memory_fraction(double fraction, int device);
void pymemplan_record_stream(void* ptr, pymemplan_stream_t stream);
/* PyTorch's getBaseAllocation (CUDA IPC: a tensor shared with another process is sent as the
 * device allocation that holds it and an offset): the segment holding `ptr` and, in *size, its
 * size. Throws for memory it cannot export (virtual-memory segments) or does not own. */
void* pymemplan_base_alloc(void* ptr, size_t* size);

/* --- The C API for Python (ctypes). Return 0 on success, -1 on error (see last_error). --- */
/* As pymemplan_alloc, but never throws, whatever oom_action says: NULL with the message in
 * pymemplan_last_error(). For callers that cannot catch C++ exceptions (ctypes, CuPy). */
void* pymemplan_try_alloc(ssize_t size, int device, pymemplan_stream_t stream);
/* Policy name and config string ("key:value,..."), for allocators created after this call.
 * Fails if an allocator already exists or the config is invalid. */
int pymemplan_configure(const char* policy, const char* config);
/* Writes a NUL-terminated JSON object into buf (PyTorch memory_stats() keys) and returns
 * the length it needs (excluding NUL); call again with a bigger buffer if that is >= len.
 * A device with no allocator yet reports all-zero stats. Returns -1 on error. */
long pymemplan_stats_json(int device, char* buf, size_t len);
/* Same protocol; a JSON object {"segments": [...]} in torch.cuda.memory._snapshot() shape. */
long pymemplan_snapshot_json(int device, char* buf, size_t len);
int pymemplan_reset_peak_stats(int device);
int pymemplan_reset_accumulated_stats(int device);
int pymemplan_set_memory_limit(int device, size_t bytes); /* 0: no limit */
int pymemplan_empty_cache(int device);                     /* -1: every device */
/* A training step starts here (-1: every device). A hint for pymemplan-planned, which finds
 * the repeated step by itself without it; the other policies ignore it. */
int pymemplan_mark_step(int device);
/* Gives back pages that blocks in use fill only partly (-1: every device): two such pages
 * whose live bytes lie at disjoint offsets become one physical page mapped at both addresses.
 * Policies with virtual memory only; synchronizes the device, so no other thread may enqueue
 * work meanwhile. *given_back (if not NULL): the bytes given back. */
int pymemplan_share_pages(int device, size_t* given_back);
/* pymemplan-planned: the plans a device's allocator armed in this run, as text (see
 * pymemplan_import_plans), with the protocol of pymemplan_stats_json. Fails for another
 * policy, or a device with no allocator yet. */
long pymemplan_export_plans(int device, char* buf, size_t len);
/* pymemplan-planned: adds plans that pymemplan_export_plans wrote (in an earlier run of the
 * same job), creating the device's allocator if there is none yet; each is recognised by its
 * first requests and served once a step of this run has matched it. Bad text fails and adds
 * nothing. *added (if not NULL): the plans added (those already known are not). */
int pymemplan_import_plans(int device, const char* text, size_t* added);
/* pymemplan-planned: plans that pymemplan_export_plans wrote, for a device (-1: every device)
 * whose allocator may not exist yet. An allocator that exists takes them at once, as
 * pymemplan_import_plans; one made later takes them as it is made, so that loading plans
 * does not touch the driver. Text for one device wins over text for every device. Fails for
 * another policy, or text an existing allocator refuses. */
int pymemplan_stage_plans(int device, const char* text);
/* Keeps the last max_entries allocations, frees and out-of-memory errors of a device (-1:
 * every device), as torch.cuda.memory._record_memory_history() does for PyTorch's allocator
 * (which a pluggable allocator does not reach); 0 stops and forgets them. */
int pymemplan_record_history(int device, size_t max_entries);
/* The history, oldest first, as a JSON list of PyTorch's trace entries ("alloc",
 * "free_completed", "oom" with device_free), with the protocol of pymemplan_stats_json. */
long pymemplan_history_json(int device, char* buf, size_t len);
/* The last error of the calling thread (OOM message, bad pointer, driver failure), or "". */
const char* pymemplan_last_error(void);
/* Number of devices the driver reports, or -1 with last_error set (no driver, ...). */
int pymemplan_device_count(void);

#ifdef __cplusplus
}
#endif

#endif /* PYMEMPLAN_ALLOC_H */
