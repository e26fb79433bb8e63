// The core's native test executable, built with -DPYMEMPLAN_NATIVE_TESTS=ON (and with
// AddressSanitizer + UBSan under -DPYMEMPLAN_SANITIZE=ON). Exits non-zero on any failure.
//   core_tests [ops-per-policy]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/allocator.hpp"
#include "core/errors.hpp"
#include "devices/simulated_device.hpp"
#include "testing/fuzz.hpp"

using namespace pymemplan;

namespace {

int failures = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                            \
    }                                                                        \
  } while (0)

template <typename E, typename F>
bool throws(F f) {
  try {
    f();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

void bad_input(const std::string& policy) {
  auto dev = std::make_shared<SimulatedDevice>(std::size_t{1} << 30);
  auto owned = make_allocator(dev, policy);
  Allocator& a = *owned;
  void* p = a.malloc(3 << 20, 0);
  CHECK(throws<AllocatorError>([&] { a.malloc(0, 0); }));
  CHECK(throws<AllocatorError>([&] { a.malloc(-1, 0); }));
  CHECK(throws<AllocatorError>([&] { a.free(reinterpret_cast<void*>(0x1000)); }));
  CHECK(throws<AllocatorError>([&] { a.free(static_cast<char*>(p) + 512); }));
  void* q = a.malloc(100, 0);
  a.free(q);
  CHECK(throws<AllocatorError>([&] { a.free(q); }));
  a.set_memory_limit(std::size_t{64} << 20);
  CHECK(throws<OutOfMemoryError>([&] { a.malloc(std::int64_t{65} << 20, 0); }));
  CHECK(a.try_malloc(std::int64_t{65} << 20, 0) == nullptr && !a.last_error().empty());
  CHECK(throws<AllocatorError>([&] { make_allocator(dev, policy, "no_such_key:1"); }));
  void* r = a.malloc(1 << 20, 0);
  CHECK(r != nullptr);
  a.free(r);
  a.free(p);
  a.empty_cache();
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
}

void threads(const std::string& policy) {
  auto dev = std::make_shared<SimulatedDevice>(std::size_t{16} << 30);
  auto owned = make_allocator(dev, policy);
  Allocator& a = *owned;
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&a, t] {
      std::vector<void*> mine;
      unsigned x = 12345u + static_cast<unsigned>(t);
      for (int i = 0; i < 20000; ++i) {
        x = x * 1103515245u + 12345u;
        if (!mine.empty() && (x >> 16) % 2 == 0) {
          a.free(mine.back());
          mine.pop_back();
        } else {
          void* p = a.malloc(static_cast<std::int64_t>(1 + (x >> 8) % (4 << 20)),
                             static_cast<StreamId>(t % 2));
          if ((x >> 4) % 16 == 0) a.record_stream(p, static_cast<StreamId>(t + 1));
          mine.push_back(p);
        }
        if (i % 5000 == 0) a.empty_cache();
      }
      for (void* p : mine) a.free(p);
    });
  }
  for (auto& w : workers) w.join();
  a.empty_cache();
  CHECK(a.stats().allocated_bytes[kAllPools].current == 0);
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  CHECK(dev->used() == 0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::uint64_t ops = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 200000;
  const char* configs[][2] = {{"pymemplan", ""},
                              {"pymemplan", "max_split_size_mb:48"},
                              {"pymemplan-vmm", ""},
                              {"pymemplan-vmm", "vmm_segment_mb:64"},
                              {"torch", ""},
                              {"torch", "max_split_size_mb:48,roundup_power2_divisions:4"},
                              {"torch", "expandable_segments:True"},
                              {"nocache", ""},
                              {"pymemplan-planned", ""},
                              // periodic: a repeated iteration program, so plans serve requests
                              {"pymemplan-planned", "periodic"},
                              {"pymemplan-planned", "periodic min_period:8,match_window:8"},
                              {"pymemplan-planned", "periodic vmm:False"},
                              {"pymemplan-planned", "periodic limit"},
                              // the model of GMLake, as it ships and stitching every request
                              {"gmlake", ""},
                              {"gmlake", "frag_limit_mb:0"}};
  for (auto& c : configs) {
    try {
      FuzzOptions o;
      o.ops = ops;
      o.policy = c[0];
      std::string conf = c[1];
      o.capacity = std::size_t{2} << 30;
      o.seed = 7;
      if (conf.rfind("periodic", 0) == 0) {
        o.periodic = true;
        o.ops = ops / 4 + 1;  // hundreds of iterations already
        conf = conf.substr(conf.find(' ') == std::string::npos ? conf.size() : conf.find(' ') + 1);
        if (conf == "limit") {
          o.limit = std::size_t{96} << 20;
          conf.clear();
        }
      }
      o.config = conf;
      FuzzReport r = fuzz(o);
      std::printf("fuzz %-17s %-40s ops=%llu mallocs=%llu ooms=%llu full_checks=%llu plan_hits=%llu "
                  "remakes=%llu full_rearms=%llu busy_arenas_retired=%llu\n",
                  c[0], c[1], static_cast<unsigned long long>(r.ops),
                  static_cast<unsigned long long>(r.mallocs), static_cast<unsigned long long>(r.ooms),
                  static_cast<unsigned long long>(r.full_checks),
                  static_cast<unsigned long long>(r.plan_hits),
                  static_cast<unsigned long long>(r.plan_remakes),
                  static_cast<unsigned long long>(r.plan_full_rearms),
                  static_cast<unsigned long long>(r.plan_busy_arenas_retired));
      if (o.periodic) CHECK(r.plan_hits > 0);  // plans served, not only the fallback pool
      // Plans are made again from a pass as it repeats (one-off blocks of the first iteration,
      // noise between iterations), and plans recognised by their first requests arm whole at
      // their cut: those paths run under the sanitizers too.
      if (o.periodic) CHECK(r.plan_remakes > 0 && r.plan_full_rearms > 0);
      // Without virtual memory an arena with live blocks is never retired into the pool (its
      // whole segment would stay pinned beside the next one).
      if (o.config.find("vmm:False") != std::string::npos) CHECK(r.plan_busy_arenas_retired == 0);
      if (o.periodic) {
        // The same programs again, restarted with the plans the run ended with (a plan with
        // offsets of another run, checked against every request).
        FuzzOptions again = o;
        again.ops = o.ops / 2 + 1;
        again.plans = r.plans;
        const FuzzReport r2 = fuzz(again);
        std::size_t saved = 0;
        for (std::size_t at = r.plans.find("\nplan "); at != std::string::npos;
             at = r.plans.find("\nplan ", at + 1)) {
          ++saved;
        }
        // Fewer where two plans have one signature (a plan made again may equal another).
        CHECK(r2.plans_imported <= saved && (saved == 0 || r2.plans_imported > 0));
        // The run, shorter than a prologue, is served from the prologue it exported (with
        // virtual memory); without it, from the plans.
        const bool vmm = o.config.find("vmm:False") == std::string::npos;
        CHECK(vmm ? r2.prologue_hits > 0 : r2.plan_hits > 0);
        const std::string config = again.config + (again.config.empty() ? "" : ",");
        again.config = config + "prologue:0";
        const FuzzReport r3 = fuzz(again);
        CHECK(r3.plan_hits > 0 && r3.prologue_hits == 0);
        // A prologue that ends where a pass a plan served whole ends, a third into the run (as a
        // run longer than a prologue hands over): that plan takes over there.
        again.config = config + "prologue:" + std::to_string(r2.mallocs / 3 + 1);
        again.plans.clear();                // recorded by a run of its own
        again.plans = fuzz(again).plans;
        const FuzzReport r4 = fuzz(again);
        // (Where the text names it: a plan made again later under another signature is not.)
        const std::size_t at = again.plans.find("\nprologue ");
        unsigned long long events = 0, slots = 0, named = 0;
        CHECK(at != std::string::npos &&
              std::sscanf(again.plans.c_str() + at, "\nprologue %llu %llu %llu", &events, &slots, &named) == 3);
        CHECK(r4.plan_hits > 0 && (vmm ? r4.prologue_hits > 0 : r4.prologue_hits == 0));
        CHECK(r4.prologue_handover == (vmm && named != 0));
        // A run longer than the one that saved the text, which stopped before its prologue's
        // end (a trial run): laid out past where that one stopped, along the pass it was in.
        FuzzOptions trial = o;
        trial.ops = o.ops / 6 + 1;
        FuzzOptions longer = o;
        longer.ops = o.ops / 2 + 1;
        longer.plans = fuzz(trial).plans;
        const FuzzReport r5 = fuzz(longer);
        const std::size_t at5 = longer.plans.find("\nprologue ");
        unsigned long long plan5 = 0, cursor5 = 0;
        CHECK(at5 != std::string::npos &&
              std::sscanf(longer.plans.c_str() + at5, "\nprologue %llu %llu %llu %llu", &events, &slots,
                          &plan5, &cursor5) == 4);
        CHECK(vmm ? r5.prologue_hits > 0 : r5.prologue_hits == 0);
        CHECK((r5.prologue_ahead > 0) == (vmm && cursor5 != 0));
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fuzz %s %s: %s\n", c[0], c[1], e.what());
      ++failures;
    }
  }
  // Page mappings that run out of memory now and then (a cuMemMap whose page tables cannot
  // grow): the OOM ladder absorbs each, with pages moved, plans arming and pages shared.
  for (const char* policy : {"pymemplan-vmm", "pymemplan-planned", "gmlake"}) {
    const bool periodic = std::string(policy) == "pymemplan-planned";
    for (const std::size_t limit : {std::size_t{0}, std::size_t{96} << 20}) {
      FuzzOptions o;
      o.ops = ops / 4 + 1;
      o.seed = 11;
      o.policy = policy;
      if (o.policy == "gmlake") o.config = "frag_limit_mb:0";
      o.capacity = std::size_t{2} << 30;
      o.limit = limit;
      o.periodic = periodic;
      o.fail_map_every = 97;
      try {
        const FuzzReport r = fuzz(o);
        std::printf("fuzz %-17s failing maps, limit %zu MiB: ops=%llu ooms=%llu plan_hits=%llu\n",
                    o.policy.c_str(), limit >> 20, static_cast<unsigned long long>(r.ops),
                    static_cast<unsigned long long>(r.ooms),
                    static_cast<unsigned long long>(r.plan_hits));
        if (periodic) CHECK(r.plan_hits > 0);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fuzz %s with failing maps: %s\n", o.policy.c_str(), e.what());
        ++failures;
      }
    }
  }
  for (const char* p : {"pymemplan", "pymemplan-vmm", "pymemplan-planned", "torch", "nocache", "gmlake"}) {
    bad_input(p);
    threads(p);
  }
  std::printf(failures ? "FAILED: %d\n" : "all core tests passed\n", failures);
  return failures ? 1 : 0;
}
