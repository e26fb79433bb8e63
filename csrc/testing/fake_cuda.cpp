// libfakecuda.so: the subset of the CUDA driver API that CudaDevice uses, over host memory,
// with fault injection. See fake_cuda.h for the control API and the environment variables.
//
// Semantics kept from the real driver where tests can observe them: every call but cuInit,
// cuDriverGetVersion, cuGetErrorName/String and cuGetProcAddress* fails with
// CUDA_ERROR_NOT_INITIALIZED before cuInit; the current context is per thread; cuMemAlloc
// needs a current context; an event never recorded is complete; a mapping made by cuMemMap
// is inaccessible (PROT_NONE) until cuMemSetAccess; a physical handle released while mapped
// lives until its last mapping is unmapped.
//
// One mutex guards all state. Host memory comes from mmap, so nothing is touched until
// written: a capacity of 16 GiB costs nothing until used.
#include "fake_cuda.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUmemGenericAllocationHandle;

struct CUctx_st {
  int device;
};

struct CUevent_st {
  CUctx_st* ctx = nullptr;  // current when it was created: it records only on that context's streams
  bool pending = false;   // recorded and not yet complete
  bool manual = false;    // completes only when completed explicitly
  int queries_left = 0;   // NOT_READY answers still owed (not manual)
  CUstream stream = nullptr;
  std::uint64_t seq = 0;  // the stream's work queued before it was recorded (fakecuda_launch)
  bool captured = false;  // last recorded on a stream capturing a graph: not queryable
};

namespace {

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;
constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900;
constexpr CUresult CUDA_ERROR_CAPTURED_EVENT = 907;

constexpr int kDriverVersion = 12040;
constexpr int kMaxDevices = 64;
constexpr std::size_t kGranularity = std::size_t{2} << 20;  // 2 MiB, as on real GPUs
constexpr std::size_t kDefaultCapacity = std::size_t{16} << 30;
constexpr unsigned kEventFlagsMask = 0x1 | 0x2 | 0x4;  // blocking sync, no timing, IPC

// Layouts of the driver's structs (cuda.h), read only for the fields the fake honours.
struct MemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int id;
};
struct MemAllocationProp {
  int type;  // CU_MEM_ALLOCATION_TYPE_PINNED = 1
  int requestedHandleTypes;
  MemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct MemAccessDesc {
  MemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_NONE = 0, _PROT_READ = 1, _PROT_READWRITE = 3
};

struct Allocation {
  std::size_t bytes;     // as requested, counted against capacity
  std::uintptr_t base;   // the mmap'd range (the pointer handed out is base)
  std::size_t length;
  int device;
};

struct Handle {
  int fd;           // memfd; -1 once released
  std::size_t bytes;
  int device;
  int mappings = 0;
  bool released = false;
  bool rdma = false;  // made with allocFlags.gpuDirectRDMACapable
};

struct Mapping {
  std::size_t bytes;
  CUmemGenericAllocationHandle handle;
  unsigned long long access = 0;  // bit d: device d may read or write (cuMemSetAccess)
};

struct Settings {
  int device_count = 1;
  std::size_t capacity = kDefaultCapacity;
  int fail_alloc_countdown = 0;  // 0: disarmed
  int fail_create_countdown = 0;
  int fail_map_countdown = 0;
  int fail_access_countdown = 0;
  int fail_map_error = CUDA_ERROR_INVALID_VALUE;  // what injected cuMemMap/cuMemSetAccess failures return
  int fail_record_countdown = 0;  // cuEventRecord: CUDA_ERROR_INVALID_HANDLE, as for a stream of another context
  int fail_error = CUDA_ERROR_OUT_OF_MEMORY;
  int event_delay = 0;
  bool manual_events = false;
  bool vmm_supported = true;  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  bool peer_access = true;    // cuDeviceCanAccessPeer between distinct devices
  bool rdma_vmm = false;      // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
};

// A kernel's use of device memory (fakecuda_launch), queued on a stream and not yet known
// to be done.
struct Work {
  CUstream stream;
  std::uint64_t seq;  // the stream's launches up to and including this one
  std::uintptr_t lo, hi;
};

struct State {
  std::mutex mutex;
  bool initialized = false;
  std::uint64_t generation = 1;  // bumped by reset: thread-local current contexts expire
  Settings settings;
  CUctx_st contexts[kMaxDevices];
  int ctx_refcount[kMaxDevices] = {};
  std::size_t bytes_in_use[kMaxDevices] = {};
  int live_allocations[kMaxDevices] = {};
  int live_handles[kMaxDevices] = {};
  long long num_allocs = 0;
  long long num_frees = 0;
  long long ctx_synchronizations = 0;
  long long bytes_copied = 0;
  long long create_calls = 0, map_calls = 0, set_access_calls = 0, unmap_calls = 0;
  std::map<std::uintptr_t, Allocation> allocations;
  std::unordered_set<CUevent_st*> events;
  // Work queued by fakecuda_launch: launches per stream, launches known done per stream, and
  // the uses of memory still pending. Touching pending memory otherwise counts a hazard.
  std::unordered_map<CUstream, std::uint64_t> launched;
  std::unordered_map<CUstream, std::uint64_t> done;
  std::vector<Work> work;
  long long hazards = 0;
  std::string last_hazard;
  // Streams made by fakecuda_stream_create, with their device. Any other non-null value is
  // taken for a stream of the current context, so tests may name streams by any pointer.
  std::unordered_map<CUstream, int> stream_device;
  // Streams capturing a CUDA graph (fakecuda_set_capturing), all in the default global
  // mode: while any is, calls that are unsafe during a capture fail with
  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and are counted (the capture is invalidated).
  std::unordered_set<CUstream> capturing;
  long long capture_violations = 0;
  std::uintptr_t next_stream = 0x5eed0000;
  std::map<std::uintptr_t, std::size_t> reservations;
  std::map<std::uintptr_t, Mapping> mappings;
  std::unordered_map<CUmemGenericAllocationHandle, Handle> handles;
  CUmemGenericAllocationHandle next_handle = 1;

