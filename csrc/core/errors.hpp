// Errors the allocator reports. Each leaves the allocator in the state it had before the call.
#pragma once

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

}  // namespace pymemplan
