#include "config.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "errors.hpp"

namespace pymemplan {
namespace {

struct KeyInfo {
  const char* key;
  const char* values;  // what a valid value looks like, for error messages
  bool ours_only;
  bool torch_only = false;
};

constexpr const char* kMediumSegmentValues =
    "an integer >= 0 (MiB; the largest medium segment; 0: exact-size segments)";

constexpr KeyInfo kKeys[] = {
    {"max_split_size_mb", "an integer > 20 (MiB)", false},
    {"max_non_split_rounding_mb", "an integer >= 0 (MiB)", false},
    {"roundup_power2_divisions",
     "0 or a power of two up to 64, or a list [MiB:divisions,...,>:divisions] with power-of-two "
     "sizes in MiB, as in PYTORCH_CUDA_ALLOC_CONF", false},
    {"release_before_grow", "True or False", true},
    {"cross_stream_reuse", "True or False", true},
    {"medium_segment_mb", kMediumSegmentValues, true},
    {"vmm", "True or False", true},
    {"vmm_segment_mb", "an integer >= 2 (MiB)", true},
    {"share_pages", "True or False (1 or 0)", true},
    {"pack_long_lived", "True or False", true},
    {"expandable_segments", "True or False", false, true},
};

bool accepts(const KeyInfo& k, PolicyKind kind) {
  if (kind == PolicyKind::NoCache) return false;  // nocache has no knobs
  if (k.ours_only) return kind == PolicyKind::Pymemplan;
  if (k.torch_only) return kind == PolicyKind::Torch;
  return true;
}

std::string valid_keys(PolicyKind kind) {
  std::string out;
  for (const auto& k : kKeys) {
    if (!accepts(k, kind)) continue;
    out += out.empty() ? "" : ", ";
    out += std::string(k.key) + " (" + k.values + ")";
  }
  return out.empty() ? "none" : out;
}

bool parse_bool(const std::string& key, const std::string& value) {
  if (value == "True" || value == "true" || value == "1") return true;
  if (value == "False" || value == "false" || value == "0") return false;
  bad_config_value(key, value, "True or False");
}

}  // namespace

void bad_config_value(const std::string& key, const std::string& value, const std::string& expected) {
  throw AllocatorError("allocator config: bad value '" + value + "' for '" + key + "': expected " +
                       expected);
}

long long parse_config_int(const std::string& key, const std::string& value,
                           const std::string& expected) {
  if (value.empty()) bad_config_value(key, value, expected);
  std::size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &pos);
  } catch (const std::exception&) {
    bad_config_value(key, value, expected);
  }
  if (pos != value.size()) bad_config_value(key, value, expected);
  return v;
}

