// Plan-guided placement: see planned.hpp for the design.
#include "planned.hpp"

#include <algorithm>
#include <cctype>
#include <functional>
#include <sstream>

#include "errors.hpp"
#include "packing.hpp"

namespace pymemplan {
namespace {

constexpr std::uint64_t kHashBase = 1099511628211ULL;  // odd: arithmetic mod 2^64 stays invertible
constexpr std::size_t kAlign = 512;
// A candidate period is planned only if at least this share of the bytes allocated during it
// have a lifetime known and within the period (the rest would bypass the plan).
constexpr double kMinCoverage = 0.5;
// Candidate periods examined per detection (newest occurrences of the window, plus the oldest).
constexpr std::size_t kMaxCandidates = 24;
// Validation: a plan is armed at its cut only after a pass (cut to cut, or from adoption to
// the cut) in which requests of less than arena / kArmShare bytes failed to match it; an armed
// plan lets its arena go once mismatched requests exceed arena / kDisarmShare bytes in a pass.
constexpr std::size_t kArmShare = 32;
// Smallest share of the highest live (requested) bytes a plan's bound must reach to be armed.
constexpr double kMinPlanShare = 0.2;
constexpr std::size_t kDisarmShare = 16;

std::uint64_t mix(std::uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t alloc_token(std::size_t rounded, StreamId stream) {
  return mix(mix(static_cast<std::uint64_t>(rounded)) ^ (stream * 0x2545f4914f6cdd1dULL));
}

std::uint64_t free_token(std::uint64_t distance) { return mix(distance ^ 0xf1ee5eedf1ee5eedULL); }

std::uint64_t pow_base(std::uint64_t e) {
  std::uint64_t r = 1, b = kHashBase;
  while (e != 0) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return r;
}

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string to_hex(std::uintptr_t addr) {
  std::ostringstream s;
  s << "0x" << std::hex << addr;
  return s.str();
}

struct PlannedKey {
  const char* key;
  std::size_t PlannedConfig::*field;
  std::size_t lo, hi;
};
constexpr PlannedKey kPlannedKeys[] = {
    {"min_period", &PlannedConfig::min_period, 2, std::size_t{1} << 24},
    {"match_window", &PlannedConfig::match_window, 4, std::size_t{1} << 16},
    {"max_period", &PlannedConfig::max_period, 2, std::size_t{1} << 24},
    {"max_plans", &PlannedConfig::max_plans, 1, 1024},
    {"resync_window", &PlannedConfig::resync_window, 0, std::size_t{1} << 20},
    {"search_rounds", &PlannedConfig::search_rounds, 0, 100000},
};

std::string planned_keys() {
  std::string out;
  for (const auto& k : kPlannedKeys) {
    out += out.empty() ? "" : ", ";
    out += std::string(k.key) + " (an integer in [" + std::to_string(k.lo) + ", " +
           std::to_string(k.hi) + "])";
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config

PlannedConfig PlannedConfig::parse(const std::string& conf) {
  PlannedConfig c;
  std::string rest;  // keys of the pool, parsed by PolicyConfig
  std::stringstream items(conf);
  std::string item;
  while (std::getline(items, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    const auto colon = item.find(':');
    const std::string key = trim(item.substr(0, colon));
    const PlannedKey* known = nullptr;
    for (const auto& k : kPlannedKeys) {
      if (colon != std::string::npos && key == k.key) known = &k;
    }
    if (known == nullptr) {
      rest += (rest.empty() ? "" : ",") + item;
      continue;
    }
    const std::string value = trim(item.substr(colon + 1));
    const std::string expected = "an integer in [" + std::to_string(known->lo) + ", " +
                                 std::to_string(known->hi) + "]";
    std::size_t pos = 0;
    long long v = -1;
    try {
      v = std::stoll(value, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (value.empty() || pos != value.size() || v < 0 ||
        static_cast<unsigned long long>(v) < known->lo ||
        static_cast<unsigned long long>(v) > known->hi) {
      throw AllocatorError("allocator config: bad value '" + value + "' for '" + key +
                           "': expected " + expected);
    }
    c.*(known->field) = static_cast<std::size_t>(v);
  }
  try {
    c.pool = PolicyConfig::parse("pymemplan", rest);
  } catch (const AllocatorError& e) {
    throw AllocatorError(std::string(e.what()) + "; policy 'pymemplan-planned' also takes: " +
                         planned_keys());
  }
  if (c.min_period > c.max_period) {
    throw AllocatorError("allocator config: min_period (" + std::to_string(c.min_period) +
                         ") is above max_period (" + std::to_string(c.max_period) + ")");
  }
  return c;
}

std::string PlannedConfig::to_string() const {
  std::ostringstream out;
  for (const auto& k : kPlannedKeys) out << k.key << ':' << this->*(k.field) << ',';
  out << pool.to_string();
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Construction

PlannedAllocator::PlannedAllocator(std::shared_ptr<Device> device, PlannedConfig config)
    : device_(std::move(device)), config_(std::move(config)) {
  if (!device_) throw AllocatorError("PlannedAllocator needs a device");
  pool_ = std::make_unique<CachingAllocator>(device_, config_.pool);
  prefix_.push_back(0);
  last_pool_ = pool_->stats();
  stats_ = last_pool_;
}

PlannedAllocator::~PlannedAllocator() {
  try {
    for (const Pending& p : pending_) device_->synchronize_event(p.event);
    for (const Pending& p : pending_) device_->destroy_event(p.event);
    for (EventHandle e : event_pool_) device_->destroy_event(e);
    for (const auto& a : arenas_) {
      if (!a->borrowed) device_->free_segment(reinterpret_cast<void*>(a->addr), a->size);
    }
  } catch (...) {
    // A destructor cannot report; the device is being torn down anyway.
  }
}

// ---------------------------------------------------------------------------------------------
// Public entry points

void* PlannedAllocator::malloc(std::int64_t size, StreamId stream) {
  std::string message;
  void* p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (size <= 0) {
      throw AllocatorError("invalid allocation size " + std::to_string(size) +
                           ": the size must be a positive number of bytes");
    }
    bool oom = false;
    p = allocate_locked(static_cast<std::size_t>(size), stream, &oom);
    if (p == nullptr) message = last_error_;
  }
  if (p == nullptr) throw OutOfMemoryError(message);
  return p;
}

void* PlannedAllocator::try_malloc(std::int64_t size, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (size <= 0) {
    throw AllocatorError("invalid allocation size " + std::to_string(size) +
                         ": the size must be a positive number of bytes");
  }
  bool oom = false;
  return allocate_locked(static_cast<std::size_t>(size), stream, &oom);
}

void PlannedAllocator::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_locked(ptr);
  sync_stats();
}

void PlannedAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    throw AllocatorError("record_stream: pointer " + to_hex(addr) +
                         " is not a live allocation of this allocator");
  }
  Live& l = it->second;
  if (l.arena == nullptr) {
    pool_->record_stream(ptr, stream);
  } else if (stream != l.stream &&
             std::find(l.uses.begin(), l.uses.end(), stream) == l.uses.end()) {
    l.uses.push_back(stream);
  }
}

bool PlannedAllocator::owns(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.count(reinterpret_cast<std::uintptr_t>(ptr)) != 0;
}

void PlannedAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  synchronize_events();
  if (return_idle_borrowed()) armed_ = false;
  if (arena_ != nullptr && arena_->ranges.empty()) release_arena(arena_);
  pool_->empty_cache();
  sync_stats();
}

void PlannedAllocator::set_memory_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
  apply_limit();
}

void PlannedAllocator::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw AllocatorError("invalid memory fraction " + std::to_string(fraction) +
                         ": expected a number in (0, 1]");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = static_cast<std::size_t>(fraction * static_cast<double>(device_->capacity()));
  apply_limit();
}

std::size_t PlannedAllocator::memory_limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_;
}

Stats PlannedAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void PlannedAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_->reset_peak_stats();
  sync_stats();
  stats_.reset_peak();
  last_pool_ = pool_->stats();
}