  State() {
    for (int i = 0; i < kMaxDevices; ++i) contexts[i].device = i;
  }
};

State& state() {
  static State* s = new State();  // never destroyed: callers may outlive static destructors
  return *s;
}

thread_local CUctx_st* t_current = nullptr;
thread_local std::uint64_t t_generation = 0;

CUctx_st* current_context(const State& s) {
  return t_generation == s.generation ? t_current : nullptr;
}

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

bool is_power_of_two(std::size_t n) { return n != 0 && (n & (n - 1)) == 0; }

// An anonymous mapping of `length` bytes (a multiple of the page size) aligned to `align`
// (a power of two, at least the page size); 0 on failure.
std::uintptr_t map_aligned(std::size_t length, std::size_t align, int prot) {
  const std::size_t total = length + align;
  if (total < length) return 0;
  void* p = mmap(nullptr, total, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 0;
  const auto raw = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t aligned = (raw + align - 1) & ~(static_cast<std::uintptr_t>(align) - 1);
  if (aligned > raw) munmap(p, aligned - raw);
  const std::uintptr_t end = aligned + length;
  if (raw + total > end) munmap(reinterpret_cast<void*>(end), raw + total - end);
  return aligned;
}

// `stream` is known done with its launches up to `seq`.
void finish(State& s, CUstream stream, std::uint64_t seq) {
  std::uint64_t& d = s.done[stream];
  if (seq <= d) return;
  d = seq;
  s.work.erase(std::remove_if(s.work.begin(), s.work.end(),
                              [&](const Work& w) { return w.stream == stream && w.seq <= d; }),
               s.work.end());
}

void finish_stream(State& s, CUstream stream) { finish(s, stream, s.launched[stream]); }

void finish_all(State& s) {
  for (const auto& [stream, n] : s.launched) s.done[stream] = n;
  s.work.clear();
}

// An event completes: the work queued before it on its stream is done.
void complete(State& s, CUevent_st* e) {
  e->pending = false;
  e->queries_left = 0;
  finish(s, e->stream, e->seq);
}

// The first pending use of [lo, hi) by a stream other than `except` (nullptr: none).
const Work* pending_use(const State& s, std::uintptr_t lo, std::uintptr_t hi,
                        const CUstream* except = nullptr) {
  for (const Work& w : s.work) {
    if (w.lo < hi && lo < w.hi && (except == nullptr || w.stream != *except)) return &w;
  }
  return nullptr;
}

void hazard(State& s, const char* what, std::uintptr_t lo, std::uintptr_t hi, const Work& w) {
  ++s.hazards;
  char text[256];
  std::snprintf(text, sizeof text, "%s [%#llx, %#llx) while stream %p may still use [%#llx, %#llx)",
                what, static_cast<unsigned long long>(lo), static_cast<unsigned long long>(hi),
                static_cast<void*>(w.stream), static_cast<unsigned long long>(w.lo),
                static_cast<unsigned long long>(w.hi));
  s.last_hazard = text;
}

// Releases every resource and returns to the defaults. Caller holds the mutex.
void reset_locked(State& s) {
  for (auto& [ptr, a] : s.allocations) munmap(reinterpret_cast<void*>(a.base), a.length);
  s.allocations.clear();
  for (auto& [ptr, size] : s.reservations) munmap(reinterpret_cast<void*>(ptr), size);
  s.reservations.clear();
  s.mappings.clear();
  for (auto& [id, h] : s.handles) {
    if (h.fd >= 0) close(h.fd);
  }
  s.handles.clear();
  for (CUevent_st* e : s.events) delete e;
  s.events.clear();
  s.stream_device.clear();
  s.launched.clear();
  s.done.clear();
  s.work.clear();
  s.hazards = 0;
  s.last_hazard.clear();
  s.capturing.clear();
  s.capture_violations = 0;
  s.settings = Settings();
  s.initialized = false;
  ++s.generation;
  for (int i = 0; i < kMaxDevices; ++i) {
    s.ctx_refcount[i] = 0;
    s.bytes_in_use[i] = 0;
    s.live_allocations[i] = 0;
    s.live_handles[i] = 0;
  }
  s.num_allocs = 0;
  s.num_frees = 0;
  s.ctx_synchronizations = 0;
  s.bytes_copied = 0;
  s.create_calls = s.map_calls = s.set_access_calls = s.unmap_calls = 0;
  s.next_handle = 1;
}

bool parse_size(const char* text, std::size_t* out) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text || *text == '-') return false;
  const std::string suffix(end);
  int shift = 0;
  if (suffix.empty()) shift = 0;
  else if (suffix == "K" || suffix == "KiB") shift = 10;
  else if (suffix == "M" || suffix == "MiB") shift = 20;
  else if (suffix == "G" || suffix == "GiB") shift = 30;
  else if (suffix == "T" || suffix == "TiB") shift = 40;
  else return false;
  if (shift > 0 && v > (~0ULL >> shift)) return false;
  *out = static_cast<std::size_t>(v << shift);
  return true;
}

