// Plan-guided placement, configuration, construction and the allocator interface: see planned.hpp for the design.
#include "planned.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <numeric>
#include <optional>
#include <sstream>

#include "errors.hpp"
#include "packing.hpp"
#include "planned_internal.hpp"

namespace pymemplan {

using namespace planned_internal;

namespace {

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
    {"plan_slack", &PlannedConfig::plan_slack, 0, 1000},
    {"holes", &PlannedConfig::holes, 0, 1},
    {"prologue", &PlannedConfig::prologue, 0, std::size_t{1} << 18},
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
  for (std::string item : split_config_items(conf)) {
    item = trim_space(item);
    if (item.empty()) continue;
    const auto colon = item.find(':');
    const std::string key = trim_space(item.substr(0, colon));
    const PlannedKey* known = nullptr;
    for (const auto& k : kPlannedKeys) {
      if (colon != std::string::npos && key == k.key) known = &k;
    }
    if (known == nullptr) {
      rest += (rest.empty() ? "" : ",") + item;
      continue;
    }
    const std::string value = trim_space(item.substr(colon + 1));
    const std::string expected = "an integer in [" + std::to_string(known->lo) + ", " +
                                 std::to_string(known->hi) + "]";
    const long long v = parse_config_int(key, value, expected);
    if (v < 0 || static_cast<unsigned long long>(v) < known->lo ||
        static_cast<unsigned long long>(v) > known->hi) {
      bad_config_value(key, value, expected);
    }
    c.*(known->field) = static_cast<std::size_t>(v);
  }
  try {
    c.pool = PolicyConfig::parse("pymemplan-vmm", rest);
  } catch (const AllocatorError& e) {
    // The pool's keys are checked as pymemplan-vmm's: name the policy the user gave.
    std::string what = e.what();
    const std::string pool = "policy 'pymemplan-vmm'";
    for (auto at = what.find(pool); at != std::string::npos; at = what.find(pool, at)) {
      what.replace(at, pool.size(), "policy 'pymemplan-planned'");
    }
    throw AllocatorError(what + "; policy 'pymemplan-planned' also takes: " + planned_keys());
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
  prologue_open_ = config_.prologue != 0;
}

std::size_t PlannedAllocator::page() const { return std::max<std::size_t>(device_->granularity(), 1); }

// ---------------------------------------------------------------------------------------------
// Public entry points: the pool's, with the plan in front of malloc

void* PlannedAllocator::malloc(std::int64_t size, StreamId stream) {
  void* p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    p = allocate_locked(checked_request_size(size), stream);
  }
  if (p == nullptr) throw OutOfMemoryError(pool_->last_error());
  return p;
}

void* PlannedAllocator::try_malloc(std::int64_t size, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocate_locked(checked_request_size(size), stream);
}

void PlannedAllocator::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    pool_->free(ptr);  // throws AllocatorError with the pool's diagnosis
    throw AllocatorError("free: pointer " + to_hex(addr) + " was not allocated by this allocator");
  }
  pool_->free(ptr);
  const Live l = it->second;
  live_.erase(it);
  Event e;
  e.token = free_token(allocs_ - l.id);
  e.live_before = live_bytes_;
  live_bytes_ -= static_cast<std::int64_t>(l.size);
  const std::uint64_t g = record_event(e);
  if (l.event >= base_) ev(l.event).free_at = g;
  if (prologue_open_ && l.id < prologue_.size()) prologue_[l.id].life = g - prologue_[l.id].start;
  detect();
}


void PlannedAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_->record_stream(ptr, stream);
}

bool PlannedAllocator::owns(const void* ptr) const { return pool_->owns(ptr); }

bool PlannedAllocator::free_pending(const void* ptr) const { return pool_->free_pending(ptr); }

void PlannedAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_->empty_cache();  // pending frees complete first
  lent_arena_ = 0;  // gone back with the pool's free segments, if it was free
  if (arena_ != 0 && !pool_->arena_in_use(arena_)) {
    // Idle: it becomes a segment of the pool and goes back too (a new one is made when a
    // plan arms again).
    pool_->retire_arena(arena_);
    pool_->trim(0, 0);
    arena_ = 0;
    arena_size_ = 0;
    stop_serving();
  }
}

void PlannedAllocator::set_memory_limit(std::size_t bytes) { pool_->set_memory_limit(bytes); }

void PlannedAllocator::set_memory_fraction(double fraction) { pool_->set_memory_fraction(fraction); }