void PlannedAllocator::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_->reset_accumulated_stats();
  arena_acc_.reset_accumulated();
  device_allocs_ = device_frees_ = ooms_ = 0;
  sync_stats();
}

std::string PlannedAllocator::last_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_error_;
}

std::size_t PlannedAllocator::round_size(std::size_t size) const { return pool_->round_size(size); }

std::string PlannedAllocator::config_string() const { return config_.to_string(); }

std::int64_t PlannedAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.reserved_bytes[kAllPools].current;
}

std::uint64_t PlannedAllocator::first_planned_request() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_planned_;
}

std::vector<std::pair<std::string, double>> PlannedAllocator::plan_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::string, double>> out;
  auto put = [&](const char* k, double v) { out.emplace_back(k, v); };
  put("plans", static_cast<double>(plans_.size()));
  put("plans_built", static_cast<double>(plans_built_));
  put("plan_switches", static_cast<double>(plan_switches_));
  put("arms", static_cast<double>(arms_));
  put("arm_refusals", static_cast<double>(arm_refusals_));
  put("plan_coverage", last_coverage_);
  put("refused_pool_bytes", static_cast<double>(refused_pool_bytes_));
  put("refused_need_bytes", static_cast<double>(refused_need_bytes_));
  put("reserved_hwm_bytes", static_cast<double>(reserved_hwm_));
  put("active_plan_period",
      active_ == kNoOffset ? 0.0 : static_cast<double>(plans_[active_].period));
  put("arena_bytes", static_cast<double>(arenas_bytes()));
  double borrowed = 0.0;
  for (const Arena* b : borrowed_) borrowed += static_cast<double>(b->size);
  put("borrowed_bytes", borrowed);
  put("borrowed_holes", static_cast<double>(borrowed_.size()));
  put("plan_arena_bytes", static_cast<double>(last_arena_));
  put("plan_bound_bytes", static_cast<double>(last_bound_));
  put("plan_ratio", last_ratio_);
  put("planned_requests", static_cast<double>(planned_requests_));
  put("pool_requests", static_cast<double>(pool_requests_));
  put("arena_gap_requests", static_cast<double>(gap_requests_));
  put("divergences", static_cast<double>(divergences_));
  put("first_planned_request",
      first_planned_ == kNever ? -1.0 : static_cast<double>(first_planned_));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Allocation

