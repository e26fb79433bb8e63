// The caching allocator: placement at fixed offsets (arenas). Rules marked "torch:" model
// c10/cuda/CUDACachingAllocator.cpp; rules marked "ours:" are where pymemplan departs from it.
#include "allocator.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

#include "allocator_internal.hpp"
#include "errors.hpp"

namespace pymemplan {

using namespace allocator_internal;

// ---------------------------------------------------------------------------------------------
// Placement at fixed offsets (arenas of plan-guided placement)

Segment* CachingAllocator::arena_segment(std::uintptr_t arena) const {
  auto it = segments_.find(arena);
  if (it == segments_.end() || !it->second->arena) {
    throw AllocatorError("no arena at " + to_hex(arena) + " (never created, or retired)");
  }
  return it->second;
}

std::uintptr_t CachingAllocator::create_arena(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t page = std::max<std::size_t>(device_->granularity(), 1);
  bytes = round_up(std::max<std::size_t>(bytes, 1), page);
  Block* b;
  if (config_.vmm) {
    b = add_segment(reinterpret_cast<std::uintptr_t>(device_->reserve_address(bytes)), bytes,
                    kAnyStream, false, true);
    b->segment->pages.assign(bytes / page, 0);
    b->segment->users.assign(bytes / page, 0);
    b->segment->freed_by.assign(bytes / page, kAnyStream);
    b->segment->freed_seq.assign(bytes / page, 0);
  } else {
    b = new_segment(large_, bytes, kAnyStream);
    if (b == nullptr) return 0;
  }
  // Fresh memory: no stream has work queued on it, so any may use it.
  b->stream = kAnyStream;
  b->segment->arena = true;
  insert_free(b);
  return b->addr;
}

Block* CachingAllocator::free_run(const Segment* seg, std::uintptr_t lo, std::uintptr_t hi,
                                  StreamId stream, StreamId* foreign) {
  // Arenas' free blocks and claimed ones are listed by address; in the rest of a pool
  // segment (a hole that is not claimed), free blocks are listed by size: walk the segment.
  Block* first = nullptr;
  Block probe;
  probe.addr = lo;
  auto it = arena_free_.upper_bound(&probe);
  if (it != arena_free_.begin()) first = *std::prev(it);
  if (!seg->arena && (first == nullptr || first->segment != seg || first->addr + first->size <= lo)) {
    for (first = seg->head; first != nullptr && first->addr + first->size <= lo;) first = first->next;
  }
  if (first == nullptr || first->segment != seg || first->addr > lo ||
      first->addr + first->size <= lo) {
    return nullptr;
  }
  for (Block* b = first;; b = b->next) {
    // Free neighbours of different owners stay apart, so a range may span several blocks; a
    // range is claimed as a whole or not at all.
    if (b == nullptr || !b->listed || b->claimed != first->claimed) return nullptr;
    if (b->stream != stream && b->stream != kAnyStream) {
      *foreign = b->stream;
      return nullptr;
    }
    if (b->addr + b->size >= hi) return first;
  }
}

void* CachingAllocator::allocate_at(std::uintptr_t arena, std::size_t offset, std::size_t rounded,
                                    std::int64_t requested, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (requested <= 0 || rounded % kMinBlockSize != 0 ||
      rounded < static_cast<std::size_t>(requested)) {
    throw AllocatorError("allocate_at: invalid size " + std::to_string(requested) + " (rounded " +
                         std::to_string(rounded) + ")");
  }
  Segment* seg = arena_segment(arena);
  if (offset % kMinBlockSize != 0 || offset > seg->size || rounded > seg->size - offset) {
    return nullptr;
  }
  return allocate_range(seg, seg->addr + offset, rounded, requested, stream);
}

void* CachingAllocator::allocate_in_hole(std::uintptr_t addr, std::size_t rounded,
                                         std::int64_t requested, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (requested <= 0 || rounded % kMinBlockSize != 0 ||
      rounded < static_cast<std::size_t>(requested)) {
    throw AllocatorError("allocate_in_hole: invalid size " + std::to_string(requested) +
                         " (rounded " + std::to_string(rounded) + ")");
  }
  Segment* seg = addr % kMinBlockSize == 0 ? segment_of(addr) : nullptr;
  if (seg == nullptr || rounded > seg->size - (addr - seg->addr)) {
    return nullptr;
  }
  return allocate_range(seg, addr, rounded, requested, stream);
}

namespace {
// Calls f(segment, block) for each listed free block of the pool's virtual segments (arenas
// excepted), in address order.
template <class F>
void each_free_vmm_block(const std::map<std::uintptr_t, Segment*>& segments, F&& f) {
  for (const auto& [addr, seg] : segments) {
    if (!seg->vmm || seg->arena) continue;
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (b->listed) f(seg, b);
    }
  }
}
}  // namespace

