// The caching allocator: pages (expandable segments, virtual memory). Rules marked "torch:" model
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
// Expandable segments (a model of PyTorch's expandable_segments:True)

Block* CachingAllocator::expand(Pool& pool, std::size_t rounded, StreamId stream) {
  // torch: find_expandable_block(): the lowest address at which free and unmapped space of
  // this stream's segments of the pool adds up to the request: an unmapped block, taken
  // with the free block before it.
  auto usable = [](const Block* x) { return x != nullptr && x->listed; };
  Block* start = nullptr;
  for (auto& [addr, seg] : segments_) {
    if (seg->chunk == 0 || seg->small != pool.small || seg->stream != stream) continue;
    for (Block* c = seg->head; c != nullptr && start == nullptr; c = c->next) {
      if (!c->unmapped) continue;
      Block* first = usable(c->prev) ? c->prev : c;
      std::size_t room = 0;
      for (Block* x = first; room < rounded && usable(x); x = x->next) room += x->size;
      if (room >= rounded) start = first;
    }
    if (start != nullptr) break;
  }
  if (start == nullptr) {
    // torch: a new segment is address space only, an eighth larger than the device's memory;
    // the small pool maps 2 MiB at a time, the large one 20 MiB (kSmallBuffer, kLargeBuffer).
    const std::size_t page = device_->granularity();
    const std::size_t chunk = round_up(pool.small ? kSmallBuffer : kLargeBuffer, page);
    const std::size_t capacity = device_->capacity();
    const std::size_t bytes = round_up(std::max(capacity + capacity / 8, rounded), chunk);
    void* ptr = device_->reserve_address(bytes);
    Block* b = add_segment(reinterpret_cast<std::uintptr_t>(ptr), bytes, stream, pool.small, true);
    b->segment->chunk = chunk;
    b->segment->pages.assign(bytes / page, 0);
    b->segment->users.assign(bytes / page, 0);
    b->segment->freed_by.assign(bytes / page, kAnyStream);
    b->segment->freed_seq.assign(bytes / page, 0);
    b->unmapped = true;
    insert_free(b);
    start = b;
  }
  // torch: try_allocate_expandable_block(): map the unmapped blocks of the run, in order,
  // until the free block they merge into is large enough.
  Block* b = start->unmapped ? map_chunks(start, std::min(start->size, rounded)) : start;
  while (b != nullptr && b->size < rounded) {
    b = map_chunks(b->next, std::min(rounded - b->size, b->next->size));
  }
  if (b == nullptr) return nullptr;
  erase_free(b);
  return b;
}

Block* CachingAllocator::map_chunks(Block* b, std::size_t bytes) {
  // torch: map_block().
  Segment* seg = b->segment;
  const std::size_t n = std::min(b->size, round_up(bytes, seg->chunk));
  if (!map_pages(seg, b->addr, b->addr + n)) return nullptr;
  erase_free(b);
  if (n < b->size) insert_free(split(b, b->addr + n));  // the rest stays unmapped
  b->unmapped = false;
  b = coalesce(b);
  insert_free(b);
  return b;
}

std::size_t CachingAllocator::unmap_free_chunks() {
  // torch: release_cached_blocks() -> unmap_block(): the whole chunks under free blocks of
  // expandable segments go back; the parts of those blocks outside them stay mapped.
  const std::size_t page = device_->granularity();
  std::size_t released = 0;
  for (auto& [addr, seg] : segments_) {
    if (seg->chunk == 0) continue;
    std::vector<Block*> mapped_free;
    for (Block* b = seg->head; b != nullptr; b = b->next) {
      if (b->listed && !b->unmapped) mapped_free.push_back(b);
    }
    for (Block* b : mapped_free) {
      const std::uintptr_t lo = seg->addr + round_up(b->addr - seg->addr, seg->chunk);
      const std::uintptr_t hi =
          seg->addr + (b->addr + b->size - seg->addr) / seg->chunk * seg->chunk;
      if (lo >= hi) continue;
      // Unmapping does not wait for queued work (cudaFree does): the owner must be done.
      if (b->stream != kAnyStream) {
        synchronize_stream(b->stream);
        ++stats_.num_unmap_waits;
      }
      erase_free(b);
      Block* middle = b;
      if (lo > b->addr) {
        middle = split(b, lo);
        insert_free(b);
      }
      if (hi < middle->addr + middle->size) insert_free(split(middle, hi));
      unmap_mapped(seg, (lo - seg->addr) / page, (hi - seg->addr) / page);
      released += hi - lo;
      middle->unmapped = true;
      insert_free(coalesce(middle));
    }
  }
  return released;
}