bool parse_int(const char* text, int* out) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < -2147483647L || v > 2147483647L) {
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

// Applies the FAKECUDA_* variables that are set. Caller holds the mutex.
CUresult read_environment(Settings& st) {
  bool ok = true;
  auto bad = [&ok](const char* name, const char* value) {
    std::fprintf(stderr, "libfakecuda: cannot parse %s=%s\n", name, value);
    ok = false;
  };
  auto int_var = [&bad](const char* name, int* out, int lo, int hi) {
    const char* v = std::getenv(name);
    if (v == nullptr) return;
    int x = 0;
    if (!parse_int(v, &x) || x < lo || x > hi) return bad(name, v);
    *out = x;
  };
  Settings next = st;
  int_var("FAKECUDA_DEVICE_COUNT", &next.device_count, 0, kMaxDevices);
  if (const char* v = std::getenv("FAKECUDA_CAPACITY")) {
    if (!parse_size(v, &next.capacity)) bad("FAKECUDA_CAPACITY", v);
  }
  int_var("FAKECUDA_FAIL_ALLOC_AT", &next.fail_alloc_countdown, -2147483647, 2147483647);
  int_var("FAKECUDA_FAIL_CREATE_AT", &next.fail_create_countdown, -2147483647, 2147483647);
  int_var("FAKECUDA_FAIL_ALLOC_ERROR", &next.fail_error, 1, 2147483647);
  int_var("FAKECUDA_EVENT_DELAY", &next.event_delay, 0, 2147483647);
  int manual = next.manual_events ? 1 : 0;
  int_var("FAKECUDA_MANUAL_EVENTS", &manual, 0, 1);
  next.manual_events = manual != 0;
  int vmm = next.vmm_supported ? 1 : 0, peers = next.peer_access ? 1 : 0;
  int_var("FAKECUDA_VMM_SUPPORTED", &vmm, 0, 1);
  int_var("FAKECUDA_PEER_ACCESS", &peers, 0, 1);
  int rdma = next.rdma_vmm ? 1 : 0;
  int_var("FAKECUDA_RDMA_VMM", &rdma, 0, 1);
  next.rdma_vmm = rdma != 0;
  next.vmm_supported = vmm != 0;
  next.peer_access = peers != 0;
  if (next.fail_alloc_countdown < 0) next.fail_alloc_countdown = 0;
  if (next.fail_create_countdown < 0) next.fail_create_countdown = 0;
  if (!ok) return CUDA_ERROR_INVALID_VALUE;
  st = next;
  return CUDA_SUCCESS;
}

// Counts one call against an armed countdown; true when this call is the one to fail.
bool injected_failure(int& countdown) {
  if (countdown <= 0) return false;
  return --countdown == 0;
}

bool valid_device(const State& s, int device) {
  return device >= 0 && device < s.settings.device_count;
}

bool has_room(const State& s, int device, std::size_t bytes) {
  const std::size_t used = s.bytes_in_use[device];
  return used <= s.settings.capacity && bytes <= s.settings.capacity - used;
}

// The reservation holding [ptr, ptr + size), or end().
std::map<std::uintptr_t, std::size_t>::const_iterator reservation_of(const State& s,
                                                                     std::uintptr_t ptr,
                                                                     std::size_t size) {
  auto it = s.reservations.upper_bound(ptr);
  if (it == s.reservations.begin()) return s.reservations.end();
  --it;
  if (ptr + size < ptr || ptr + size > it->first + it->second) return s.reservations.end();
  return it;
}

bool overlaps_mapping(const State& s, std::uintptr_t ptr, std::size_t size) {
  auto it = s.mappings.upper_bound(ptr);
  if (it != s.mappings.begin() && std::prev(it)->first + std::prev(it)->second.bytes > ptr) {
    return true;
  }
  return it != s.mappings.end() && it->first < ptr + size;
}

// True when [ptr, ptr + size) is covered by mappings without gaps.
bool fully_mapped(const State& s, std::uintptr_t ptr, std::size_t size) {
  std::uintptr_t cursor = ptr;
  const std::uintptr_t end = ptr + size;
  auto it = s.mappings.upper_bound(ptr);
  if (it == s.mappings.begin()) return false;
  --it;
  while (cursor < end) {
    if (it == s.mappings.end() || it->first > cursor) return false;
    const std::uintptr_t mapping_end = it->first + it->second.bytes;
    if (mapping_end <= cursor) return false;
    cursor = mapping_end;
    ++it;
  }
  return true;
}

// Drops one mapping of a handle; a released handle goes with its last mapping.
void drop_mapping_ref(State& s, CUmemGenericAllocationHandle id) {
  auto h = s.handles.find(id);
  if (h == s.handles.end()) return;
  --h->second.mappings;
  if (h->second.released && h->second.mappings == 0) {
    s.bytes_in_use[h->second.device] -= h->second.bytes;
    --s.live_handles[h->second.device];
    s.handles.erase(h);
  }
}

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};

// Names and descriptions as the real driver reports them.
constexpr ErrorText kErrors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {907, "CUDA_ERROR_CAPTURED_EVENT",
     "operation not permitted on an event last recorded in a capturing stream"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ErrorText* find_error(CUresult code) {
  for (const ErrorText& e : kErrors) {
    if (e.code == code) return &e;
  }
  return nullptr;
}

}  // namespace

#define FAKECUDA_DRIVER extern "C" FAKECUDA_API

// Every driver call but the few that work before cuInit starts with this.
#define REQUIRE_INIT(s)                                   \
  std::lock_guard<std::mutex> lock((s).mutex);            \
  if (!(s).initialized) return CUDA_ERROR_NOT_INITIALIZED

// A call the driver refuses while a graph is being captured in global mode (cudaMalloc,
// cudaFree, event queries and synchronizations): it invalidates the capture.
#define REFUSE_DURING_CAPTURE(s)                          \
  if (!(s).capturing.empty()) {                           \
    ++(s).capture_violations;                             \
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;         \
  }

// ---------------------------------------------------------------- initialization, devices

