// The caching allocator. Rules marked "torch:" model c10/cuda/CUDACachingAllocator.cpp
// (DeviceCachingAllocator); rules marked "ours:" are where pymemplan departs from it.
#include "allocator.hpp"

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <sstream>

#include "allocator_internal.hpp"
#include "errors.hpp"

namespace pymemplan {

using namespace allocator_internal;

namespace {

bool is_pow2(std::size_t n) { return n && !(n & (n - 1)); }

std::size_t pow2_floor(std::size_t n) {
  std::size_t p = 1;
  while (p <= n / 2) p <<= 1;
  return p;
}

// torch: roundup_power2_next_division(): split [2^k, 2^(k+1)) into `divisions` equal steps.
std::size_t roundup_power2_next_division(std::size_t size, std::size_t divisions) {
  if (is_pow2(size)) return size;
  std::size_t floor = pow2_floor(size);
  std::size_t step = floor / divisions;
  if (step == 0) return floor << 1;
  std::size_t rounded_floor = size & ~(step - 1);
  return rounded_floor == size ? size : rounded_floor + step;
}


// The message of the last failed request, per thread and allocator: a caller that reads it
// after its own try_malloc failed gets its own message, never that of a request another
// thread made meanwhile (the plugin reads it outside the allocator's lock). Keyed by an id
// no later allocator reuses, as its address could be.
std::unordered_map<std::uint64_t, std::string>& thread_errors() {
  // Never destroyed: a tensor freed while a thread or the process exits may fail after
  // thread-locals with destructors are gone (one small map per thread that ever failed).
  thread_local auto* errors = new std::unordered_map<std::uint64_t, std::string>;
  return *errors;
}
std::atomic<std::uint64_t> next_allocator_id{1};
}  // namespace

CachingAllocator::CachingAllocator(std::shared_ptr<Device> device, PolicyConfig config)
    : LockedAllocator(std::move(device)), config_(config) {
  if (!device_) throw AllocatorError("CachingAllocator needs a device");
  if (config_.vmm && !device_->supports_vmm()) {
    throw AllocatorError("policy config asks for vmm, but this device has no virtual memory "
                         "support; use policy 'pymemplan' or vmm:False");
  }
  if (config_.expandable_segments && !device_->supports_vmm()) {
    throw AllocatorError("policy config asks for expandable_segments, but this device has no "
                         "virtual memory support; use expandable_segments:False");
  }
  small_.small = true;
  stats_.max_split_size = config_.max_split_size == kNoLimit
                              ? -1
                              : static_cast<std::int64_t>(config_.max_split_size);
}

CachingAllocator::~CachingAllocator() {
  thread_errors().erase(id_);
  // The allocator's memory is going away with it: wait for queued work, return everything.
  try {
    for (auto& p : pending_) device_->synchronize_event(p.event);
    for (auto& p : pending_) device_->destroy_event(p.event);
    for (const Epoch& e : epochs_) device_->synchronize_event(e.event);
    for (const Epoch& e : epochs_) device_->destroy_event(e.event);
    for (EventHandle e : event_pool_) device_->destroy_event(e);
    for (auto& [addr, seg] : segments_) {
      if (!seg->vmm) {
        device_->free_segment(reinterpret_cast<void*>(addr), seg->size);
        continue;
      }
      for (std::size_t i = 0; i < seg->pages.size(); ++i) {
        if (seg->pages[i] == 0) continue;
        const std::uintptr_t at = addr + i * device_->granularity();
        device_->unmap_page(reinterpret_cast<void*>(at));
        auto shared = shares_.find(at);
        if (shared != shares_.end() && shared->second->seg[1] == seg &&
            shared->second->index[1] == i) {
          continue;  // an alias: the page is released at its other address
        }
        device_->release_page(seg->pages[i]);
      }
      device_->release_address(reinterpret_cast<void*>(addr), seg->size);
    }
  } catch (...) {
    // A destructor cannot report; the device is being torn down anyway.
  }
  // Each share is listed under both its pages: found by its kept side, while the segments
  // it points to still exist (read after they were deleted, a share could be deleted twice).
  std::vector<Share*> shares;
  for (auto& [addr, sh] : shares_) {
    if (sh->seg[0]->addr + sh->index[0] * device_->granularity() == addr) shares.push_back(sh);
  }
  for (Share* sh : shares) delete sh;
  for (auto& [addr, seg] : segments_) {
    for (Block* b = seg->head; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    delete seg;
  }
  for (Block* b : block_pool_) delete b;
}

// ---------------------------------------------------------------------------------------------
// Rules

std::size_t CachingAllocator::round_size(std::size_t size) const {
  // torch: round_size(): at least kMinBlockSize, multiples of 512 B, or power-of-two
  // divisions when roundup_power2_divisions is set and the size is above 512 B * divisions.
  if (size < kMinBlockSize) return kMinBlockSize;
  std::size_t div = config_.divisions_for(size);
  if (div > 1 && size > kMinBlockSize * div) return roundup_power2_next_division(size, div);
  return round_up(size, kMinBlockSize);
}

std::size_t CachingAllocator::segment_size(std::size_t rounded) const {
  std::size_t bytes = rounded;
  switch (config_.kind) {
    case PolicyKind::Torch:
      // torch: get_allocation_size(): small requests share 2 MiB segments, requests under
      // kMinLargeAlloc (10 MiB) get a 20 MiB segment to split, larger ones their size
      // rounded to 2 MiB.
      if (rounded <= kSmallSize) {
        bytes = kSmallBuffer;
      } else if (rounded < kMinLargeAlloc) {
        bytes = kLargeBuffer;
      } else {
        bytes = round_up(rounded, kRoundLarge);
      }
      break;
    case PolicyKind::Pymemplan:
      // ours: as torch, small requests share 2 MiB segments and requests in (1 MiB, 10 MiB)
      // share larger ones (up to medium_segment_mb as the pool grows), so the device's 2 MiB
      // granularity is paid once per segment rather than once per tensor. A request of
      // 10 MiB or more gets a segment of its own size: split remainders of big shared
      // segments are where torch strands memory, while an exact segment wastes at most its
      // granularity tail, which small requests may still use (find_large_pool_fragment).
      if (rounded <= kSmallSize) {
        bytes = kSmallBuffer;
      } else if (rounded < kMinLargeAlloc && config_.medium_segment > 0) {
        // A segment is a small share of the most the pool has held (1/32), so that a small
        // workload does not hold a big segment for a few tensors, and never below torch's.
        const std::size_t share =
            round_up(static_cast<std::size_t>(reserved_hwm_) / 32, kRoundLarge);
        const std::size_t medium = std::min(config_.medium_segment, std::max(kLargeBuffer, share));
        bytes = std::max(medium, rounded);
        // Cut to a whole number of requests of this size, in whole pages, where one fits:
        // 8 MiB requests get 16 MiB segments, not 20 MiB ones whose last 4 MiB only smaller
        // requests could use (mamba_4l: 1.224 -> 1.122 of its live bytes).
        const std::size_t unit =
            std::lcm(rounded, std::max<std::size_t>(device_->granularity(), 1));
        if (unit < bytes) bytes = bytes / unit * unit;
      } else {
        bytes = rounded;
      }
      break;
    case PolicyKind::NoCache:
      // cudaMalloc of the rounded size, one per request.
      return rounded;
  }
  return round_up(bytes, std::max<std::size_t>(device_->granularity(), 1));
}

bool CachingAllocator::should_split(const Block* block, std::size_t rounded) const {
  std::size_t remaining = block->size - rounded;
  switch (config_.kind) {
    case PolicyKind::Torch:
      // torch: should_split(): the small pool splits any remainder of at least 512 B; the
      // large pool splits only requests below max_split_size with a remainder above 1 MiB
      // (a smaller remainder stays attached to the block, allocated but unused).
      // With expandable segments, both pools split any remainder of at least 512 B.
      if (block->segment->small || config_.expandable_segments) return remaining >= kMinBlockSize;
      return rounded < config_.max_split_size && remaining > kSmallSize;
    case PolicyKind::Pymemplan:
      // ours: split any remainder of at least 512 B in both pools, so granularity tails and
      // best-fit leftovers stay free and coalesce back when their neighbour is freed.
      return rounded < config_.max_split_size && remaining >= kMinBlockSize;
    case PolicyKind::NoCache:
      return false;
  }
  return false;
}

bool CachingAllocator::acceptable(const Block* block, std::size_t rounded) const {
  // torch: get_free_block(): do not hand an oversize block to a request below
  // max_split_size, and do not hand an oversize block to a large request that would waste
  // max_non_split_rounding or more.
  if (rounded < config_.max_split_size && block->size >= config_.max_split_size) return false;
  if (rounded >= config_.max_split_size &&
      block->size >= rounded + config_.max_non_split_rounding) {
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Public entry points


std::uint64_t CachingAllocator::next_id() { return next_allocator_id.fetch_add(1); }

void CachingAllocator::set_last_error(std::string message) {
  thread_errors()[id_] = message;
  last_error_ = std::move(message);
}

void* CachingAllocator::malloc(std::int64_t size, StreamId stream) {
  std::string message;
  Block* b;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    b = allocate_locked(checked_request_size(size), stream, &message);
    if (b == nullptr) set_last_error(message);
  }
  if (b == nullptr) throw OutOfMemoryError(message);
  return reinterpret_cast<void*>(b->addr);
}

void* CachingAllocator::try_malloc(std::int64_t size, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string message;
  Block* b = allocate_locked(checked_request_size(size), stream, &message);
  if (b == nullptr) {
    set_last_error(std::move(message));
    return nullptr;
  }
  return reinterpret_cast<void*>(b->addr);
}

void CachingAllocator::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = block_at(ptr, "free");
  // torch: insert_events(): the block stays active until work queued on every stream that
  // used it (as of now) has finished. The events are recorded before anything changes: if
  // the device refuses one, the block stays allocated and the error propagates.
  std::vector<EventHandle> events;
  try {
    for (StreamId s : b->stream_uses) {
      events.push_back(get_event());
      device_->record_event(events.back(), s);
    }
  } catch (...) {
    for (EventHandle e : events) return_event(e);
    throw;
  }
  b->allocated = false;
  ++events_;
  run_ = 0;
  if (index_live_) drop_index();
  const bool small = b->segment->small;
  update_stat(&Stats::allocation, small, -1);
  update_stat(&Stats::allocated_bytes, small, -static_cast<std::int64_t>(b->size));
  update_stat(&Stats::requested_bytes, small, -static_cast<std::int64_t>(b->requested));
  if (b->size >= config_.max_split_size) stats_.oversize_allocations.decrease(1);
  if (!events.empty()) {
    for (EventHandle e : events) {
      pending_.push_back({e, b, 0, 0});
      ++b->pending_events;
    }
    b->stream_uses.clear();
    return;
  }
  free_block(b);
}

void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = block_at(ptr, "record_stream");
  if (stream == b->stream) return;  // its own stream orders its own reuse
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
    b->stream_uses.push_back(stream);
  }
}