// ---------------------------------------------------------------------------------------------
// Virtual memory

Block* CachingAllocator::new_virtual_segment(std::size_t rounded, StreamId stream) {
  const std::size_t page = device_->granularity();
  const std::size_t bytes = round_up(std::max(rounded, config_.vmm_segment), page);
  void* ptr = device_->reserve_address(bytes);
  Block* b = add_segment(reinterpret_cast<std::uintptr_t>(ptr), bytes, stream, false, true);
  b->segment->pages.assign(bytes / page, 0);
  b->segment->users.assign(bytes / page, 0);
  b->segment->freed_by.assign(bytes / page, kAnyStream);
  b->segment->freed_seq.assign(bytes / page, 0);
  return b;
}

bool CachingAllocator::back(Block* b, std::size_t rounded) {
  // Map the pages under [b->addr, b->addr + rounded) that are not mapped yet, following
  // the same ladder as segments: first without raising the peak, then after giving back
  // everything unused. Nothing changes when it fails.
  Segment* seg = b->segment;
  const std::size_t page = device_->granularity();
  const std::uintptr_t lo = b->addr, hi = b->addr + rounded;
  std::size_t missing = 0;
  for (std::size_t i = (lo - seg->addr) / page; i <= (hi - 1 - seg->addr) / page; ++i) {
    missing += seg->pages[i] == 0;
  }
  if (missing == 0) return true;
  const auto need = static_cast<std::int64_t>(missing * page);
  bool mapped = false;
  try {
    if (reserved_ + need > grow_mark_) {
      // ours: unused pages under free blocks, then cached segments, go back before the peak
      // rises. The physical pages unmapped are kept, to be mapped here (no cuMemRelease +
      // cuMemCreate per page moved).
      const auto over = static_cast<std::size_t>(reserved_ + need - grow_mark_);
      const std::size_t got = reclaim_pages(seg, lo, hi, over, true, b);
      if (got < over && config_.release_before_grow) release_cached(over - got);
    }
    mapped = map_pages(seg, lo, hi);
  } catch (...) {
    release_spares();
    throw;
  }
  release_spares();
  if (mapped) return true;
  synchronize_and_free_events();
  reclaim_pages(seg, lo, hi, kNoLimit, false, b);
  release_cached(kNoLimit);
  ++stats_.num_alloc_retries;
  return map_pages(seg, lo, hi);
}

