// What every allocator of pymemplan offers its callers (the plugin, the Python module, the
// replay engine): the caching allocator, and allocators composed on top of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device.hpp"
#include "snapshot.hpp"
#include "stats.hpp"

namespace pymemplan {

// A block in use in a layout recorded elsewhere (Allocator::adopt_segment).
struct AdoptedBlock {
  std::size_t offset = 0;      // from the segment's start
  std::size_t size = 0;        // the block's size (rounded, as the recording allocator had it)
  std::int64_t requested = 0;  // bytes the program asked for
};

class Allocator {
 public:
  virtual ~Allocator() = default;

  // Memory for `size` bytes used on `stream`. Throws AllocatorError for size <= 0 and
  // OutOfMemoryError (after the OOM ladder) when it cannot be served.
  virtual void* malloc(std::int64_t size, StreamId stream) = 0;
  // As malloc, but returns nullptr on out-of-memory with the message in last_error().
  virtual void* try_malloc(std::int64_t size, StreamId stream) = 0;
  // Throws AllocatorError for a pointer not handed out by this allocator, or freed already.
  virtual void free(void* ptr) = 0;
  virtual void record_stream(void* ptr, StreamId stream) = 0;
  virtual bool owns(const void* ptr) const = 0;
  // Whether `ptr`, freed, still waits for work queued on other streams (record_stream)
  // before its block can be handed out again: PyTorch's history writes its free_completed
  // only then.
  virtual bool free_pending(const void* ptr) const { (void)ptr; return false; }
  virtual void empty_cache() = 0;

  virtual void set_memory_limit(std::size_t bytes) = 0;  // 0: none
  virtual void set_memory_fraction(double fraction) = 0;
  virtual std::size_t memory_limit() const = 0;

  virtual Stats stats() const = 0;
  virtual void reset_peak_stats() = 0;
  virtual void reset_accumulated_stats() = 0;
  virtual std::vector<SegmentInfo> snapshot() const = 0;
  // The message of the calling thread's last failed request (of any thread's, if it made
  // none).
  virtual std::string last_error() const = 0;
  virtual std::size_t round_size(std::size_t size) const = 0;
  virtual std::string policy_name() const = 0;
  virtual std::string config_string() const = 0;
  // Bytes held from the device now; cheaper than stats() for a caller that polls it.
  virtual std::int64_t reserved_bytes() const = 0;
  // Allocators that serve requests from an offline plan: the ordinal (0-based, counting
  // allocation requests) of the first request a plan served; UINT64_MAX when none did.
  virtual std::uint64_t first_planned_request() const { return ~std::uint64_t{0}; }
  // Seconds spent computing plans (offline packing), for benchmarks that separate the one-off
  // planning cost from the cost of serving requests; 0 for allocators without plans.
  virtual double planning_seconds() const { return 0.0; }
  // Optional hint from the caller: a training step starts here (pymemplan.mark_step()).
  // Allocators that find the repeated step by themselves may use it to plan sooner and to cut
  // the plan at the step boundary; the others ignore it. Never needed for correctness.
  virtual void mark_step() {}
  // Gives back physical pages held by partly used pages, without moving any allocation's
  // address: where two pages' live bytes sit at disjoint offsets, one page's bytes are copied
  // into the other's free offsets and both addresses map that one page. Waits for all work
  // on the device first (no other thread may enqueue work during the call). Returns the
  // bytes given back; 0 where the allocator or the device cannot share pages.
  virtual std::size_t share_pages() { return 0; }
  // Turns off page sharing on the allocator's own initiative (the share_pages key; calls of
  // share_pages() still pair). Returns whether it was on.
  virtual bool stop_automatic_page_sharing() { return false; }
  // Checks the allocator's own indexes against its blocks (tests and the fuzzer): "" when they
  // agree, else what is wrong.
  virtual std::string self_check() const { return ""; }
  // Takes over a segment of a layout recorded elsewhere (a PyTorch snapshot's): `bytes` from
  // the device, in the small pool or the large, with blocks in use at the given offsets and
  // the rest free. Returns the blocks' addresses, in the order given. Throws OutOfMemoryError
  // where the device or the memory limit refuses the segment (nothing changes), and
  // AllocatorError for a layout that is not one, or an allocator whose layouts are not
  // PyTorch's (only the model of PyTorch's allocator without expandable segments takes one).
  virtual std::vector<std::uintptr_t> adopt_segment(std::size_t bytes, bool small, StreamId stream,
                                                    const std::vector<AdoptedBlock>& blocks);
};

// The allocator a policy name stands for ("pymemplan", "torch", "nocache", ...), over
// `device`. Throws AllocatorError naming a bad policy, key or value.
std::unique_ptr<Allocator> make_allocator(std::shared_ptr<Device> device, const std::string& policy,
                                          const std::string& config = "");
// Checks a policy and config as make_allocator would, without a device; returns the full
// effective config string. Throws AllocatorError naming the bad policy, key or value.
std::string validate_config(const std::string& policy, const std::string& config = "");

}  // namespace pymemplan