std::int64_t CachingAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

bool CachingAllocator::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return it != allocated_.end() && it->second->allocated;
}

bool CachingAllocator::free_pending(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return it != allocated_.end() && !it->second->allocated;  // freed, its events not done
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  // torch: emptyCache() -> release_cached_blocks(): synchronize outstanding events first so
  // blocks waiting on them can be released too.
  synchronize_and_free_events();
  reclaim_pages(nullptr, 0, 0, kNoLimit);
  release_cached(kNoLimit);
}

std::string CachingAllocator::last_error() const {
  const auto& errors = thread_errors();
  const auto own = errors.find(id_);
  if (own != errors.end()) return own->second;
  std::lock_guard<std::mutex> lock(mutex_);
  return last_error_;
}

std::vector<SegmentInfo> CachingAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [addr, seg] : segments_) {
    SegmentInfo s;
    s.address = seg->addr;
    s.total_size = seg->size;
    s.stream = seg->stream;
    s.segment_type = seg->small ? "small" : "large";
    if (seg->vmm) {
      s.is_virtual = true;
      s.page_size = device_->granularity();
      s.chunk_size = seg->chunk != 0 ? seg->chunk : s.page_size;
      s.torch_expandable = seg->chunk != 0;
      std::size_t aliased = 0;
      for (std::size_t i = 0; i < seg->pages.size(); ++i) {
        s.page_mapped.push_back(seg->pages[i] != 0);
        auto shared = shares_.find(seg->addr + i * s.page_size);
        const bool alias = shared != shares_.end() && shared->second->seg[1] == seg &&
                           shared->second->index[1] == i;
        s.page_aliased.push_back(alias);
        aliased += alias;
      }
      s.mapped_size = (seg->mapped - aliased) * s.page_size;
    }
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      BlockInfo info;
      info.address = b->addr;
      info.size = b->size;
      info.requested_size = b->requested;
      if (b->guard) {
        info.state = "inactive";  // not usable either: the other address's bytes
      } else if (b->allocated) {
        info.state = "active_allocated";
        s.allocated_size += b->size;
        s.active_size += b->size;
      } else if (b->pending_events > 0) {
        info.state = "active_pending_free";
        s.active_size += b->size;
      } else {
        info.state = "inactive";
      }
      s.requested_size += b->requested;
      s.blocks.push_back(info);
    }
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Allocation