void* PlannedAllocator::allocate_locked(std::size_t size, StreamId stream, bool* oom) {
  process_events();
  const std::size_t rounded = round_up(size, kAlign);
  const std::uint64_t id = allocs_++;
  const std::uint64_t token = alloc_token(rounded, stream);
  recent_[id % kPrefix] = token;

  Slot* slot = nullptr;
  if (active_ != kNoOffset) {
    if (cursor_ == 0) boundary();
    slot = match_plan(rounded, stream);
    if (slot == nullptr) {
      diverged_ = ever_diverged_ = true;
      last_divergence_ = base_ + events_.size();
      ++divergences_;
      // The plan no longer describes the stream (a new shape, or the end of repeated layers):
      // stop holding its arena, so the pool may use that memory; a validated pass re-arms.
      pass_miss_bytes_ += rounded;
      if (armed_ && pass_miss_bytes_ * kDisarmShare > plans_[active_].arena) disarm();
    } else {
      ++pass_matches_;
    }
  }
  if (slot == nullptr && allocs_ >= kPrefix) {
    // Which stored plan starts with the last kPrefix requests? (alternating shapes)
    const std::uint64_t h = recent_prefix_hash();
    for (std::size_t i = 0; i < plans_.size(); ++i) {
      if (plans_[i].prefix == h && plans_[i].slots.size() > kPrefix &&
          (i != active_ || cursor_ != kPrefix)) {
        adopt(i, kPrefix);
        ++plan_switches_;
        break;
      }
    }
  }

  // The pool counts an OOM for each refusal it makes (soft caps, retries); the caller sees
  // one OOM, or none if a later rung served the request.
  const std::int64_t pool_ooms = last_pool_.num_ooms;
  void* out = nullptr;
  Live l;
  l.id = id;
  l.size = rounded;
  l.requested = size;
  l.stream = stream;
  Arena* bin = slot != nullptr && armed_ && slot->offset != kNoOffset ? bin_arena(*slot) : nullptr;
  if (bin != nullptr && slot->offset + rounded <= bin->size &&
      range_free(*bin, slot->offset, rounded) && stream_ok(*bin, stream)) {
    occupy(*bin, slot->offset, rounded, size);
    l.arena = bin;
    l.offset = slot->offset;
    out = reinterpret_cast<void*>(bin->addr + slot->offset);
    ++planned_requests_;
    if (first_planned_ == kNever) first_planned_ = id;
  } else if (!armed_) {
    out = serve_from_gaps(rounded, size, stream, l);
    if (out != nullptr) ++gap_requests_;
  }
  if (out == nullptr) {
    const auto request = static_cast<std::int64_t>(size);
    if (!arenas_.empty()) {
      // With arenas held, the pool may grow only up to the highest reserved so far; past it,
      // free gaps of the arenas serve first (a planned slot that needs one later goes to the
      // pool), and only then is the pool let past the old peak.
      const auto held = static_cast<std::size_t>(arenas_bytes());
      const auto hwm = static_cast<std::size_t>(reserved_hwm_);
      std::size_t cap = hwm > held ? hwm - held : 1;
      if (limit_ != 0) cap = std::min(cap, limit_ > held ? limit_ - held : 1);
      pool_->set_memory_limit(cap);
      out = pool_->try_malloc(request, stream);
      apply_limit();
      if (out == nullptr) {
        out = serve_from_gaps(rounded, size, stream, l);
        if (out != nullptr) ++gap_requests_;
      }
    }
    if (out == nullptr && l.arena == nullptr) out = pool_->try_malloc(request, stream);
    if (out == nullptr) {
      // The OOM ladder, one rung more: idle borrowed holes and an idle arena go back before
      // the request fails.
      bool released = return_idle_borrowed();
      if (arena_ != nullptr && arena_->ranges.empty()) {
        release_arena(arena_);
        released = true;
      }
      if (released) {
        out = pool_->try_malloc(request, stream);
      }
    }
    if (out == nullptr) {
      // Last rung: a free gap of the arena or a borrowed hole (armed or not); a planned slot
      // that needs it later goes to the pool instead.
      out = serve_from_gaps(rounded, size, stream, l);
    }
    if (out == nullptr) {
      *oom = true;
      last_error_ = pool_->last_error();
    }
    ++pool_requests_;
  }

  Event e;
  e.token = token;
  e.size = rounded;
  e.stream = stream;
  e.alloc = true;
  l.event = record_event(e);
  if (out != nullptr) live_.emplace(reinterpret_cast<std::uintptr_t>(out), std::move(l));
  detect();
  ooms_ -= pool_->stats().num_ooms - pool_ooms;
  if (out == nullptr) ++ooms_;
  sync_stats();
  return out;
}

PlannedAllocator::Slot* PlannedAllocator::match_plan(std::size_t rounded, StreamId stream) {
  // The slot at the cursor, or a later one: slots that outlive the period (kNoOffset) are
  // skipped freely (one-off allocations of the iteration the plan was made from, such as an
  // optimizer's state), planned ones up to resync_window. The search may cross the plan's end
  // once (the next iteration starts).
  Plan& p = plans_[active_];
  const std::size_t n = p.slots.size();
  std::size_t c = cursor_, skipped = 0;
  for (std::size_t steps = 0; steps < n; ++steps) {
    Slot& s = p.slots[c];
    if (s.size == rounded && s.stream == stream) {
      cursor_ = c + 1;
      if (cursor_ == n) cursor_ = 0;
      return &s;
    }
    if (s.offset != kNoOffset && ++skipped > config_.resync_window) break;
    if (++c == n) c = 0;
  }
  return nullptr;
}

void PlannedAllocator::boundary() {
  // The cursor is at the plan's cut: the fewest planned bytes are alive. Arm the plan, or,
  // armed, give the pool's wholly free segments back so reserved = arena + what the pool holds.
  Plan& p = plans_[active_];
  if (pass_matches_ > 0 && pass_miss_bytes_ * kArmShare <= p.arena) p.validated = true;
  pass_matches_ = 0;
  pass_miss_bytes_ = 0;
  if (!armed_) {
    if (p.validated) arm();
  } else if (last_pool_.reserved_bytes[kAllPools].current >
             last_pool_.active_bytes[kAllPools].current) {
    pool_->empty_cache();
  }
  diverged_ = false;
}

bool PlannedAllocator::repack(Plan& p) {
  // Offsets for the plan's blocks in the borrowed holes first, then in the arena.
  std::vector<std::size_t> caps;
  caps.reserve(borrowed_.size());
  for (const Arena* b : borrowed_) caps.push_back(b->size);
  const PackResult r = pack_blocks_into(p.blocks, p.period, caps, config_.search_rounds);
  for (std::size_t j = 0; j < p.slots.size(); ++j) {
    const std::size_t k = p.slot_block[j];
    if (k == kNoOffset) continue;
    p.slots[j].offset = r.offsets[k];
    p.slots[j].bin = r.bins[k] == caps.size() ? kArenaBin : r.bins[k];
  }
  p.need = r.arena;
  p.packed_for = bins_version_;
  p.bins_packed = true;
  return true;
}

void PlannedAllocator::borrow_holes() {
  // The pool's free holes between its live (long-lived) blocks would sit idle next to the
  // arena; held as pool blocks, they become bins the plan fills first. Only holes of the
  // large pool (> 1 MiB), and only while the pool can give them without growing.
  std::vector<std::pair<std::size_t, StreamId>> holes;
  for (const SegmentInfo& seg : pool_->snapshot()) {
    if (seg.blocks.size() < 2 || seg.segment_type != "large") continue;
    for (const BlockInfo& b : seg.blocks) {
      if (b.state == "inactive" && b.size > kSmallSize) holes.emplace_back(b.size, seg.stream);
    }
  }
  std::sort(holes.begin(), holes.end(), std::greater<>());
  const std::int64_t reserved = pool_->reserved_bytes();
  bool changed = false;
  for (const auto& [size, owner] : holes) {
    void* q = pool_->try_malloc(static_cast<std::int64_t>(size), owner);
    if (q == nullptr) continue;
    if (pool_->reserved_bytes() != reserved) {  // it grew instead: undo, stop
      pool_->free(q);
      pool_->empty_cache();
      break;
    }
    auto a = std::make_unique<Arena>();
    a->addr = reinterpret_cast<std::uintptr_t>(q);
    a->size = pool_->round_size(size);
    a->requested = size;
    a->borrowed = true;
    // The pool handed it out as safe for `owner` only: another stream drains first.
    a->has_stream = true;
    a->first_stream = owner;
    offset_pool_stats(*a, -1);
    borrowed_.push_back(a.get());
    arenas_.push_back(std::move(a));
    changed = true;
  }
  if (changed) ++bins_version_;
}

