// Errors the allocator reports. Each leaves the allocator in the state it had before the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <stdexcept>
#include <string>

namespace pymemplan {

// Misuse by the caller: bad size, unknown or double-freed pointer, bad configuration.
class AllocatorError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The request cannot be served even after the OOM ladder ran.
class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The device itself failed (a driver error other than out-of-memory).
class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The driver ran out of memory in a call whose failure is not a plain "no memory" answer:
// mapping pages (cuMemMap, cuMemSetAccess: the page tables need device memory too). The
// allocator treats it as one, giving cached memory back and trying again before it fails.
class DeviceOutOfMemory : public DeviceError {
 public:
  using DeviceError::DeviceError;
};

std::string format_bytes(long long bytes);

// The size of a request, checked: throws AllocatorError for size <= 0.
inline std::size_t checked_request_size(std::int64_t size) {
  if (size <= 0) {
    throw AllocatorError("invalid allocation size " + std::to_string(size) +
                         ": the size must be a positive number of bytes");
  }
  return static_cast<std::size_t>(size);
}

// The memory limit set_memory_fraction(fraction) sets on a device of `capacity` bytes;
// throws AllocatorError for a fraction outside (0, 1].
inline std::size_t limit_for_fraction(double fraction, std::size_t capacity) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw AllocatorError("invalid memory fraction " + std::to_string(fraction) +
                         ": expected a number in [0, 1], as torch.cuda.set_per_process_memory_fraction");
  }
  // A limit of 0 means none: a fraction too small for one byte (0 included) allows nothing,
  // as it does in PyTorch, rather than everything.
  return std::max<std::size_t>(1, static_cast<std::size_t>(fraction * static_cast<double>(capacity)));
}

}  // namespace pymemplan
