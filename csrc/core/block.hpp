// Blocks, segments and the ordered free lists the allocator searches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "device.hpp"

namespace pymemplan {

// Owner key of a free block that any stream may take: its last owner's work is known done.
constexpr StreamId kAnyStream = ~StreamId{0};
constexpr StreamId kSeveralStreams = kAnyStream - 1;  // see Segment::freed_by

struct Segment;

// A contiguous range inside one segment: allocated to a caller, or free.
struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // the caller's size while allocated; 0 when free
  std::uint64_t born = 0;     // allocated: the allocator's event count then (long-lived guess)
  // Allocated: the allocation stream. Free: the only stream that may reuse it at once, or
  // kAnyStream once that stream's work is known complete.
  StreamId stream = 0;
  bool allocated = false;
  bool listed = false;                // in its pool's free list
  // Reserved for a plan (holes of pymemplan-planned, CachingAllocator::claim): free, it is
  // listed with the arenas' free blocks, which best fit never searches; allocated, it goes
  // back there when freed. Claimed and unclaimed neighbours never merge.
  bool claimed = false;
  // Covers offsets of a shared page that the page's other address owns (share_pages): never
  // handed out, listed nowhere, shown as inactive. Removed when the sharing ends.
  bool guard = false;
  // Address space of an expandable segment with no pages behind it (torch,
  // expandable_segments): free, listed apart from the blocks best fit searches, and merged
  // only with blocks like it. Mapped when the segment grows into it.
  bool unmapped = false;
  int pending_events = 0;             // freed, but waiting on this many events before reuse
  std::vector<StreamId> stream_uses;  // streams other than `stream` that used it (record_stream)
  std::uint64_t free_seq = 0;         // order in which it became free (for stream drains)
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address neighbours within the segment (never across segments)
  Block* next = nullptr;

  bool is_free() const { return !allocated && pending_events == 0; }
  // A block spanning its whole segment: the segment can go back to the device.
  bool is_whole_segment() const { return prev == nullptr && next == nullptr; }
};

struct Segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  StreamId stream = 0;  // stream it was allocated for
  bool small = false;   // which pool it belongs to
  Block* head = nullptr;
  // Virtual segments (vmm): an address range whose pages are backed on demand. pages[i] is
  // the physical page mapped at addr + i * page size, or 0.
  bool vmm = false;
  std::vector<PageHandle> pages;
  std::size_t mapped = 0;  // pages mapped
  // users[i]: blocks in use (allocated, or freed and waiting on events) that overlap page i;
  // unused_mapped: pages mapped with no user, which reclaiming may give back.
  std::vector<std::uint32_t> users;
  std::size_t unused_mapped = 0;
  // Who may still have work queued on page i (CachingAllocator::page_idle): the stream that
  // freed its last user and the free's sequence number; kAnyStream when nobody may,
  // kSeveralStreams when users were freed on different streams not known done.
  std::vector<StreamId> freed_by;
  std::vector<std::uint64_t> freed_seq;
  // Its pages that are one address of a shared pair (share_pages): a free in a segment with
  // none looks no page up among the pairs.
  std::size_t shared_pages = 0;
  // An expandable segment (torch, expandable_segments): pages are mapped this many bytes
  // at a time, each run aligned to the segment's start; 0 for other segments.
  std::size_t chunk = 0;
  // An arena of plan-guided placement: its free blocks are never searched by best fit;
  // memory in it is handed out only at the offsets a plan names (allocate_at).
  bool arena = false;
};

// Free blocks ordered by (owner stream, size, address): lower_bound on (stream, n, 0) is the
// best fit for a request of n bytes on that stream, in O(log n).
struct BlockBySize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};
using FreeList = std::set<Block*, BlockBySize>;

// Free blocks of arenas, by address: the block under a planned offset in O(log n).
struct BlockByAddress {
  bool operator()(const Block* a, const Block* b) const { return a->addr < b->addr; }
};

}  // namespace pymemplan