Block* CachingAllocator::allocate_locked(std::size_t size, StreamId stream, std::string* oom) {
  process_events();
  const std::size_t rounded = round_size(size);
  if (limit_ != 0 && rounded > limit_) {
    ++stats_.num_ooms;
    ++stats_.num_oom_rejections;
    *oom = oom_message(size, rounded, stream, "the request alone exceeds the memory limit");
    return nullptr;
  }
  // Checked first: a request no device memory could hold must not reserve its address
  // range (with bookkeeping per page) on the way to failing.
  if (device_->capacity() != 0 && rounded > device_->capacity()) {
    ++stats_.num_ooms;
    *oom = oom_message(size, rounded, stream, "the request alone exceeds the device's memory");
    return nullptr;
  }
  Pool& pool = pool_for(rounded);
  const bool virtual_memory = config_.vmm;
  // ours: free blocks of other streams are drained whenever a stream asks, not only once
  // nothing else fits: when an event recorded on their owner after their frees completes,
  // they are shared (share_blocks_of) and merge with the free space beside them. Drained only
  // when nothing fit, they never were with virtual memory, where the address range's free
  // tail always fits: a side stream's freed block stayed its own for good, a wall in the
  // middle of the main stream's free space, and the layout went round it. Of the 200 random
  // training runs, the 37 with a second stream now hold what they hold on one stream on 35
  // (seed 65: 1.055 -> 1.025 of live, as on one stream).
  if (config_.cross_stream_reuse) drain_other_streams(pool, stream);
  Block* b = nullptr;
  bool lowest = false;
  if (virtual_memory && config_.pack_long_lived && long_lived(rounded)) {
    if (!index_live_) make_index();
    b = lowest_fit(rounded, stream);
    if (b != nullptr) erase_free(b);
    lowest = b != nullptr;
  }
  if (b == nullptr) b = find_free_block(pool, rounded, stream);
  if (b == nullptr && pool.small && config_.kind == PolicyKind::Pymemplan && !config_.vmm) {
    b = find_large_pool_fragment(rounded, stream);
  }
  if (virtual_memory) {
    // ours (vmm): address space is free; only the pages under the block cost memory.
    if (b == nullptr) b = new_virtual_segment(rounded, stream);
    auto back_or_return = [&] {
      try {
        return back(b, rounded);
      } catch (...) {
        insert_free(b);  // a driver error: the block goes back as it was
        throw;
      }
    };
    auto best_fit_again = [&] {  // after `b` could not be backed and went back to the lists
      b = find_free_block(pool, rounded, stream);
      if (b == nullptr) b = new_virtual_segment(rounded, stream);
      return back_or_return();
    };
    bool backed = back_or_return();
    if (!backed && lowest) {
      // The lowest address is a preference, never a reason to fail: where its pages cannot
      // be had, best fit may find a block on pages mapped already.
      insert_free(b);
      backed = best_fit_again();
    }
    if (!backed && claimed_blocks_ != 0) {
      // Free space reserved for a plan's holes may be what is missing: a plan is a
      // preference, never a reason to fail. Give the claims back and try once more.
      insert_free(b);
      unclaim_locked();
      backed = best_fit_again();
    }
    if (!backed && config_.share_pages && device_->supports_page_sharing()) {
      // ours: pages that blocks in use fill only partly, paired onto one physical page
      // (share_pages), may give back the pages this request needs. A device-wide
      // synchronize is the price of not failing.
      insert_free(b);
      std::size_t shared = 0;
      try {
        shared = share_pages_locked(share_candidates_locked({}));
      } catch (const DeviceError&) {
        shared = 0;  // nothing was changed by the pair that failed
      }
      b = find_free_block(pool, rounded, stream);
      if (b == nullptr) b = new_virtual_segment(rounded, stream);
      if (shared != 0) {
        try {
          backed = back(b, rounded);
        } catch (...) {
          insert_free(b);
          throw;
        }
      }
    }
    if (!backed) {
      insert_free(b);
      return refuse(size, rounded, stream, rounded, true, oom);
    }
    return take(b, rounded, size, stream);
  }
  if (config_.expandable_segments) {
    // torch: alloc_block() with expandable segments: a segment of this stream and pool grows
    // instead of a cudaMalloc; when that fails, cached blocks are released (their free
    // chunks unmapped) and it is tried once more.
    if (b == nullptr) b = expand(pool, rounded, stream);
    if (b == nullptr) {
      synchronize_and_free_events();
      release_cached(kNoLimit);
      ++stats_.num_alloc_retries;
      b = expand(pool, rounded, stream);
    }
    if (b == nullptr) {
      return refuse(size, rounded, stream, rounded, true, oom);
    }
    return take(b, rounded, size, stream);
  }
  if (b == nullptr) {
    const std::size_t seg = segment_size(rounded);
    if (config_.release_before_grow && !unused_segments_.empty() &&
        reserved_ + static_cast<std::int64_t>(seg) > grow_mark_) {
      // ours: cached segments that cannot serve this request would otherwise sit under a
      // new, higher peak; give back just enough of them to keep the peak where it was.
      release_cached(static_cast<std::size_t>(reserved_ + static_cast<std::int64_t>(seg) -
                                              grow_mark_));
    }
    b = new_segment(pool, seg, stream);
    // torch: release_available_cached_blocks(): with max_split_size set, free oversize
    // cached blocks of this stream (one big enough, else the largest ones) and retry.
    if (b == nullptr && release_oversize_for(pool, rounded, stream)) {
      b = new_segment(pool, seg, stream);
    }
    if (b == nullptr) {
      // torch: release_cached_blocks() and alloc_block(isRetry=true): wait for pending
      // frees, return every wholly free segment, and try once more.
      synchronize_and_free_events();
      release_cached(kNoLimit);
      ++stats_.num_alloc_retries;
      // ours: blocks whose pending frees just completed may serve the request as they are.
      if (config_.kind == PolicyKind::Pymemplan) b = find_free_block(pool, rounded, stream);
      if (b == nullptr) b = new_segment(pool, seg, stream);
    }
    const std::size_t own = round_up(rounded, std::max<std::size_t>(device_->granularity(), 1));
    if (b == nullptr && config_.kind == PolicyKind::Pymemplan && !pool.small && own < seg) {
      // ours: a shared medium segment is a convenience; where it no longer fits, a segment
      // of the request's own size may.
      b = new_segment(pool, own, stream);
    }
    if (b == nullptr) {
      return refuse(size, rounded, stream, seg, false, oom);
    }
  }
  return take(b, rounded, size, stream);
}