bool CachingAllocator::map_pages(Segment* seg, std::uintptr_t lo, std::uintptr_t hi) {
  // All or nothing: physical pages for every missing page first (a page the device or the
  // limit refuses gives them all back), then each run of consecutive ones mapped in one call.
  const std::size_t page = device_->granularity();
  std::vector<std::size_t> missing;
  for (std::size_t i = (lo - seg->addr) / page; i <= (hi - 1 - seg->addr) / page; ++i) {
    if (seg->pages[i] == 0) missing.push_back(i);
  }
  // Pages a reclaim just unmapped for this (spare_pages_) first: they are held already.
  std::vector<PageHandle> handles;
  while (handles.size() < missing.size() && !spare_pages_.empty()) {
    handles.push_back(spare_pages_.back());
    spare_pages_.pop_back();
  }
  const std::size_t spares = handles.size();
  auto release_all = [&] {
    spare_pages_.insert(spare_pages_.end(), handles.begin(), handles.begin() + static_cast<std::ptrdiff_t>(spares));
    for (std::size_t k = spares; k < handles.size(); ++k) device_->release_page(handles[k]);
  };
  try {
    for (std::size_t k = spares; k < missing.size(); ++k) {
      PageHandle h = 0;
      if (limit_ == 0 || static_cast<std::size_t>(reserved_) + (k - spares + 1) * page <= limit_) {
        h = device_->create_page();
      }
      if (h == 0) {
        release_all();
        return false;
      }
      handles.push_back(h);
    }
  } catch (...) {
    release_all();
    throw;
  }
  auto run_end = [&](std::size_t k) {  // one past the run of consecutive pages from missing[k]
    std::size_t e = k + 1;
    while (e < missing.size() && missing[e] == missing[e - 1] + 1) ++e;
    return e;
  };
  std::size_t mapped = 0;  // missing[0, mapped) are mapped, in whole runs
  auto undo = [&] {
    for (std::size_t k = 0; k < mapped;) {  // the runs mapped before the error
      const std::size_t e = run_end(k);
      device_->unmap_pages(reinterpret_cast<void*>(seg->addr + missing[k] * page), e - k);
      k = e;
    }
    release_all();
  };
  try {
    while (mapped < missing.size()) {
      const std::size_t e = run_end(mapped);
      device_->map_pages(reinterpret_cast<void*>(seg->addr + missing[mapped] * page),
                         &handles[mapped], e - mapped);
      mapped = e;
    }
  } catch (const DeviceOutOfMemory&) {
    // The device had no memory for the mapping itself: as when it has none for a page, the
    // caller's ladder gives cached memory back and tries once more before failing.
    undo();
    return false;
  } catch (...) {
    undo();
    throw;
  }
  for (std::size_t k = 0; k < missing.size(); ++k) {
    const std::size_t i = missing[k];
    seg->pages[i] = handles[k];
    ++seg->mapped;
    if (seg->users[i] == 0) ++seg->unused_mapped;  // its block is counted once taken
    if (k >= spares) {  // a spare is held (and counted) already
      reserved_ += static_cast<std::int64_t>(page);
      update_stat(&Stats::reserved_bytes, seg->small, static_cast<std::int64_t>(page));
    }
    // An expandable segment maps whole chunks, each one cuMemCreate + cuMemMap in torch.
    if (seg->chunk == 0 || i % (seg->chunk / page) == 0) ++stats_.num_device_alloc;
  }
  reserved_hwm_ = std::max(reserved_hwm_, reserved_);
  reserved_hwm_seen_.store(reserved_hwm_, std::memory_order_relaxed);
  window_hwm_ = std::max(window_hwm_, reserved_);
  grow_mark_ = std::max(grow_mark_, reserved_);
  return true;
}

void CachingAllocator::unmap_pages(Segment* seg, std::size_t first, std::size_t n, bool spare) {
  const std::size_t page = device_->granularity();
  device_->unmap_pages(reinterpret_cast<void*>(seg->addr + first * page), n);
  for (std::size_t i = first; i < first + n; ++i) {
    if (spare) {
      spare_pages_.push_back(seg->pages[i]);
    } else {
      device_->release_page(seg->pages[i]);
      reserved_ -= static_cast<std::int64_t>(page);
      update_stat(&Stats::reserved_bytes, seg->small, -static_cast<std::int64_t>(page));
    }
    seg->pages[i] = 0;
    --seg->mapped;
    if (seg->users[i] == 0) --seg->unused_mapped;
    seg->freed_by[i] = kAnyStream;  // a page mapped here later is new
    seg->freed_seq[i] = 0;
    if (seg->chunk == 0 || i % (seg->chunk / page) == 0) ++stats_.num_device_free;
  }
}

void CachingAllocator::release_spares() {
  const std::size_t page = device_->granularity();
  for (PageHandle h : spare_pages_) {
    device_->release_page(h);
    reserved_ -= static_cast<std::int64_t>(page);
    update_stat(&Stats::reserved_bytes, false, -static_cast<std::int64_t>(page));
  }
  spare_pages_.clear();
}

void CachingAllocator::unmap_mapped(Segment* seg, std::size_t from, std::size_t to) {
  for (std::size_t i = from; i < to;) {
    if (seg->pages[i] == 0) {
      ++i;
      continue;
    }
    std::size_t e = i + 1;
    while (e < to && seg->pages[e] != 0) ++e;
    unmap_pages(seg, i, e - i);
    i = e;
  }
}

