// The caching allocator. Rules marked "torch:" model c10/cuda/CUDACachingAllocator.cpp
// (DeviceCachingAllocator); rules marked "ours:" are where pymemplan departs from it.
#include "allocator.hpp"

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <sstream>

#include "errors.hpp"

namespace pymemplan {
namespace {

constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

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

std::string to_hex(std::uintptr_t addr) {
  std::ostringstream s;
  s << "0x" << std::hex << addr;
  return s.str();
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
  return b;
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
  } else if (b->segment->chunk == 0) {
    // torch: free_block(): expandable segments are left out of inactive_split (their free
    // chunks can always be unmapped).
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
  } else if (b->segment->chunk == 0) {
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

// ---------------------------------------------------------------------------------------------
// Page sharing

std::vector<CachingAllocator::Ranges> CachingAllocator::page_uses(const Segment* seg) const {
  // One walk over the segment's blocks (a list by address). Free space a plan has claimed
  // is as good as used: its blocks are on their way.
  const std::size_t page = device_->granularity();
  std::vector<Ranges> used(seg->pages.size());
  for (const Block* b = seg->head; b != nullptr; b = b->next) {
    if (b->listed && !b->claimed) continue;
    const std::size_t lo = b->addr - seg->addr, hi = lo + b->size;
    for (std::size_t i = lo / page; i * page < hi; ++i) {
      const std::size_t a = std::max(lo, i * page) - i * page;
      const std::size_t z = std::min(hi, (i + 1) * page) - i * page;
      Ranges& r = used[i];
      if (!r.empty() && r.back().second == a) {
        r.back().second = z;
      } else {
        r.emplace_back(a, z);
      }
    }
  }
  return used;
}

namespace {
bool disjoint(const std::vector<std::pair<std::size_t, std::size_t>>& a,
              const std::vector<std::pair<std::size_t, std::size_t>>& b) {
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].second <= b[j].first) {
      ++i;
    } else if (b[j].second <= a[i].first) {
      ++j;
    } else {
      return false;
    }
  }
  return true;
}
}  // namespace

std::vector<SharePair> CachingAllocator::share_candidates(
    const std::vector<std::uintptr_t>& leave_out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return share_candidates_locked(leave_out);
}

std::vector<SharePair> CachingAllocator::share_candidates_locked(
    const std::vector<std::uintptr_t>& leave_out) const {
  std::vector<SharePair> out;
  if (!config_.vmm || !device_->supports_page_sharing()) return out;
  const std::size_t page = device_->granularity();
  struct Candidate {
    std::uintptr_t addr;
    Ranges used;
    std::size_t bytes;
  };
  // Pages held by blocks in use (or waiting on events) but not filled by them, not shared
  // already. Space claimed by a plan counts as used.
  std::vector<Candidate> c;
  std::vector<std::uintptr_t> excluded;  // pages touched by the blocks left out
  for (std::uintptr_t a : leave_out) {
    auto it = allocated_.find(a);
    if (it == allocated_.end() || !it->second->segment->vmm) continue;
    const Block* b = it->second;
    for (std::uintptr_t p = b->addr / page * page; p < b->addr + b->size; p += page) excluded.push_back(p);
  }
  std::sort(excluded.begin(), excluded.end());
  for (const auto& [addr, seg] : segments_) {
    if (!seg->vmm || seg->arena || seg->mapped == seg->unused_mapped) continue;
    std::vector<Ranges> uses = page_uses(seg);
    for (std::size_t i = 0; i < seg->pages.size(); ++i) {
      if (seg->pages[i] == 0 || seg->users[i] == 0) continue;
      if (shares_.count(seg->addr + i * page) != 0) continue;
      if (std::binary_search(excluded.begin(), excluded.end(), seg->addr + i * page)) continue;
      std::size_t bytes = 0;
      for (const auto& [lo, hi] : uses[i]) bytes += hi - lo;
      if (bytes < page) c.push_back({seg->addr + i * page, std::move(uses[i]), bytes});
    }
  }
  // First fit by decreasing use: each page pairs with the first later one whose live bytes
  // lie at other offsets; the fuller page keeps its physical page, so the least is copied.
  // Quadratic in the partly used pages, which are few (blocks in use mostly fill theirs);
  // bounded all the same.
  std::stable_sort(c.begin(), c.end(),
                   [](const Candidate& a, const Candidate& b) { return a.bytes > b.bytes; });
  constexpr std::size_t kMaxCandidates = 4096;
  if (c.size() > kMaxCandidates) c.resize(kMaxCandidates);
  std::vector<bool> taken(c.size(), false);
  for (std::size_t a = 0; a < c.size(); ++a) {
    if (taken[a]) continue;
    for (std::size_t b = a + 1; b < c.size(); ++b) {
      if (taken[b] || c[a].bytes + c[b].bytes > page || !disjoint(c[a].used, c[b].used)) continue;
      taken[a] = taken[b] = true;
      out.push_back({c[a].addr, c[b].addr, c[b].used});
      break;
    }
  }
  return out;
}

