#include "simulated_device.hpp"

#include <algorithm>
#include <string>

#include "../core/errors.hpp"

namespace pymemplan {

namespace {
// Addresses start where a CUDA device's usually do, so snapshots look familiar.
constexpr std::uintptr_t kBaseAddress = std::uintptr_t{0x7f0000000000};
}  // namespace

SimulatedDevice::SimulatedDevice(std::size_t capacity, std::size_t granularity,
                                 bool auto_complete)
    : capacity_(capacity),
      granularity_(granularity),
      auto_complete_(auto_complete),
      next_addr_(kBaseAddress) {
  if (granularity_ == 0 || (granularity_ & (granularity_ - 1)) != 0 || granularity_ < 512) {
    throw AllocatorError("simulated device: granularity " + std::to_string(granularity) +
                         " must be a power of two of at least 512 bytes");
  }
  if (capacity_ == 0) throw AllocatorError("simulated device: capacity must be positive");
  // Policies with virtual memory keep a table entry per page of the device (an arena spans
  // it): past this many pages those tables alone take gigabytes of host memory.
  if (capacity_ / granularity_ > kMaxPages) {
    throw AllocatorError("simulated device: capacity " + std::to_string(capacity) + " bytes is " +
                         std::to_string(capacity_ / granularity_) + " pages of " +
                         std::to_string(granularity) + " bytes; it models at most " +
                         std::to_string(kMaxPages) + " pages (64 TiB of 2 MiB pages), whose "
                         "tables live in host memory: give a smaller capacity or a larger "
                         "granularity");
  }
}

std::size_t SimulatedDevice::footprint(std::size_t bytes) const {
  return (bytes + granularity_ - 1) / granularity_ * granularity_;
}

void* SimulatedDevice::allocate_segment(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes == 0) throw DeviceError("simulated device: allocation of 0 bytes");
  if (fail_next_ > 0) {
    --fail_next_;
    return nullptr;
  }
  const std::size_t fp = footprint(bytes);
  if (fp > capacity_ - used_) return nullptr;
  // Virtual addresses are never reused: a stale pointer can never alias a newer segment.
  const std::uintptr_t addr = next_addr_;
  next_addr_ += fp;
  used_ += fp;
  segments_.emplace(addr, bytes);
  return reinterpret_cast<void*>(addr);
}

void SimulatedDevice::free_segment(void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == segments_.end() || it->second != bytes) {
    throw DeviceError("simulated device: free of " + std::to_string(bytes) +
                      " bytes at an address that is not a live segment of that size");
  }
  used_ -= footprint(bytes);
  segments_.erase(it);
}

void* SimulatedDevice::reserve_address(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes == 0 || bytes % granularity_ != 0) {
    throw DeviceError("simulated device: reservation of " + std::to_string(bytes) +
                      " bytes is not a positive multiple of the granularity");
  }
  const std::uintptr_t addr = next_addr_;
  if (bytes > UINTPTR_MAX - addr) {
    throw DeviceError("simulated device: no address range of " + std::to_string(bytes) +
                      " bytes is left");
  }
  next_addr_ += bytes;
  reservations_.emplace(addr, bytes);
  return reinterpret_cast<void*>(addr);
}

void SimulatedDevice::release_address(void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = reservations_.find(addr);
  if (it == reservations_.end() || it->second != bytes) {
    throw DeviceError("simulated device: release of a range that is not a reservation");
  }
  auto m = mappings_.lower_bound(addr);
  if (m != mappings_.end() && m->first < addr + bytes) {
    throw DeviceError("simulated device: release of a reservation with pages still mapped");
  }
  reservations_.erase(it);
}

PageHandle SimulatedDevice::create_page() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fail_next_ > 0) {
    --fail_next_;
    return 0;
  }
  if (granularity_ > capacity_ - used_) return 0;
  used_ += granularity_;
  const PageHandle h = next_page_++;
  pages_.emplace(h, 0);
  return h;
}

void SimulatedDevice::release_page(PageHandle page) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pages_.find(page);
  if (it == pages_.end()) throw DeviceError("simulated device: release of an unknown page");
  if (it->second != 0) throw DeviceError("simulated device: release of a page still mapped");
  pages_.erase(it);
  used_ -= granularity_;
}

void SimulatedDevice::map_page(void* ptr, PageHandle page) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fail_maps_ > 0) {
    --fail_maps_;
    throw DeviceOutOfMemory("simulated device: no memory left to map a page");
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto p = pages_.find(page);
  if (p == pages_.end()) throw DeviceError("simulated device: map of an unknown page");
  if (addr % granularity_ != 0) throw DeviceError("simulated device: map at an unaligned address");
  auto r = reservations_.upper_bound(addr);
  if (r == reservations_.begin() || (--r, addr + granularity_ > r->first + r->second)) {
    throw DeviceError("simulated device: map outside any reservation");
  }
  if (!mappings_.emplace(addr, page).second) {
    throw DeviceError("simulated device: map over an address already mapped");
  }
  ++p->second;
}

void SimulatedDevice::set_unmap_hook(std::function<void(std::uintptr_t)> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  unmap_hook_ = std::move(hook);
}