Block* CachingAllocator::refuse(std::size_t size, std::size_t rounded, StreamId stream,
                               std::size_t growth, bool pages, std::string* oom) {
  ++stats_.num_ooms;
  const bool over_limit = limit_ != 0 && reserved_ + static_cast<std::int64_t>(growth) >
                                             static_cast<std::int64_t>(limit_);
  stats_.num_oom_rejections += over_limit;
  const char* reason = pages ? (over_limit ? "the pages it needs would exceed the memory limit"
                                           : "the device has no free pages for it")
                             : (over_limit ? "a new segment would exceed the memory limit"
                                           : "the device has no free memory for a new segment");
  *oom = oom_message(size, rounded, stream, reason);
  return nullptr;
}

Block* CachingAllocator::best_fit(Pool& pool, std::size_t rounded, StreamId key) {
  Block probe;
  probe.stream = key;
  probe.size = rounded;
  probe.addr = 0;
  auto it = pool.free.lower_bound(&probe);
  if (it == pool.free.end() || (*it)->stream != key) return nullptr;
  if (config_.expandable_segments && (*it)->segment->chunk != 0) {
    // torch: get_free_block(): a block followed by unmapped space counts, for best fit, at
    // the size it can grow to; a larger block that cannot grow as far is taken instead, so
    // that the segment's end stays free to grow.
    auto growable = [](const Block* b) {
      return b->size + (b->next != nullptr && b->next->unmapped ? b->next->size : 0);
    };
    for (auto next = std::next(it);
         (*it)->segment->chunk != 0 && next != pool.free.end() && (*next)->stream == key &&
         growable(*next) < growable(*it);
         ++next) {
      it = next;
    }
  }
  return *it;
}

namespace {
// Power-of-two class of a block size (> 0), for the address index of pack_long_lived.
int size_class(std::size_t size) { return 63 - __builtin_clzll(static_cast<unsigned long long>(size)); }
}  // namespace

// ours (vmm, pack_long_lived): after the first backward pass the optimizer makes its state,
// tensor by tensor in the image of the parameters (zeros_like), with nothing freed in between;
// gradients kept across steps and an EMA copy of the weights come the same way. Best fit puts
// each of them in the smallest free block that fits, among the holes the step's freed
// activations left all over the pool, and once those neighbours are gone each such block,
// often a few KiB (the state of a bias or a norm), pins a page that the steps ahead cannot use
// (swin_t_b4: 36 partly used pages, 37 MiB free in them, held by the state for good). Such a
// request is recognised by two signs together: it extends a run of kLongLivedRun allocations
// without a free, and a block of its size has been alive since the first quarter of the
// events so far (a parameter). Either alone also takes a forward pass's activations, or the
// optimizer's temporaries and the gradients, which come in the parameters' sizes too but
// between frees. Those requests go to the lowest free address that fits, which packs them
// beside the parameters, made first; every other request is served best fit as before.
constexpr std::uint64_t kLongLivedRun = 24;
constexpr std::uint64_t kOldShare = 4;          // alive since the first 1/kOldShare of events
constexpr std::uint64_t kOldSizesEvery = 1024;  // events between two makings of old_sizes_