std::vector<std::pair<std::uintptr_t, std::size_t>> CachingAllocator::holes_after_sharing(
    const std::vector<std::pair<std::uintptr_t, std::size_t>>& holes,
    const std::vector<SharePair>& pairs) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t page = device_->granularity();
  // What sharing takes from free space: the whole alias page (its free offsets are the kept
  // page's), and the alias's live offsets in the kept page.
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> taken;
  for (const SharePair& sp : pairs) {
    taken.emplace_back(sp.alias, sp.alias + page);
    for (const auto& [lo, hi] : sp.alias_used) taken.emplace_back(sp.keep + lo, sp.keep + hi);
  }
  std::sort(taken.begin(), taken.end());
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  for (const auto& [addr, n] : holes) {
    std::uintptr_t lo = addr;
    const std::uintptr_t hi = addr + n;
    auto it = std::upper_bound(taken.begin(), taken.end(), std::make_pair(lo, std::uintptr_t{0}));
    if (it != taken.begin()) --it;
    for (; it != taken.end() && it->first < hi && lo < hi; ++it) {
      if (it->second <= lo) continue;
      if (it->first > lo) out.emplace_back(lo, it->first - lo);
      lo = std::max(lo, it->second);
    }
    if (lo < hi) out.emplace_back(lo, hi - lo);
  }
  return out;
}

bool CachingAllocator::stop_automatic_page_sharing() {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool was = config_.vmm && config_.share_pages && device_->supports_page_sharing();
  config_.share_pages = false;
  return was;
}

std::size_t CachingAllocator::share_pages() {
  const std::vector<SharePair> pairs = share_candidates();
  return pairs.empty() ? 0 : share_pages(pairs);
}

std::size_t CachingAllocator::share_pages(const std::vector<SharePair>& pairs) {
  std::lock_guard<std::mutex> lock(mutex_);
  return share_pages_locked(pairs);
}

std::size_t CachingAllocator::share_pages_locked(const std::vector<SharePair>& pairs) {
  if (!config_.vmm || !device_->supports_page_sharing() || pairs.empty()) return 0;
  const std::size_t page = device_->granularity();
  // Queued work may still write the blocks about to be copied.
  device_->synchronize_device();
  ++stats_.num_sync_all_streams;
  synchronize_and_free_events();
  std::size_t given_back = 0;
  // Pages in use per segment, walked once each (a pair changes only its own two pages).
  std::unordered_map<const Segment*, std::vector<Ranges>> uses;
  auto uses_of = [&](const Segment* seg) -> std::vector<Ranges>& {
    auto it = uses.find(seg);
    if (it == uses.end()) it = uses.emplace(seg, page_uses(seg)).first;
    return it->second;
  };
  for (const SharePair& sp : pairs) {
    // Checked again: the pairs may have been found before blocks were freed (only freeing
    // can have happened since, under the caller's lock, and that keeps a pair disjoint),
    // and a bad pair from a caller must not corrupt memory.
    Segment* keep = segment_of(sp.keep);
    Segment* alias = segment_of(sp.alias);
    if (keep == nullptr || alias == nullptr || sp.keep % page != 0 || sp.alias % page != 0 ||
        sp.keep == sp.alias || shares_.count(sp.keep) != 0 || shares_.count(sp.alias) != 0) {
      continue;
    }
    const std::size_t ki = (sp.keep - keep->addr) / page, ai = (sp.alias - alias->addr) / page;
    // A page that nothing uses any more is better given back as it is.
    if (keep->pages[ki] == 0 || alias->pages[ai] == 0 || keep->users[ki] == 0 ||
        alias->users[ai] == 0) {
      continue;
    }
    const Ranges keep_used = uses_of(keep)[ki], alias_used = uses_of(alias)[ai];
    if (alias_used.empty() || !disjoint(keep_used, alias_used)) continue;
    if (!share_pair(keep, ki, alias, ai, alias_used)) break;
    given_back += page;
  }
  return given_back;
}