bool PlannedAllocator::return_idle_borrowed() {
  bool any = false;
  for (std::size_t i = 0; i < borrowed_.size();) {
    Arena* a = borrowed_[i];
    if (!a->ranges.empty()) {
      ++i;
      continue;
    }
    for (auto it = pending_.begin(); it != pending_.end();) {  // drain markers
      if (it->arena == a) {
        device_->synchronize_event(it->event);
        event_pool_.push_back(it->event);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    pool_->free(reinterpret_cast<void*>(a->addr));
    offset_pool_stats(*a, +1);
    borrowed_.erase(borrowed_.begin() + static_cast<std::ptrdiff_t>(i));
    arenas_.erase(std::remove_if(arenas_.begin(), arenas_.end(),
                                 [a](const std::unique_ptr<Arena>& x) { return x.get() == a; }),
                  arenas_.end());
    any = true;
  }
  if (any) {
    ++bins_version_;
    if (armed_ && active_ != kNoOffset && plans_[active_].packed_for != bins_version_) {
      armed_ = false;  // its slots may name bins that are gone
    }
  }
  return any;
}

void PlannedAllocator::offset_pool_stats(const Arena& a, int sign) {
  // The pool counts a borrowed hole as one allocated block; the planned blocks inside it are
  // counted by us instead. Only current values move (cumulative counters stay the pool's).
  const auto size = static_cast<std::int64_t>(a.size) * sign;
  const auto req = static_cast<std::int64_t>(a.requested) * sign;
  for (int t : {kAllPools, kLargePool}) {
    const auto i = static_cast<std::size_t>(t);
    arena_acc_.allocation[i].current += sign;
    arena_acc_.active[i].current += sign;
    arena_acc_.allocated_bytes[i].current += size;
    arena_acc_.active_bytes[i].current += size;
    arena_acc_.requested_bytes[i].current += req;
  }
}

void* PlannedAllocator::serve_from_gaps(std::size_t rounded, std::size_t size, StreamId stream,
                                        Live& l) {
  Arena* best = nullptr;
  std::size_t best_off = kNoOffset;
  for (const auto& a : arenas_) {
    if (a.get() != arena_ && !a->borrowed) continue;  // retired arenas only drain
    const std::size_t off = best_gap(*a, rounded);
    if (off != kNoOffset && (best == nullptr || a->size < best->size)) {
      best = a.get();
      best_off = off;
    }
  }
  if (best == nullptr || !stream_ok(*best, stream)) return nullptr;
  occupy(*best, best_off, rounded, size);
  l.arena = best;
  l.offset = best_off;
  return reinterpret_cast<void*>(best->addr + best_off);
}

bool PlannedAllocator::arm() {
  Plan& p = plans_[active_];
  if (p.blocks.empty()) return false;
  // A plan that covers a small share of the peak (a period of repeated layers, of the
  // optimizer's loop over parameter groups, ...) is not worth an arena: it would only shuffle
  // the pool's layout. The iteration's plan covers the activations, a large share.
  if (static_cast<double>(p.bound) < kMinPlanShare * static_cast<double>(live_hwm_)) return false;
  const std::size_t gran = std::max<std::size_t>(device_->granularity(), 1);
  // The arena takes the place of the pool's cached segments; its holes become bins.
  pool_->empty_cache();
  borrow_holes();
  if (p.packed_for != bins_version_ || !p.bins_packed) repack(p);
  const std::size_t need = round_up(p.need, gran);
  if (need == 0 || (arena_ != nullptr && arena_->size >= need)) {
    armed_ = true;
    ++arms_;
    return true;
  }
  if (arena_ != nullptr) {
    if (arena_->ranges.empty()) {
      release_arena(arena_);
    } else {
      arena_ = nullptr;  // retired: given back once its last block is freed
    }
  }
  const auto pool_reserved = static_cast<std::size_t>(pool_->reserved_bytes());
  if (limit_ != 0 && pool_reserved + static_cast<std::size_t>(arenas_bytes()) + need > limit_) {
    return_idle_borrowed();
    return false;
  }
  // Never raise the peak to arm: the arena must fit under the highest reserved so far (the
  // pool alone reached it), else the plan waits for a later boundary. This keeps the policy at
  // or below the pool's own peak whatever the pool's long-lived blocks strand.
  if (pool_reserved + static_cast<std::size_t>(arenas_bytes()) + need >
      static_cast<std::size_t>(reserved_hwm_)) {
    ++arm_refusals_;
    refused_pool_bytes_ = pool_reserved;
    refused_need_bytes_ = need;
    return_idle_borrowed();
    return false;
  }
  void* ptr = device_->allocate_segment(need);
  if (ptr == nullptr) {
    return_idle_borrowed();
    return false;
  }
  auto a = std::make_unique<Arena>();
  a->addr = reinterpret_cast<std::uintptr_t>(ptr);
  a->size = need;
  arena_ = a.get();
  arenas_.push_back(std::move(a));
  ++device_allocs_;
  for (int t : {kAllPools, kLargePool}) {
    arena_acc_.segment[static_cast<std::size_t>(t)].increase(1);
    arena_acc_.reserved_bytes[static_cast<std::size_t>(t)].increase(static_cast<std::int64_t>(need));
  }
  apply_limit();
  armed_ = true;
  ++arms_;
  return true;
}

void PlannedAllocator::disarm() {
  // The arena stays: while no plan is armed, requests bound for the pool are placed in its
  // free gaps first (best fit), so the memory it holds keeps serving instead of sitting idle
  // next to a growing pool. A later arm() reuses it if it is large enough.
  armed_ = false;
}

std::size_t PlannedAllocator::best_gap(const Arena& a, std::size_t size) const {
  std::size_t best = kNoOffset, best_len = kNoOffset, at = 0;
  auto consider = [&](std::size_t to) {
    if (to > at && to - at >= size && to - at < best_len) {
      best = at;
      best_len = to - at;
    }
  };
  for (const auto& [off, r] : a.ranges) {
    consider(off);
    at = off + r.size;
  }
  consider(a.size);
  return best;
}

bool PlannedAllocator::stream_ok(Arena& a, StreamId stream) {
  if (!a.has_stream) {
    a.has_stream = true;
    a.first_stream = stream;
    return true;
  }
  if (stream == a.first_stream) return true;
  if (!a.multi_stream) {
    // The arena's ranges were freed by first_stream without events so far: before another
    // stream may use any of them, first_stream's work up to now must be done (a drain).
    a.multi_stream = true;
    a.draining = true;
    EventHandle e = event_pool_.empty() ? device_->create_event() : event_pool_.back();
    if (!event_pool_.empty()) event_pool_.pop_back();
    device_->record_event(e, a.first_stream);
    pending_.push_back({e, &a, kNoOffset});
    return false;
  }
  return !a.draining;
}

void PlannedAllocator::guard(Arena& a, std::size_t offset, StreamId stream) {
  EventHandle e = event_pool_.empty() ? device_->create_event() : event_pool_.back();
  if (!event_pool_.empty()) event_pool_.pop_back();
  device_->record_event(e, stream);
  pending_.push_back({e, &a, offset});
  ++a.ranges.at(offset).pending_events;
}

bool PlannedAllocator::range_free(const Arena& a, std::size_t off, std::size_t size) const {
  auto it = a.ranges.lower_bound(off);
  if (it != a.ranges.end() && it->first < off + size) return false;
  if (it != a.ranges.begin()) {
    --it;
    if (it->first + it->second.size > off) return false;
  }
  return true;
}

void PlannedAllocator::occupy(Arena& a, std::size_t off, std::size_t size, std::size_t requested) {
  // Maximal free intervals: the one holding [off, off + size) splits into its parts on either
  // side that remain.
  auto next = a.ranges.lower_bound(off);
  const bool right_adj = off + size == a.size || (next != a.ranges.end() && next->first == off + size);
  bool left_adj = off == 0;
  if (!left_adj && next != a.ranges.begin()) {
    auto prev = std::prev(next);
    left_adj = prev->first + prev->second.size == off;
  }
  a.gaps = a.gaps + (left_adj ? 0 : 1) + (right_adj ? 0 : 1) - 1;
  Range r;
  r.size = size;
  r.allocated = true;
  r.requested = requested;
  a.ranges.emplace(off, r);
  a.occupied += size;
  const auto bytes = static_cast<std::int64_t>(size);
  for (int t : {kAllPools, kLargePool}) {
    const auto i = static_cast<std::size_t>(t);
    arena_acc_.allocation[i].increase(1);
    arena_acc_.allocated_bytes[i].increase(bytes);
    arena_acc_.active[i].increase(1);
    arena_acc_.active_bytes[i].increase(bytes);
    arena_acc_.requested_bytes[i].increase(static_cast<std::int64_t>(requested));
  }
}

void PlannedAllocator::release_range(Arena& a, std::size_t off) {
  auto it = a.ranges.find(off);
  const std::size_t size = it->second.size;
  auto next = std::next(it);
  const bool right_adj = off + size == a.size || (next != a.ranges.end() && next->first == off + size);
  bool left_adj = off == 0;
  if (!left_adj && it != a.ranges.begin()) {
    auto prev = std::prev(it);
    left_adj = prev->first + prev->second.size == off;
  }
  a.gaps = a.gaps + 1 - (left_adj ? 0 : 1) - (right_adj ? 0 : 1);
  a.ranges.erase(it);
  a.occupied -= size;
  for (int t : {kAllPools, kLargePool}) {
    const auto i = static_cast<std::size_t>(t);
    arena_acc_.active[i].decrease(1);
    arena_acc_.active_bytes[i].decrease(static_cast<std::int64_t>(size));
  }
}

void PlannedAllocator::maybe_retire(Arena* a) {
  if (a != arena_ && !a->borrowed && a->ranges.empty()) release_arena(a);
}

void PlannedAllocator::release_arena(Arena* a) {
  // `a` holds no range. Drop drain markers that refer to it.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->arena == a) {
      device_->synchronize_event(it->event);
      event_pool_.push_back(it->event);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  device_->free_segment(reinterpret_cast<void*>(a->addr), a->size);
  ++device_frees_;
  for (int t : {kAllPools, kLargePool}) {
    const auto i = static_cast<std::size_t>(t);
    arena_acc_.segment[i].decrease(1);
    arena_acc_.reserved_bytes[i].decrease(static_cast<std::int64_t>(a->size));
  }
  if (a == arena_) {
    arena_ = nullptr;
    armed_ = false;
  }
  arenas_.erase(std::remove_if(arenas_.begin(), arenas_.end(),
                               [a](const std::unique_ptr<Arena>& x) { return x.get() == a; }),
                arenas_.end());
  apply_limit();
}

// ---------------------------------------------------------------------------------------------
// Freeing and events

void PlannedAllocator::free_locked(void* ptr) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    for (const auto& a : arenas_) {
      if (addr >= a->addr && addr < a->addr + a->size) {
        throw AllocatorError("free: pointer " + to_hex(addr) +
                             " is not allocated (double free, or a pointer already freed)");
      }
    }
    pool_->free(ptr);  // throws AllocatorError with the pool's diagnosis
    throw AllocatorError("free: pointer " + to_hex(addr) + " was not allocated by this allocator");
  }
  Live& l = it->second;
  if (l.arena == nullptr) {
    pool_->free(ptr);
  } else {
    Arena& a = *l.arena;
    Range& r = a.ranges.at(l.offset);
    r.allocated = false;
    r.requested = 0;
    for (int t : {kAllPools, kLargePool}) {
      const auto i = static_cast<std::size_t>(t);
      arena_acc_.allocation[i].decrease(1);
      arena_acc_.allocated_bytes[i].decrease(static_cast<std::int64_t>(l.size));
      arena_acc_.requested_bytes[i].decrease(static_cast<std::int64_t>(l.requested));
    }
    // As in the pool (torch: insert_events()): the range stays busy until the work queued on
    // every stream that used it has finished; in a multi-stream arena, its own stream too.
    for (StreamId s : l.uses) guard(a, l.offset, s);
    if (a.multi_stream) guard(a, l.offset, l.stream);
    if (r.pending_events == 0) {
      release_range(a, l.offset);
      maybe_retire(&a);
    }
  }
  Event e;
  e.token = free_token(allocs_ - l.id);
  const std::uint64_t g = record_event(e);
  if (l.event >= base_) ev(l.event).free_at = g;
  live_.erase(it);
  detect();
}