FAKECUDA_DRIVER CUresult cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.initialized) return CUDA_SUCCESS;
  const CUresult r = read_environment(s.settings);
  if (r != CUDA_SUCCESS) return r;
  if (s.settings.device_count == 0) return CUDA_ERROR_NO_DEVICE;
  s.initialized = true;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuDriverGetVersion(int* version) {
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = kDriverVersion;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuDeviceGetCount(int* count) {
  State& s = state();
  REQUIRE_INIT(s);
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = s.settings.device_count;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  State& s = state();
  REQUIRE_INIT(s);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice device) {
  State& s = state();
  REQUIRE_INIT(s);
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, device)) return CUDA_ERROR_INVALID_DEVICE;
  if (attribute == 102) {  // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    *value = s.settings.vmm_supported ? 1 : 0;
  } else if (attribute == 110) {  // GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    *value = s.settings.vmm_supported && s.settings.rdma_vmm ? 1 : 0;
  } else {
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuDeviceCanAccessPeer(int* can, CUdevice device, CUdevice peer) {
  State& s = state();
  REQUIRE_INIT(s);
  if (can == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, device) || !valid_device(s, peer)) return CUDA_ERROR_INVALID_DEVICE;
  *can = device != peer && s.settings.peer_access ? 1 : 0;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuDeviceTotalMem_v2(std::size_t* bytes, CUdevice device) {
  State& s = state();
  REQUIRE_INIT(s);
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, device)) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = s.settings.capacity;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------- contexts

