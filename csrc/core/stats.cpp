#include "stats.hpp"

namespace pymemplan {
namespace {

const char* const kPoolNames[] = {"all", "small_pool", "large_pool"};

void put(std::vector<std::pair<std::string, std::int64_t>>& out, const std::string& prefix,
         const Stat& s) {
  out.emplace_back(prefix + ".current", s.current);
  out.emplace_back(prefix + ".peak", s.peak);
  out.emplace_back(prefix + ".allocated", s.allocated);
  out.emplace_back(prefix + ".freed", s.freed);
}

template <typename F>
void for_each_array(Stats& s, F f) {
  for (StatArray* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                       &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                       &s.requested_bytes}) {
    for (Stat& st : *a) f(st);
  }
  f(s.oversize_allocations);
  f(s.oversize_segments);
}

}  // namespace

std::vector<std::pair<std::string, std::int64_t>> Stats::items() const {
  std::vector<std::pair<std::string, std::int64_t>> out;
  const std::pair<const char*, const StatArray*> arrays[] = {
      {"allocation", &allocation},
      {"segment", &segment},
      {"active", &active},
      {"inactive_split", &inactive_split},
      {"allocated_bytes", &allocated_bytes},
      {"reserved_bytes", &reserved_bytes},
      {"active_bytes", &active_bytes},
      {"inactive_split_bytes", &inactive_split_bytes},
      {"requested_bytes", &requested_bytes},
  };
  for (const auto& [name, arr] : arrays) {
    for (int t = 0; t < 3; ++t) put(out, std::string(name) + "." + kPoolNames[t], (*arr)[t]);
  }
  put(out, "oversize_allocations", oversize_allocations);
  put(out, "oversize_segments", oversize_segments);
  out.emplace_back("num_alloc_retries", num_alloc_retries);
  out.emplace_back("num_ooms", num_ooms);
  out.emplace_back("num_oom_rejections", num_oom_rejections);
  out.emplace_back("num_sync_all_streams", num_sync_all_streams);
  out.emplace_back("num_device_alloc", num_device_alloc);
  out.emplace_back("num_device_free", num_device_free);
  out.emplace_back("max_split_size", max_split_size);
  return out;
}

void Stats::reset_peak() {
  for_each_array(*this, [](Stat& s) { s.reset_peak(); });
}

void Stats::reset_accumulated() {
  for_each_array(*this, [](Stat& s) { s.reset_accumulated(); });
  num_alloc_retries = num_ooms = num_oom_rejections = num_sync_all_streams = num_device_alloc =
      num_device_free = 0;
  num_unmap_waits = 0;
}

}  // namespace pymemplan