std::vector<std::pair<std::uintptr_t, std::size_t>> CachingAllocator::page_holes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  const std::size_t page = device_->granularity();
  each_free_vmm_block(segments_, [&](const Segment* seg, const Block* b) {
    const std::uintptr_t end = b->addr + b->size;
    auto kept_at = [&](std::uintptr_t x) {
      const std::size_t i = (x - seg->addr) / page;
      return seg->pages[i] != 0 && seg->users[i] != 0;
    };
    if (kept_at(b->addr) && kept_at(end - 1)) {
      // Between two pages kept anyway: a block placed here pays only for the pages inside
      // (unkept_bytes) and gets the free parts at both ends for nothing.
      out.emplace_back(b->addr, b->size);
      return;
    }
    // Otherwise split the free block at the pages no block in use touches (or not mapped).
    std::uintptr_t run = 0;
    for (std::uintptr_t x = b->addr; x < end;) {
      const std::size_t i = (x - seg->addr) / page;
      const std::uintptr_t next = std::min<std::uintptr_t>(end, seg->addr + (i + 1) * page);
      const bool kept = seg->pages[i] != 0 && seg->users[i] != 0;
      if (kept && run == 0) run = x;
      if (!kept && run != 0) {
        out.emplace_back(run, x - run);
        run = 0;
      }
      x = next;
    }
    if (run != 0) out.emplace_back(run, end - run);
  });
  return out;
}

std::size_t CachingAllocator::claim(
    const std::vector<std::pair<std::uintptr_t, std::size_t>>& ranges) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t claimed = 0;
  for (const auto& [lo, n] : ranges) {
    if (n == 0 || lo % kMinBlockSize != 0 || n % kMinBlockSize != 0) continue;
    Segment* seg = segment_of(lo);
    if (seg == nullptr) continue;
    Block* b = seg->head;
    while (b != nullptr && b->addr + b->size <= lo) b = b->next;
    const std::uintptr_t hi = lo + n;
    if (b == nullptr || !b->listed || b->claimed || b->addr > lo || b->addr + b->size < hi) continue;
    b = cut_run(b, lo, hi);
    b->claimed = true;
    ++claimed_blocks_;
    insert_free(b);
    claimed += n;
  }
  return claimed;
}

void CachingAllocator::unclaim_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  unclaim_locked();
}

void CachingAllocator::unclaim_locked() {
  if (claimed_blocks_ == 0) return;
  std::vector<Block*> free_ones;
  for (Block* b : arena_free_) {
    if (b->claimed) free_ones.push_back(b);
  }
  for (Block* b : free_ones) {
    erase_free(b);
    b->claimed = false;
    --claimed_blocks_;
  }
  for (Block* b : free_ones) {
    if (b->segment == nullptr) continue;  // absorbed by a neighbour in this pass
    insert_free(coalesce(b));
  }
  for (auto& [addr, b] : allocated_) {  // in use (or waiting on events): back when freed
    if (b->claimed) {
      b->claimed = false;
      --claimed_blocks_;
    }
  }
}

std::vector<std::pair<std::uintptr_t, std::size_t>> CachingAllocator::page_tails() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  const std::size_t page = device_->granularity();
  each_free_vmm_block(segments_, [&](const Segment* seg, const Block* b) {
    const std::size_t first = (b->addr - seg->addr) / page;
    const std::size_t last = (b->addr + b->size - 1 - seg->addr) / page;
    const bool kept = seg->pages[first] != 0 && seg->users[first] != 0;
    if (!b->claimed && kept && last > first && b->addr % page != 0) out.emplace_back(b->addr, b->size);
  });
  return out;
}

std::size_t CachingAllocator::unkept_bytes(
    const std::vector<std::pair<std::uintptr_t, std::size_t>>& ranges) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t page = device_->granularity();
  std::vector<std::uintptr_t> pages;  // page addresses the ranges touch that are not kept
  for (const auto& [lo, n] : ranges) {
    if (n == 0) continue;
    auto it = segments_.upper_bound(lo);
    if (it == segments_.begin()) continue;
    const Segment* seg = std::prev(it)->second;
    if (!seg->vmm || lo + n > seg->addr + seg->size) continue;
    for (std::size_t i = (lo - seg->addr) / page; i <= (lo + n - 1 - seg->addr) / page; ++i) {
      if (seg->pages[i] == 0 || seg->users[i] == 0) pages.push_back(seg->addr + i * page);
    }
  }
  std::sort(pages.begin(), pages.end());
  return static_cast<std::size_t>(std::unique(pages.begin(), pages.end()) - pages.begin()) * page;
}