bool CachingAllocator::long_lived(std::size_t rounded) {
  if (run_ + 1 < kLongLivedRun) return false;  // this request would extend a run of run_
  if (!old_sizes_made_ || events_ - old_sizes_at_ >= kOldSizesEvery) {
    old_sizes_.clear();
    for (const auto& [addr, b] : allocated_) {
      if (b->born * kOldShare < events_) old_sizes_.insert(b->size);
    }
    old_sizes_at_ = events_;
    old_sizes_made_ = true;
  }
  return old_sizes_.count(rounded) != 0;
}

bool CachingAllocator::indexed(const Block* b) const {
  return config_.vmm && config_.pack_long_lived && b->segment->vmm && !b->segment->small &&
         !b->segment->arena && b->segment->chunk == 0 && !b->claimed && !b->unmapped;
}

void CachingAllocator::make_index() {
  for (const auto& [addr, seg] : segments_) {
    for (Block* b = seg->head; b != nullptr; b = b->next) {
      if (!b->allocated && b->listed && indexed(b)) by_address_[size_class(b->size)].insert(b);
    }
  }
  index_live_ = true;
}

void CachingAllocator::drop_index() {
  for (auto& set : by_address_) set.clear();
  index_live_ = false;
}

Block* CachingAllocator::lowest_fit(std::size_t rounded, StreamId stream) {
  // The lowest usable block of each size class that can hold the request: every block of a
  // larger class can; in the request's own class, only those at least its size.
  auto usable = [&](const Block* b) {
    return b->size >= rounded && acceptable(b, rounded) &&
           (b->stream == stream || (config_.cross_stream_reuse && b->stream == kAnyStream));
  };
  Block* best = nullptr;
  const int own = size_class(rounded);
  for (int c = kSizeClasses - 1; c >= own; --c) {  // the own class last: a scan, cut short
    for (Block* b : by_address_[c]) {
      if (best != nullptr && b->addr > best->addr) break;
      if (usable(b)) {
        best = b;
        break;
      }
    }
  }
  return best;
}

std::string CachingAllocator::self_check() const {
  // by_address_ holds exactly the listed free blocks of the large pool's virtual segments
  // (arenas and claimed ranges aside), each in the class of its size; nothing when not kept.
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t expected = 0, indexed_blocks = 0;
  for (const auto& [addr, seg] : segments_) {
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (!index_live_ || b->allocated || !b->listed || !indexed(b)) continue;
      ++expected;
      if (by_address_[size_class(b->size)].count(const_cast<Block*>(b)) == 0) {
        return "free block at " + std::to_string(b->addr) + " missing from the address index";
      }
    }
  }
  for (const auto& set : by_address_) indexed_blocks += set.size();
  if (indexed_blocks != expected) {
    return "address index holds " + std::to_string(indexed_blocks) + " blocks, not the " +
           std::to_string(expected) + " free ones";
  }
  return "";
}

Block* CachingAllocator::usable_best_fit(Pool& pool, std::size_t rounded, StreamId stream) {
  // The smaller of the best fits among this stream's blocks and the shared ones.
  Block* own = best_fit(pool, rounded, stream);
  if (own != nullptr && !acceptable(own, rounded)) own = nullptr;
  // kAnyStream sorts last: the last free block tells in O(1) whether any is shared.
  if (!config_.cross_stream_reuse || pool.free.empty() ||
      (*pool.free.rbegin())->stream != kAnyStream) {
    return own;
  }
  Block* shared = best_fit(pool, rounded, kAnyStream);
  if (shared != nullptr && !acceptable(shared, rounded)) shared = nullptr;
  return shared != nullptr && (own == nullptr || shared->size < own->size) ? shared : own;
}

Block* CachingAllocator::find_free_block(Pool& pool, std::size_t rounded, StreamId stream) {
  if (config_.kind == PolicyKind::NoCache) return nullptr;
  Block* b = usable_best_fit(pool, rounded, stream);
  if (b != nullptr) erase_free(b);
  return b;
}

Block* CachingAllocator::find_large_pool_fragment(std::size_t rounded, StreamId stream) {
  // ours: a free block of the large pool smaller than a small segment serves almost no large
  // request (those are over 1 MiB; exact-size segments leave such tails under the 2 MiB
  // granularity); it serves a small request before the small pool grows.
  Block* b = usable_best_fit(large_, rounded, stream);
  if (b == nullptr || b->size >= kSmallBuffer) return nullptr;
  erase_free(b);
  return b;
}

Block* CachingAllocator::new_segment(Pool& pool, std::size_t bytes, StreamId stream) {
  if (limit_ != 0 && static_cast<std::size_t>(reserved_) + bytes > limit_) return nullptr;
  void* ptr = device_->allocate_segment(bytes);
  if (ptr == nullptr) return nullptr;
  Block* b = add_segment(reinterpret_cast<std::uintptr_t>(ptr), bytes, stream, pool.small, false);
  reserved_ += static_cast<std::int64_t>(bytes);
  reserved_hwm_ = std::max(reserved_hwm_, reserved_);
  reserved_hwm_seen_.store(reserved_hwm_, std::memory_order_relaxed);
  window_hwm_ = std::max(window_hwm_, reserved_);
  grow_mark_ = std::max(grow_mark_, reserved_);
  update_stat(&Stats::reserved_bytes, pool.small, static_cast<std::int64_t>(bytes));
  if (bytes >= config_.max_split_size) stats_.oversize_segments.increase(1);
  ++stats_.num_device_alloc;
  return b;
}

Block* CachingAllocator::add_segment(std::uintptr_t addr, std::size_t bytes, StreamId stream,
                                     bool small, bool vmm) {
  // A new segment with one free block spanning it, listed nowhere yet.
  auto* seg = new Segment;
  seg->addr = addr;
  seg->size = bytes;
  seg->stream = stream;
  seg->small = small;
  seg->vmm = vmm;
  Block* b = new_block();
  b->addr = addr;
  b->size = bytes;
  b->stream = stream;
  b->segment = seg;
  seg->head = b;
  segments_.emplace(addr, seg);
  update_stat(&Stats::segment, small, 1);
  return b;
}