bool CachingAllocator::count_use(const Block* b, int delta) {
  // On every malloc and free of the pool, over each page of the block: kept to plain loops
  // without branches, which the compiler vectorizes.
  Segment* seg = b->segment;
  if (!seg->vmm) return false;
  const std::size_t page = device_->granularity();
  const std::size_t first = (b->addr - seg->addr) / page;
  const std::size_t n = (b->addr + b->size - 1 - seg->addr) / page + 1 - first;
  std::uint32_t* users = seg->users.data() + first;
  const PageHandle* pages = seg->pages.data() + first;
  std::size_t flipped = 0;  // mapped pages that gained their first user, or lost their last
  if (delta > 0) {
    for (std::size_t k = 0; k < n; ++k) {
      flipped += static_cast<std::size_t>((users[k] == 0) & (pages[k] != 0));
      ++users[k];
    }
    seg->unused_mapped -= flipped;
    return false;
  }
  for (std::size_t k = 0; k < n; ++k) {
    --users[k];
    flipped += static_cast<std::size_t>((users[k] == 0) & (pages[k] != 0));
  }
  seg->unused_mapped += flipped;
  // Work of b's stream on the pages is done once an epoch after this free completes. A guard
  // (kAnyStream) had no work of its own.
  if (b->stream != kAnyStream) {
    StreamId* by = seg->freed_by.data() + first;
    std::uint64_t* seq = seg->freed_seq.data() + first;
    for (std::size_t k = 0; k < n; ++k) {
      const StreamId before = by[k];
      by[k] = before == b->stream || page_idle(seg, first + k) ? b->stream : kSeveralStreams;
      seq[k] = b->free_seq;
    }
  }
  return flipped != 0;
}

bool CachingAllocator::page_idle(const Segment* seg, std::size_t i) const {
  const StreamId s = seg->freed_by[i];
  if (s == kAnyStream) return true;
  if (s == kSeveralStreams) return false;
  return page_idle_through(s, seg->freed_seq[i]);
}

bool CachingAllocator::page_idle_through(StreamId stream, std::uint64_t seq) const {
  auto it = idle_through_.find(stream);
  return it != idle_through_.end() && seq <= it->second;
}

void CachingAllocator::start_epoch(StreamId stream) {
  // One in flight per stream: frees after it wait for the next, recorded once it completes.
  for (const Epoch& e : epochs_) {
    if (e.stream == stream) return;
  }
  EventHandle e = get_event();
  try {
    device_->record_event(e, stream);
  } catch (...) {
    return_event(e);  // without an epoch, unmapping these pages waits for the stream
    return;
  }
  epochs_.push_back({e, stream, free_seq_});
}

void CachingAllocator::poll_epochs() {
  for (std::size_t k = 0; k < epochs_.size();) {
    const Epoch e = epochs_[k];
    if (!device_->query_event(e.event)) {
      ++k;
      continue;
    }
    std::uint64_t& through = idle_through_[e.stream];
    through = std::max(through, e.seq);
    return_event(e.event);
    epochs_[k] = epochs_.back();
    epochs_.pop_back();
    // Pages left unused by frees since it was recorded need the next one.
    if (last_idle_free_[e.stream] > through) start_epoch(e.stream);
  }
}

void CachingAllocator::synchronize_epochs() {
  for (const Epoch& e : epochs_) {
    device_->synchronize_event(e.event);
    std::uint64_t& through = idle_through_[e.stream];
    through = std::max(through, e.seq);
    return_event(e.event);
  }
  epochs_.clear();
}

