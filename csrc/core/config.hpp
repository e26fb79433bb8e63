// Policy parameters, parsed from a PYTORCH_CUDA_ALLOC_CONF-style string ("key:value,...").
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <vector>

namespace pymemplan {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;

// Which rule set the engine follows.
enum class PolicyKind {
  Pymemplan,  // ours: see allocator*.cpp for where it departs from PyTorch and why
  Torch,      // a model of c10/cuda/CUDACachingAllocator.cpp's native policy
  NoCache,    // one device allocation per request (PYTORCH_NO_CUDA_MEMORY_CACHING=1)
};

// Items of a "key:value,..." config, split at the commas outside brackets: a list value
// ("roundup_power2_divisions:[256:1,>:4]") keeps its commas.
std::vector<std::string> split_config_items(const std::string& conf);
// An item, key or value of a config without the spaces around it.
std::string trim_space(const std::string& s);
// Throws AllocatorError: "bad value 'value' for 'key': expected <expected>".
[[noreturn]] void bad_config_value(const std::string& key, const std::string& value,
                                   const std::string& expected);
// The whole of `value` as an integer, else bad_config_value.
long long parse_config_int(const std::string& key, const std::string& value,
                           const std::string& expected);

struct PolicyConfig {
  PolicyKind kind = PolicyKind::Pymemplan;

  // Blocks at least this large are never split ("oversize"); PyTorch's max_split_size_mb.
  std::size_t max_split_size = std::numeric_limits<std::size_t>::max();
  // An oversize cached block serves a request only if it wastes less than this.
  std::size_t max_non_split_rounding = 20 * kMiB;
  // Round requests up to one of this many divisions between powers of two (0 or 1: off),
  // per size interval as PyTorch keeps them: [0] for sizes up to 2 MiB, [k] for
  // [2^k, 2^(k+1)) MiB, [15] from 32 GiB up (AllocatorConfig.cpp).
  static constexpr std::size_t kDivisionIntervals = 16;
  std::size_t roundup_power2_divisions[kDivisionIntervals] = {};
  std::size_t divisions_for(std::size_t size) const;
  // Before a new segment would raise peak reserved memory, release wholly free cached
  // segments first (ours only; PyTorch releases cached segments only after a failed cudaMalloc).
  bool release_before_grow = true;
  // Free blocks of one stream become usable by others once an event shows the owner's work
  // is done (ours only; PyTorch never reuses a block across streams).
  bool cross_stream_reuse = true;
  // Segment size for requests in (1 MiB, 10 MiB) (ours only; 0: the request's own size).
  std::size_t medium_segment = 48 * kMiB;
  // Large requests come from virtual segments whose pages are mapped on demand, and pages
  // under free blocks go back to the device when memory must grow (ours only).
  bool vmm = false;
  // Size of the address ranges reserved for virtual segments (vmm only).
  std::size_t vmm_segment = 1024 * kMiB;
  // Page sharing on the allocator's own initiative (vmm only): the OOM ladder's last step and,
  // in pymemplan-planned, at each arming. Each pairing synchronizes the device, copies live
  // bytes and remaps a page, so no other host thread may launch work on those tensors
  // meanwhile; False for programs whose threads launch kernels while others allocate.
  // share_pages() on request works either way.
  bool share_pages = true;
  // Blocks made in the image of long-lived ones, in a burst (an optimizer making its state
  // after the first backward, gradients kept across steps, an EMA copy) go to the lowest free
  // address that fits, beside the parameters, instead of best fit among freed activations,
  // where each would pin a page the next steps cannot use (vmm only; see allocator.cpp).
  bool pack_long_lived = true;
  // PyTorch's expandable segments (torch only; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True):
  // one address range per stream and pool, mapped at its end as it grows, 2 MiB at a time
  // for the small pool and 20 MiB for the large one.
  bool expandable_segments = false;

  // Defaults of a named policy ("pymemplan", "pymemplan-vmm", "torch", "nocache") then the
  // settings in `conf`.
  // Throws AllocatorError naming the bad key or value and listing the valid ones.
  static PolicyConfig parse(const std::string& policy, const std::string& conf = "");
  static std::vector<std::string> policy_names();

  std::string policy_name() const;
  // The settings back as a config string (keys valid for this policy only).
  std::string to_string() const;
};

}  // namespace pymemplan
