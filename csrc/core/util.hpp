// Small helpers the core's sources share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

namespace pymemplan {

inline std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

inline std::string to_hex(std::uintptr_t addr) {
  std::ostringstream s;
  s << "0x" << std::hex << addr;
  return s.str();
}

}  // namespace pymemplan
