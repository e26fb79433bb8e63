#include "allocator.hpp"
#include "errors.hpp"
#include "gmlake.hpp"
#include "planned.hpp"

namespace pymemplan {

std::unique_ptr<Allocator> make_allocator(std::shared_ptr<Device> device, const std::string& policy,
                                          const std::string& config) {
  // Plan-guided placement over a "pymemplan" pool (planned.hpp).
  if (policy == "pymemplan-planned") {
    return std::make_unique<PlannedAllocator>(std::move(device), PlannedConfig::parse(config));
  }
  // A model of GMLake, the published stitching allocator, for comparisons (gmlake.hpp).
  if (policy == "gmlake") {
    return std::make_unique<GMLakeAllocator>(std::move(device), GMLakeConfig::parse(config));
  }
  return std::make_unique<CachingAllocator>(std::move(device), PolicyConfig::parse(policy, config));
}

std::vector<std::uintptr_t> Allocator::adopt_segment(std::size_t, bool, StreamId,
                                                     const std::vector<AdoptedBlock>&) {
  throw AllocatorError("adopt_segment: only the model of PyTorch's allocator takes a recorded "
                       "layout, not " + policy_name());
}

std::string validate_config(const std::string& policy, const std::string& config) {
  if (policy == "pymemplan-planned") return PlannedConfig::parse(config).to_string();
  if (policy == "gmlake") return GMLakeConfig::parse(config).to_string();
  return PolicyConfig::parse(policy, config).to_string();
}

}  // namespace pymemplan
