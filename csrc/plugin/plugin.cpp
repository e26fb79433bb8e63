// libpymemplan_alloc.so: the C ABI PyTorch's CUDAPluggableAllocator and pymemplan's ctypes
// layer call. Everything C++ stays behind this file: each entry point catches what the
// allocator throws and turns it into a return value and a per-thread last error.
#include "pymemplan_alloc.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>

#include "../core/allocator_api.hpp"
#include "../core/config.hpp"
#include "../core/errors.hpp"
#include "../core/planned.hpp"
#include "../core/util.hpp"
#include "../devices/cuda_device.hpp"

using namespace pymemplan;

namespace {

constexpr int kMaxDevices = 64;

struct PluginConfig {
  std::string policy = "pymemplan";
  std::string config;      // the policy's own keys
  bool raise_on_oom = true;  // oom_action:raise (see pymemplan_alloc.h)
};

// One action of the allocation history (pymemplan_record_history), as PyTorch's
// torch.cuda.memory._record_memory_history() keeps its TraceEntry.
struct HistoryEntry {
  // "alloc", "free_requested", "free_completed", "oom", "segment_alloc", "segment_free",
  // "segment_map", "segment_unmap"
  const char* action;
  std::uintptr_t addr;  // "oom": free device memory (PyTorch's device_free)
  std::int64_t size;    // bytes requested
  std::uintptr_t stream;
  std::int64_t time_us;
};

// A device's history: the last `max` entries (0: not recording).
struct History {
  std::mutex mutex;
  std::size_t max = 0;
  std::deque<HistoryEntry> entries;
  // Held by an allocation or a free, with its entries, while the history is recorded: see
  // InHistoryOrder.
  std::mutex order;
  // Frees written as requested whose blocks still wait on other streams' work (under order).
  std::vector<HistoryEntry> deferred;
};

struct Plugin {
  std::mutex mutex;  // guards creation and configuration; lookups are lock-free
  PluginConfig config;
  std::array<std::atomic<Allocator*>, kMaxDevices> allocators{};
  std::array<std::atomic<CudaDevice*>, kMaxDevices> devices{};  // each allocator's device
  std::atomic<int> allocator_count{0};  // with one, a free names its device
  std::atomic<bool> raise_on_oom{true};
  // Plans for allocators not made yet (pymemplan_stage_plans), per device and for any device:
  // loading them must not make a device's allocator early, which retains a CUDA context.
  std::array<std::string, kMaxDevices> staged_plans;
  std::string staged_plans_any;
  // Allocations in progress per device, and whether two threads were ever seen in them at
  // once (see InFlight).
  std::array<std::atomic<int>, kMaxDevices> in_flight{};
  std::array<std::atomic<bool>, kMaxDevices> threads_overlapped{};
  // The allocation history per device; `recording` is read on every request, the rest only
  // while it is set.
  std::array<std::atomic<bool>, kMaxDevices> recording{};
  std::array<History, kMaxDevices> history;
};

Plugin& plugin() {
  static Plugin* p = new Plugin;  // lives until exit: tensors may be freed during teardown
  return *p;
}

void record(int device, const char* action, std::uintptr_t addr, std::int64_t size,
            std::uintptr_t stream) {
  if (device < 0 || device >= kMaxDevices) return;
  Plugin& p = plugin();
  if (!p.recording[static_cast<std::size_t>(device)].load(std::memory_order_relaxed)) return;
  const auto now = std::chrono::duration_cast<std::chrono::microseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  History& h = p.history[static_cast<std::size_t>(device)];
  std::lock_guard<std::mutex> lock(h.mutex);
  if (h.max == 0) return;
  if (h.entries.size() == h.max) h.entries.pop_front();
  h.entries.push_back({action, addr, size, stream, static_cast<std::int64_t>(now)});
}

// The device's own segments and page mappings, recorded as PyTorch records them
// (segment_alloc and segment_free; segment_map and segment_unmap for virtual memory, one per
// run of pages), so that its viewer can rebuild the segments of any moment of the history
// and `pymemplan explain` knows what was reserved at an out-of-memory error.
class HistoryDevice final : public CudaDevice {
 public:
  using CudaDevice::CudaDevice;
  void* allocate_segment(std::size_t bytes) override {
    void* p = CudaDevice::allocate_segment(bytes);
    if (p != nullptr) note("segment_alloc", p, bytes);
    return p;
  }
  void free_segment(void* ptr, std::size_t bytes) override {
    CudaDevice::free_segment(ptr, bytes);
    note("segment_free", ptr, bytes);
  }
  void map_page(void* addr, PageHandle page) override {
    CudaDevice::map_page(addr, page);
    note("segment_map", addr, granularity());
  }
  void unmap_page(void* addr) override {
    CudaDevice::unmap_page(addr);
    note("segment_unmap", addr, granularity());
  }
  void map_pages(void* addr, const PageHandle* pages, std::size_t n) override {
    CudaDevice::map_pages(addr, pages, n);
    note("segment_map", addr, n * granularity());
  }
  void unmap_pages(void* addr, std::size_t n) override {
    CudaDevice::unmap_pages(addr, n);
    note("segment_unmap", addr, n * granularity());
  }