Block* CachingAllocator::take(Block* b, std::size_t rounded, std::size_t requested,
                              StreamId stream) {
  // `b` is free and in no free list.
  if (should_split(b, rounded)) insert_free(split(b, b->addr + rounded));
  mark_allocated(b, requested, stream);
  return b;
}

void CachingAllocator::mark_allocated(Block* b, std::size_t requested, StreamId stream) {
  b->allocated = true;
  b->requested = requested;
  b->born = events_++;
  ++run_;
  b->stream = stream;
  count_use(b, +1);
  allocated_.emplace(b->addr, b);
  const bool small = b->segment->small;
  const auto bytes = static_cast<std::int64_t>(b->size);
  update_stat(&Stats::allocation, small, 1);
  update_stat(&Stats::allocated_bytes, small, bytes);
  update_stat(&Stats::active, small, 1);
  update_stat(&Stats::active_bytes, small, bytes);
  update_stat(&Stats::requested_bytes, small, static_cast<std::int64_t>(requested));
  if (b->size >= config_.max_split_size) stats_.oversize_allocations.increase(1);
}

std::vector<std::uintptr_t> CachingAllocator::adopt_segment(std::size_t bytes, bool small,
                                                            StreamId stream,
                                                            const std::vector<AdoptedBlock>& blocks) {
  if (config_.kind != PolicyKind::Torch || config_.expandable_segments) {
    throw AllocatorError("adopt_segment: only the model of PyTorch's allocator without "
                         "expandable segments takes a recorded layout, not " + config_.policy_name());
  }
  if (bytes == 0 || bytes % kMinBlockSize != 0) {
    throw AllocatorError("adopt_segment: a segment of " + std::to_string(bytes) +
                         " bytes (a positive multiple of 512 expected)");
  }
  std::vector<std::size_t> order(blocks.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return blocks[a].offset < blocks[b].offset; });
  std::size_t end = 0;
  for (std::size_t i : order) {
    const AdoptedBlock& a = blocks[i];
    if (a.size == 0 || a.size % kMinBlockSize != 0 || a.offset % kMinBlockSize != 0 ||
        a.offset < end || a.offset + a.size > bytes || a.requested <= 0 ||
        static_cast<std::size_t>(a.requested) > a.size) {
      throw AllocatorError("adopt_segment: block " + std::to_string(i) + " (offset " +
                           std::to_string(a.offset) + ", " + std::to_string(a.size) +
                           " bytes for " + std::to_string(a.requested) + " requested) overlaps " +
                           "another, lies outside the segment of " + std::to_string(bytes) +
                           " bytes, or is not in multiples of 512 bytes holding its request");
    }
    end = a.offset + a.size;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Block* rest = new_segment(small ? small_ : large_, bytes, stream);
  if (rest == nullptr) {
    throw OutOfMemoryError("adopt_segment: the device has no room for a segment of " +
                           std::to_string(bytes) + " bytes");
  }
  std::vector<std::uintptr_t> out(blocks.size());
  const std::uintptr_t base = rest->addr;
  for (std::size_t i : order) {
    const AdoptedBlock& a = blocks[i];
    Block* b = rest;
    if (b->addr < base + a.offset) {  // free space before it
      b = split(rest, base + a.offset);
      insert_free(rest);
    }
    rest = b->size > a.size ? split(b, b->addr + a.size) : nullptr;
    mark_allocated(b, static_cast<std::size_t>(a.requested), stream);
    out[i] = b->addr;
    if (rest == nullptr) break;
  }
  if (rest != nullptr) insert_free(rest);
  return out;
}

Block* CachingAllocator::split(Block* b, std::uintptr_t at) {
  Block* rest = new_block();
  rest->addr = at;
  rest->size = b->addr + b->size - at;
  rest->stream = b->stream;  // the remainder keeps the owner the whole block had
  rest->free_seq = b->free_seq;
  rest->claimed = b->claimed;
  if (rest->claimed) ++claimed_blocks_;
  rest->unmapped = b->unmapped;
  rest->segment = b->segment;
  rest->prev = b;
  rest->next = b->next;
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  b->size = at - b->addr;
  return rest;
}

// ---------------------------------------------------------------------------------------------
// Freeing

void CachingAllocator::free_block(Block* b) {
  // `b` is no longer allocated and waits on no event; it becomes reusable by its stream.
  allocated_.erase(b->addr);
  const bool small = b->segment->small;
  update_stat(&Stats::active, small, -1);
  update_stat(&Stats::active_bytes, small, -static_cast<std::int64_t>(b->size));
  b->requested = 0;
  b->free_seq = ++free_seq_;
  // ours (vmm): torch waits for the stream at every unmap; we record when we need not.
  if (count_use(b, -1) && config_.vmm && b->stream != kAnyStream) {
    last_idle_free_[b->stream] = b->free_seq;
    start_epoch(b->stream);
  }
  if (config_.kind == PolicyKind::NoCache) {
    release_segment(b);
    return;
  }
  if (b->segment->shared_pages == 0) {
    insert_free(coalesce(b));
    return;
  }
  // Pages of a shared pair this block was on may have no block left but their guards.
  Segment* seg = b->segment;
  const std::size_t page = device_->granularity();
  const std::size_t first = (b->addr - seg->addr) / page, last = (b->addr + b->size - 1 - seg->addr) / page;
  insert_free(coalesce(b));
  end_idle_shares(seg, first, last);
}

