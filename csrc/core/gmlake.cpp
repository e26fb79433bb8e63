#include "gmlake.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "errors.hpp"
#include "util.hpp"

namespace pymemplan {
namespace {

constexpr std::size_t kMinBlock = 512;
constexpr std::size_t kSmallRequest = kMiB;     // at most this: the small pool
constexpr std::size_t kSmallSegment = 2 * kMiB;  // torch's kSmallBuffer
constexpr std::size_t kMediumLimit = 10 * kMiB;  // torch's kMinLargeAlloc
constexpr std::size_t kMediumSegment = 20 * kMiB;  // torch's kLargeBuffer

const char* const kGMLakeKeys = "frag_limit_mb, reuse_limit";

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config

GMLakeConfig GMLakeConfig::parse(const std::string& conf) {
  GMLakeConfig c;
  for (std::string item : split_config_items(conf)) {
    item = trim_space(item);
    if (item.empty()) continue;
    const auto colon = item.find(':');
    if (colon == std::string::npos) {
      throw AllocatorError("allocator config: '" + item + "' is not of the form key:value; " +
                           "valid keys for policy 'gmlake': " + kGMLakeKeys);
    }
    const std::string key = trim_space(item.substr(0, colon));
    const std::string value = trim_space(item.substr(colon + 1));
    if (key == "frag_limit_mb") {
      const char* expected = "an integer >= 0 (MiB; 0 stitches every request over 1 MiB)";
      const long long mb = parse_config_int(key, value, expected);
      if (mb < 0 || mb > (1LL << 40)) bad_config_value(key, value, expected);
      c.frag_limit = static_cast<std::size_t>(mb) * kMiB;
    } else if (key == "reuse_limit") {
      const char* expected = "a number >= 1";
      std::size_t used = 0;
      double v = 0;
      try {
        v = std::stod(value, &used);
      } catch (const std::exception&) {
        bad_config_value(key, value, expected);
      }
      if (used != value.size() || !(v >= 1.0) || !std::isfinite(v)) {
        bad_config_value(key, value, expected);
      }
      c.reuse_limit = v;
    } else {
      throw AllocatorError("allocator config: unknown key '" + key +
                           "' for policy 'gmlake'; valid keys: " + kGMLakeKeys);
    }
  }
  return c;
}

std::string GMLakeConfig::to_string() const {
  std::ostringstream out;
  out << "frag_limit_mb:" << frag_limit / kMiB << ",reuse_limit:" << reuse_limit;
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Orders and helpers

bool GMLakeAllocator::BlkOrder::operator()(const Blk* a, const Blk* b) const {
  // torch's BlockComparatorSize: stream, then size, then address.
  if (a->seg->stream != b->seg->stream) return a->seg->stream < b->seg->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->seg->addr + a->off < b->seg->addr + b->off;
}

bool GMLakeAllocator::StitchOrder::operator()(const Stitch* a, const Stitch* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->cached_size != b->cached_size) return a->cached_size < b->cached_size;
  return a->addr < b->addr;
}

GMLakeAllocator::GMLakeAllocator(std::shared_ptr<Device> device, GMLakeConfig config)
    : LockedAllocator(std::move(device)), config_(config), page_(device_ ? device_->granularity() : 0) {
  if (!device_) throw AllocatorError("policy 'gmlake' needs a device");
  if (!device_->supports_vmm() || !device_->supports_page_sharing()) {
    throw AllocatorError("policy 'gmlake' stitches physical pages into new address ranges, which "
                         "needs a device with virtual memory and pages mapped at several "
                         "addresses; this device has not");
  }
  if (page_ == 0 || page_ % kMinBlock != 0) {
    throw AllocatorError("policy 'gmlake': the device's granularity must be a multiple of 512 B");
  }
}

GMLakeAllocator::~GMLakeAllocator() {
  // The memory goes away with the allocator: wait for queued work, return everything.
  try {
    for (auto& p : pending_) {
      device_->synchronize_event(p.event);
      device_->destroy_event(p.event);
    }
    std::set<StreamId> streams;
    for (auto& [addr, seg] : segs_) {
      streams.insert(seg->stream);
      for (auto& [off, b] : seg->blocks) streams.insert(b->uses.begin(), b->uses.end());
    }
    for (auto& [addr, st] : stitches_) streams.insert(st->uses.begin(), st->uses.end());
    sync_streams(streams);
    while (!stitches_.empty()) delete_stitch(stitches_.begin()->second.get());
    while (!segs_.empty()) release_segment(segs_.begin()->second.get());
  } catch (...) {
    // A destructor must not throw; the device is going away anyway.
  }
}

void GMLakeAllocator::update_stat(StatArray Stats::*field, bool small, std::int64_t delta) {
  pymemplan::update_stat(stats_.*field, small, delta);
}

// Snapshots show a block lent to a stitched block as inactive in its own segment: its bytes
// are in use through the stitched address (as share_pages' guards are, in CachingAllocator).
void GMLakeAllocator::split_stat(const Seg* seg, int sign) {
  if (seg->blocks.size() < 2) return;
  update_stat(&Stats::inactive_split, seg->small, sign * static_cast<std::int64_t>(seg->inactive_n));
  update_stat(&Stats::inactive_split_bytes, seg->small,
              sign * static_cast<std::int64_t>(seg->inactive_bytes));
}

void GMLakeAllocator::stitch_split_stat(const Stitch* s, int sign) {
  if (s->used == 0 || s->used == s->size()) return;
  update_stat(&Stats::inactive_split, false, sign);
  update_stat(&Stats::inactive_split_bytes, false,
              sign * static_cast<std::int64_t>(s->size() - s->used));
}

void GMLakeAllocator::set_state(Blk* b, State s) {
  auto inactive = [](State x) { return x == State::Free || x == State::Stitched; };
  if (inactive(b->state) && !inactive(s)) {
    --b->seg->inactive_n;
    b->seg->inactive_bytes -= b->size;
  } else if (!inactive(b->state) && inactive(s)) {
    ++b->seg->inactive_n;
    b->seg->inactive_bytes += b->size;
  }
  b->state = s;
}

void GMLakeAllocator::unlist(Blk* b) { (b->seg->small ? small_free_ : large_free_).erase(b); }

void GMLakeAllocator::list(Blk* b) { (b->seg->small ? small_free_ : large_free_).insert(b); }

GMLakeAllocator::Blk* GMLakeAllocator::neighbour(Blk* b, bool after) const {
  auto& blocks = b->seg->blocks;
  auto it = blocks.find(b->off);
  if (after) {
    ++it;
    return it == blocks.end() ? nullptr : it->second;
  }
  return it == blocks.begin() ? nullptr : std::prev(it)->second;
}

// b is Free and unlisted, inside a split_stat bracket; merges it with free neighbours.
void GMLakeAllocator::merge_free(Blk* b) {
  for (bool after : {false, true}) {
    Blk* n = neighbour(b, after);
    if (n == nullptr || n->state != State::Free) continue;
    unlist(n);
    Blk* keep = after ? b : n;
    Blk* gone = after ? n : b;
    // Both are inactive: the segment's inactive bytes stay; one block fewer.
    --b->seg->inactive_n;
    keep->size += gone->size;
    b->seg->blocks.erase(gone->off);
    spare_.push_back(gone);
    b = keep;
  }
  list(b);
}

GMLakeAllocator::Blk* GMLakeAllocator::new_blk(Seg* seg, std::size_t off, std::size_t size) {
  Blk* b;
  if (spare_.empty()) {
    blk_store_.push_back(std::make_unique<Blk>());
    b = blk_store_.back().get();
  } else {
    b = spare_.back();
    spare_.pop_back();
  }
  *b = Blk{};
  b->seg = seg;
  b->off = off;
  b->size = size;
  return b;
}

GMLakeAllocator::Blk* GMLakeAllocator::carve(Blk* b, std::size_t off, std::size_t size) {
  Seg* seg = b->seg;
  split_stat(seg, -1);
  unlist(b);
  auto piece = [&](std::size_t at, std::size_t n) {
    Blk* p = new_blk(seg, at, n);
    seg->blocks[at] = p;
    ++seg->inactive_n;  // bytes already counted in b's
    return p;
  };
  const std::size_t end = b->off + b->size;
  if (off + size < end) list(piece(off + size, end - off - size));
  if (off > b->off) {
    Blk* mid = piece(off, size);
    b->size = off - b->off;
    list(b);
    b = mid;
  } else {
    b->size = size;
  }
  split_stat(seg, +1);
  return b;
}

std::size_t GMLakeAllocator::round_size(std::size_t size) const {
  // GMLake's round_size: 512 B steps, and whole 2 MiB pages above 1 MiB.
  std::size_t r = size < kMinBlock ? kMinBlock : round_up(size, kMinBlock);
  if (r > kSmallRequest) r = round_up(r, page_);
  return r;
}

std::size_t GMLakeAllocator::large_segment_size(std::size_t rounded) const {
  return rounded < kMediumLimit ? round_up(kMediumSegment, page_) : rounded;
}

// ---------------------------------------------------------------------------------------------
// Allocation

GMLakeAllocator::Blk* GMLakeAllocator::best_fit(bool small, std::size_t rounded, StreamId stream) {
  auto& pool = small ? small_free_ : large_free_;
  Seg probe_seg;
  probe_seg.stream = stream;
  Blk probe;
  probe.seg = &probe_seg;
  probe.size = rounded;
  auto it = pool.lower_bound(&probe);
  if (it == pool.end() || (*it)->seg->stream != stream) return nullptr;
  return *it;
}

void* GMLakeAllocator::serve_block(Blk* b, std::size_t rounded, std::size_t size) {
  Seg* seg = b->seg;
  const std::size_t rest = b->size - rounded;
  // torch splits small blocks down to 512 B; GMLake large ones only by whole pages.
  const bool split = seg->small ? rest >= kMinBlock : rest >= page_;
  if (split) b = carve(b, b->off, rounded);
  split_stat(seg, -1);
  unlist(b);
  set_state(b, State::Allocated);
  split_stat(seg, +1);
  b->requested = size;
  update_stat(&Stats::allocation, seg->small, 1);
  update_stat(&Stats::allocated_bytes, seg->small, static_cast<std::int64_t>(b->size));
  update_stat(&Stats::requested_bytes, seg->small, static_cast<std::int64_t>(size));
  update_stat(&Stats::active, seg->small, 1);
  update_stat(&Stats::active_bytes, seg->small, static_cast<std::int64_t>(b->size));
  const std::uintptr_t addr = seg->addr + b->off;
  allocated_[addr] = b;
  return reinterpret_cast<void*>(addr);
}

GMLakeAllocator::Stitch* GMLakeAllocator::reuse_stitch(std::size_t rounded, StreamId stream) {
  Stitch probe;
  probe.stream = stream;
  probe.cached_size = rounded;  // address 0: before every cached block of that size
  Stitch* found = nullptr;
  auto page_free = [&](const std::pair<Seg*, std::size_t>& p) {
    auto it = p.first->blocks.upper_bound(p.second * page_);
    return std::prev(it)->second->state == State::Free;
  };
  for (auto it = cached_.lower_bound(&probe); it != cached_.end() && (*it)->stream == stream; ++it) {
    Stitch* s = *it;
    // GMLake keeps apart the stitched blocks some of whose pages are in use again.
    if (!std::all_of(s->pages.begin(), s->pages.end(), page_free)) continue;
    if (static_cast<double>(s->size()) > config_.reuse_limit * static_cast<double>(rounded)) {
      return nullptr;  // the smallest one wastes too much address space... and pages
    }
    found = s;
    break;
  }
  if (found == nullptr) return nullptr;
  // Its first pages serve the request: lend them, a run of consecutive pages at a time.
  const std::size_t n = rounded / page_;
  for (std::size_t i = 0; i < n;) {
    Seg* seg = found->pages[i].first;
    const std::size_t first = found->pages[i].second;
    std::size_t j = i + 1;
    while (j < n && found->pages[j].first == seg && found->pages[j].second == first + (j - i)) ++j;
    Blk* b = std::prev(seg->blocks.upper_bound(first * page_))->second;
    Blk* part = carve(b, first * page_, (j - i) * page_);
    part->state = State::Stitched;  // inactive either way: no count changes
    found->parts.push_back(part);
    i = j;
  }
  cached_.erase(found);
  found->used = rounded;
  found->state = State::Allocated;
  stitch_split_stat(found, +1);
  return found;
}

GMLakeAllocator::Stitch* GMLakeAllocator::stitch(std::size_t rounded, StreamId stream) {
  Seg probe_seg;  // the stream's free blocks: from size 0 to the largest size there is
  probe_seg.stream = stream;
  Blk lo, hi;
  lo.seg = hi.seg = &probe_seg;
  hi.size = std::numeric_limits<std::size_t>::max();
  const auto begin = large_free_.lower_bound(&lo);
  const auto end = large_free_.lower_bound(&hi);
  if (begin == end || std::next(begin) == end) return nullptr;  // needs two blocks at least
  std::vector<Blk*> chosen;
  std::size_t total = 0;
  for (auto it = end; it != begin && total < rounded;) {
    --it;
    chosen.push_back(*it);
    total += (*it)->size;
  }
  if (total < rounded) return nullptr;
  const std::size_t n = rounded / page_;
  const std::size_t va = n * page_;
  void* addr = device_->reserve_address(va);
  auto s = std::make_unique<Stitch>();
  s->addr = reinterpret_cast<std::uintptr_t>(addr);
  s->stream = stream;
  s->page = page_;
  s->va = va;
  std::vector<PageHandle> handles;
  handles.reserve(n);
  std::size_t left = rounded;
  for (Blk* b : chosen) {
    // The last one gives only the front it needs; its tail stays free.
    Blk* part = carve(b, b->off, std::min(b->size, left));
    part->state = State::Stitched;
    s->parts.push_back(part);
    for (std::size_t off = part->off; off < part->off + part->size; off += page_) {
      s->pages.emplace_back(part->seg, off / page_);
      handles.push_back(part->seg->pages[off / page_]);
    }
    left -= part->size;
  }
  try {
    device_->map_pages(addr, handles.data(), handles.size());
  } catch (const DeviceOutOfMemory&) {
    for (Blk* part : s->parts) {
      split_stat(part->seg, -1);
      part->state = State::Free;
      merge_free(part);
      split_stat(part->seg, +1);
    }
    device_->release_address(addr, va);
    return nullptr;
  }
  s->used = rounded;
  s->state = State::Allocated;
  update_stat(&Stats::segment, false, 1);
  Stitch* out = s.get();
  stitches_[s->addr] = std::move(s);
  return out;
}

GMLakeAllocator::Blk* GMLakeAllocator::new_segment(bool small, std::size_t rounded, StreamId stream) {
  const std::size_t bytes = small ? kSmallSegment : large_segment_size(rounded);
  if (limit_ != 0 && static_cast<std::size_t>(reserved_) + bytes > limit_) return nullptr;
  auto seg = std::make_unique<Seg>();
  seg->size = bytes;
  seg->stream = stream;
  seg->small = small;
  if (small) {
    void* p = device_->allocate_segment(bytes);
    if (p == nullptr) return nullptr;
    seg->addr = reinterpret_cast<std::uintptr_t>(p);
    ++stats_.num_device_alloc;
  } else {
    // One cuMemCreate per page, one address range, the pages mapped into it.
    void* p = device_->reserve_address(bytes);
    const std::size_t n = bytes / page_;
    auto give_back = [&] {
      for (PageHandle h : seg->pages) device_->release_page(h);
      device_->release_address(p, bytes);
    };
    for (std::size_t i = 0; i < n; ++i) {
      PageHandle h = device_->create_page();
      if (h == 0) {
        give_back();
        return nullptr;
      }
      seg->pages.push_back(h);
    }
    try {
      device_->map_pages(p, seg->pages.data(), n);
    } catch (const DeviceOutOfMemory&) {
      give_back();
      return nullptr;
    }
    seg->addr = reinterpret_cast<std::uintptr_t>(p);
    stats_.num_device_alloc += static_cast<std::int64_t>(n);
  }
  Blk* b = new_blk(seg.get(), 0, bytes);
  seg->blocks[0] = b;
  seg->inactive_n = 1;
  seg->inactive_bytes = bytes;
  list(b);
  reserved_ += static_cast<std::int64_t>(bytes);
  update_stat(&Stats::reserved_bytes, small, static_cast<std::int64_t>(bytes));
  update_stat(&Stats::segment, small, 1);
  segs_[seg->addr] = std::move(seg);
  return b;
}

void* GMLakeAllocator::allocate_locked(std::size_t size, StreamId stream, std::string* oom) {
  process_events(false);
  const std::size_t rounded = round_size(size);
  if (rounded > device_->capacity()) {  // no segment or stitch that large can exist
    ++stats_.num_ooms;
    *oom = oom_message(size, rounded, stream);
    return nullptr;
  }
  const bool small = rounded <= kSmallRequest;
  if (Blk* b = best_fit(small, rounded, stream)) return serve_block(b, rounded, size);
  Stitch* s = nullptr;
  if (!small) {
    s = reuse_stitch(rounded, stream);
    if (s == nullptr && rounded >= config_.frag_limit) s = stitch(rounded, stream);
  }
  if (s != nullptr) {
    s->requested = size;
    update_stat(&Stats::allocation, false, 1);
    update_stat(&Stats::allocated_bytes, false, static_cast<std::int64_t>(s->used));
    update_stat(&Stats::requested_bytes, false, static_cast<std::int64_t>(size));
    update_stat(&Stats::active, false, 1);
    update_stat(&Stats::active_bytes, false, static_cast<std::int64_t>(s->used));
    allocated_stitches_[s->addr] = s;
    return reinterpret_cast<void*>(s->addr);
  }
  Blk* b = new_segment(small, rounded, stream);
  if (b == nullptr) {
    // torch's ladder: give back every cached segment wholly free, then try once more.
    ++stats_.num_alloc_retries;
    release_cached();
    b = new_segment(small, rounded, stream);
  }
  if (b == nullptr) {
    ++stats_.num_ooms;
    *oom = oom_message(size, rounded, stream);
    return nullptr;
  }
  return serve_block(b, rounded, size);
}

std::string GMLakeAllocator::oom_message(std::size_t size, std::size_t rounded, StreamId stream) const {
  std::ostringstream m;
  m << "gmlake: out of memory: tried to allocate " << format_bytes(static_cast<long long>(size))
    << " (rounded to " << format_bytes(static_cast<long long>(rounded)) << ") on stream " << stream
    << "; " << format_bytes(reserved_) << " reserved, "
    << format_bytes(stats_.allocated_bytes[kAllPools].current) << " allocated";
  if (limit_ != 0) m << ", memory limit " << format_bytes(static_cast<long long>(limit_));
  m << ", device capacity " << format_bytes(static_cast<long long>(device_->capacity()));
  return m.str();
}

// ---------------------------------------------------------------------------------------------
// Freeing and giving back

void GMLakeAllocator::process_events(bool wait) {
  for (std::size_t i = 0; i < pending_.size();) {
    Pending p = pending_[i];
    if (wait) device_->synchronize_event(p.event);
    if (!wait && !device_->query_event(p.event)) {
      ++i;
      continue;
    }
    device_->destroy_event(p.event);
    pending_[i] = pending_.back();
    pending_.pop_back();
    if (p.blk != nullptr && --p.blk->pending == 0) finish_free_block(p.blk);
    if (p.stitch != nullptr && --p.stitch->pending == 0) finish_free_stitch(p.stitch);
  }
}

void GMLakeAllocator::finish_free_block(Blk* b) {
  Seg* seg = b->seg;
  update_stat(&Stats::active, seg->small, -1);
  update_stat(&Stats::active_bytes, seg->small, -static_cast<std::int64_t>(b->size));
  split_stat(seg, -1);
  set_state(b, State::Free);
  b->requested = 0;
  merge_free(b);
  split_stat(seg, +1);
}

void GMLakeAllocator::finish_free_stitch(Stitch* s) {
  update_stat(&Stats::active, false, -1);
  update_stat(&Stats::active_bytes, false, -static_cast<std::int64_t>(s->used));
  stitch_split_stat(s, -1);
  for (Blk* part : s->parts) {
    split_stat(part->seg, -1);
    part->state = State::Free;  // inactive either way
    merge_free(part);
    split_stat(part->seg, +1);
  }
  s->parts.clear();
  s->used = 0;
  s->requested = 0;
  s->state = State::Free;
  if (s->doomed) {
    sync_streams({s->stream});  // its pages are unmapped now: the work queued on them first
    delete_stitch(s);
  } else {
    s->cached_size = s->size();
    cached_.insert(s);
  }
}

void GMLakeAllocator::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto record = [&](const std::vector<StreamId>& uses) {
    std::vector<EventHandle> events;
    try {
      for (StreamId s : uses) {
        events.push_back(device_->create_event());
        device_->record_event(events.back(), s);
      }
    } catch (...) {
      for (EventHandle e : events) device_->destroy_event(e);
      throw;
    }
    return events;
  };
  if (auto it = allocated_.find(addr); it != allocated_.end()) {
    Blk* b = it->second;
    const auto events = record(b->uses);
    allocated_.erase(it);
    update_stat(&Stats::allocation, b->seg->small, -1);
    update_stat(&Stats::allocated_bytes, b->seg->small, -static_cast<std::int64_t>(b->size));
    update_stat(&Stats::requested_bytes, b->seg->small, -static_cast<std::int64_t>(b->requested));
    b->uses.clear();
    if (events.empty()) {
      finish_free_block(b);
      return;
    }
    b->state = State::Pending;  // active either way
    for (EventHandle e : events) pending_.push_back({e, b, nullptr});
    b->pending = static_cast<int>(events.size());
    return;
  }
  if (auto it = allocated_stitches_.find(addr); it != allocated_stitches_.end()) {
    Stitch* s = it->second;
    const auto events = record(s->uses);
    allocated_stitches_.erase(it);
    update_stat(&Stats::allocation, false, -1);
    update_stat(&Stats::allocated_bytes, false, -static_cast<std::int64_t>(s->used));
    update_stat(&Stats::requested_bytes, false, -static_cast<std::int64_t>(s->requested));
    s->uses.clear();
    if (events.empty()) {
      finish_free_stitch(s);
      return;
    }
    s->state = State::Pending;
    for (EventHandle e : events) pending_.push_back({e, nullptr, s});
    s->pending = static_cast<int>(events.size());
    return;
  }
  std::ostringstream m;
  m << "free of pointer 0x" << std::hex << addr
    << " that this allocator did not hand out or that was freed already (policy 'gmlake')";
  throw AllocatorError(m.str());
}

void GMLakeAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  StreamId own;
  std::vector<StreamId>* uses;
  if (auto it = allocated_.find(addr); it != allocated_.end()) {
    own = it->second->seg->stream;
    uses = &it->second->uses;
  } else if (auto st = allocated_stitches_.find(addr); st != allocated_stitches_.end()) {
    own = st->second->stream;
    uses = &st->second->uses;
  } else {
    std::ostringstream m;
    m << "record_stream of pointer 0x" << std::hex << addr
      << " that this allocator did not hand out or that was freed already (policy 'gmlake')";
    throw AllocatorError(m.str());
  }
  if (stream != own && std::find(uses->begin(), uses->end(), stream) == uses->end()) {
    uses->push_back(stream);
  }
}

