// A model of GMLake's allocator (policy "gmlake"), the published virtual-memory stitching
// allocator (Guo et al., ASPLOS 2024; intelligent-machine-learning/glake, GMLake/src/
// CUDACachingAllocator.cpp), so that the benchmarks compare pymemplan with it on the same
// traces. Written from its rules, not its code:
// - Requests of at most 1 MiB go to PyTorch's small pool (2 MiB cudaMalloc segments, best fit,
//   split down to 512 B), as in stock PyTorch.
// - Larger requests are rounded up to whole pages (2 MiB) and served from "primary" blocks:
//   runs of physical pages (one cuMemCreate per page) mapped into an address range of their
//   own, made as stock PyTorch makes large segments (20 MiB for requests under 10 MiB, else
//   the request), best fit among the stream's free blocks, split when 2 MiB or more is left,
//   freed blocks merged with free neighbours of the same segment.
// - Where no free block of the stream is large enough: a cached stitched block whose pages
//   are all free (the smallest one at least as large as the request, if it is at most
//   `reuse_limit` times the request) serves it with its first pages; else, for requests of at
//   least `frag_limit` bytes, the stream's free blocks, largest first, are stitched: their
//   pages mapped again, one after another, into a new address range (the last one split
//   where it overshoots by a page or more). No new physical memory. A freed stitched block
//   stays cached, its pages back in their blocks.
// - Only then new physical memory; when that fails, cached segments wholly free go back to
//   the device (and every stitched block that maps their pages) and the request is retried.
// Reserved memory is the physical pages and small segments; stitched ranges map pages that
// are already counted. GMLake's knobs kept: fragLimit (default 512 MiB: only requests that
// large are stitched) as frag_limit_mb, reuseLimit as reuse_limit. Left out: its reAlloc mode
// (off by default), defragLevel (stitching tried before or after new memory; before by
// default), the garbage collection of stitched address ranges (1000 GiB by default), which
// holds address space only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator_api.hpp"
#include "config.hpp"
#include "locked_allocator.hpp"

namespace pymemplan {

struct GMLakeConfig {
  // Requests of at least this many bytes (rounded) may be stitched (GMLake's fragLimit).
  std::size_t frag_limit = 512 * kMiB;
  // A cached stitched block serves a request only if at most this many times as large.
  double reuse_limit = 10.0;

  // Throws AllocatorError naming a bad key or value and listing the valid keys.
  static GMLakeConfig parse(const std::string& conf);
  std::string to_string() const;
};

class GMLakeAllocator : public LockedAllocator {
 public:
  GMLakeAllocator(std::shared_ptr<Device> device, GMLakeConfig config);
  ~GMLakeAllocator() override;
  GMLakeAllocator(const GMLakeAllocator&) = delete;
  GMLakeAllocator& operator=(const GMLakeAllocator&) = delete;

  void* malloc(std::int64_t size, StreamId stream) override;
  void* try_malloc(std::int64_t size, StreamId stream) override;
  void free(void* ptr) override;
  void record_stream(void* ptr, StreamId stream) override;
  bool owns(const void* ptr) const override;
  void empty_cache() override;
  std::vector<SegmentInfo> snapshot() const override;
  std::string last_error() const override;
  std::size_t round_size(std::size_t size) const override;
  std::string policy_name() const override { return "gmlake"; }
  std::string config_string() const override { return config_.to_string(); }
  std::int64_t reserved_bytes() const override;
  std::string self_check() const override;