Segment* CachingAllocator::segment_of(std::uintptr_t addr) const {
  // A virtual segment of the pool (arenas excepted) holding addr, or nullptr.
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) return nullptr;
  Segment* seg = std::prev(it)->second;
  if (!seg->vmm || seg->arena || addr >= seg->addr + seg->size) return nullptr;
  return seg;
}

bool CachingAllocator::share_pair(Segment* keep, std::size_t ki, Segment* alias, std::size_t ai,
                                  const Ranges& alias_used) {
  // The alias page's live bytes go to the same offsets of the kept page (free there), then
  // the alias address maps the kept page and its own page goes back. A driver error leaves
  // the alias page mapped as it was and stops sharing.
  const std::size_t page = device_->granularity();
  const std::uintptr_t kaddr = keep->addr + ki * page, aaddr = alias->addr + ai * page;
  const PageHandle kept = keep->pages[ki], own = alias->pages[ai];
  try {
    for (const auto& [lo, hi] : alias_used) {
      device_->copy(reinterpret_cast<void*>(kaddr + lo), reinterpret_cast<const void*>(aaddr + lo),
                    hi - lo);
    }
    device_->unmap_page(reinterpret_cast<void*>(aaddr));
  } catch (const DeviceError&) {
    return false;
  }
  try {
    device_->map_page(reinterpret_cast<void*>(aaddr), kept);
  } catch (const DeviceError&) {
    try {
      device_->map_page(reinterpret_cast<void*>(aaddr), own);  // its bytes are still there
    } catch (const DeviceError&) {
      alias->pages[ai] = 0;  // lost: the address is unmapped, the page released
      --alias->mapped;
      device_->release_page(own);
      reserved_ -= static_cast<std::int64_t>(page);
      update_stat(&Stats::reserved_bytes, false, -static_cast<std::int64_t>(page));
      ++stats_.num_device_free;
      throw;
    }
    return false;
  }
  device_->release_page(own);
  alias->pages[ai] = kept;
  reserved_ -= static_cast<std::int64_t>(page);
  update_stat(&Stats::reserved_bytes, alias->small, -static_cast<std::int64_t>(page));
  ++stats_.num_device_free;
  auto* s = new Share{{keep, alias}, {ki, ai}, {}};
  // Each side's guards: the offsets the other side's blocks hold. The alias side owns only
  // its live ranges; the rest of the page (its free bytes included) stays with the kept side.
  auto guard_complement = [&](Segment* seg, std::size_t i, const Ranges& own_used,
                              std::vector<Block*>& out) {
    const std::uintptr_t base = seg->addr + i * page;
    std::size_t at = 0;
    for (const auto& [lo, hi] : own_used) {
      if (lo > at) out.push_back(make_guard(seg, base + at, base + lo));
      at = hi;
    }
    if (at < page) out.push_back(make_guard(seg, base + at, base + page));
  };
  guard_complement(alias, ai, alias_used, s->guards[1]);
  for (const auto& [lo, hi] : alias_used) s->guards[0].push_back(make_guard(keep, kaddr + lo, kaddr + hi));
  shares_[kaddr] = s;
  shares_[aaddr] = s;
  ++keep->shared_pages;
  ++alias->shared_pages;
  return true;
}