void GMLakeAllocator::delete_stitch(Stitch* s) {
  device_->unmap_pages(reinterpret_cast<void*>(s->addr), s->pages.size());
  device_->release_address(reinterpret_cast<void*>(s->addr), s->va);
  update_stat(&Stats::segment, false, -1);
  cached_.erase(s);
  stitches_.erase(s->addr);
}

void GMLakeAllocator::release_segment(Seg* seg) {
  if (!seg->small) {
    // Stitched blocks mapping its pages go first: those cached at once; one in use (its
    // pages past what it serves are in this segment) loses its range and goes when freed.
    std::vector<Stitch*> hit;
    for (auto& [addr, s] : stitches_) {
      for (const auto& p : s->pages) {
        if (p.first == seg) {
          hit.push_back(s.get());
          break;
        }
      }
    }
    for (Stitch* s : hit) {
      if (s->used == 0) {
        delete_stitch(s);
        continue;
      }
      // In use: unmap the unused tail (none of its pages are lent to it) and keep the rest;
      // the address range goes back whole when it is freed.
      const std::size_t keep = s->used / page_;
      stitch_split_stat(s, -1);
      device_->unmap_pages(reinterpret_cast<void*>(s->addr + keep * page_), s->pages.size() - keep);
      s->pages.resize(keep);
      s->doomed = true;
      stitch_split_stat(s, +1);
    }
  }
  split_stat(seg, -1);
  for (auto& [off, b] : seg->blocks) {
    if (b->state == State::Free) unlist(b);
    spare_.push_back(b);
  }
  if (seg->small) {
    device_->free_segment(reinterpret_cast<void*>(seg->addr), seg->size);
    ++stats_.num_device_free;
  } else {
    device_->unmap_pages(reinterpret_cast<void*>(seg->addr), seg->pages.size());
    for (PageHandle h : seg->pages) device_->release_page(h);
    device_->release_address(reinterpret_cast<void*>(seg->addr), seg->size);
    stats_.num_device_free += static_cast<std::int64_t>(seg->pages.size());
  }
  reserved_ -= static_cast<std::int64_t>(seg->size);
  update_stat(&Stats::reserved_bytes, seg->small, -static_cast<std::int64_t>(seg->size));
  update_stat(&Stats::segment, seg->small, -1);
  segs_.erase(seg->addr);
}

