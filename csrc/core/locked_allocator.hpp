// What the core's pooling allocators (CachingAllocator, GMLakeAllocator) keep under one lock
// alike: the device, the memory limit and the stats, with the Allocator calls that only read
// or set them.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>

#include "allocator_api.hpp"
#include "device.hpp"
#include "errors.hpp"
#include "stats.hpp"

namespace pymemplan {

class LockedAllocator : public Allocator {
 public:
  void set_memory_limit(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
  }
  void set_memory_fraction(double fraction) override {
    const std::size_t limit = limit_for_fraction(fraction, device_->capacity());
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = limit;
  }
  std::size_t memory_limit() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }
  Stats stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.reset_peak();
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.reset_accumulated();
  }

 protected:
  explicit LockedAllocator(std::shared_ptr<Device> device) : device_(std::move(device)) {}

  std::shared_ptr<Device> device_;
  mutable std::mutex mutex_;
  std::size_t limit_ = 0;  // 0: none
  Stats stats_;
};

}  // namespace pymemplan