 private:
  void note(const char* action, void* addr, std::size_t bytes) {
    record(ordinal(), action, reinterpret_cast<std::uintptr_t>(addr), static_cast<std::int64_t>(bytes), 0);
  }
};

// While a device's history is recorded, each allocation and free on it runs with its entries
// one at a time: otherwise a free could be written after another thread was already handed
// the same address, and the history would allocate a live block again (which `pymemplan
// explain` and PyTorch's viewer refuse). Taken before the allocator's own lock, never inside
// it; the cost is paid only while recording.
class InHistoryOrder {
 public:
  explicit InHistoryOrder(int device) : device_(device) {
    if (device < 0 || device >= kMaxDevices) return;
    Plugin& p = plugin();
    if (!p.recording[static_cast<std::size_t>(device)].load(std::memory_order_relaxed)) return;
    lock_ = std::unique_lock<std::mutex>(p.history[static_cast<std::size_t>(device)].order);
  }

  // A free, written as requested, and as completed once its block may be handed out again:
  // at once, or (where it waits on other streams' work) at the first allocation or free
  // that finds it done, before that call's own entry, so that the history never allocates
  // a block again before its free completed.
  void freed(const Allocator& a, std::uintptr_t addr, std::int64_t size, std::uintptr_t stream) {
    record(device_, "free_requested", addr, size, stream);
    if (lock_.owns_lock() && a.free_pending(reinterpret_cast<const void*>(addr))) {
      history().deferred.push_back({"free_completed", addr, size, stream, 0});
    } else {
      record(device_, "free_completed", addr, size, stream);
    }
  }
  void settle(const Allocator& a) {
    if (!lock_.owns_lock()) return;
    auto& deferred = history().deferred;
    for (std::size_t i = 0; i < deferred.size();) {
      const HistoryEntry e = deferred[i];
      if (a.free_pending(reinterpret_cast<const void*>(e.addr))) {
        ++i;
        continue;
      }
      record(device_, e.action, e.addr, e.size, e.stream);
      deferred.erase(deferred.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

 private:
  History& history() { return plugin().history[static_cast<std::size_t>(device_)]; }

  int device_;
  std::unique_lock<std::mutex> lock_;
};

// Never destroyed: frees during thread or process teardown (a tensor held by a thread-local
// or a static) may fail after thread-locals with destructors are gone.
std::string& thread_last_error() {
  thread_local auto* message = new std::string;
  return *message;
}

// A graph replays its kernels on the addresses they had when captured, so memory handed out
// during a capture must stay the graph's; PyTorch gives a pluggable allocator no way to know
// which graph pool is meant (its begin/end-allocate-to-pool hooks are C++ only). Serving from
// the shared pool would let eager tensors take those addresses and be overwritten at replay.
constexpr const char* kCaptureRefused =
    "pymemplan: cannot allocate on a stream that is capturing a CUDA graph (torch.cuda.graph, "
    "torch.compile(mode=\"reduce-overhead\")): a graph needs memory of its own, which a "
    "pluggable allocator cannot give it. Capture graphs without pymemplan (do not enable it in "
    "that process), or compile without CUDA graphs (mode=\"default\" or "
    "\"max-autotune-no-cudagraphs\").";

void set_error(const std::string& message) { thread_last_error() = message; }

// Page sharing on the allocator's own initiative (the OOM ladder's last step, and
// pymemplan-planned's arming) copies live tensors' bytes to another physical page and
// remaps their address. A device synchronize covers the work queued until then, not a
// kernel another host thread launches meanwhile: that one could write a page as it moves.
// A plain PyTorch training loop launches a device's work from one thread at a time (the
// main thread, then autograd's device thread while the main thread waits in backward), so
// it is safe there. Two threads allocating at once on one device are the sign of a program
// that is not like that: automatic sharing is turned off for good, once. Frees do not
// count: a thread that only frees (NCCL's watchdog releasing the tensors a collective kept)
// launches no work.
Allocator* existing_allocator(int device);

void threads_overlap(int device) {
  Plugin& p = plugin();
  if (p.threads_overlapped[static_cast<std::size_t>(device)].exchange(true)) return;
  Allocator* a = existing_allocator(device);
  if (a != nullptr && a->stop_automatic_page_sharing()) {
    std::fprintf(stderr,
                 "pymemplan: two threads allocate on device %d at once; automatic page sharing "
                 "(share_pages) is now off on it, since it moves tensors' bytes and another "
                 "thread could launch work on them meanwhile. Set share_pages:False to keep "
                 "this message away.\n",
                 device);
  }
}

// Marks an allocation in progress on a device.
class InFlight {
 public:
  explicit InFlight(int device) : device_(device) {
    if (device_ < 0 || device_ >= kMaxDevices) return;
    if (plugin().in_flight[static_cast<std::size_t>(device_)].fetch_add(1) > 0) threads_overlap(device_);
  }
  ~InFlight() {
    if (device_ >= 0 && device_ < kMaxDevices) plugin().in_flight[static_cast<std::size_t>(device_)].fetch_sub(1);
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  int device_;
};

// Splits plugin keys (oom_action) from the policy's keys and validates both.
PluginConfig parse_plugin_config(const std::string& policy, const std::string& conf) {
  PluginConfig out;
  out.policy = policy;
  std::string rest;
  for (const std::string& item : split_config_items(conf)) {
    const auto colon = item.find(':');
    std::string key = item.substr(0, colon);
    key.erase(0, key.find_first_not_of(" \t"));
    key.erase(key.find_last_not_of(" \t") + 1);
    if (key == "oom_action") {
      std::string value = colon == std::string::npos ? "" : item.substr(colon + 1);
      value.erase(0, value.find_first_not_of(" \t"));
      value.erase(value.find_last_not_of(" \t") + 1);
      if (value != "raise" && value != "null") {
        throw AllocatorError("allocator config: bad value '" + value +
                             "' for 'oom_action': expected raise or null");
      }
      out.raise_on_oom = value == "raise";
    } else if (!item.empty()) {
      rest += rest.empty() ? item : "," + item;
    }
  }
  try {
    validate_config(policy, rest);  // throws with the policy's valid keys listed
  } catch (const AllocatorError& e) {
    throw AllocatorError(std::string(e.what()) + "; plugin key: oom_action (raise or null)");
  }
  out.config = rest;
  return out;
}

Allocator& allocator_for(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw DeviceError("invalid CUDA device index " + std::to_string(device));
  }
  Plugin& p = plugin();
  Allocator* a = p.allocators[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
  if (a != nullptr) return *a;
  std::lock_guard<std::mutex> lock(p.mutex);
  a = p.allocators[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  if (a == nullptr) {
    auto cuda = std::make_shared<HistoryDevice>(device);
    CudaDevice* dev = cuda.get();
    a = make_allocator(std::move(cuda), p.config.policy, p.config.config)
            .release();  // owned by the plugin until exit, and its device with it
    // Published once the allocator exists: a failed creation leaves no pointer to a device
    // that is gone.
    p.devices[static_cast<std::size_t>(device)].store(dev, std::memory_order_release);
    const std::string& staged = p.staged_plans[static_cast<std::size_t>(device)];
    const std::string& text = staged.empty() ? p.staged_plans_any : staged;
    if (auto* planned = dynamic_cast<PlannedAllocator*>(a); planned != nullptr && !text.empty()) {
      // Checked when staged; plans are only a head start, so a failure here (text staged
      // without pymemplan's checks) is reported and the allocator serves without them.
      try {
        planned->import_plans(text);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "pymemplan: the plans staged for device %d were not loaded: %s\n", device,
                     e.what());
      }
    }
    p.allocators[static_cast<std::size_t>(device)].store(a, std::memory_order_release);
    p.allocator_count.fetch_add(1, std::memory_order_release);
  }
  return *a;
}

Allocator* existing_allocator(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return plugin().allocators[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

// A device index a caller names: -1 (every device) where `every` allows it, else one the
// driver has. A device with an allocator exists; another is checked against the driver,
// where it loads (without one there is no allocator to act on).
void check_device(int device, bool every) {
  if (every && device == -1) return;
  if (device < 0 || device >= kMaxDevices) {
    throw DeviceError("invalid CUDA device index " + std::to_string(device));
  }
  if (existing_allocator(device) != nullptr) return;
  int count = 0;
  try {
    const cuda::Driver& d = cuda::Driver::get();
    d.check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
  } catch (const DeviceError&) {
    return;
  }
  if (device >= count) {
    throw DeviceError("CUDA device " + std::to_string(device) + " does not exist (the driver reports " +
                      std::to_string(count) + " device" + (count == 1 ? "" : "s") + ")");
  }
}

PlannedAllocator& planned(Allocator& a, const char* what) {
  auto* p = dynamic_cast<PlannedAllocator*>(&a);
  if (p == nullptr) {
    throw AllocatorError(std::string(what) + ": policy " + a.policy_name() +
                         " has no plans; enable pymemplan with policy 'pymemplan-planned'");
  }
  return *p;
}

// Runs f, turning any exception into -1 and the last error.
template <typename F>
int guarded(F f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    set_error(e.what());
  } catch (...) {
    set_error("unknown error");
  }
  return -1;
}

long write_out(const std::string& s, char* buf, std::size_t len) {
  if (buf != nullptr && len > s.size()) {
    std::memcpy(buf, s.data(), s.size());
    buf[s.size()] = '\0';
  }
  return static_cast<long>(s.size());
}

std::string stats_json(const Stats& s) {
  std::ostringstream out;
  out << '{';
  bool first = true;
  for (const auto& [key, value] : s.items()) {
    out << (first ? "" : ",") << '"' << key << "\":" << value;
    first = false;
  }
  out << '}';
  return out.str();
}

std::string snapshot_json(const std::vector<SegmentInfo>& segments, int device,
                          const std::string& policy) {
  std::ostringstream out;
  // The policy as a replay names it ("pymemplan-vmm=key:value,..."): no quote or backslash
  // can be in it (config values are validated).
  out << "{\"policy\":\"" << policy << "\",\"segments\":[";
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const SegmentInfo& s = segments[i];
    out << (i ? "," : "") << "{\"device\":" << device << ",\"address\":" << s.address
        << ",\"total_size\":" << s.total_size << ",\"allocated_size\":" << s.allocated_size
        << ",\"active_size\":" << s.active_size << ",\"requested_size\":" << s.requested_size
        << ",\"stream\":" << s.stream << ",\"segment_type\":\"" << s.segment_type
        << "\",\"segment_pool_id\":[0,0],\"is_expandable\":" << (s.is_virtual ? "true" : "false")
        << ",\"mapped_size\":" << s.mapped_size;
    if (s.is_virtual) {
      // Which pages hold memory, as the Python module's snapshots say it: what
      // `pymemplan explain` counts (a virtual segment's total_size is address space).
      auto flags = [&out](const char* key, const std::vector<bool>& v) {
        out << ",\"" << key << "\":[";
        for (std::size_t k = 0; k < v.size(); ++k) out << (k ? "," : "") << (v[k] ? "true" : "false");
        out << ']';
      };
      out << ",\"page_size\":" << s.page_size << ",\"chunk_size\":" << s.chunk_size
          << ",\"torch_expandable\":" << (s.torch_expandable ? "true" : "false");
      flags("page_mapped", s.page_mapped);
      flags("page_aliased", s.page_aliased);
    }
    out << ",\"frames\":[],\"blocks\":[";
    for (std::size_t j = 0; j < s.blocks.size(); ++j) {
      const BlockInfo& b = s.blocks[j];
      out << (j ? "," : "") << "{\"address\":" << b.address << ",\"size\":" << b.size
          << ",\"requested_size\":" << b.requested_size << ",\"state\":\"" << b.state
          << "\",\"frames\":[]}";
    }
    out << "]}";
  }
  out << "]}";
  return out.str();
}

constexpr const char* kTorchOomWords = " (PyTorch's words: CUDA out of memory.)";

}  // namespace

extern "C" {

void* pymemplan_try_alloc(ssize_t size, int device, pymemplan_stream_t stream) {
  if (size == 0) return nullptr;  // as PyTorch's own allocator: empty tensors own no memory
  try {
    Allocator& a = allocator_for(device);
    InFlight in_flight(device);
    InHistoryOrder in_order(device);
    if (plugin().devices[static_cast<std::size_t>(device)].load(std::memory_order_acquire)
            ->stream_capturing(reinterpret_cast<StreamId>(stream))) {
      set_error(kCaptureRefused);
      return nullptr;
    }
    void* p = a.try_malloc(static_cast<std::int64_t>(size), reinterpret_cast<StreamId>(stream));
    in_order.settle(a);
    const auto s = reinterpret_cast<std::uintptr_t>(stream);
    if (p != nullptr) {
      record(device, "alloc", reinterpret_cast<std::uintptr_t>(p), size, s);
    } else {
      // PyTorch's words too: batch-size finders (Accelerate's find_executable_batch_size,
      // Lightning's tuner) tell an OOM from other RuntimeErrors by them.
      set_error(allocator_for(device).last_error() + kTorchOomWords);
      // What the driver reports free, as PyTorch's device_free: the CUDA context, NCCL's
      // buffers and other processes hold memory this allocator does not.
      record(device, "oom",
             plugin().devices[static_cast<std::size_t>(device)].load(std::memory_order_acquire)->free_memory(),
             size, s);
    }
    return p;
  } catch (const std::exception& e) {
    set_error(std::string("pymemplan: allocation failed: ") + e.what());
  } catch (...) {
    set_error("pymemplan: allocation failed");
  }
  return nullptr;
}

void* pymemplan_alloc(ssize_t size, int device, pymemplan_stream_t stream) {
  void* p = pymemplan_try_alloc(size, device, stream);
  if (p == nullptr && size != 0 && plugin().raise_on_oom.load(std::memory_order_relaxed)) {
    // Deliberately the one exception that leaves this library: PyTorch would otherwise wrap
    // NULL in a tensor without an error. Its Python bindings turn this into a RuntimeError.
    throw std::runtime_error(thread_last_error());
  }
  return p;
}

void pymemplan_free(void* ptr, ssize_t size, int device, pymemplan_stream_t stream) {
  if (ptr == nullptr) return;
  const int rc = guarded([&] {
    // PyTorch names the device the tensor was made on; a block of another device (a caller's
    // mistake) is found where it is, without making an allocator for the device named.
    // Where no allocator owns it, the named device's says what is wrong (inside a block,
    // freed already). With one allocator in the process (one GPU), nothing to look up.
    Allocator* a = existing_allocator(device);
    if (a == nullptr ||
        (plugin().allocator_count.load(std::memory_order_acquire) > 1 && !a->owns(ptr))) {
      for (int d = 0; d < kMaxDevices; ++d) {
        Allocator* other = existing_allocator(d);
        if (d != device && other != nullptr && other->owns(ptr)) {
          a = other, device = d;
          break;
        }
      }
    }
    if (a == nullptr) {
      throw AllocatorError("free of pointer " + to_hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                           " that pymemplan did not allocate (device " + std::to_string(device) + ")");
    }
    InHistoryOrder in_order(device);
    a->free(ptr);
    in_order.settle(*a);
    // As PyTorch writes them: its viewer pairs an allocation with its free_requested.
    in_order.freed(*a, reinterpret_cast<std::uintptr_t>(ptr), size, reinterpret_cast<std::uintptr_t>(stream));
  });
  // Nobody can receive an error from a deleter; say it where a user will see it.
  if (rc != 0) std::fprintf(stderr, "pymemplan: %s\n", thread_last_error().c_str());
}

void pymemplan_init(int) {}  // allocators are created per device on first use

void pymemplan_reset(void) { pymemplan_empty_cache(-1); }

void pymemplan_memory_fraction(double fraction, int device) {
  if (guarded([&] { allocator_for(device).set_memory_fraction(fraction); }) != 0) {
    std::fprintf(stderr, "pymemplan: %s\n", thread_last_error().c_str());
  }
}

void pymemplan_record_stream(void* ptr, pymemplan_stream_t stream) {
  const int rc = guarded([&] {
    for (int d = 0; d < kMaxDevices; ++d) {
      Allocator* a = existing_allocator(d);
      if (a != nullptr && a->owns(ptr)) {
        a->record_stream(ptr, reinterpret_cast<StreamId>(stream));
        return;
      }
    }
    throw AllocatorError("record_stream: pointer was not allocated by pymemplan");
  });
  if (rc != 0) std::fprintf(stderr, "pymemplan: %s\n", thread_last_error().c_str());
}

void* pymemplan_base_alloc(void* ptr, std::size_t* size) {
  void* base = nullptr;
  const int rc = guarded([&] {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    for (int d = 0; d < kMaxDevices; ++d) {
      Allocator* a = existing_allocator(d);
      if (a == nullptr || !a->owns(ptr)) continue;
      for (const SegmentInfo& seg : a->snapshot()) {
        if (p < seg.address || p >= seg.address + seg.total_size) continue;
        if (seg.is_virtual) {
          // Its pages are cuMemCreate memory, which cudaIpcGetMemHandle cannot export.
          throw AllocatorError(
              "tensors in virtual-memory segments (policies pymemplan-vmm and "
              "pymemplan-planned) cannot be shared between processes through CUDA IPC, as "
              "PyTorch's expandable segments cannot; use the policy 'pymemplan' in the "
              "processes that share CUDA tensors");
        }
        base = reinterpret_cast<void*>(seg.address);
        if (size != nullptr) *size = seg.total_size;
        return;
      }
    }
    throw AllocatorError("base allocation: pointer " + to_hex(p) + " was not allocated by pymemplan");
  });
  // PyTorch takes the answer for an exportable allocation; a wrong one would share other
  // memory, so failing is the one safe answer, and PyTorch turns it into a RuntimeError.
  if (rc != 0) throw std::runtime_error("pymemplan: " + thread_last_error());
  return base;
}

int pymemplan_configure(const char* policy, const char* config) {
  return guarded([&] {
    PluginConfig c = parse_plugin_config(policy ? policy : "pymemplan", config ? config : "");
    Plugin& p = plugin();
    std::lock_guard<std::mutex> lock(p.mutex);
    for (auto& a : p.allocators) {
      if (a.load() != nullptr && (c.policy != p.config.policy || c.config != p.config.config)) {
        throw AllocatorError("the allocator is already in use with policy '" + p.config.policy +
                             "' and config '" + p.config.config +
                             "'; configure it before the first CUDA allocation");
      }
    }
    p.config = c;
    p.raise_on_oom.store(c.raise_on_oom);
  });
}

long pymemplan_stats_json(int device, char* buf, std::size_t len) {
  long n = -1;
  guarded([&] {
    if (device < 0 || device >= kMaxDevices) throw DeviceError("invalid device " + std::to_string(device));
    Allocator* a = existing_allocator(device);
    n = write_out(stats_json(a != nullptr ? a->stats() : Stats{}), buf, len);
  });
  return n;
}

long pymemplan_snapshot_json(int device, char* buf, std::size_t len) {
  long n = -1;
  guarded([&] {
    if (device < 0 || device >= kMaxDevices) throw DeviceError("invalid device " + std::to_string(device));
    Allocator* a = existing_allocator(device);
    std::string policy;
    if (a != nullptr) {
      policy = a->policy_name() + "=" + a->config_string();
    } else {
      std::lock_guard<std::mutex> lock(plugin().mutex);
      policy = plugin().config.policy + "=" + plugin().config.config;
    }
    n = write_out(snapshot_json(a != nullptr ? a->snapshot() : std::vector<SegmentInfo>{}, device,
                                policy),
                  buf, len);
  });
  return n;
}

int pymemplan_reset_peak_stats(int device) {
  return guarded([&] {
    check_device(device, false);
    if (Allocator* a = existing_allocator(device)) a->reset_peak_stats();
  });
}

int pymemplan_reset_accumulated_stats(int device) {
  return guarded([&] {
    check_device(device, false);
    if (Allocator* a = existing_allocator(device)) a->reset_accumulated_stats();
  });
}

int pymemplan_set_memory_limit(int device, std::size_t bytes) {
  return guarded([&] { allocator_for(device).set_memory_limit(bytes); });
}

int pymemplan_empty_cache(int device) {
  return guarded([&] {
    check_device(device, true);
    for (int d = 0; d < kMaxDevices; ++d) {
      if (device >= 0 && d != device) continue;
      if (Allocator* a = existing_allocator(d)) {
        InHistoryOrder in_order(d);
        a->empty_cache();  // waits for the events pending frees wait on
        in_order.settle(*a);
      }
    }
  });
}

int pymemplan_mark_step(int device) {
  return guarded([&] {
    check_device(device, true);
    for (int d = 0; d < kMaxDevices; ++d) {
      if (device >= 0 && d != device) continue;
      if (Allocator* a = existing_allocator(d)) a->mark_step();
    }
  });
}

int pymemplan_share_pages(int device, std::size_t* given_back) {
  std::size_t total = 0;
  const int rc = guarded([&] {
    check_device(device, true);
    for (int d = 0; d < kMaxDevices; ++d) {
      if (device >= 0 && d != device) continue;
      if (Allocator* a = existing_allocator(d)) total += a->share_pages();
    }
  });
  if (given_back != nullptr) *given_back = total;
  return rc;
}

long pymemplan_export_plans(int device, char* buf, std::size_t len) {
  long n = -1;
  guarded([&] {
    if (device < 0 || device >= kMaxDevices) throw DeviceError("invalid device " + std::to_string(device));
    Allocator* a = existing_allocator(device);
    if (a == nullptr) {
      throw AllocatorError("export_plans: nothing was allocated on device " + std::to_string(device) +
                           " yet, so there are no plans");
    }
    n = write_out(planned(*a, "export_plans").export_plans(), buf, len);
  });
  return n;
}

int pymemplan_import_plans(int device, const char* text, std::size_t* added) {
  std::size_t n = 0;
  const int rc = guarded([&] {
    if (text == nullptr) throw AllocatorError("import_plans: no text");
    n = planned(allocator_for(device), "import_plans").import_plans(text);
  });
  if (added != nullptr) *added = n;
  return rc;
}

int pymemplan_stage_plans(int device, const char* text) {
  return guarded([&] {
    if (text == nullptr) throw AllocatorError("stage_plans: no text");
    if (device < -1 || device >= kMaxDevices) throw DeviceError("invalid device " + std::to_string(device));
    Plugin& p = plugin();
    std::lock_guard<std::mutex> lock(p.mutex);
    if (p.config.policy != "pymemplan-planned") {
      throw AllocatorError("stage_plans: policy " + p.config.policy +
                           " has no plans; enable pymemplan with policy 'pymemplan-planned'");
    }
    // Allocators made already take them now; the others when they are made.
    for (int d = 0; d < kMaxDevices; ++d) {
      if (device != -1 && d != device) continue;
      if (Allocator* a = existing_allocator(d)) planned(*a, "stage_plans").import_plans(text);
    }
    (device == -1 ? p.staged_plans_any : p.staged_plans[static_cast<std::size_t>(device)]) = text;
  });
}

const char* pymemplan_last_error(void) { return thread_last_error().c_str(); }

int pymemplan_record_history(int device, size_t max_entries) {
  return guarded([&] {
    if (device < -1 || device >= kMaxDevices) {
      throw DeviceError("invalid CUDA device index " + std::to_string(device));
    }
    Plugin& p = plugin();
    for (int d = device < 0 ? 0 : device; d < (device < 0 ? kMaxDevices : device + 1); ++d) {
      History& h = p.history[static_cast<std::size_t>(d)];
      std::lock_guard<std::mutex> order(h.order);
      if (max_entries == 0) h.deferred.clear();
      std::lock_guard<std::mutex> lock(h.mutex);
      h.max = max_entries;
      if (max_entries == 0) h.entries.clear();
      while (h.entries.size() > max_entries) h.entries.pop_front();
      p.recording[static_cast<std::size_t>(d)].store(max_entries != 0, std::memory_order_relaxed);
    }
  });
}

long pymemplan_history_json(int device, char* buf, size_t len) {
  long n = -1;
  guarded([&] {
    if (device < 0 || device >= kMaxDevices) {
      throw DeviceError("invalid CUDA device index " + std::to_string(device));
    }
    History& h = plugin().history[static_cast<std::size_t>(device)];
    std::ostringstream out;
    {
      std::lock_guard<std::mutex> lock(h.mutex);
      out << '[';
      bool first = true;
      for (const HistoryEntry& e : h.entries) {
        const bool oom = std::strcmp(e.action, "oom") == 0;
        out << (first ? "" : ",") << "{\"action\":\"" << e.action << "\",\""
            << (oom ? "device_free" : "addr") << "\":" << e.addr << ",\"size\":" << e.size
            << ",\"stream\":" << e.stream << ",\"time_us\":" << e.time_us << ",\"frames\":[]}";
        first = false;
      }
      out << ']';
    }
    n = write_out(out.str(), buf, len);
  });
  return n;
}

int pymemplan_device_count(void) {
  int count = -1;
  guarded([&] {
    const cuda::Driver& d = cuda::Driver::get();
    d.check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
  });
  return count;
}

}  // extern "C"