Block* CachingAllocator::coalesce(Block* b) {
  // `b` is free and listed nowhere. It absorbs free neighbours that its owner may use: those
  // of the same owner, and shared ones (kAnyStream). Merging with another stream's block
  // would let one stream reuse memory the other may still be using.
  auto joinable = [&](Block* n) {
    return n != nullptr && n->listed && n->claimed == b->claimed && n->unmapped == b->unmapped &&
           (n->stream == b->stream || n->stream == kAnyStream);
  };
  if (joinable(b->prev)) {
    Block* prev = b->prev;
    erase_free(prev);
    prev->stream = b->stream;
    b = merge(prev, b);
  }
  if (joinable(b->next)) {
    Block* next = b->next;
    erase_free(next);
    b = merge(b, next);
  }
  return b;
}

Block* CachingAllocator::merge(Block* first, Block* second) {
  // `first` immediately precedes `second` in the same segment; both are free and listed nowhere.
  first->size += second->size;
  first->next = second->next;
  if (second->next != nullptr) second->next->prev = first;
  // A drain covers only blocks freed before it: the merged block is as young as its
  // youngest part.
  first->free_seq = std::max(first->free_seq, second->free_seq);
  if (second->claimed) --claimed_blocks_;
  if (first->claimed != second->claimed && first->claimed) {
    first->claimed = false;  // only a wholly free segment merges across a claim (it ends)
    --claimed_blocks_;
  }
  delete_block(second);
  return first;
}

void CachingAllocator::insert_free(Block* b) {
  Pool& pool = b->segment->small ? small_ : large_;
  const bool reserved = b->segment->arena || b->claimed;
  if (b->unmapped) {
    // Address space only: listed so that it merges, but in no list a search reads
    // (expand() walks the segment's blocks).
  } else if (reserved) {
    arena_free_.insert(b);
  } else {
    pool.free.insert(b);
    if (index_live_ && indexed(b)) by_address_[size_class(b->size)].insert(b);
  }
  b->listed = true;
  if (b->is_whole_segment()) {
    // Arenas go back only when retired, expandable segments never (their pages do).
    if (!reserved && !b->unmapped) unused_segments_.insert(b);
  } else if (!b->segment->vmm) {
    // torch: free_block(): expandable segments are left out of inactive_split (their free
    // chunks can always be unmapped), and so are ours of virtual memory: most of their free
    // blocks are address space with no page behind them.
    update_stat(&Stats::inactive_split, pool.small, 1);
    update_stat(&Stats::inactive_split_bytes, pool.small, static_cast<std::int64_t>(b->size));
  }
}

void CachingAllocator::erase_free(Block* b) {
  Pool& pool = b->segment->small ? small_ : large_;
  const bool reserved = b->segment->arena || b->claimed;
  if (b->unmapped) {
    // listed in no set (insert_free)
  } else if (reserved) {
    arena_free_.erase(b);
  } else {
    pool.free.erase(b);
    if (index_live_ && indexed(b)) by_address_[size_class(b->size)].erase(b);
  }
  b->listed = false;
  if (b->is_whole_segment()) {
    if (!reserved && !b->unmapped) unused_segments_.erase(b);
  } else if (!b->segment->vmm) {
    update_stat(&Stats::inactive_split, pool.small, -1);
    update_stat(&Stats::inactive_split_bytes, pool.small, -static_cast<std::int64_t>(b->size));
  }
}

void CachingAllocator::release_segment(Block* b) {
  // `b` spans its whole segment, is free and listed nowhere.
  Segment* seg = b->segment;
  if (seg->vmm) {
    // Queued work of the block's owner may still touch its pages: wait before unmapping,
    // unless epochs tell it is done.
    bool idle = true;
    for (std::size_t i = 0; i < seg->pages.size() && idle; ++i) {
      idle = seg->pages[i] == 0 || page_idle(seg, i);
    }
    if (!idle && b->stream != kAnyStream) {
      synchronize_stream(b->stream);
      ++stats_.num_unmap_waits;
    }
    unmap_mapped(seg, 0, seg->pages.size());
    device_->release_address(reinterpret_cast<void*>(seg->addr), seg->size);
  } else {
    device_->free_segment(reinterpret_cast<void*>(seg->addr), seg->size);
    reserved_ -= static_cast<std::int64_t>(seg->size);
    update_stat(&Stats::reserved_bytes, seg->small, -static_cast<std::int64_t>(seg->size));
    ++stats_.num_device_free;
  }
  update_stat(&Stats::segment, seg->small, -1);
  if (!seg->vmm && seg->size >= config_.max_split_size) stats_.oversize_segments.decrease(1);
  segments_.erase(seg->addr);
  delete seg;
  delete_block(b);
}

void CachingAllocator::collapse_free_segments() {
  // Free neighbours owned by different streams are kept apart so neither stream reuses the
  // other's memory early. A segment made only of such blocks can still go back to the
  // device as a whole: freeing a segment waits for all work on it.
  // An arena is never given back this way: its blocks keep their owners. Unmapping the pages
  // of a virtual segment does not wait for queued work (cudaFree does): its owners are
  // synchronized first, and the merged block is then safe for every stream.
  for (auto& [addr, seg] : segments_) {
    Block* head = seg->head;
    if (head->next == nullptr || seg->arena || seg->chunk != 0) continue;
    bool all_free = true;
    // Listed, not merely free: a block being handed out is free but already off the lists.
    for (Block* b = head; b != nullptr && all_free; b = b->next) all_free = b->listed;
    if (!all_free) continue;
    std::vector<StreamId> owners;
    for (Block* b = head; b != nullptr; b = b->next) {
      erase_free(b);
      if (b->stream != kAnyStream &&
          std::find(owners.begin(), owners.end(), b->stream) == owners.end()) {
        owners.push_back(b->stream);
      }
    }
    while (head->next != nullptr) merge(head, head->next);
    if (head->claimed) {  // the segment is wholly free: the plan's holes there are gone
      head->claimed = false;
      --claimed_blocks_;
    }
    if (seg->vmm && owners.size() > 1) {
      for (StreamId s : owners) synchronize_stream(s);
      head->stream = kAnyStream;
    }
    insert_free(head);
  }
}

