#include "allocator.hpp"

namespace pymemplan {

std::unique_ptr<Allocator> make_allocator(std::shared_ptr<Device> device, const std::string& policy,
                                          const std::string& config) {
  return std::make_unique<CachingAllocator>(std::move(device), PolicyConfig::parse(policy, config));
}

}  // namespace pymemplan