void* CachingAllocator::allocate_range(Segment* seg, std::uintptr_t lo, std::size_t rounded,
                                       std::int64_t requested, StreamId stream) {
  process_events();
  const std::uintptr_t hi = lo + rounded;
  Block* b = nullptr;
  for (int attempt = 0; b == nullptr; ++attempt) {
    StreamId foreign = kAnyStream;
    b = free_run(seg, lo, hi, stream, &foreign);
    if (b != nullptr) break;
    // Another stream freed (part of) the range: once its queued work is done, the range is
    // safe for every stream. Ask now; a later request may find it done.
    if (foreign == kAnyStream || !config_.cross_stream_reuse || attempt == 1) return nullptr;
    start_drain(foreign);
    process_events();
  }
  b = cut_run(b, lo, hi);
  if (seg->vmm) {
    bool backed = false;
    try {
      backed = back(b, rounded);
    } catch (...) {
      insert_free(coalesce(b));  // a driver error: the range goes back as it was
      throw;
    }
    if (!backed) {
      insert_free(coalesce(b));
      return nullptr;
    }
  }
  return reinterpret_cast<void*>(take(b, rounded, static_cast<std::size_t>(requested), stream)->addr);
}

void CachingAllocator::retire_arena(std::uintptr_t arena) {
  std::lock_guard<std::mutex> lock(mutex_);
  Segment* seg = arena_segment(arena);
  std::vector<Block*> listed;
  for (Block* b = seg->head; b != nullptr; b = b->next) {
    if (b->listed) listed.push_back(b);
  }
  for (Block* b : listed) erase_free(b);
  seg->arena = false;
  for (Block* b : listed) insert_free(b);
  Block* head = seg->head;
  if (head->is_whole_segment() && head->listed) {
    erase_free(head);
    release_segment(head);
  }
}

std::size_t CachingAllocator::reclaim_arena(std::uintptr_t addr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.find(addr);
  if (it == segments_.end()) return 0;
  Segment* seg = it->second;
  if (seg->arena || !seg->vmm || seg->small || seg->shared_pages != 0) return 0;
  std::vector<Block*> listed;
  for (Block* b = seg->head; b != nullptr; b = b->next) {
    if (!b->is_free() || b->claimed) return 0;
    if (b->listed) listed.push_back(b);
  }
  for (Block* b : listed) erase_free(b);
  seg->arena = true;
  for (Block* b : listed) insert_free(b);
  return seg->size;
}

std::size_t CachingAllocator::arena_mapped(std::uintptr_t arena) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.find(arena);
  if (it == segments_.end() || !it->second->arena) return 0;
  const Segment* seg = it->second;
  return seg->vmm ? seg->mapped * device_->granularity() : seg->size;
}

std::size_t CachingAllocator::arena_busy_bytes(std::uintptr_t arena) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Segment* seg = arena_segment(arena);
  std::size_t bytes = 0;
  for (const Block* b = seg->head; b != nullptr; b = b->next) {
    if (!b->is_free()) bytes += b->size;
  }
  return bytes;
}

bool CachingAllocator::arena_in_use(std::uintptr_t arena) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Segment* seg = arena_segment(arena);
  for (const Block* b = seg->head; b != nullptr; b = b->next) {
    if (!b->is_free()) return true;
  }
  return false;
}

std::size_t CachingAllocator::trim(std::uintptr_t arena, std::size_t arena_keep, std::size_t want,
                                   const AddressRanges& also_keep) {
  std::lock_guard<std::mutex> lock(mutex_);
  process_events();
  const std::int64_t before = reserved_;
  const Segment* keep = nullptr;
  if (arena != 0) keep = arena_segment(arena);
  const std::uintptr_t lo = keep != nullptr ? keep->addr : 0;
  const std::size_t got = reclaim_pages(keep, lo, lo + arena_keep, want, false, nullptr, also_keep);
  if (want == kNoLimit) {
    release_cached(kNoLimit);
  } else if (got < want) {
    release_cached(want - got);
  }
  return static_cast<std::size_t>(before - reserved_);
}

std::optional<std::size_t> CachingAllocator::trimmable_outside(std::uintptr_t arena) {
  std::lock_guard<std::mutex> lock(mutex_);
  process_events();  // as trim does: completed frees leave pages unused
  std::size_t bytes = 0;
  for (const auto& [addr, seg] : segments_) {
    if (!seg->vmm || seg->chunk != 0) return std::nullopt;
    if (addr != arena) bytes += seg->unused_mapped * device_->granularity();
  }
  return bytes;
}

void CachingAllocator::set_grow_mark(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  grow_mark_ = std::max(reserved_, static_cast<std::int64_t>(bytes));
}

std::int64_t CachingAllocator::reserved_high_water() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_hwm_;
}

std::int64_t CachingAllocator::take_window_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::int64_t peak = window_hwm_;
  window_hwm_ = reserved_;
  return peak;
}

}  // namespace pymemplan
