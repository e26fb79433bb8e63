// A picture of the allocator's segments and blocks in the shape of torch.cuda.memory._snapshot().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device.hpp"

namespace pymemplan {

struct BlockInfo {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  // "active_allocated", "active_pending_free" (freed, waiting on events) or "inactive".
  std::string state;
};

struct SegmentInfo {
  std::uintptr_t address = 0;
  std::size_t total_size = 0;
  StreamId stream = 0;
  std::string segment_type;  // "small" or "large"
  std::size_t allocated_size = 0;
  std::size_t active_size = 0;
  std::size_t requested_size = 0;
  std::vector<BlockInfo> blocks;  // in address order, covering the segment exactly
  // Virtual segments (vmm): only mapped pages hold memory.
  bool is_virtual = false;
  std::size_t page_size = 0;
  // What one driver call maps: page_size, or a chunk of an expandable segment (torch).
  std::size_t chunk_size = 0;
  // An expandable segment of the torch model: left out of inactive_split, as in torch.
  bool torch_expandable = false;
  std::size_t mapped_size = 0;
  std::vector<bool> page_mapped;
  // Mapped pages whose physical page another address holds (share_pages): not counted in
  // mapped_size, which is what this segment holds.
  std::vector<bool> page_aliased;
};

}  // namespace pymemplan