std::size_t PlannedAllocator::memory_limit() const { return pool_->memory_limit(); }

Stats PlannedAllocator::stats() const { return pool_->stats(); }

void PlannedAllocator::reset_peak_stats() { pool_->reset_peak_stats(); }

void PlannedAllocator::reset_accumulated_stats() { pool_->reset_accumulated_stats(); }

std::vector<SegmentInfo> PlannedAllocator::snapshot() const { return pool_->snapshot(); }

std::string PlannedAllocator::last_error() const { return pool_->last_error(); }

std::size_t PlannedAllocator::round_size(std::size_t size) const { return pool_->round_size(size); }

std::string PlannedAllocator::config_string() const { return config_.to_string(); }

std::int64_t PlannedAllocator::reserved_bytes() const { return pool_->reserved_bytes(); }

std::uint64_t PlannedAllocator::first_planned_request() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_planned_;
}

double PlannedAllocator::planning_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pack_seconds_;
}

std::vector<std::pair<std::string, double>> PlannedAllocator::plan_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::string, double>> out;
  auto put = [&](const char* k, double v) { out.emplace_back(k, v); };
  auto num = [](auto v) { return static_cast<double>(v); };
  put("plan_hits", num(plan_hits_));
  put("fallbacks", num(fallbacks_));
  put("slot_busy", num(slot_busy_));
  put("divergences", num(divergences_));
  put("plans", num(plans_.size()));
  put("plans_built", num(plans_built_));
  put("plan_switches", num(plan_switches_));
  put("arms", num(arms_));
  put("arm_refusals", num(arm_refusals_));
  put("refinements", num(refinements_));
  put("remakes", num(remakes_));
  put("detection_ties", num(ties_));
  put("layouts_kept", num(layouts_kept_));
  put("tail_layouts", num(tail_layouts_));
  put("packings_reused", num(packings_reused_));
  put("full_rearms", num(full_rearms_));
  put("first_request_cuts", num(first_request_cuts_));
  put("busy_arenas_retired", num(busy_arenas_retired_));
  put("arenas_made", num(arenas_made_));
  put("arenas_reclaimed", num(arenas_reclaimed_));
  put("mid_pass_arms", num(mid_pass_arms_));
  put("marks", num(marks_));
  put("plans_imported", num(imported_));
  put("prologue_recorded", num(prologue_.size()));
  put("prologue_hits", num(prologue_hits_));
  put("prologue_serving", loaded_arena_ != 0 ? 1.0 : 0.0);
  put("prologue_dropped", prologue_dropped_ ? 1.0 : 0.0);
  put("prologue_handover", prologue_handover_ ? 1.0 : 0.0);
  put("prologue_ahead", num(prologue_ahead_));
  put("armed", armed_ ? 1.0 : 0.0);
  put("active_plan_period", active_ == kNoOffset ? 0.0 : num(plans_[active_].period));
  put("plan_coverage", last_coverage_);
  put("plan_arena_bytes", num(last_arena_));
  put("plan_bound_bytes", num(last_bound_));
  put("plan_ratio", last_ratio_);
  put("plan_hole_bytes", num(last_hole_bytes_));
  put("hole_hits", num(hole_hits_));
  put("plan_hole_cost_bytes", num(last_hole_cost_));
  put("pack_seconds", pack_seconds_);
  put("arm_held_bytes", num(last_held_));
  put("shared_page_bytes", num(shared_bytes_));
  put("arm_footprint_bytes", num(last_footprint_));
  put("live_hwm_bytes", num(live_hwm_));
  put("reserved_high_water_bytes", num(pool_->reserved_high_water()));
  put("arena_bytes", num(arena_size_));
  put("arena_mapped_bytes", num(arena_ != 0 ? pool_->arena_mapped(arena_) : 0));
  put("first_planned_request", first_planned_ == kNever ? -1.0 : num(first_planned_));
  return out;
}

std::pair<std::size_t, std::vector<PackBlock>> PlannedAllocator::last_plan_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {last_period_, last_blocks_};
}


std::size_t PlannedAllocator::share_pages() {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t n = pool_->share_pages();
  shared_bytes_ += n;
  return n;
}

bool PlannedAllocator::stop_automatic_page_sharing() {
  std::lock_guard<std::mutex> lock(mutex_);
  config_.pool.share_pages = false;
  return pool_->stop_automatic_page_sharing();
}

std::string PlannedAllocator::self_check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pool_->self_check();
}

}  // namespace pymemplan