std::size_t CachingAllocator::release_cached(std::size_t needed) {
  std::size_t released = 0;
  if (needed == kNoLimit) {
    released += unmap_free_chunks();
    collapse_free_segments();
  }
  while (released < needed && !unused_segments_.empty()) {
    Block* b = *unused_segments_.begin();  // the largest
    released += b->size;
    erase_free(b);
    release_segment(b);
  }
  return released;
}

bool CachingAllocator::release_oversize_for(Pool& pool, std::size_t rounded, StreamId stream) {
  if (config_.max_split_size == kNoLimit) return false;
  const std::size_t want = std::max(rounded, config_.max_split_size);
  Block probe;
  probe.stream = stream;
  probe.size = want;
  auto it = pool.free.lower_bound(&probe);
  if (it != pool.free.end() && (*it)->stream == stream && (*it)->is_whole_segment()) {
    Block* b = *it;
    erase_free(b);
    release_segment(b);
    return true;
  }
  // No single block is large enough: release oversize blocks of this stream, largest first.
  std::vector<Block*> victims;
  std::size_t total = 0;
  while (it != pool.free.begin() && total < want) {
    --it;
    Block* b = *it;
    if (b->stream != stream || b->size < config_.max_split_size) break;
    if (!b->is_whole_segment()) continue;
    victims.push_back(b);
    total += b->size;
  }
  if (total < want) return false;
  for (Block* b : victims) {
    erase_free(b);
    release_segment(b);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Helpers

Block* CachingAllocator::block_at(void* ptr, const char* what) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = allocated_.find(addr);
  if (it != allocated_.end()) {
    if (it->second->allocated) return it->second;
    throw AllocatorError(std::string(what) + ": pointer " + to_hex(addr) +
                         " was already freed (double free); it is waiting on stream events");
  }
  auto seg = segments_.upper_bound(addr);
  if (seg != segments_.begin()) {
    --seg;
    const Segment* s = seg->second;
    if (addr < s->addr + s->size) {
      for (const Block* b = s->head; b != nullptr; b = b->next) {
        if (b->addr == addr) {
          throw AllocatorError(std::string(what) + ": pointer " + to_hex(addr) +
                               " is not allocated (double free, or a pointer already freed)");
        }
      }
      throw AllocatorError(std::string(what) + ": pointer " + to_hex(addr) +
                           " points inside a block, not at its start; pass the pointer that "
                           "malloc returned");
    }
  }
  throw AllocatorError(std::string(what) + ": pointer " + to_hex(addr) +
                       " was not allocated by this allocator");
}

void CachingAllocator::update_stat(StatArray Stats::*field, bool small, std::int64_t delta) {
  pymemplan::update_stat(stats_.*field, small, delta);
}

Block* CachingAllocator::new_block() {
  if (block_pool_.empty()) return new Block;
  Block* b = block_pool_.back();
  block_pool_.pop_back();
  *b = Block{};
  return b;
}

void CachingAllocator::delete_block(Block* b) {
  b->segment = nullptr;  // marks it dead for passes that still hold the pointer
  b->stream_uses.clear();
  block_pool_.push_back(b);
}

std::string CachingAllocator::oom_message(std::size_t size, std::size_t rounded, StreamId stream,
                                          const char* reason) const {
  // Cached free: free bytes that pages back. A free block of a virtual segment is address
  // space, backed only where its pages are mapped (the rest costs nothing and is not memory).
  const std::size_t page = std::max<std::size_t>(device_->granularity(), 1);
  auto backed = [&](const Block* b) -> std::size_t {
    if (b->unmapped) return 0;
    const Segment* seg = b->segment;
    if (seg == nullptr || seg->pages.empty()) return b->size;
    std::size_t n = 0;
    for (std::uintptr_t p = b->addr / page * page; p < b->addr + b->size; p += page) {
      const std::size_t i = (p - seg->addr) / page;
      if (i < seg->pages.size() && seg->pages[i] != 0) {
        n += std::min(p + page, b->addr + b->size) - std::max(p, b->addr);
      }
    }
    return n;
  };
  std::size_t largest_free = 0;
  std::int64_t free_cached = 0;
  for (const Pool* pool : {&small_, &large_}) {
    for (const Block* b : pool->free) {
      const std::size_t n = backed(b);
      largest_free = std::max(largest_free, n);
      free_cached += static_cast<std::int64_t>(n);
    }
  }
  const std::int64_t allocated = stats_.allocated_bytes[kAllPools].current;
  std::ostringstream m;
  m << "pymemplan: out of memory: tried to allocate " << format_bytes(static_cast<long long>(size))
    << " (rounded to " << format_bytes(static_cast<long long>(rounded)) << ") on stream "
    << stream << ": " << reason << ". Allocated " << format_bytes(allocated) << ", reserved "
    << format_bytes(reserved_) << " in " << segments_.size() << " segments, of which "
    << format_bytes(free_cached) << " is cached free; the largest free block is "
    << format_bytes(static_cast<long long>(largest_free)) << ". Device capacity "
    << format_bytes(static_cast<long long>(device_->capacity()));
  if (limit_ != 0) m << ", memory limit " << format_bytes(static_cast<long long>(limit_));
  m << ".";
  // Fragmentation is the cause only when the cached free bytes would have been enough (and
  // not with virtual memory, which maps free pages anywhere into a request).
  if (!config_.vmm && free_cached >= static_cast<std::int64_t>(rounded) && largest_free < rounded) {
    m << " Free memory is fragmented: no free block is large enough for this request.";
  }
  return m.str();
}

}  // namespace pymemplan