std::vector<CachingAllocator::Victim> CachingAllocator::pool_victims(
    const Segment* keep, std::uintptr_t keep_lo, std::uintptr_t keep_hi, std::size_t n,
    const Block* extra, const AddressRanges& also_keep) const {
  // Best fit hands out the smallest free block that fits, from its low end: the pages it
  // reaches last, and so the ones to give back first, are the top pages of the largest free
  // blocks. Taken in address order, pages that the next requests mapped again went back (vmm
  // over the 31 traces of alloc_replay: 13,036 driver calls in their last thirds; in this
  // order 3,290, at the same peaks). Before them all, the pages known idle: unmapping those
  // waits for nothing (on a device 64 events behind the host, waits over the last thirds
  // 113 -> 90, for 2% more unmaps).
  // Free blocks are walked from the largest down (ties: the higher address first), merged
  // from each stream's run of the free lists, the claimed blocks of pool segments and
  // `extra`; in each, pages from the top; the walk stops once it has n idle pages. Walking
  // every block of the pool instead, at each page moved, made a random run of 60 steps on
  // 13 GB (alloc_random seed 4) 2.7 times slower per event.
  const std::size_t page = device_->granularity();
  using Rev = FreeList::const_reverse_iterator;
  std::vector<std::pair<Rev, Rev>> runs;
  for (const Pool* pool : {&large_, &small_}) {
    for (Rev it = pool->free.rbegin(); it != pool->free.rend();) {
      Block probe;
      probe.stream = (*it)->stream;
      probe.size = 0;
      probe.addr = 0;
      const Rev end(pool->free.lower_bound(&probe));
      runs.emplace_back(it, end);
      it = end;
    }
  }
  auto later = [](const Block* a, const Block* b) {  // b comes first
    return a->size != b->size ? a->size < b->size : a->addr < b->addr;
  };
  std::vector<const Block*> others;
  if (claimed_blocks_ != 0) {
    for (const Block* b : arena_free_) {
      if (b->claimed && !b->segment->arena) others.push_back(b);
    }
  }
  if (extra != nullptr && !extra->allocated && !extra->listed) others.push_back(extra);
  std::sort(others.begin(), others.end(), [&](const Block* a, const Block* b) { return later(b, a); });
  std::size_t next_other = 0;
  std::vector<Victim> idle, busy;
  while (idle.size() < n) {
    const Block* b = nullptr;
    std::size_t from = runs.size();  // the run it comes from; runs.size(): others
    for (std::size_t r = 0; r < runs.size(); ++r) {
      if (runs[r].first == runs[r].second) continue;
      if (b == nullptr || later(b, *runs[r].first)) {
        b = *runs[r].first;
        from = r;
      }
    }
    if (next_other < others.size() && (b == nullptr || later(b, others[next_other]))) {
      b = others[next_other];
      from = runs.size();
    }
    if (b == nullptr) break;
    if (from == runs.size()) {
      ++next_other;
    } else {
      ++runs[from].first;
    }
    Segment* seg = b->segment;
    if (!seg->vmm || seg->unused_mapped == 0 || seg->arena || seg->chunk != 0) continue;
    const std::size_t first = (b->addr - seg->addr + page - 1) / page;
    std::size_t i = std::min(seg->pages.size(), (b->addr + b->size - seg->addr + page - 1) / page);
    while (i > first && idle.size() < n) {
      --i;
      const std::uintptr_t plo = seg->addr + i * page;
      if (seg->pages[i] == 0 || seg->users[i] != 0) continue;
      if (seg == keep && plo < keep_hi && keep_lo < plo + page) continue;
      if (!also_keep.empty()) {
        // The last range starting below the page's end is the only one that can overlap it
        // (the ranges are sorted and disjoint).
        auto r = std::upper_bound(also_keep.begin(), also_keep.end(), plo + page,
                                  [](std::uintptr_t x, const auto& range) { return x <= range.first; });
        if (r != also_keep.begin() && std::prev(r)->first + std::prev(r)->second > plo) continue;
      }
      Victim v{b->size, plo, seg, page_idle(seg, i)};
      (v.idle ? idle : busy).push_back(v);
    }
  }
  for (std::size_t k = 0; idle.size() < n && k < busy.size(); ++k) idle.push_back(busy[k]);
  return idle;
}