void SimulatedDevice::unmap_page(void* ptr) {
  std::function<void(std::uintptr_t)> hook;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    hook = unmap_hook_;
  }
  if (hook) hook(reinterpret_cast<std::uintptr_t>(ptr));  // it may query the device
  std::lock_guard<std::mutex> lock(mutex_);
  auto m = mappings_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (m == mappings_.end()) throw DeviceError("simulated device: unmap of an address not mapped");
  --pages_.at(m->second);
  mappings_.erase(m);
}

void SimulatedDevice::synchronize_device() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::uint64_t until = now_;
  for (auto& [e, s] : events_) {
    if (s.recorded && !s.complete) until = std::max(until, s.due);
    mark_complete(s);
  }
  waited_ += until - now_;
  now_ = until;
  // Every stream's work queued so far is done, streams without events included.
  synced_through_ = ++record_seq_;
  ++device_syncs_;
}

void SimulatedDevice::copy(void* dst, const void* src, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  auto mapped = [&](std::uintptr_t lo) {
    for (std::uintptr_t p = lo / granularity_ * granularity_; p < lo + bytes; p += granularity_) {
      if (mappings_.find(p) == mappings_.end()) return false;
    }
    return true;
  };
  if (bytes == 0 || !mapped(d) || !mapped(s)) {
    throw DeviceError("simulated device: copy of " + std::to_string(bytes) +
                      " bytes touches an address not mapped");
  }
  if (d < s + bytes && s < d + bytes) throw DeviceError("simulated device: copy between overlapping ranges");
  bytes_copied_ += bytes;
}

std::pair<PageHandle, std::size_t> SimulatedDevice::translate(std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto m = mappings_.find(addr / granularity_ * granularity_);
  if (m == mappings_.end()) return {0, 0};
  return {m->second, addr % granularity_};
}

std::uint64_t SimulatedDevice::device_synchronizations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return device_syncs_;
}

std::uint64_t SimulatedDevice::bytes_copied() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_copied_;
}

std::size_t SimulatedDevice::live_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pages_.size();
}

std::size_t SimulatedDevice::mapped_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mappings_.size();
}

std::size_t SimulatedDevice::live_reservations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reservations_.size();
}

SimulatedDevice::EventState& SimulatedDevice::event(EventHandle e, const char* what) {
  auto it = events_.find(e);
  if (it == events_.end()) {
    throw DeviceError(std::string("simulated device: ") + what + " of an unknown event");
  }
  return it->second;
}

EventHandle SimulatedDevice::create_event() {
  std::lock_guard<std::mutex> lock(mutex_);
  EventHandle e = next_event_++;
  events_.emplace(e, EventState{});
  return e;
}

void SimulatedDevice::destroy_event(EventHandle e) {
  std::lock_guard<std::mutex> lock(mutex_);
  event(e, "destroy");
  events_.erase(e);
}

void SimulatedDevice::record_event(EventHandle e, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  EventState& s = event(e, "record");
  s.recorded = true;
  s.complete = false;
  s.stream = stream;
  s.seq = ++record_seq_;
  s.due = now_ + lag_;
}

void SimulatedDevice::mark_complete(EventState& s) {
  if (!s.complete && s.recorded) {
    std::uint64_t& through = done_through_[s.stream];
    if (s.seq > through) through = s.seq;
  }
  s.complete = true;
}

bool SimulatedDevice::query_event(EventHandle e) {
  std::lock_guard<std::mutex> lock(mutex_);
  EventState& s = event(e, "query");
  // Streams run in order: an event is reached once a later one on its stream was.
  if ((auto_complete_ && now_ >= s.due) || (s.recorded && done_through_[s.stream] >= s.seq)) {
    mark_complete(s);
  }
  return s.complete;
}

void SimulatedDevice::synchronize_event(EventHandle e) {
  std::lock_guard<std::mutex> lock(mutex_);
  EventState& s = event(e, "synchronize");
  if (s.recorded && !s.complete && s.due > now_) {  // the host waits for the device
    waited_ += s.due - now_;
    now_ = s.due;
  }
  mark_complete(s);  // waiting on it lets the stream get there
}

void SimulatedDevice::set_lag(std::uint64_t ticks) {
  std::lock_guard<std::mutex> lock(mutex_);
  lag_ = ticks;
}

void SimulatedDevice::advance(std::uint64_t ticks) {
  std::lock_guard<std::mutex> lock(mutex_);
  now_ += ticks;
}

std::uint64_t SimulatedDevice::ticks_waited() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waited_;
}

void SimulatedDevice::set_auto_complete(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto_complete_ = on;
}

void SimulatedDevice::complete_events(StreamId stream, bool all_streams) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [e, s] : events_) {
    if (all_streams || s.stream == stream) mark_complete(s);
  }
}

void SimulatedDevice::fail_next_allocations(int n) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_next_ = n;
}

void SimulatedDevice::fail_next_maps(int n) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_maps_ = n;
}

std::size_t SimulatedDevice::used() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

std::size_t SimulatedDevice::live_segments() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return segments_.size();
}

std::size_t SimulatedDevice::pending_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t n = 0;
  for (const auto& [e, s] : events_) n += s.recorded && !s.complete;
  return n;
}

std::size_t SimulatedDevice::live_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

}  // namespace pymemplan

namespace pymemplan {

std::uint64_t SimulatedDevice::record_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return record_seq_;
}

std::uint64_t SimulatedDevice::completed_through(StreamId stream) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = done_through_.find(stream);
  return std::max(synced_through_, it == done_through_.end() ? 0 : it->second);
}

}  // namespace pymemplan