Block* CachingAllocator::cut_run(Block* b, std::uintptr_t lo, std::uintptr_t hi) {
  // Cut the run at lo and hi (the outer parts keep their owners) and merge what is between.
  erase_free(b);
  if (b->addr < lo) {
    Block* mid = split(b, lo);
    insert_free(b);
    b = mid;
  }
  while (b->addr + b->size < hi) {
    Block* next = b->next;
    erase_free(next);
    if (next->addr + next->size > hi) insert_free(split(next, hi));
    b = merge(b, next);
  }
  if (b->addr + b->size > hi) insert_free(split(b, hi));
  return b;
}

Block* CachingAllocator::make_guard(Segment* seg, std::uintptr_t lo, std::uintptr_t hi) {
  // [lo, hi) is free, inside one page: a run of listed blocks (of one owner, coalesced into
  // one; of several, merged here: the guard is nobody's).
  Block* b = seg->head;
  while (b->addr + b->size <= lo) b = b->next;
  Block* g = cut_run(b, lo, hi);
  g->guard = true;
  g->allocated = true;
  g->stream = kAnyStream;
  count_use(g, +1);
  update_stat(&Stats::inactive_split, false, 1);
  update_stat(&Stats::inactive_split_bytes, false, static_cast<std::int64_t>(g->size));
  return g;
}

void CachingAllocator::drop_guard(Block* g) {
  update_stat(&Stats::inactive_split, false, -1);
  update_stat(&Stats::inactive_split_bytes, false, -static_cast<std::int64_t>(g->size));
  count_use(g, -1);
  g->guard = false;
  g->allocated = false;
  g->stream = kAnyStream;  // its address's owners were synchronized (end_share)
  insert_free(coalesce(g));
}

void CachingAllocator::end_idle_shares(Segment* seg, std::size_t first, std::size_t last) {
  const std::size_t page = device_->granularity();
  for (std::size_t i = first; i <= last; ++i) {
    auto it = shares_.find(seg->addr + i * page);
    if (it == shares_.end()) continue;
    Share* s = it->second;
    const int side = s->seg[0] == seg && s->index[0] == i ? 0 : 1;
    if (seg->users[i] == s->guards[side].size()) end_share(s, side);
  }
}

void CachingAllocator::end_share(Share* s, int side) {
  // `side` has no block in use but its guards: its address is unmapped, and the page is the
  // other side's alone. Free blocks there may still be touched by their owners' queued work.
  const std::size_t page = device_->granularity();
  Segment* seg = s->seg[side];
  const std::size_t i = s->index[side];
  const std::uintptr_t plo = seg->addr + i * page;
  std::vector<StreamId> owners;
  for (const Block* b = seg->head; b != nullptr && b->addr < plo + page; b = b->next) {
    if (b->addr + b->size > plo && b->listed && b->stream != kAnyStream &&
        std::find(owners.begin(), owners.end(), b->stream) == owners.end()) {
      owners.push_back(b->stream);
    }
  }
  for (StreamId st : owners) synchronize_stream(st);
  device_->unmap_page(reinterpret_cast<void*>(plo));
  seg->pages[i] = 0;
  --seg->mapped;
  shares_.erase(plo);
  shares_.erase(s->seg[1 - side]->addr + s->index[1 - side] * page);
  --s->seg[0]->shared_pages;
  --s->seg[1]->shared_pages;
  for (Block* g : s->guards[side]) drop_guard(g);
  for (Block* g : s->guards[1 - side]) drop_guard(g);
  delete s;
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

// ---------------------------------------------------------------------------------------------
// Events and streams

void CachingAllocator::process_events() {
  poll_epochs();
  // Completed events release their blocks; incomplete ones stay queued.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!device_->query_event(it->event)) {
      ++it;
      continue;
    }
    PendingEvent done = *it;
    it = pending_.erase(it);
    complete_event(done);
    // complete_event may not touch pending_, so `it` stays valid.
  }
}

void CachingAllocator::synchronize_and_free_events() {
  if (!pending_.empty()) {
    ++stats_.num_sync_all_streams;
    std::deque<PendingEvent> all;
    all.swap(pending_);
    for (auto& p : all) {
      device_->synchronize_event(p.event);
      complete_event(p);
    }
  }
  synchronize_epochs();  // last: the blocks freed just now may have started one
}