void PlannedAllocator::process_events() {
  for (std::size_t i = 0; i < pending_.size();) {
    Pending p = pending_[i];
    if (!device_->query_event(p.event)) {
      ++i;
      continue;
    }
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    event_pool_.push_back(p.event);
    if (p.offset == kNoOffset) {
      p.arena->draining = false;
      continue;
    }
    Range& r = p.arena->ranges.at(p.offset);
    if (--r.pending_events == 0) {
      release_range(*p.arena, p.offset);
      maybe_retire(p.arena);
    }
  }
}

void PlannedAllocator::synchronize_events() {
  for (const Pending& p : pending_) device_->synchronize_event(p.event);
  process_events();
}

// ---------------------------------------------------------------------------------------------
// Detection and planning

std::uint64_t PlannedAllocator::record_event(const Event& e) {
  const std::uint64_t g = base_ + events_.size();
  events_.push_back(e);
  prefix_.push_back(prefix_.back() * kHashBase + e.token);
  // Keep two periods of history (and the window) at most; trim in halves so it is amortized.
  const std::size_t keep = 2 * config_.max_period + config_.match_window + 1;
  if (events_.size() > 2 * keep) {
    const std::size_t drop = events_.size() - keep;
    events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(drop));
    prefix_.erase(prefix_.begin(), prefix_.begin() + static_cast<std::ptrdiff_t>(drop));
    base_ += drop;
  }
  return g;
}