 private:
  struct Seg;
  struct Stitch;
  enum class State { Free, Allocated, Pending, Stitched };
  // A run of a segment: handed out, free, waiting on events, or lent to a stitched block.
  struct Blk {
    Seg* seg = nullptr;
    std::size_t off = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    State state = State::Free;
    int pending = 0;
    std::vector<StreamId> uses;  // other streams (record_stream)
  };
  struct Seg {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
    StreamId stream = 0;
    bool small = false;                  // a cudaMalloc segment of the small pool
    std::vector<PageHandle> pages;       // large: one physical page per granule
    std::map<std::size_t, Blk*> blocks;  // by offset, tiling the segment
    std::size_t inactive_n = 0;          // blocks shown inactive (free or lent)
    std::size_t inactive_bytes = 0;
  };
  // A stitched block: the pages of several blocks mapped again into one address range.
  struct Stitch {
    std::uintptr_t addr = 0;
    StreamId stream = 0;
    std::vector<std::pair<Seg*, std::size_t>> pages;  // (segment, page index), in order
    std::vector<Blk*> parts;  // the blocks lent to it while it is in use
    std::size_t used = 0;     // bytes handed out (whole pages); 0 when cached
    std::size_t requested = 0;
    State state = State::Free;
    int pending = 0;
    std::vector<StreamId> uses;
    bool doomed = false;  // a page of it went back to the device: deleted when freed
    std::size_t page = 0;
    std::size_t va = 0;  // bytes of its address range (its pages, until some went back)
    std::size_t size() const { return pages.size() * page; }
    std::size_t cached_size = 0;  // size() while in cached_ (the order's key; a probe's size)
  };
  struct BlkOrder {
    bool operator()(const Blk* a, const Blk* b) const;
  };
  struct StitchOrder {
    bool operator()(const Stitch* a, const Stitch* b) const;
  };
  struct Pending {
    EventHandle event;
    Blk* blk;
    Stitch* stitch;
  };

  void* allocate_locked(std::size_t size, StreamId stream, std::string* oom);
  Blk* best_fit(bool small, std::size_t rounded, StreamId stream);
  void* serve_block(Blk* b, std::size_t rounded, std::size_t size);
  Stitch* reuse_stitch(std::size_t rounded, StreamId stream);
  Stitch* stitch(std::size_t rounded, StreamId stream);
  Blk* new_segment(bool small, std::size_t rounded, StreamId stream);
  void release_cached();
  // Waits for the work queued so far on each stream (cudaStreamSynchronize), before pages
  // freed there are unmapped: unlike cudaFree, cuMemUnmap does not wait.
  void sync_streams(const std::set<StreamId>& streams);
  void release_segment(Seg* seg);
  void delete_stitch(Stitch* s);
  // Frees whose events completed (all of them, waiting, with wait) finish.
  void process_events(bool wait);
  void finish_free_block(Blk* b);
  void finish_free_stitch(Stitch* s);
  // A free block of seg (from spare_ where one is), in no list or map yet.
  Blk* new_blk(Seg* seg, std::size_t off, std::size_t size);
  // Splits b so that [off, off + size) of its segment is a block of its own; returns it.
  Blk* carve(Blk* b, std::size_t off, std::size_t size);
  void set_state(Blk* b, State s);
  void unlist(Blk* b);
  void list(Blk* b);
  void merge_free(Blk* b);
  Blk* neighbour(Blk* b, bool after) const;
  // Keeps inactive_split in step with a segment whose blocks change (before / after).
  void split_stat(const Seg* seg, int sign);
  void stitch_split_stat(const Stitch* s, int sign);
  void update_stat(StatArray Stats::*field, bool small, std::int64_t delta);
  std::size_t large_segment_size(std::size_t rounded) const;
  std::string oom_message(std::size_t size, std::size_t rounded, StreamId stream) const;

  const GMLakeConfig config_;
  const std::size_t page_;
  std::int64_t reserved_ = 0;
  std::string last_error_;
  std::map<std::uintptr_t, std::unique_ptr<Seg>> segs_;
  std::vector<std::unique_ptr<Blk>> blk_store_;  // recycled through spare_
  std::vector<Blk*> spare_;
  std::set<Blk*, BlkOrder> small_free_, large_free_;
  std::map<std::uintptr_t, std::unique_ptr<Stitch>> stitches_;
  std::set<Stitch*, StitchOrder> cached_;  // stitched blocks not in use
  std::unordered_map<std::uintptr_t, Blk*> allocated_;
  std::unordered_map<std::uintptr_t, Stitch*> allocated_stitches_;
  std::vector<Pending> pending_;
};

}  // namespace pymemplan