std::size_t CachingAllocator::reclaim_pages(const Segment* keep, std::uintptr_t keep_lo,
                                            std::uintptr_t keep_hi, std::size_t want, bool spare,
                                            const Block* extra, const AddressRanges& also_keep) {
  // Unmaps pages no live block touches (but those under [keep_lo, keep_hi) of `keep`, about
  // to be used) and gives them back to the device, until `want` bytes are reclaimed. The
  // pool's segments go first, arenas last: their free pages will serve the plan again.
  const std::size_t page = device_->granularity();
  std::size_t reclaimed = 0;
  std::vector<Victim> victims;
  poll_epochs();
  for (const bool arenas : {false, true}) {
    if (reclaimed >= want) break;
    const std::size_t short_by = want - reclaimed;  // kNoLimit: every unused page
    const std::size_t needed = short_by / page + (short_by % page != 0);
    if (!arenas) {
      victims = pool_victims(keep, keep_lo, keep_hi, needed, extra, also_keep);
    } else {
      // Arenas, reached only where the pool's pages were not enough: each unused page, in the
      // pool's order.
      victims.clear();
      for (auto& [addr, seg] : segments_) {
        if (!seg->vmm || seg->unused_mapped == 0 || !seg->arena) continue;
        for (const Block* b = seg->head; b != nullptr; b = b->next) {
          if (b->allocated) continue;
          for (std::size_t i = (b->addr - seg->addr + page - 1) / page;
               i < seg->pages.size() && seg->addr + i * page < b->addr + b->size; ++i) {
            const std::uintptr_t plo = seg->addr + i * page;
            if (seg->pages[i] == 0 || seg->users[i] != 0) continue;
            if (seg == keep && plo < keep_hi && keep_lo < plo + page) continue;
            victims.push_back({b->size, plo, seg, page_idle(seg, i)});
          }
        }
      }
      const std::size_t n = std::min(victims.size(), needed);
      std::partial_sort(victims.begin(), victims.begin() + static_cast<std::ptrdiff_t>(n),
                        victims.end(), [](const Victim& a, const Victim& b) {
                          if (a.idle != b.idle) return a.idle;
                          return a.free_block != b.free_block ? a.free_block > b.free_block
                                                              : a.addr > b.addr;
                        });
      victims.resize(n);
    }
    const std::size_t n = victims.size();
    std::sort(victims.begin(), victims.end(),
              [](const Victim& a, const Victim& b) { return a.addr < b.addr; });
    for (std::size_t k = 0; k < victims.size();) {
      Segment* seg = victims[k].seg;
      // Work queued before the frees that left these pages unused may still touch them: the
      // streams not known done are waited for, up to the newest such free (an epoch in flight
      // recorded after it is enough; else the stream's whole queue).
      std::vector<std::pair<StreamId, std::uint64_t>> owners;
      auto wait_for = [&](StreamId s, std::uint64_t seq) {
        auto it = std::find_if(owners.begin(), owners.end(), [&](const auto& o) { return o.first == s; });
        if (it == owners.end()) {
          owners.emplace_back(s, seq);
        } else {
          it->second = std::max(it->second, seq);
        }
      };
      for (std::size_t j = k; j < victims.size() && victims[j].seg == seg; ++j) {
        const std::size_t i = (victims[j].addr - seg->addr) / page;
        if (page_idle(seg, i)) continue;
        if (seg->freed_by[i] != kSeveralStreams) {
          wait_for(seg->freed_by[i], seg->freed_seq[i]);
          continue;
        }
        // Users freed on several streams: every owner of a free block of the segment.
        for (const Block* b = seg->head; b != nullptr; b = b->next) {
          if (b->is_free() && b->stream != kAnyStream) wait_for(b->stream, free_seq_);
        }
      }
      for (const auto& [s, seq] : owners) {
        if (page_idle_through(s, seq)) continue;  // a wait for another stream got there
        auto e = std::find_if(epochs_.begin(), epochs_.end(), [&](const Epoch& x) { return x.stream == s; });
        if (e != epochs_.end() && e->seq >= seq) {
          device_->synchronize_event(e->event);
          poll_epochs();
        } else {
          synchronize_stream(s);
        }
        ++stats_.num_unmap_waits;
      }
      while (k < victims.size() && victims[k].seg == seg) {  // runs of consecutive pages
        std::size_t e = k + 1;
        while (e < victims.size() && victims[e].seg == seg &&
               victims[e].addr == victims[e - 1].addr + page) {
          ++e;
        }
        unmap_pages(seg, (victims[k].addr - seg->addr) / page, e - k, spare);
        k = e;
      }
    }
    reclaimed += n * page;
  }
  return reclaimed;
}

void CachingAllocator::synchronize_stream(StreamId stream) {
  EventHandle e = get_event();
  device_->record_event(e, stream);
  device_->synchronize_event(e);
  return_event(e);
  std::uint64_t& through = idle_through_[stream];
  through = std::max(through, free_seq_);  // everything freed on it so far is done
  poll_epochs();                            // and its epochs are reached
}

}  // namespace pymemplan
