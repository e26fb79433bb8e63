// A device with an address space and a capacity but no memory behind it: an 80 GiB GPU
// costs a few kilobytes of bookkeeping. Events complete when the caller says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "../core/device.hpp"

namespace pymemplan {

class SimulatedDevice : public Device {
 public:
  // The most pages (capacity / granularity) a simulated device may have.
  static constexpr std::size_t kMaxPages = std::size_t{1} << 25;
  // auto_complete: events complete as soon as they are queried (an idle GPU); otherwise they
  // stay pending until complete_events() or a synchronize.
  explicit SimulatedDevice(std::size_t capacity, std::size_t granularity = 2 << 20,
                           bool auto_complete = true);

  std::size_t capacity() const override { return capacity_; }
  std::size_t granularity() const override { return granularity_; }
  void* allocate_segment(std::size_t bytes) override;
  void free_segment(void* ptr, std::size_t bytes) override;
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamId stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;

  // Virtual memory: reservations cost nothing, each page costs granularity() bytes of
  // capacity while it exists, mapped or not.
  bool supports_vmm() const override { return true; }
  void* reserve_address(std::size_t bytes) override;
  void release_address(void* ptr, std::size_t bytes) override;
  PageHandle create_page() override;
  void release_page(PageHandle page) override;
  void map_page(void* addr, PageHandle page) override;
  void unmap_page(void* addr) override;
  // Page sharing: a page may be mapped at several addresses. There is no memory behind the
  // addresses: copy checks that both ranges are mapped and counts the bytes.
  bool supports_page_sharing() const override { return true; }
  void synchronize_device() override;  // completes every recorded event
  void copy(void* dst, const void* src, std::size_t bytes) override;
  // The page mapped at `addr` and the offset of addr in it; (0, 0) where nothing is mapped.
  std::pair<PageHandle, std::size_t> translate(std::uintptr_t addr) const;
  std::uint64_t device_synchronizations() const;
  std::uint64_t bytes_copied() const;
  std::size_t live_pages() const;
  std::size_t mapped_pages() const;
  std::size_t live_reservations() const;

  // Test controls.
  void set_auto_complete(bool on);
  // A device that runs behind the host (with auto_complete): an event completes once the
  // host's clock has advanced `ticks` past its record; synchronizing waits for it, moving the
  // clock there. The replay engine advances the clock by one per trace event. 0: at once.
  void set_lag(std::uint64_t ticks);
  void advance(std::uint64_t ticks = 1);
  std::uint64_t ticks_waited() const;  // clock ticks the host spent waiting in synchronizes
  // Called with the page's address before each unmap_page (a checker's hook; may throw).
  void set_unmap_hook(std::function<void(std::uintptr_t)> hook);
  // Completes every recorded event on `stream` (all streams when all_streams is true).
  void complete_events(StreamId stream, bool all_streams = false);
  // The next `n` segment allocations fail as if the device were full.
  void fail_next_allocations(int n);
  // The next `n` page mappings fail with DeviceOutOfMemory, as cuMemMap or cuMemSetAccess
  // does when the page tables cannot grow.
  void fail_next_maps(int n);
  std::size_t used() const;            // bytes in live segments (with granularity) and pages
  std::size_t live_segments() const;
  std::size_t pending_events() const;  // recorded and not complete
  std::size_t live_events() const;     // created and not destroyed
  // Every record_event gets the next number; completed_through(s) is the highest number of a
  // completed event recorded on stream s (0 if none). Streams run in order, so work queued on
  // s before record number n is done once completed_through(s) >= n.
  std::uint64_t record_count() const;
  std::uint64_t completed_through(StreamId stream) const;

 private:
  struct EventState {
    bool recorded = false;
    bool complete = true;
    StreamId stream = 0;
    std::uint64_t seq = 0;
    std::uint64_t due = 0;  // clock tick at which a lagging device reaches it
  };
  void mark_complete(EventState& s);
  std::size_t footprint(std::size_t bytes) const;
  EventState& event(EventHandle e, const char* what);

  const std::size_t capacity_;
  const std::size_t granularity_;
  bool auto_complete_;
  mutable std::mutex mutex_;
  std::uintptr_t next_addr_;
  std::size_t used_ = 0;
  int fail_next_ = 0;
  int fail_maps_ = 0;
  std::unordered_map<std::uintptr_t, std::size_t> segments_;
  std::map<std::uintptr_t, std::size_t> reservations_;           // address -> bytes
  std::unordered_map<PageHandle, std::size_t> pages_;            // page -> addresses mapping it
  std::map<std::uintptr_t, PageHandle> mappings_;                // address -> page
  PageHandle next_page_ = 1;
  std::unordered_map<EventHandle, EventState> events_;
  EventHandle next_event_ = 1;
  std::uint64_t record_seq_ = 0;
  std::uint64_t synced_through_ = 0;  // record number of the last synchronize_device
  std::uint64_t device_syncs_ = 0;
  std::uint64_t bytes_copied_ = 0;
  std::unordered_map<StreamId, std::uint64_t> done_through_;
  std::uint64_t now_ = 0;
  std::uint64_t lag_ = 0;
  std::uint64_t waited_ = 0;
  std::function<void(std::uintptr_t)> unmap_hook_;
};

}  // namespace pymemplan