void GMLakeAllocator::sync_streams(const std::set<StreamId>& streams) {
  for (StreamId s : streams) {
    EventHandle e = device_->create_event();
    device_->record_event(e, s);
    device_->synchronize_event(e);
    device_->destroy_event(e);
  }
}

void GMLakeAllocator::release_cached() {
  // torch's release_cached_blocks(): wait for outstanding events, then return every segment
  // that is one free block (stitched blocks mapping its pages with it: their streams are
  // the segment's).
  process_events(true);
  ++stats_.num_sync_all_streams;
  std::vector<Seg*> idle;
  std::set<StreamId> streams;
  for (auto& [addr, seg] : segs_) {
    if (seg->blocks.size() == 1 && seg->blocks.begin()->second->state == State::Free) {
      idle.push_back(seg.get());
      if (!seg->small) streams.insert(seg->stream);
    }
  }
  sync_streams(streams);
  for (Seg* seg : idle) release_segment(seg);
}

// ---------------------------------------------------------------------------------------------
// Public entry points

void* GMLakeAllocator::malloc(std::int64_t size, StreamId stream) {
  std::string message;
  void* p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    p = allocate_locked(checked_request_size(size), stream, &message);
    if (p == nullptr) last_error_ = message;
  }
  if (p == nullptr) throw OutOfMemoryError(message);
  return p;
}