FAKECUDA_DRIVER CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  State& s = state();
  REQUIRE_INIT(s);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, device)) return CUDA_ERROR_INVALID_DEVICE;
  ++s.ctx_refcount[device];
  *ctx = &s.contexts[device];
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
  State& s = state();
  REQUIRE_INIT(s);
  if (!valid_device(s, device)) return CUDA_ERROR_INVALID_DEVICE;
  if (s.ctx_refcount[device] <= 0) return CUDA_ERROR_INVALID_CONTEXT;
  --s.ctx_refcount[device];
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuCtxGetCurrent(CUcontext* ctx) {
  State& s = state();
  REQUIRE_INIT(s);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *ctx = current_context(s);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuCtxSetCurrent(CUcontext ctx) {
  State& s = state();
  REQUIRE_INIT(s);
  if (ctx != nullptr) {
    const std::ptrdiff_t i = ctx - s.contexts;
    if (i < 0 || i >= s.settings.device_count || ctx != &s.contexts[i]) {
      return CUDA_ERROR_INVALID_CONTEXT;
    }
  }
  t_current = ctx;
  t_generation = s.generation;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuCtxGetDevice(CUdevice* device) {
  State& s = state();
  REQUIRE_INIT(s);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* ctx = current_context(s);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *device = ctx->device;
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------------------ memory

FAKECUDA_DRIVER CUresult cuMemAlloc_v2(CUdeviceptr* dptr, std::size_t bytes) {
  State& s = state();
  REQUIRE_INIT(s);
  REFUSE_DURING_CAPTURE(s);
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* ctx = current_context(s);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  const int device = ctx->device;
  if (injected_failure(s.settings.fail_alloc_countdown)) return s.settings.fail_error;
  if (!has_room(s, device, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  const std::size_t length = round_up(bytes, page_size());
  const std::uintptr_t base = map_aligned(length, kGranularity, PROT_READ | PROT_WRITE);
  if (base == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  s.allocations[base] = Allocation{bytes, base, length, device};
  s.bytes_in_use[device] += bytes;
  ++s.live_allocations[device];
  ++s.num_allocs;
  *dptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemFree_v2(CUdeviceptr dptr) {
  State& s = state();
  REQUIRE_INIT(s);
  REFUSE_DURING_CAPTURE(s);
  auto it = s.allocations.find(static_cast<std::uintptr_t>(dptr));
  if (it == s.allocations.end()) return CUDA_ERROR_INVALID_VALUE;
  const Allocation a = it->second;
  finish_all(s);  // cuMemFree synchronizes the device before it frees
  s.allocations.erase(it);
  munmap(reinterpret_cast<void*>(a.base), a.length);
  s.bytes_in_use[a.device] -= a.bytes;
  --s.live_allocations[a.device];
  ++s.num_frees;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemGetInfo_v2(std::size_t* free_bytes, std::size_t* total_bytes) {
  State& s = state();
  REQUIRE_INIT(s);
  if (free_bytes == nullptr || total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* ctx = current_context(s);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  const std::size_t used = s.bytes_in_use[ctx->device];
  *total_bytes = s.settings.capacity;
  *free_bytes = used < s.settings.capacity ? s.settings.capacity - used : 0;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------- events, streams

FAKECUDA_DRIVER CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  State& s = state();
  REQUIRE_INIT(s);
  if (event == nullptr || (flags & ~kEventFlagsMask) != 0) return CUDA_ERROR_INVALID_VALUE;
  auto* e = new CUevent_st();
  e->ctx = current_context(s);
  s.events.insert(e);
  *event = e;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuEventDestroy_v2(CUevent event) {
  State& s = state();
  REQUIRE_INIT(s);
  if (s.events.erase(event) == 0) return CUDA_ERROR_INVALID_HANDLE;
  delete event;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuEventRecord(CUevent event, CUstream stream) {
  State& s = state();
  REQUIRE_INIT(s);
  if (s.events.count(event) == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (injected_failure(s.settings.fail_record_countdown)) return CUDA_ERROR_INVALID_HANDLE;
  // "hEvent and hStream must be from the same context otherwise CUDA_ERROR_INVALID_HANDLE"
  auto bound = s.stream_device.find(stream);
  if (bound != s.stream_device.end() && event->ctx != nullptr &&
      event->ctx != &s.contexts[bound->second]) {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  event->stream = stream;
  // Recorded into a capture, the event becomes a node of the graph, not a point of the
  // stream's work: it cannot be queried or waited for until recorded again outside one.
  event->captured = s.capturing.count(stream) != 0;
  if (event->captured) {
    event->pending = false;
    return CUDA_SUCCESS;
  }
  event->manual = s.settings.manual_events;
  event->queries_left = s.settings.event_delay;
  event->seq = s.launched[stream];
  event->pending = event->manual || event->queries_left > 0;
  if (!event->pending) finish(s, stream, event->seq);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuEventQuery(CUevent event) {
  State& s = state();
  REQUIRE_INIT(s);
  if (s.events.count(event) == 0) return CUDA_ERROR_INVALID_HANDLE;
  REFUSE_DURING_CAPTURE(s);
  if (event->captured) return CUDA_ERROR_CAPTURED_EVENT;
  if (!event->pending) return CUDA_SUCCESS;
  if (event->manual) return CUDA_ERROR_NOT_READY;
  if (event->queries_left > 0) {
    --event->queries_left;
    return CUDA_ERROR_NOT_READY;
  }
  complete(s, event);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuEventSynchronize(CUevent event) {
  State& s = state();
  REQUIRE_INIT(s);
  if (s.events.count(event) == 0) return CUDA_ERROR_INVALID_HANDLE;
  REFUSE_DURING_CAPTURE(s);
  if (event->captured) return CUDA_ERROR_CAPTURED_EVENT;
  complete(s, event);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuStreamIsCapturing(CUstream stream, int* status) {
  State& s = state();
  REQUIRE_INIT(s);
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *status = s.capturing.count(stream) != 0 ? 1 : 0;  // CU_STREAM_CAPTURE_STATUS_ACTIVE : _NONE
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuStreamGetCtx(CUstream stream, CUcontext* ctx) {
  State& s = state();
  REQUIRE_INIT(s);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto bound = s.stream_device.find(stream);
  *ctx = bound != s.stream_device.end() ? &s.contexts[bound->second] : current_context(s);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuStreamSynchronize(CUstream stream) {
  State& s = state();
  REQUIRE_INIT(s);
  REFUSE_DURING_CAPTURE(s);
  for (CUevent_st* e : s.events) {
    if (e->pending && e->stream == stream) complete(s, e);
  }
  finish_stream(s, stream);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuCtxSynchronize(void) {
  State& s = state();
  REQUIRE_INIT(s);
  REFUSE_DURING_CAPTURE(s);
  for (CUevent_st* e : s.events) {
    if (e->pending) complete(s, e);
  }
  finish_all(s);
  ++s.ctx_synchronizations;
  return CUDA_SUCCESS;
}

namespace {
// [ptr, ptr + size) lies in one cuMemAlloc block or in mapped virtual memory.
bool device_memory(const State& s, std::uintptr_t ptr, std::size_t size) {
  auto a = s.allocations.upper_bound(ptr);
  if (a != s.allocations.begin()) {
    --a;
    if (ptr + size <= a->second.base + a->second.length) return true;
  }
  return fully_mapped(s, ptr, size);
}
}  // namespace

// Synchronous here (the memory is the host's); the driver's may return before the copy
// completes, so callers that need it done synchronize the context after it.
FAKECUDA_DRIVER CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, std::size_t size) {
  State& s = state();
  REQUIRE_INIT(s);
  const auto d = static_cast<std::uintptr_t>(dst), from = static_cast<std::uintptr_t>(src);
  if (size == 0) return CUDA_SUCCESS;
  if (!device_memory(s, d, size) || !device_memory(s, from, size)) return CUDA_ERROR_INVALID_VALUE;
  if (const Work* w = pending_use(s, d, d + size)) hazard(s, "cuMemcpyDtoD to", d, d + size, *w);
  if (const Work* w = pending_use(s, from, from + size)) {
    hazard(s, "cuMemcpyDtoD from", from, from + size, *w);
  }
  std::memmove(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(from), size);
  s.bytes_copied += static_cast<long long>(size);
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------------------ errors

FAKECUDA_DRIVER CUresult cuGetErrorName(CUresult error, const char** name) {
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(error);
  *name = e != nullptr ? e->name : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKECUDA_DRIVER CUresult cuGetErrorString(CUresult error, const char** text) {
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(error);
  *text = e != nullptr ? e->text : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// ---------------------------------------------------------------------- virtual memory

FAKECUDA_DRIVER CUresult cuMemGetAllocationGranularity(std::size_t* granularity,
                                                       const void* prop, int option) {
  State& s = state();
  REQUIRE_INIT(s);
  // CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0, _RECOMMENDED = 1
  if (granularity == nullptr || prop == nullptr || (option != 0 && option != 1)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!s.settings.vmm_supported) return CUDA_ERROR_NOT_SUPPORTED;
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemAddressReserve(CUdeviceptr* ptr, std::size_t size,
                                             std::size_t alignment, CUdeviceptr addr,
                                             unsigned long long flags) {
  State& s = state();
  REQUIRE_INIT(s);
  if (ptr == nullptr || size == 0 || size % kGranularity != 0 || flags != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (alignment == 0) alignment = kGranularity;
  if (!is_power_of_two(alignment)) return CUDA_ERROR_INVALID_VALUE;
  if (alignment < page_size()) alignment = page_size();
  std::uintptr_t base = 0;
  if (addr != 0 && addr % alignment == 0) {  // the address is a hint, as in the driver
    void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p != MAP_FAILED) {
      if (reinterpret_cast<std::uintptr_t>(p) == addr) base = addr;
      else munmap(p, size);
    }
  }
  if (base == 0) base = map_aligned(size, alignment, PROT_NONE);
  if (base == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  s.reservations[base] = size;
  *ptr = static_cast<CUdeviceptr>(base);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemAddressFree(CUdeviceptr ptr, std::size_t size) {
  State& s = state();
  REQUIRE_INIT(s);
  const auto base = static_cast<std::uintptr_t>(ptr);
  auto it = s.reservations.find(base);
  if (it == s.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  if (overlaps_mapping(s, base, size)) return CUDA_ERROR_INVALID_VALUE;  // unmap first
  munmap(reinterpret_cast<void*>(base), size);
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, std::size_t size,
                                     const void* prop, unsigned long long flags) {
  State& s = state();
  REQUIRE_INIT(s);
  ++s.create_calls;
  if (handle == nullptr || prop == nullptr || flags != 0 || size == 0 ||
      size % kGranularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!s.settings.vmm_supported) return CUDA_ERROR_NOT_SUPPORTED;
  MemAllocationProp p;
  std::memcpy(&p, prop, sizeof p);
  if (p.type != 1 || p.location.type != 1) return CUDA_ERROR_INVALID_VALUE;
  const int device = p.location.id;
  if (!valid_device(s, device)) return CUDA_ERROR_INVALID_DEVICE;
  // Asking for GPUDirect RDMA where the device cannot (integrated GPUs) fails the call.
  if (p.allocFlags.gpuDirectRDMACapable != 0 && !s.settings.rdma_vmm) return CUDA_ERROR_INVALID_VALUE;
  if (injected_failure(s.settings.fail_create_countdown)) return s.settings.fail_error;
  if (!has_room(s, device, size)) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUmemGenericAllocationHandle id = s.next_handle++;
  s.handles[id] = Handle{fd, size, device};
  s.handles[id].rdma = p.allocFlags.gpuDirectRDMACapable != 0;
  s.bytes_in_use[device] += size;
  ++s.live_handles[device];
  *handle = id;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  State& s = state();
  REQUIRE_INIT(s);
  auto it = s.handles.find(handle);
  if (it == s.handles.end() || it->second.released) return CUDA_ERROR_INVALID_HANDLE;
  Handle& h = it->second;
  close(h.fd);  // the mappings keep the memory alive
  h.fd = -1;
  h.released = true;
  if (h.mappings == 0) {
    s.bytes_in_use[h.device] -= h.bytes;
    --s.live_handles[h.device];
    s.handles.erase(it);
  }
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemMap(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                                  CUmemGenericAllocationHandle handle,
                                  unsigned long long flags) {
  State& s = state();
  REQUIRE_INIT(s);
  ++s.map_calls;
  if (injected_failure(s.settings.fail_map_countdown)) return s.settings.fail_map_error;
  const auto base = static_cast<std::uintptr_t>(ptr);
  if (flags != 0 || offset != 0 || size == 0 || size % kGranularity != 0 ||
      base % kGranularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  auto it = s.handles.find(handle);
  if (it == s.handles.end() || it->second.released) return CUDA_ERROR_INVALID_HANDLE;
  Handle& h = it->second;
  if (size > h.bytes) return CUDA_ERROR_INVALID_VALUE;
  if (reservation_of(s, base, size) == s.reservations.end()) return CUDA_ERROR_INVALID_VALUE;
  if (overlaps_mapping(s, base, size)) return CUDA_ERROR_INVALID_VALUE;
  // Inaccessible until cuMemSetAccess, as on a GPU.
  void* p = mmap(reinterpret_cast<void*>(base), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h.fd, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.mappings[base] = Mapping{size, handle};
  ++h.mappings;
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemUnmap(CUdeviceptr ptr, std::size_t size) {
  State& s = state();
  REQUIRE_INIT(s);
  ++s.unmap_calls;
  const auto base = static_cast<std::uintptr_t>(ptr);
  const std::uintptr_t end = base + size;
  // The range must consist of whole mappings, one after another.
  auto first = s.mappings.find(base);
  if (size == 0 || first == s.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  auto last = first;
  std::uintptr_t cursor = base;
  while (cursor < end) {
    if (last == s.mappings.end() || last->first != cursor) return CUDA_ERROR_INVALID_VALUE;
    cursor += last->second.bytes;
    ++last;
  }
  if (cursor != end) return CUDA_ERROR_INVALID_VALUE;
  // The driver does not wait for queued work before unmapping: a kernel still running there
  // faults, or reads pages mapped there next.
  if (const Work* w = pending_use(s, base, end)) hazard(s, "cuMemUnmap of", base, end, *w);
  void* p = mmap(reinterpret_cast<void*>(base), size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_INVALID_VALUE;
  for (auto it = first; it != last;) {
    const CUmemGenericAllocationHandle id = it->second.handle;
    it = s.mappings.erase(it);
    drop_mapping_ref(s, id);
  }
  return CUDA_SUCCESS;
}

FAKECUDA_DRIVER CUresult cuMemSetAccess(CUdeviceptr ptr, std::size_t size, const void* desc,
                                        std::size_t count) {
  State& s = state();
  REQUIRE_INIT(s);
  ++s.set_access_calls;
  if (injected_failure(s.settings.fail_access_countdown)) return s.settings.fail_map_error;
  const auto base = static_cast<std::uintptr_t>(ptr);
  if (desc == nullptr || count == 0 || size == 0 || base % page_size() != 0 ||
      size % page_size() != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  int prot = PROT_NONE;
  unsigned long long granted = 0;
  for (std::size_t i = 0; i < count; ++i) {
    MemAccessDesc d;
    std::memcpy(&d, static_cast<const char*>(desc) + i * sizeof d, sizeof d);
    if (d.location.type != 1) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(s, d.location.id)) return CUDA_ERROR_INVALID_DEVICE;
    if (d.flags == 1) prot |= PROT_READ;
    else if (d.flags == 3) prot |= PROT_READ | PROT_WRITE;
    else if (d.flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (d.flags != 0) granted |= 1ULL << d.location.id;
  }
  if (!fully_mapped(s, base, size)) return CUDA_ERROR_INVALID_VALUE;
  if (mprotect(reinterpret_cast<void*>(base), size, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
  auto it = s.mappings.upper_bound(base);
  if (it != s.mappings.begin()) --it;  // the mapping holding base (fully_mapped checked it)
  for (; it != s.mappings.end() && it->first < base + size; ++it) it->second.access = granted;
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------- cuGetProcAddress

FAKECUDA_DRIVER CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version,
                                             unsigned long long flags, int* symbol_status);
FAKECUDA_DRIVER CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version,
                                          unsigned long long flags);

namespace {

struct Entry {
  const char* base_name;  // what callers ask for
  const char* exported;   // the versioned implementation
  void* fn;
};

#define FAKECUDA_ENTRY(base, fn) {base, #fn, reinterpret_cast<void*>(&fn)}

const Entry* find_entry(const char* symbol) {
  static const Entry entries[] = {
      FAKECUDA_ENTRY("cuInit", cuInit),
      FAKECUDA_ENTRY("cuDriverGetVersion", cuDriverGetVersion),
      FAKECUDA_ENTRY("cuDeviceGetCount", cuDeviceGetCount),
      FAKECUDA_ENTRY("cuDeviceGet", cuDeviceGet),
      FAKECUDA_ENTRY("cuDeviceTotalMem", cuDeviceTotalMem_v2),
      FAKECUDA_ENTRY("cuDeviceGetAttribute", cuDeviceGetAttribute),
      FAKECUDA_ENTRY("cuDeviceCanAccessPeer", cuDeviceCanAccessPeer),
      FAKECUDA_ENTRY("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain),
      FAKECUDA_ENTRY("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2),
      FAKECUDA_ENTRY("cuCtxGetCurrent", cuCtxGetCurrent),
      FAKECUDA_ENTRY("cuCtxSetCurrent", cuCtxSetCurrent),
      FAKECUDA_ENTRY("cuCtxGetDevice", cuCtxGetDevice),
      FAKECUDA_ENTRY("cuMemAlloc", cuMemAlloc_v2),
      FAKECUDA_ENTRY("cuMemFree", cuMemFree_v2),
      FAKECUDA_ENTRY("cuMemGetInfo", cuMemGetInfo_v2),
      FAKECUDA_ENTRY("cuEventCreate", cuEventCreate),
      FAKECUDA_ENTRY("cuEventDestroy", cuEventDestroy_v2),
      FAKECUDA_ENTRY("cuEventRecord", cuEventRecord),
      FAKECUDA_ENTRY("cuEventQuery", cuEventQuery),
      FAKECUDA_ENTRY("cuEventSynchronize", cuEventSynchronize),
      FAKECUDA_ENTRY("cuStreamSynchronize", cuStreamSynchronize),
      FAKECUDA_ENTRY("cuStreamGetCtx", cuStreamGetCtx),
      FAKECUDA_ENTRY("cuStreamIsCapturing", cuStreamIsCapturing),
      FAKECUDA_ENTRY("cuCtxSynchronize", cuCtxSynchronize),
      FAKECUDA_ENTRY("cuMemcpyDtoD", cuMemcpyDtoD_v2),
      FAKECUDA_ENTRY("cuGetErrorName", cuGetErrorName),
      FAKECUDA_ENTRY("cuGetErrorString", cuGetErrorString),
      FAKECUDA_ENTRY("cuMemGetAllocationGranularity", cuMemGetAllocationGranularity),
      FAKECUDA_ENTRY("cuMemAddressReserve", cuMemAddressReserve),
      FAKECUDA_ENTRY("cuMemAddressFree", cuMemAddressFree),
      FAKECUDA_ENTRY("cuMemCreate", cuMemCreate),
      FAKECUDA_ENTRY("cuMemRelease", cuMemRelease),
      FAKECUDA_ENTRY("cuMemMap", cuMemMap),
      FAKECUDA_ENTRY("cuMemUnmap", cuMemUnmap),
      FAKECUDA_ENTRY("cuMemSetAccess", cuMemSetAccess),
      FAKECUDA_ENTRY("cuGetProcAddress", cuGetProcAddress_v2),
  };
  for (const Entry& e : entries) {
    if (std::strcmp(symbol, e.base_name) == 0 || std::strcmp(symbol, e.exported) == 0) {
      return &e;
    }
  }
  return nullptr;
}

}  // namespace

FAKECUDA_DRIVER CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version,
                                             unsigned long long flags, int* symbol_status) {
  (void)cuda_version;
  (void)flags;
  // CU_GET_PROC_ADDRESS_SUCCESS = 0, _SYMBOL_NOT_FOUND = 1
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const Entry* e = find_entry(symbol);
  *pfn = e != nullptr ? e->fn : nullptr;
  if (symbol_status != nullptr) *symbol_status = e != nullptr ? 0 : 1;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

FAKECUDA_DRIVER CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version,
                                          unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, nullptr);
}

// ------------------------------------------------------------------------- control API

namespace {

// A counter read, or a setting changed, under the state's lock.
template <class F>
auto locked(F read) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return read(s);
}

// Arms an injected failure: the n-th call from now fails once; n <= 0 disarms.
void arm(int Settings::*countdown, int n) {
  locked([&](State& s) { s.settings.*countdown = n > 0 ? n : 0; });
}

}  // namespace

extern "C" {

void fakecuda_reset(void) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  reset_locked(s);
}

void fakecuda_set_device_count(int n) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.settings.device_count = n < 0 ? 0 : (n > kMaxDevices ? kMaxDevices : n);
}

void fakecuda_set_capacity(size_t bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.settings.capacity = bytes;
}

void fakecuda_fail_alloc_at(int n) { arm(&Settings::fail_alloc_countdown, n); }

void fakecuda_fail_alloc_error(int code) {
  locked([&](State& s) { s.settings.fail_error = code; });
}

void* fakecuda_stream_create(int device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (device < 0 || device >= kMaxDevices) return nullptr;
  auto* stream = reinterpret_cast<CUstream>(s.next_stream);
  s.next_stream += 16;
  s.stream_device[stream] = device;
  return stream;
}

void fakecuda_fail_record_at(int n) { arm(&Settings::fail_record_countdown, n); }

void fakecuda_fail_create_at(int n) { arm(&Settings::fail_create_countdown, n); }

void fakecuda_fail_map_at(int n) { arm(&Settings::fail_map_countdown, n); }

void fakecuda_fail_access_at(int n) { arm(&Settings::fail_access_countdown, n); }

void fakecuda_fail_map_error(int code) {
  locked([&](State& s) { s.settings.fail_map_error = code; });
}

long long fakecuda_create_calls(void) {
  return locked([&](State& s) { return s.create_calls; });
}

long long fakecuda_map_calls(void) {
  return locked([&](State& s) { return s.map_calls; });
}

long long fakecuda_set_access_calls(void) {
  return locked([&](State& s) { return s.set_access_calls; });
}

long long fakecuda_unmap_calls(void) {
  return locked([&](State& s) { return s.unmap_calls; });
}

void fakecuda_set_event_delay(int k) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.settings.event_delay = k > 0 ? k : 0;
}

void fakecuda_set_manual_events(int on) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.settings.manual_events = on != 0;
}

void fakecuda_complete_stream(void* stream) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (CUevent_st* e : s.events) {
    if (e->pending && e->stream == static_cast<CUstream>(stream)) complete(s, e);
  }
  finish_stream(s, static_cast<CUstream>(stream));
}

void fakecuda_set_capturing(void* stream, int on) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (on != 0) {
    s.capturing.insert(static_cast<CUstream>(stream));
  } else {
    s.capturing.erase(static_cast<CUstream>(stream));
  }
}

long long fakecuda_capture_violations(void) {
  return locked([](State& s) { return s.capture_violations; });
}

void fakecuda_complete_all(void) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (CUevent_st* e : s.events) complete(s, e);
  finish_all(s);
}

int fakecuda_launch(void* stream, const void* ptr, size_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto st = static_cast<CUstream>(stream);
  const auto lo = reinterpret_cast<std::uintptr_t>(ptr), hi = lo + size;
  const long long before = s.hazards;
  if (size == 0) return 0;
  if (!device_memory(s, lo, size)) {
    ++s.hazards;
    s.last_hazard = "launch on memory that is not device memory, or not mapped";
    return 1;
  }
  if (const Work* w = pending_use(s, lo, hi, &st)) hazard(s, "launch on", lo, hi, *w);
  s.work.push_back(Work{st, ++s.launched[st], lo, hi});
  return s.hazards != before ? 1 : 0;
}

long long fakecuda_hazards(void) {
  return locked([](State& s) { return s.hazards; });
}

const char* fakecuda_last_hazard(void) {
  // The text lives until the next hazard or reset; tests read it at once.
  return locked([](State& s) { return s.last_hazard.c_str(); });
}

size_t fakecuda_bytes_in_use(int device) {
  return locked([&](State& s) { return device >= 0 && device < kMaxDevices ? s.bytes_in_use[device] : 0; });
}

int fakecuda_live_allocations(int device) {
  return locked([&](State& s) { return device >= 0 && device < kMaxDevices ? s.live_allocations[device] : 0; });
}

long long fakecuda_num_allocs(void) {
  return locked([&](State& s) { return s.num_allocs; });
}

long long fakecuda_ctx_synchronizations(void) {
  return locked([&](State& s) { return s.ctx_synchronizations; });
}

long long fakecuda_bytes_copied(void) {
  return locked([&](State& s) { return s.bytes_copied; });
}

long long fakecuda_num_frees(void) {
  return locked([&](State& s) { return s.num_frees; });
}

int fakecuda_live_events(void) {
  return locked([&](State& s) { return static_cast<int>(s.events.size()); });
}

int fakecuda_pending_events(void) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  int n = 0;
  for (const CUevent_st* e : s.events) n += e->pending ? 1 : 0;
  return n;
}

int fakecuda_live_handles(int device) {
  return locked([&](State& s) { return device >= 0 && device < kMaxDevices ? s.live_handles[device] : 0; });
}

void fakecuda_set_vmm_supported(int on) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.settings.vmm_supported = on != 0;
}

void fakecuda_set_peer_access(int on) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.settings.peer_access = on != 0;
}

int fakecuda_rdma_capable(const void* ptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = s.mappings.upper_bound(addr);
  if (it == s.mappings.begin()) return -1;
  --it;
  if (addr >= it->first + it->second.bytes) return -1;
  auto h = s.handles.find(it->second.handle);
  return h == s.handles.end() ? -1 : (h->second.rdma ? 1 : 0);
}

unsigned long long fakecuda_access_mask(const void* ptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = s.mappings.upper_bound(addr);
  if (it == s.mappings.begin()) return 0;
  --it;
  return addr < it->first + it->second.bytes ? it->second.access : 0;
}

int fakecuda_live_mappings(void) {
  return locked([&](State& s) { return static_cast<int>(s.mappings.size()); });
}

int fakecuda_live_reservations(void) {
  return locked([&](State& s) { return static_cast<int>(s.reservations.size()); });
}

int fakecuda_primary_ctx_refcount(int device) {
  return locked([&](State& s) { return device >= 0 && device < kMaxDevices ? s.ctx_refcount[device] : 0; });
}

int fakecuda_initialized(void) {
  return locked([&](State& s) { return s.initialized ? 1 : 0; });
}

}  // extern "C"