std::uint64_t PlannedAllocator::range_hash(std::uint64_t lo, std::uint64_t hi) const {
  return prefix_[static_cast<std::size_t>(hi - base_)] -
         prefix_[static_cast<std::size_t>(lo - base_)] * pow_base(hi - lo);
}

std::uint64_t PlannedAllocator::recent_prefix_hash() const {
  std::uint64_t h = 0;
  for (std::size_t j = 0; j < kPrefix; ++j) {
    h = h * kHashBase + recent_[(allocs_ + j) % kPrefix];  // oldest first
  }
  return h;
}

bool PlannedAllocator::should_plan(std::uint64_t n) const {
  // Plan when there is no plan, or when the active one diverged within its last period.
  if (active_ == kNoOffset) return true;
  return ever_diverged_ && last_divergence_ + plans_[active_].period >= n;
}

void PlannedAllocator::detect() {
  const std::uint64_t n = base_ + events_.size();
  const std::size_t w = config_.match_window;
  if (events_.size() < w) return;
  const std::uint64_t h = range_hash(n - w, n);
  if (windows_.size() > 4 * config_.max_period) windows_.clear();
  std::vector<std::uint64_t>& ends = windows_[h];
  if (n >= next_detect_ && should_plan(n) && !ends.empty()) {
    std::size_t best_p = 0;
    double best_score = -1.0, best_cov = 0.0;
    std::size_t examined = 0, largest = 0;
    for (auto it = ends.rbegin(); it != ends.rend() && examined < kMaxCandidates; ++it) {
      const std::uint64_t p64 = n - *it;
      if (p64 < config_.min_period || p64 > config_.max_period || *it < base_ + w) continue;
      const auto p = static_cast<std::size_t>(p64);
      if (n - base_ < p) continue;
      ++examined;
      largest = std::max(largest, p);
      const bool confirmed = n - base_ >= 2 * p && range_hash(n - p, n) == range_hash(n - 2 * p, n - p);
      const double cov = coverage(n, p, nullptr);
      const double score = cov + (confirmed ? 0.01 : 0.0);
      if (score > best_score) {
        best_score = score;
        best_cov = cov;
        best_p = p;
      }
    }
    if (best_p != 0 && best_cov >= kMinCoverage) {
      std::vector<std::size_t> lifetimes;
      coverage(n, best_p, &lifetimes);
      build_plan(n, best_p, lifetimes);
      next_detect_ = n + std::max<std::size_t>(best_p / 2, w);
    } else {
      next_detect_ = n + std::max<std::size_t>(largest / 4, w);
    }
  }
  ends.push_back(n);
  if (ends.size() > kMaxCandidates) ends.erase(ends.begin() + 1);  // keep the oldest
}

double PlannedAllocator::coverage(std::uint64_t n, std::size_t period,
                                  std::vector<std::size_t>* lifetimes) const {
  // Lifetime of each allocation of the last `period` events: known if freed (and within the
  // period); for one still alive, predicted from the same allocation one period earlier.
  double total = 0.0, covered = 0.0;
  for (std::uint64_t g = n - period; g < n; ++g) {
    const Event& e = ev(g);
    if (!e.alloc) continue;
    std::size_t life = 0;
    if (e.free_at != kNever) {
      if (e.free_at - g <= period) life = static_cast<std::size_t>(e.free_at - g);
    } else if (g >= base_ + period) {
      const Event& before = ev(g - period);
      if (before.alloc && before.token == e.token && before.free_at != kNever) {
        const std::uint64_t l = before.free_at - (g - period);
        if (l >= n - g && l <= period) life = static_cast<std::size_t>(l);
      }
    }
    total += static_cast<double>(e.size);
    if (life != 0) covered += static_cast<double>(e.size);
    if (lifetimes != nullptr) lifetimes->push_back(life);
  }
  return total > 0.0 ? covered / total : 0.0;
}