std::string trim_space(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::vector<std::string> split_config_items(const std::string& conf) {
  std::vector<std::string> out(1);
  int depth = 0;
  for (char ch : conf) {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (ch == ',' && depth <= 0) {
      out.emplace_back();
    } else {
      out.back() += ch;
    }
  }
  return out;
}

namespace {

// PyTorch's roundup_power2_divisions (AllocatorConfig.cpp parseRoundUpPower2Divisions): one
// number for every size, or a list of MiB:divisions pairs, each power-of-two size setting
// its interval (the first one also every interval below it), and >:divisions every interval
// above the last one named.
void parse_divisions(const std::string& key, const std::string& value,
                     std::size_t (&table)[PolicyConfig::kDivisionIntervals]) {
  const char* expected =
      "0 or a power of two up to 64, or a list [MiB:divisions,...,>:divisions] with "
      "power-of-two sizes in MiB";
  auto divisions = [&](const std::string& v) {
    long long d = parse_config_int(key, v, expected);
    if (d < 0 || d > 64 || (d & (d - 1)) != 0) bad_config_value(key, value, expected);
    return static_cast<std::size_t>(d);
  };
  const std::size_t n = PolicyConfig::kDivisionIntervals;
  if (value.empty() || value.front() != '[') {
    std::size_t d = divisions(value);
    for (std::size_t i = 0; i < n; ++i) table[i] = d;
    return;
  }
  if (value.back() != ']') bad_config_value(key, value, expected);
  for (std::size_t i = 0; i < n; ++i) table[i] = 0;
  std::stringstream pairs(value.substr(1, value.size() - 2));
  std::string pair;
  bool first = true;
  std::size_t last = 0;
  while (std::getline(pairs, pair, ',')) {
    auto colon = pair.find(':');
    if (colon == std::string::npos) bad_config_value(key, value, expected);
    const std::string size = trim_space(pair.substr(0, colon));
    const std::size_t d = divisions(trim_space(pair.substr(colon + 1)));
    if (size == ">") {
      for (std::size_t i = last + 1; i < n; ++i) table[i] = d;
      continue;
    }
    long long mb = parse_config_int(key, size, expected);
    if (mb <= 0 || (mb & (mb - 1)) != 0) bad_config_value(key, value, expected);
    std::size_t index = 0;
    while ((1LL << (index + 1)) <= mb) ++index;
    index = std::min(index, n - 1);
    if (first) {
      for (std::size_t i = 0; i < index; ++i) table[i] = d;
      first = false;
    }
    table[index] = d;
    last = index;
  }
}

std::string divisions_to_string(const std::size_t (&table)[PolicyConfig::kDivisionIntervals]) {
  bool same = true;
  for (std::size_t d : table) same = same && d == table[0];
  if (same) return std::to_string(table[0]);
  std::string out = "[";
  for (std::size_t i = 0; i < PolicyConfig::kDivisionIntervals; ++i) {
    out += (i ? "," : "") + std::to_string(1ULL << i) + ":" + std::to_string(table[i]);
  }
  return out + "]";
}

}  // namespace

std::size_t PolicyConfig::divisions_for(std::size_t size) const {
  // PyTorch: index = log2(size) - log2(1 MiB), at least 0, at most 15.
  std::size_t log = 0;
  while (log < 63 && (std::size_t{2} << log) <= size) ++log;
  std::size_t index = log > 20 ? log - 20 : 0;
  return roundup_power2_divisions[std::min(index, kDivisionIntervals - 1)];
}

std::vector<std::string> PolicyConfig::policy_names() {
  // pymemplan-planned is built by the factory (planned.cpp) around a pymemplan pool; gmlake,
  // a model of the published allocator for comparisons, by the factory too (gmlake.cpp).
  return {"pymemplan", "pymemplan-vmm", "pymemplan-planned", "torch", "nocache", "gmlake"};
}

std::string PolicyConfig::policy_name() const {
  switch (kind) {
    case PolicyKind::Pymemplan: return vmm ? "pymemplan-vmm" : "pymemplan";
    case PolicyKind::Torch: return "torch";
    case PolicyKind::NoCache: return "nocache";
  }
  return "?";
}

PolicyConfig PolicyConfig::parse(const std::string& policy, const std::string& conf) {
  PolicyConfig c;
  if (policy == "pymemplan") {
    c.kind = PolicyKind::Pymemplan;
  } else if (policy == "pymemplan-vmm") {
    c.kind = PolicyKind::Pymemplan;
    c.vmm = true;
  } else if (policy == "torch") {
    c.kind = PolicyKind::Torch;
    c.release_before_grow = false;
    c.cross_stream_reuse = false;
  } else if (policy == "nocache") {
    c.kind = PolicyKind::NoCache;
    c.release_before_grow = false;
    c.cross_stream_reuse = false;
  } else {
    std::string names;
    for (const auto& n : policy_names()) names += (names.empty() ? "" : ", ") + n;
    throw AllocatorError("unknown allocator policy '" + policy + "': valid policies are " + names);
  }

  for (std::string item : split_config_items(conf)) {
    item = trim_space(item);
    if (item.empty()) continue;
    auto colon = item.find(':');
    if (colon == std::string::npos) {
      throw AllocatorError("allocator config: '" + item +
                           "' is not of the form key:value; valid keys for policy '" + policy +
                           "': " + valid_keys(c.kind));
    }
    std::string key = trim_space(item.substr(0, colon));
    std::string value = trim_space(item.substr(colon + 1));
    bool known = false;
    for (const auto& k : kKeys) {
      if (key == k.key && accepts(k, c.kind)) known = true;
    }
    if (!known) {
      throw AllocatorError("allocator config: unknown key '" + key + "' for policy '" + policy +
                           "'; valid keys: " + valid_keys(c.kind));
    }
    if (key == "max_split_size_mb") {
      // PyTorch requires > kLargeBuffer (20 MiB) so that every oversize block is a whole
      // segment (CUDAAllocatorConfig::parseMaxSplitSize).
      long long mb = parse_config_int(key, value, "an integer > 20 (MiB)");
      if (mb <= 20 || mb > (1LL << 40)) bad_config_value(key, value, "an integer > 20 (MiB)");
      c.max_split_size = static_cast<std::size_t>(mb) * kMiB;
    } else if (key == "max_non_split_rounding_mb") {
      long long mb = parse_config_int(key, value, "an integer >= 0 (MiB)");
      if (mb < 0 || mb > (1LL << 40)) bad_config_value(key, value, "an integer >= 0 (MiB)");
      c.max_non_split_rounding = static_cast<std::size_t>(mb) * kMiB;
    } else if (key == "roundup_power2_divisions") {
      parse_divisions(key, value, c.roundup_power2_divisions);
    } else if (key == "release_before_grow") {
      c.release_before_grow = parse_bool(key, value);
    } else if (key == "medium_segment_mb") {
      const char* expected = kMediumSegmentValues;
      long long mb = parse_config_int(key, value, expected);
      if (mb < 0 || mb > (1LL << 20)) bad_config_value(key, value, expected);
      c.medium_segment = static_cast<std::size_t>(mb) * kMiB;
    } else if (key == "vmm") {
      c.vmm = parse_bool(key, value);
    } else if (key == "vmm_segment_mb") {
      long long mb = parse_config_int(key, value, "an integer >= 2 (MiB)");
      if (mb < 2 || mb > (1LL << 30)) bad_config_value(key, value, "an integer >= 2 (MiB)");
      c.vmm_segment = static_cast<std::size_t>(mb) * kMiB;
    } else if (key == "share_pages") {
      c.share_pages = parse_bool(key, value);
    } else if (key == "pack_long_lived") {
      c.pack_long_lived = parse_bool(key, value);
    } else if (key == "cross_stream_reuse") {
      c.cross_stream_reuse = parse_bool(key, value);
    } else if (key == "expandable_segments") {
      c.expandable_segments = parse_bool(key, value);
    }
  }
  return c;
}

std::string PolicyConfig::to_string() const {
  if (kind == PolicyKind::NoCache) return "";
  std::ostringstream out;
  bool first = true;
  auto put = [&](const char* k, const std::string& v) {
    out << (first ? "" : ",") << k << ':' << v;
    first = false;
  };
  if (max_split_size != std::numeric_limits<std::size_t>::max()) {
    put("max_split_size_mb", std::to_string(max_split_size / kMiB));
  }
  put("max_non_split_rounding_mb", std::to_string(max_non_split_rounding / kMiB));
  put("roundup_power2_divisions", divisions_to_string(roundup_power2_divisions));
  if (kind == PolicyKind::Torch) put("expandable_segments", expandable_segments ? "True" : "False");
  if (kind == PolicyKind::Pymemplan) {
    put("release_before_grow", release_before_grow ? "True" : "False");
    put("cross_stream_reuse", cross_stream_reuse ? "True" : "False");
    put("medium_segment_mb", std::to_string(medium_segment / kMiB));
    put("vmm", vmm ? "True" : "False");
    put("vmm_segment_mb", std::to_string(vmm_segment / kMiB));
    put("share_pages", share_pages ? "True" : "False");
    put("pack_long_lived", pack_long_lived ? "True" : "False");
  }
  return out.str();
}

std::string format_bytes(long long bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%lld B", bytes);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  }
  return buf;
}

}  // namespace pymemplan