void CachingAllocator::complete_event(const PendingEvent& p) {
  return_event(p.event);
  if (p.block != nullptr) {
    if (--p.block->pending_events == 0) free_block(p.block);
    return;
  }
  draining_.erase(std::remove(draining_.begin(), draining_.end(), p.drained_stream),
                  draining_.end());
  share_blocks_of(p.drained_stream, p.drain_seq);
}

void CachingAllocator::drain_other_streams(Pool& pool, StreamId stream) {
  // Ask every other stream holding free blocks in this pool to mark its queue; once the
  // mark is reached, the blocks it freed before are safe for any stream.
  bool recorded = false;
  Block probe;
  probe.size = 0;
  probe.addr = 0;
  for (auto it = pool.free.begin(); it != pool.free.end();) {
    const StreamId owner = (*it)->stream;
    if (owner == kAnyStream) break;  // kAnyStream sorts last
    if (owner != stream &&
        std::find(draining_.begin(), draining_.end(), owner) == draining_.end()) {
      EventHandle e = get_event();
      device_->record_event(e, owner);
      pending_.push_back({e, nullptr, owner, free_seq_});
      draining_.push_back(owner);
      recorded = true;
    }
    probe.stream = owner + 1;  // jump to the next owner
    it = pool.free.lower_bound(&probe);
  }
  if (recorded) process_events();
}

void CachingAllocator::share_blocks_of(StreamId owner, std::uint64_t up_to_seq) {
  for (Pool* pool : {&small_, &large_}) {
    Block probe;
    probe.stream = owner;
    probe.size = 0;
    probe.addr = 0;
    std::vector<Block*> blocks;
    for (auto it = pool->free.lower_bound(&probe);
         it != pool->free.end() && (*it)->stream == owner; ++it) {
      if ((*it)->free_seq <= up_to_seq) blocks.push_back(*it);
    }
    for (Block* b : blocks) {
      erase_free(b);
      b->stream = kAnyStream;
    }
    for (Block* b : blocks) {
      if (b->segment == nullptr) continue;  // absorbed by a neighbour shared in this pass
      b = coalesce(b);
      // A free neighbour still owned by one stream takes it in (its owner may use both): the
      // main stream's free space closes over a side stream's freed buffer even while the side
      // stream asks for nothing, at the price of that stream draining again to reuse it.
      Block* owned = nullptr;
      for (Block* n : {b->prev, b->next}) {
        if (n != nullptr && n->listed && n->stream != kAnyStream && n->claimed == b->claimed &&
            n->unmapped == b->unmapped) {
          owned = n;
          break;
        }
      }
      insert_free(b);
      if (owned != nullptr) {
        erase_free(owned);
        insert_free(coalesce(owned));
      }
    }
  }
  if (arena_free_.empty()) return;
  std::vector<Block*> blocks;
  for (Block* b : arena_free_) {
    if (b->stream == owner && b->free_seq <= up_to_seq) blocks.push_back(b);
  }
  for (Block* b : blocks) {
    erase_free(b);
    b->stream = kAnyStream;
  }
  for (Block* b : blocks) {
    if (b->segment == nullptr) continue;
    insert_free(coalesce(b));
  }
}

void CachingAllocator::start_drain(StreamId owner) {
  // Once an event recorded on `owner` now has completed, the blocks it freed so far are safe
  // for every stream (share_blocks_of).
  if (std::find(draining_.begin(), draining_.end(), owner) != draining_.end()) return;
  EventHandle e = get_event();
  device_->record_event(e, owner);
  pending_.push_back({e, nullptr, owner, free_seq_});
  draining_.push_back(owner);
}

EventHandle CachingAllocator::get_event() {
  if (event_pool_.empty()) return device_->create_event();
  EventHandle e = event_pool_.back();
  event_pool_.pop_back();
  return e;
}

void CachingAllocator::return_event(EventHandle e) { event_pool_.push_back(e); }

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
