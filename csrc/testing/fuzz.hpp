// Random operation sequences against the allocator on a simulated device, every result
// checked against the allocator's invariants. Shared by the native test executable and the
// Python module (benchmarks/fuzz_allocator.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pymemplan {

struct FuzzOptions {
  std::uint64_t ops = 100000;
  std::uint64_t seed = 1;
  std::string policy = "pymemplan";
  std::string config;
  std::size_t capacity = std::size_t{4} << 30;
  std::size_t limit = 0;             // memory limit on the allocator (0: none)
  int streams = 3;
  bool manual_events = true;         // events complete only when the fuzzer says so
  std::uint64_t full_check_every = 1000;  // snapshot-based recount every this many ops
  // Periodic mode: most operations replay a random training-like iteration program over and
  // over (allocations freed within the iteration, a few across its end), switching now and
  // then to a second program (alternating shapes) or to a mutated one-off iteration (a
  // divergence); random operations (record_stream, events, extra blocks, empty_cache) are
  // interleaved. This is what exercises plan serving in pymemplan-planned.
  bool periodic = false;
  // pymemplan-planned: plans (export_plans() text, as a previous run's FuzzReport::plans)
  // imported before the first operation: a restarted job.
  std::string plans;
  // Every this many operations the next page mapping runs out of memory (a cuMemMap whose
  // page tables cannot grow), which the OOM ladder must absorb (0: never).
  std::uint64_t fail_map_every = 0;
};

struct FuzzReport {
  std::uint64_t ops = 0, mallocs = 0, frees = 0, record_streams = 0, empty_caches = 0;
  std::uint64_t ooms = 0, full_checks = 0, drains_to_zero = 0;
  std::size_t max_live_blocks = 0;
  std::int64_t max_reserved = 0;
  std::uint64_t iterations = 0;   // periodic mode: iteration programs run
  std::uint64_t plan_hits = 0;    // pymemplan-planned: requests served at a planned offset
  std::uint64_t prologue_hits = 0;  // pymemplan-planned: served from an imported prologue
  bool prologue_handover = false;   // its plan took over where the imported prologue ended
  std::uint64_t prologue_ahead = 0;  // slots of it laid out past those recorded (a shorter run's)
  std::uint64_t plan_fallbacks = 0;
  std::uint64_t plan_hole_hits = 0;  // of plan_hits, served in a hole of the pool
  std::uint64_t plan_remakes = 0;    // plans made again from a pass shorter than their period
  std::uint64_t plan_layouts_kept = 0;  // plans made again that kept their layout (it held less)
  std::uint64_t plan_tail_layouts = 0;  // packings laid out from a kept page's free tail
  std::uint64_t plan_full_rearms = 0;      // plans armed by their first requests, then whole
  std::uint64_t plan_first_request_cuts = 0;  // passes started by a plan's first request after a divergence
  std::uint64_t plan_busy_arenas_retired = 0;  // arenas retired into the pool with live blocks
  std::uint64_t plan_arenas_reclaimed = 0;     // of those, taken back as the arena later
  std::uint64_t page_shares = 0;     // share_pages calls that gave pages back
  std::uint64_t bursts = 0;          // runs of allocations in live blocks' sizes (an optimizer's state)
  std::uint64_t plans_imported = 0;  // pymemplan-planned: of FuzzOptions::plans
  std::string plans;                 // pymemplan-planned: export_plans() after the last op
};

// Throws std::logic_error naming the violated invariant, the op index and the seed.
FuzzReport fuzz(const FuzzOptions& options);

}  // namespace pymemplan