void* GMLakeAllocator::try_malloc(std::int64_t size, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string message;
  void* p = allocate_locked(checked_request_size(size), stream, &message);
  if (p == nullptr) last_error_ = std::move(message);
  return p;
}

bool GMLakeAllocator::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  return allocated_.count(addr) != 0 || allocated_stitches_.count(addr) != 0;
}

void GMLakeAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  // GMLake's emptyCache: cached segments back, then every cached stitched range.
  release_cached();
  std::vector<Stitch*> cached(cached_.begin(), cached_.end());
  std::set<StreamId> streams;
  for (Stitch* s : cached) streams.insert(s->stream);
  sync_streams(streams);
  for (Stitch* s : cached) delete_stitch(s);
}

std::string GMLakeAllocator::last_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_error_;
}

std::int64_t GMLakeAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

std::vector<SegmentInfo> GMLakeAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SegmentInfo> out;
  auto add_block = [](SegmentInfo& info, std::uintptr_t addr, std::size_t size, std::size_t requested,
                      const char* state) {
    BlockInfo bi;
    bi.address = addr;
    bi.size = size;
    bi.state = state;
    if (bi.state != "inactive") {
      bi.requested_size = requested;
      info.active_size += size;
      if (bi.state == "active_allocated") {
        info.allocated_size += size;
        info.requested_size += requested;
      }
    }
    info.blocks.push_back(bi);
  };
  for (const auto& [addr, seg] : segs_) {
    SegmentInfo info;
    info.address = seg->addr;
    info.total_size = seg->size;
    info.stream = seg->stream;
    info.segment_type = seg->small ? "small" : "large";
    if (!seg->small) {
      info.is_virtual = true;
      info.page_size = info.chunk_size = page_;
      info.mapped_size = seg->size;
      info.page_mapped.assign(seg->pages.size(), true);
      info.page_aliased.assign(seg->pages.size(), false);
    }
    for (const auto& [off, b] : seg->blocks) {
      const char* state = b->state == State::Allocated ? "active_allocated"
                          : b->state == State::Pending ? "active_pending_free"
                                                       : "inactive";
      add_block(info, seg->addr + off, b->size, b->requested, state);
    }
    out.push_back(std::move(info));
  }
  for (const auto& [addr, s] : stitches_) {
    // Its pages are the primary segments' (counted there): mapped here as aliases.
    SegmentInfo info;
    info.address = s->addr;
    info.total_size = s->size();
    info.stream = s->stream;
    info.segment_type = "large";
    info.is_virtual = true;
    info.page_size = info.chunk_size = page_;
    info.mapped_size = 0;
    info.page_mapped.assign(s->pages.size(), true);
    info.page_aliased.assign(s->pages.size(), true);
    if (s->used != 0) {
      add_block(info, s->addr, s->used, s->requested,
                s->state == State::Pending ? "active_pending_free" : "active_allocated");
    }
    if (s->used < s->size()) add_block(info, s->addr + s->used, s->size() - s->used, 0, "inactive");
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  return out;
}