void PlannedAllocator::build_plan(std::uint64_t n, std::size_t period,
                                  const std::vector<std::size_t>& lifetimes) {
  const std::uint64_t s = n - period;
  struct A {
    std::size_t t, life, size;
    StreamId stream;
  };
  std::vector<A> allocs;
  allocs.reserve(lifetimes.size());
  std::size_t k = 0;
  for (std::uint64_t g = s; g < n; ++g) {
    const Event& e = ev(g);
    if (e.alloc) allocs.push_back({static_cast<std::size_t>(g - s), lifetimes[k++], e.size, e.stream});
  }
  // The cut: the first time step where the fewest planned bytes are alive.
  std::vector<PackBlock> blocks;
  std::vector<std::size_t> block_of(allocs.size(), kNoOffset);
  for (std::size_t i = 0; i < allocs.size(); ++i) {
    if (allocs[i].life == 0) continue;
    block_of[i] = blocks.size();
    blocks.push_back({allocs[i].t, allocs[i].life, allocs[i].size});
  }
  std::vector<long long> delta(period + 1, 0);
  for (const PackBlock& b : blocks) {
    const auto sz = static_cast<long long>(b.size);
    delta[b.start] += sz;
    const std::size_t end = b.start + b.life;
    if (end <= period) {
      delta[end] -= sz;
    } else {
      delta[period] -= sz;
      delta[0] += sz;
      delta[end - period] -= sz;
    }
  }
  std::size_t cut = 0;
  long long live = 0, least = -1;
  for (std::size_t t = 0; t < period; ++t) {
    live += delta[t];
    if (least < 0 || live < least) {
      least = live;
      cut = t;
    }
  }
  // Signature: the token sequence rotated to start at the cut.
  const std::uint64_t signature =
      range_hash(s + cut, n) * pow_base(cut) + range_hash(s, s + cut);
  auto rotated = [&](std::size_t t) { return (t + period - cut) % period; };
  const std::size_t now = rotated(0);  // the next request is at time `period` == 0 (mod period)
  for (std::size_t i = 0; i < plans_.size(); ++i) {
    if (plans_[i].signature == signature) {
      // Seen before (alternating shapes come back): no packing, continue from `now`.
      if (i != active_) {
        const auto& slots = plans_[i].slots;
        auto at = std::lower_bound(slots.begin(), slots.end(), now,
                                   [](const Slot& x, std::size_t t) { return x.time < t; });
        adopt(i, at == slots.end() ? 0 : static_cast<std::size_t>(at - slots.begin()));
        ++plan_switches_;
      }
      ever_diverged_ = false;
      return;
    }
  }

  const PackResult packed = pack_blocks(blocks, period, config_.search_rounds);
  Plan plan;
  plan.signature = signature;
  plan.period = period;
  plan.arena = packed.arena;
  plan.bound = packed.bound;
  plan.need = packed.arena;  // all in the arena: valid whatever the bins
  plan.packed_for = bins_version_;  // all in the arena: valid whatever the bins; arm() repacks
  plan.blocks = blocks;
  std::vector<std::size_t> order(allocs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return rotated(allocs[a].t) < rotated(allocs[b].t);
  });
  std::size_t cursor = order.size();
  for (std::size_t j = 0; j < order.size(); ++j) {
    const A& a = allocs[order[j]];
    Slot slot;
    slot.size = a.size;
    slot.stream = a.stream;
    slot.time = rotated(a.t);
    slot.bin = kArenaBin;
    plan.slot_block.push_back(block_of[order[j]]);
    if (block_of[order[j]] != kNoOffset) slot.offset = packed.offsets[block_of[order[j]]];
    plan.slots.push_back(slot);
    if (cursor == order.size() && rotated(a.t) >= now) cursor = j;
  }
  if (cursor == order.size()) cursor = 0;
  if (plan.slots.size() >= kPrefix) {
    std::uint64_t h = 0;
    for (std::size_t j = 0; j < kPrefix; ++j) {
      h = h * kHashBase + alloc_token(plan.slots[j].size, plan.slots[j].stream);
    }
    plan.prefix = h;
  }
  ++plans_built_;
  last_arena_ = packed.arena;
  last_bound_ = packed.bound;
  last_ratio_ = packed.ratio();
  last_coverage_ = static_cast<double>(std::count_if(lifetimes.begin(), lifetimes.end(),
                                                     [](std::size_t l) { return l != 0; })) /
                   static_cast<double>(std::max<std::size_t>(lifetimes.size(), 1));
  if (plans_.size() >= config_.max_plans) {
    // Evict the least recently used plan that is not the active one.
    std::size_t victim = kNoOffset;
    for (std::size_t i = 0; i < plans_.size(); ++i) {
      if (i == active_) continue;
      if (victim == kNoOffset || plans_[i].last_used < plans_[victim].last_used) victim = i;
    }
    if (victim == kNoOffset) {
      victim = active_;
      active_ = kNoOffset;
      armed_ = false;
    }
    plans_.erase(plans_.begin() + static_cast<std::ptrdiff_t>(victim));
    if (active_ != kNoOffset && active_ > victim) --active_;
  }
  plans_.push_back(std::move(plan));
  adopt(plans_.size() - 1, cursor);
}

void PlannedAllocator::adopt(std::size_t index, std::size_t cursor) {
  active_ = index;
  cursor_ = cursor;
  diverged_ = false;
  ever_diverged_ = false;
  Plan& p = plans_[index];
  p.last_used = allocs_;
  const std::size_t gran = std::max<std::size_t>(device_->granularity(), 1);
  auto fits = [&] {
    return p.packed_for == bins_version_ && !p.blocks.empty() &&
           (p.need == 0 || (arena_ != nullptr && arena_->size >= round_up(p.need, gran)));
  };
  armed_ = fits();
  if (!armed_ && arena_ != nullptr && !p.blocks.empty() &&
      (!p.bins_packed || p.packed_for != bins_version_)) {
    // Packed with the holes already borrowed, it may fit the arena held now.
    repack(p);
    armed_ = fits();
  }
  // Adopted at the start of an iteration (by its first requests): the pool holds little now,
  // so the arena may be obtained at once.
  pass_matches_ = 0;
  pass_miss_bytes_ = 0;
  if (!armed_ && cursor <= kPrefix && cursor > 0 && p.validated) arm();
}

