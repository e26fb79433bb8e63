// Internal to the caching allocator's sources (allocator*.cpp). Not part of the library's API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "util.hpp"

namespace pymemplan::allocator_internal {

inline constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();

}  // namespace pymemplan::allocator_internal