std::string GMLakeAllocator::self_check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t listed = 0;
  for (const auto& [addr, seg] : segs_) {
    std::size_t at = 0, inactive_n = 0, inactive_bytes = 0;
    for (const auto& [off, b] : seg->blocks) {
      if (off != at || b->off != off || b->seg != seg.get()) return "blocks do not tile a segment";
      at += b->size;
      const bool free = b->state == State::Free;
      const auto& pool = seg->small ? small_free_ : large_free_;
      if (free != (pool.count(b) != 0)) return "a block's state disagrees with the free lists";
      listed += free;
      if (free || b->state == State::Stitched) {
        ++inactive_n;
        inactive_bytes += b->size;
      }
    }
    if (at != seg->size) return "blocks do not cover a segment";
    if (inactive_n != seg->inactive_n || inactive_bytes != seg->inactive_bytes) {
      return "a segment's inactive counts are wrong";
    }
  }
  if (listed != small_free_.size() + large_free_.size()) return "a free list holds a stale block";
  for (const auto& [addr, s] : stitches_) {
    const bool cached = cached_.count(s.get()) != 0;
    if (cached != (s->state == State::Free) || cached != (s->used == 0)) {
      return "a stitched block's state disagrees with the cache";
    }
    if (cached && s->cached_size != s->size()) return "a cached stitched block is listed by a stale size";
    std::size_t lent = 0;
    for (const Blk* part : s->parts) {
      if (part->state != State::Stitched) return "a stitched block's part is not lent to it";
      lent += part->size;
    }
    if (lent != s->used) return "a stitched block's parts do not add up to what it serves";
  }
  return "";
}

}  // namespace pymemplan