// ---------------------------------------------------------------------------------------------
// Stats

std::int64_t PlannedAllocator::arenas_bytes() const {
  std::int64_t total = 0;
  for (const auto& a : arenas_) {
    if (!a->borrowed) total += static_cast<std::int64_t>(a->size);
  }
  return total;
}

void PlannedAllocator::apply_limit() {
  // The pool gets what the arenas leave of the limit (at least 1 byte: 0 would mean none).
  if (limit_ == 0) {
    pool_->set_memory_limit(0);
    return;
  }
  const auto arenas = static_cast<std::size_t>(arenas_bytes());
  pool_->set_memory_limit(limit_ > arenas ? limit_ - arenas : 1);
}

void PlannedAllocator::sync_stats() {
  // Arena blocks in the snapshot's terms: free gaps of an arena with more than one block are
  // inactive split blocks.
  std::int64_t split = 0, split_bytes = 0;
  for (const auto& a : arenas_) {
    if (a->borrowed || a->ranges.size() + a->gaps > 1) {
      split += static_cast<std::int64_t>(a->gaps);
      split_bytes += static_cast<std::int64_t>(a->size - a->occupied);
    }
  }
  for (int t : {kAllPools, kLargePool}) {
    const auto i = static_cast<std::size_t>(t);
    const std::int64_t d = split - arena_acc_.inactive_split[i].current;
    if (d > 0) arena_acc_.inactive_split[i].increase(d);
    if (d < 0) arena_acc_.inactive_split[i].decrease(-d);
    const std::int64_t db = split_bytes - arena_acc_.inactive_split_bytes[i].current;
    if (db > 0) arena_acc_.inactive_split_bytes[i].increase(db);
    if (db < 0) arena_acc_.inactive_split_bytes[i].decrease(-db);
  }

  const Stats pool = pool_->stats();
  for (StatArray Stats::*f : {&Stats::allocation, &Stats::segment, &Stats::active,
                              &Stats::inactive_split, &Stats::allocated_bytes,
                              &Stats::reserved_bytes, &Stats::active_bytes,
                              &Stats::inactive_split_bytes, &Stats::requested_bytes}) {
    for (std::size_t t = 0; t < 3; ++t) {
      const Stat& p = (pool.*f)[t];
      const Stat& lp = (last_pool_.*f)[t];
      const Stat& a = (arena_acc_.*f)[t];
      Stat& out = (stats_.*f)[t];
      out.current = p.current + a.current;
      out.allocated = p.allocated + a.allocated;
      out.freed = p.freed + a.freed;
      // The pool's peak during the last call, with the arenas as they were then (unchanged
      // during a pool call), is a peak of the sum.
      std::int64_t candidate = out.current;
      if (p.peak > lp.peak) candidate = std::max(candidate, p.peak + a.current);
      out.peak = std::max(out.peak, candidate);
    }
  }
  stats_.oversize_allocations = pool.oversize_allocations;
  stats_.oversize_segments = pool.oversize_segments;
  stats_.num_alloc_retries = pool.num_alloc_retries;
  stats_.num_ooms = pool.num_ooms + ooms_;
  stats_.num_sync_all_streams = pool.num_sync_all_streams;
  stats_.num_device_alloc = pool.num_device_alloc + device_allocs_;
  stats_.num_device_free = pool.num_device_free + device_frees_;
  stats_.max_split_size = pool.max_split_size;
  last_pool_ = pool;
  reserved_hwm_ = std::max(reserved_hwm_, stats_.reserved_bytes[kAllPools].current);
  live_hwm_ = std::max(live_hwm_, stats_.requested_bytes[kAllPools].current);
}

std::vector<SegmentInfo> PlannedAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // An arena's (or a borrowed hole's) blocks: its ranges, and the gaps between them.
  auto blocks_of = [](const Arena& a, SegmentInfo& s) {
    std::size_t at = 0;
    auto gap = [&](std::size_t to) {
      if (to > at) s.blocks.push_back({a.addr + at, to - at, 0, "inactive"});
    };
    for (const auto& [off, r] : a.ranges) {
      gap(off);
      BlockInfo b{a.addr + off, r.size, r.allocated ? r.requested : 0,
                  r.allocated ? "active_allocated" : "active_pending_free"};
      if (r.allocated) s.allocated_size += r.size;
      s.active_size += r.size;
      s.requested_size += b.requested_size;
      s.blocks.push_back(b);
      at = off + r.size;
    }
    gap(a.size);
  };
  std::unordered_map<std::uintptr_t, const Arena*> borrowed;
  for (const Arena* a : borrowed_) borrowed.emplace(a->addr, a);
  std::vector<SegmentInfo> out = pool_->snapshot();
  if (!borrowed.empty()) {
    for (SegmentInfo& seg : out) {
      std::vector<BlockInfo> blocks;
      blocks.swap(seg.blocks);
      for (const BlockInfo& b : blocks) {
        auto it = borrowed.find(b.address);
        if (it == borrowed.end() || b.state != "active_allocated") {
          seg.blocks.push_back(b);
          continue;
        }
        seg.allocated_size -= b.size;
        seg.active_size -= b.size;
        seg.requested_size -= b.requested_size;
        blocks_of(*it->second, seg);
      }
    }
  }
  for (const auto& a : arenas_) {
    if (a->borrowed) continue;
    SegmentInfo s;
    s.address = a->addr;
    s.total_size = a->size;
    s.stream = a->first_stream;
    s.segment_type = "large";
    blocks_of(*a, s);
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& x, const SegmentInfo& y) { return x.address < y.address; });
  return out;
}

}  // namespace pymemplan
