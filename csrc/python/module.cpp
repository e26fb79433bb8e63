// pymemplan._core: the allocator policies over a simulated device, and trace replay.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <string>
#include <utility>

#include "../core/allocator_api.hpp"
#include "../core/config.hpp"
#include "../core/errors.hpp"
#include "../core/packing.hpp"  // pymemplan-planned (planned.hpp): pack_blocks
#include "../core/planned.hpp"
#include "../core/replay.hpp"
#include "../devices/simulated_device.hpp"
#include "../testing/fuzz.hpp"

namespace py = pybind11;
using namespace pymemplan;

namespace {

py::dict stats_dict(const Stats& s) {
  py::dict d;
  for (const auto& [k, v] : s.items()) d[py::str(k)] = v;
  return d;
}

py::dict snapshot_dict(const std::vector<SegmentInfo>& segments, StreamId) {
  py::list segs;
  for (const auto& s : segments) {
    py::list blocks;
    for (const auto& b : s.blocks) {
      py::dict bd;
      bd["address"] = b.address;
      bd["size"] = b.size;
      bd["requested_size"] = b.requested_size;
      bd["state"] = b.state;
      bd["frames"] = py::list();
      blocks.append(bd);
    }
    py::dict sd;
    sd["device"] = 0;
    sd["address"] = s.address;
    sd["total_size"] = s.total_size;
    sd["allocated_size"] = s.allocated_size;
    sd["active_size"] = s.active_size;
    sd["requested_size"] = s.requested_size;
    sd["stream"] = s.stream;
    sd["segment_type"] = s.segment_type;
    sd["segment_pool_id"] = py::make_tuple(0, 0);
    sd["is_expandable"] = s.is_virtual;
    if (s.is_virtual) {
      sd["mapped_size"] = s.mapped_size;
      sd["page_size"] = s.page_size;
      sd["chunk_size"] = s.chunk_size;
      sd["torch_expandable"] = s.torch_expandable;
      sd["page_mapped"] = s.page_mapped;
      sd["page_aliased"] = s.page_aliased;
    }
    sd["frames"] = py::list();
    sd["blocks"] = blocks;
    segs.append(sd);
  }
  py::dict snap;
  snap["segments"] = segs;
  py::list traces;
  traces.append(py::list());
  snap["device_traces"] = traces;
  return snap;
}

// A Python-facing allocator owns its device through a shared_ptr, so the device outlives it.
std::unique_ptr<Allocator> make_simulated_allocator(std::shared_ptr<SimulatedDevice> device,
                                                    const std::string& policy,
                                                    const std::string& config) {
  return make_allocator(device, policy, config);
}

template <typename T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;

// pymemplan-planned's own methods, on an Allocator of that policy.
const PlannedAllocator& planned_of(const Allocator& a, const char* what) {
  const auto* p = dynamic_cast<const PlannedAllocator*>(&a);
  if (p == nullptr) throw AllocatorError(std::string(what) + ": policy " + a.policy_name() + " has no plans");
  return *p;
}

PlannedAllocator& planned_of(Allocator& a, const char* what) {
  return const_cast<PlannedAllocator&>(planned_of(static_cast<const Allocator&>(a), what));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "pymemplan's C++ allocator core over a simulated device";

  // Python-side exception types; C++ exceptions are translated at this boundary.
  static py::exception<AllocatorError> alloc_err(m, "AllocatorError", PyExc_ValueError);
  static py::exception<OutOfMemoryError> oom_err(m, "OutOfMemoryError", PyExc_RuntimeError);
  static py::exception<DeviceError> dev_err(m, "DeviceError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const AllocatorError& e) {
      py::set_error(alloc_err, e.what());
    } catch (const OutOfMemoryError& e) {
      py::set_error(oom_err, e.what());
    } catch (const DeviceError& e) {
      py::set_error(dev_err, e.what());
    } catch (const std::logic_error& e) {
      py::set_error(PyExc_AssertionError, e.what());  // a fuzz invariant violation
    }
  });

  m.attr("POLICIES") = PolicyConfig::policy_names();
  m.def("format_bytes", &format_bytes);
  m.def(
      "parse_config",
      [](const std::string& policy, const std::string& config) {
        return validate_config(policy, config);
      },
      py::arg("policy"), py::arg("config") = "",
      "Validate a policy and config string; returns the full effective config.");

  py::class_<SimulatedDevice, std::shared_ptr<SimulatedDevice>>(m, "SimulatedDevice")
      .def(py::init<std::size_t, std::size_t, bool>(), py::arg("capacity"),
           py::arg("granularity") = 2 << 20, py::arg("auto_complete_events") = true)
      .def_property_readonly("capacity", &SimulatedDevice::capacity)
      .def_property_readonly("granularity", &SimulatedDevice::granularity)
      .def_property_readonly("used", &SimulatedDevice::used)
      .def_property_readonly("live_segments", &SimulatedDevice::live_segments)
      .def_property_readonly("pending_events", &SimulatedDevice::pending_events)
      .def_property_readonly("live_events", &SimulatedDevice::live_events)
      .def_property_readonly("record_count", &SimulatedDevice::record_count)
      .def_property_readonly("live_pages", &SimulatedDevice::live_pages)
      .def_property_readonly("mapped_pages", &SimulatedDevice::mapped_pages)
      .def_property_readonly("live_reservations", &SimulatedDevice::live_reservations)
      .def_property_readonly("device_synchronizations", &SimulatedDevice::device_synchronizations)
      .def_property_readonly("bytes_copied", &SimulatedDevice::bytes_copied)
      .def(
          "translate",
          [](const SimulatedDevice& d, std::uintptr_t addr) {
            const auto [page, offset] = d.translate(addr);
            return py::make_tuple(page, offset);
          },
          py::arg("address"),
          "(physical page, offset in it) of a device address; (0, 0) where nothing is mapped.")
      .def("completed_through", &SimulatedDevice::completed_through, py::arg("stream"))
      .def("set_auto_complete", &SimulatedDevice::set_auto_complete, py::arg("on"))
      .def(
          "complete_events",
          [](SimulatedDevice& d, py::object stream) {
            if (stream.is_none()) {
              d.complete_events(0, true);
            } else {
              d.complete_events(stream.cast<StreamId>(), false);
            }
          },
          py::arg("stream") = py::none(),
          "Complete the recorded events of one stream, or of all streams.")
      .def("fail_next_allocations", &SimulatedDevice::fail_next_allocations, py::arg("n"))
      .def("fail_next_maps", &SimulatedDevice::fail_next_maps, py::arg("n"));

  py::class_<Allocator>(m, "Allocator")
      .def(py::init(&make_simulated_allocator), py::arg("device"), py::arg("policy") = "pymemplan",
           py::arg("config") = "", py::keep_alive<1, 2>())
      .def(
          "malloc",
          [](Allocator& a, std::int64_t size, StreamId stream) {
            return reinterpret_cast<std::uintptr_t>(a.malloc(size, stream));
          },
          py::arg("size"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "free", [](Allocator& a, std::uintptr_t p) { a.free(reinterpret_cast<void*>(p)); },
          py::arg("ptr"), py::call_guard<py::gil_scoped_release>())
      .def(
          "record_stream",
          [](Allocator& a, std::uintptr_t p, StreamId s) {
            a.record_stream(reinterpret_cast<void*>(p), s);
          },
          py::arg("ptr"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("empty_cache", &Allocator::empty_cache, py::call_guard<py::gil_scoped_release>())
      .def("mark_step", &Allocator::mark_step, py::call_guard<py::gil_scoped_release>())
      .def("share_pages", &Allocator::share_pages, py::call_guard<py::gil_scoped_release>(),
           "Give back pages that blocks in use only partly fill, by mapping two such pages "
           "onto one where their live bytes lie at disjoint offsets; returns the bytes given back.")
      .def("stop_automatic_page_sharing", &Allocator::stop_automatic_page_sharing,
           "Turn off page sharing on the allocator's own initiative (as share_pages:False); "
           "returns whether it was on. The plugin calls it when two threads allocate at once.")
      .def("self_check", &Allocator::self_check,
           "Check the allocator's own indexes against its blocks: '' when they agree, else what "
           "is wrong (for tests).")
      .def("set_memory_limit", &Allocator::set_memory_limit, py::arg("bytes"))
      .def("set_memory_fraction", &Allocator::set_memory_fraction, py::arg("fraction"))
      .def_property_readonly("memory_limit", &Allocator::memory_limit)
      .def("stats", [](const Allocator& a) { return stats_dict(a.stats()); })
      .def(
          "unmap_waits", [](const Allocator& a) { return a.stats().num_unmap_waits; },
          "Page unmaps that waited for a stream's queued work (not a torch statistic; vmm).")
      .def("reset_peak_stats", &Allocator::reset_peak_stats)
      .def("reset_accumulated_stats", &Allocator::reset_accumulated_stats)
      .def("snapshot", [](const Allocator& a) { return snapshot_dict(a.snapshot(), 0); })
      .def("reserved_bytes", &Allocator::reserved_bytes,
           "Bytes held from the device now (reserved_bytes.all.current, without the stats dict).")
      .def("round_size", &Allocator::round_size, py::arg("size"))
      .def_property_readonly("last_error", &Allocator::last_error)
      .def_property_readonly("policy",
                             [](const Allocator& a) { return a.policy_name(); })
      .def_property_readonly("config",
                             [](const Allocator& a) { return a.config_string(); })
      // pymemplan-planned only (planned.hpp): figures about its plans.
      .def("plan_stats", [](const Allocator& a) {
        py::dict d;
        for (const auto& [k, v] : planned_of(a, "plan_stats").plan_stats()) d[py::str(k)] = v;
        return d;
      })
      .def(
          "export_plans",
          [](const Allocator& a) { return planned_of(a, "export_plans").export_plans(); },
          "pymemplan-planned only: its plans worth an arena, as text for import_plans().")
      .def(
          "import_plans",
          [](Allocator& a, const std::string& text) {
            return planned_of(a, "import_plans").import_plans(text);
          },
          py::arg("text"),
          "pymemplan-planned only: adds the plans export_plans() wrote (in another run); "
          "returns how many were added.")
      .def("plan_blocks", [](const Allocator& a) {
        // pymemplan-planned only: the blocks of the last plan built, for tests and the packer.
        const auto [period, blocks] = planned_of(a, "plan_blocks").last_plan_blocks();
        std::vector<std::size_t> start, life, size;
        for (const PackBlock& b : blocks) {
          start.push_back(b.start);
          life.push_back(b.life);
          size.push_back(b.size);
        }
        py::dict d;
        d["period"] = period;
        d["start"] = start;
        d["life"] = life;
        d["size"] = size;
        return d;
      });

  // pymemplan-planned's offline packer (packing.hpp), for tests and benchmarks: blocks alive
  // during [start, start + life) on a circle of `period` steps get offsets in one arena.
  m.def(
      "pack_blocks",
      [](const std::vector<std::size_t>& start, const std::vector<std::size_t>& life,
         const std::vector<std::size_t>& size, std::size_t period, std::size_t search_rounds,
         std::size_t granule, std::size_t give_up) {
        if (start.size() != life.size() || start.size() != size.size()) {
          throw AllocatorError("pack_blocks: start, life and size differ in length");
        }
        std::vector<PackBlock> blocks(start.size());
        for (std::size_t i = 0; i < blocks.size(); ++i) blocks[i] = {start[i], life[i], size[i]};
        PackResult r;
        try {
          r = pack_blocks(blocks, period, search_rounds, granule, give_up);
        } catch (const std::invalid_argument& e) {
          throw AllocatorError(e.what());
        }
        py::dict d;
        d["offsets"] = r.offsets;
        d["arena"] = r.arena;
        d["bound"] = r.bound;
        d["ratio"] = r.ratio();
        d["runs"] = r.runs;
        return d;
      },
      py::arg("start"), py::arg("life"), py::arg("size"), py::arg("period"),
      py::arg("search_rounds") = 2, py::arg("granule") = 1, py::arg("give_up") = 0);

  // The hole filler of pymemplan-planned (packing.hpp): blocks placed into fixed free ranges.
  // For "peak-shave", what using [0, top) of hole h costs is modelled as in the allocator: the
  // first free[h] bytes lie on pages kept anyway, the rest costs whole pages of `page` bytes.
  m.def(
      "fill_holes",
      [](const std::vector<std::size_t>& start, const std::vector<std::size_t>& life,
         const std::vector<std::size_t>& size, std::size_t period,
         const std::vector<std::size_t>& holes, const std::string& rule,
         const std::vector<std::size_t>& free, std::size_t page) {
        const std::pair<const char*, HoleRule> rules[] = {
            {"greedy", HoleRule::kGreedy},
            {"greedy-area", HoleRule::kGreedyByArea},
            {"greedy-life", HoleRule::kGreedyByLife},
            {"skyline", HoleRule::kSkyline},
            {"peak-shave", HoleRule::kPeakShave}};
        const auto* found = std::find_if(std::begin(rules), std::end(rules),
                                         [&](const auto& r) { return rule == r.first; });
        if (found == std::end(rules)) {
          throw AllocatorError("fill_holes: rule must be 'greedy', 'greedy-area', 'greedy-life', "
                               "'skyline' or 'peak-shave', not '" + rule + "'");
        }
        if (start.size() != life.size() || start.size() != size.size()) {
          throw AllocatorError("fill_holes: start, life and size differ in length");
        }
        if (!free.empty() && (free.size() != holes.size() || page == 0)) {
          throw AllocatorError("fill_holes: give free bytes for every hole, and a page size > 0");
        }
        HoleCost cost;
        if (!free.empty()) {
          cost = [&](std::size_t h, std::size_t top) -> std::size_t {
            return top <= free[h] ? 0 : (top - free[h] + page - 1) / page * page;
          };
        }
        std::vector<PackBlock> blocks(start.size());
        for (std::size_t i = 0; i < blocks.size(); ++i) {
          if (start[i] >= period || life[i] == 0 || life[i] > period) {
            throw AllocatorError("fill_holes: block " + std::to_string(i) +
                                 " does not fit a period of " + std::to_string(period));
          }
          blocks[i] = {start[i], life[i], size[i]};
        }
        HoleFill r;
        try {
          r = fill_holes(blocks, period, holes, found->second, cost);
        } catch (const std::invalid_argument& e) {
          throw AllocatorError(e.what());
        }
        std::vector<long long> hole(r.hole.size());
        for (std::size_t i = 0; i < hole.size(); ++i) {
          hole[i] = r.hole[i] == HoleFill::kNone ? -1 : static_cast<long long>(r.hole[i]);
        }
        py::dict d;
        d["hole"] = hole;  // -1: not placed (it goes to the arena)
        d["offset"] = r.offset;
        d["placed_bytes"] = r.placed_bytes;
        return d;
      },
      py::arg("start"), py::arg("life"), py::arg("size"), py::arg("period"), py::arg("holes"),
      py::arg("rule") = "greedy", py::arg("free") = std::vector<std::size_t>{},
      py::arg("page") = 0);

  m.def(
      "fuzz",
      [](std::uint64_t ops, std::uint64_t seed, const std::string& policy,
         const std::string& config, std::size_t capacity, std::size_t limit, int streams,
         bool manual_events, std::uint64_t full_check_every, bool periodic,
         const std::string& plans, std::uint64_t fail_map_every) {
        FuzzOptions o{ops, seed, policy, config, capacity, limit, streams, manual_events,
                      full_check_every, periodic, plans, fail_map_every};
        FuzzReport r;
        {
          py::gil_scoped_release release;
          r = fuzz(o);
        }
        py::dict d;
        d["ops"] = r.ops;
        d["mallocs"] = r.mallocs;
        d["frees"] = r.frees;
        d["record_streams"] = r.record_streams;
        d["empty_caches"] = r.empty_caches;
        d["bursts"] = r.bursts;
        d["ooms"] = r.ooms;
        d["full_checks"] = r.full_checks;
        d["drains_to_zero"] = r.drains_to_zero;
        d["max_live_blocks"] = r.max_live_blocks;
        d["max_reserved"] = r.max_reserved;
        d["iterations"] = r.iterations;
        d["plan_hits"] = r.plan_hits;
        d["prologue_hits"] = r.prologue_hits;
        d["prologue_handover"] = r.prologue_handover;
        d["prologue_ahead"] = r.prologue_ahead;
        d["plan_fallbacks"] = r.plan_fallbacks;
        d["plan_remakes"] = r.plan_remakes;
        d["plan_layouts_kept"] = r.plan_layouts_kept;
        d["plan_tail_layouts"] = r.plan_tail_layouts;
        d["plan_full_rearms"] = r.plan_full_rearms;
        d["plan_first_request_cuts"] = r.plan_first_request_cuts;
        d["plan_busy_arenas_retired"] = r.plan_busy_arenas_retired;
        d["plan_arenas_reclaimed"] = r.plan_arenas_reclaimed;
        d["plan_hole_hits"] = r.plan_hole_hits;
        d["page_shares"] = r.page_shares;
        d["plans_imported"] = r.plans_imported;
        d["plans"] = r.plans;
        return d;
      },
      py::arg("ops"), py::arg("seed") = 1, py::arg("policy") = "pymemplan",
      py::arg("config") = "", py::arg("capacity") = std::size_t{4} << 30, py::arg("limit") = 0,
      py::arg("streams") = 3, py::arg("manual_events") = true, py::arg("full_check_every") = 1000,
      py::arg("periodic") = false, py::arg("plans") = "", py::arg("fail_map_every") = 0,
      "Random operations checked against the allocator's invariants; raises on a violation. "
      "pymemplan-planned imports `plans` first, and returns its own in 'plans'. Every "
      "`fail_map_every` operations (0: never) the next page mapping runs out of memory.");

  m.def(
      "replay",
      [](carray<std::uint8_t> action, carray<std::int64_t> ptr, carray<std::int64_t> size,
         carray<std::int64_t> stream, const std::string& policy, const std::string& config,
         std::size_t capacity, std::size_t granularity, std::int64_t steady_from,
         std::uint64_t event_lag, const std::string& plans, const py::list& layout) {
        const auto n = static_cast<std::size_t>(action.size());
        if (static_cast<std::size_t>(ptr.size()) != n || static_cast<std::size_t>(size.size()) != n ||
            static_cast<std::size_t>(stream.size()) != n) {
          throw AllocatorError("replay: the trace columns differ in length");
        }
        auto device = std::make_shared<SimulatedDevice>(capacity, granularity, true);
        device->set_lag(event_lag);
        std::unique_ptr<Allocator> alloc = make_allocator(device, policy, config);
        auto* planned = dynamic_cast<PlannedAllocator*>(alloc.get());
        if (!plans.empty()) {
          if (planned == nullptr) throw AllocatorError("replay: policy " + policy + " takes no plans");
          planned->import_plans(plans);
        }
        // A recorded layout to start from: segments (bytes, small, stream, blocks), each block
        // (offset, size, requested, the trace pointer that frees it). A segment the device
        // refuses leaves its blocks unplaced: each counts as a refused request.
        std::vector<InitialBlock> initial;
        std::int64_t unplaced = 0;
        for (const auto& item : layout) {
          auto seg = item.cast<py::tuple>();
          if (seg.size() != 4) throw AllocatorError("replay: a layout segment is (bytes, small, stream, blocks)");
          std::vector<AdoptedBlock> blocks;
          std::vector<std::int64_t> ptrs;
          for (const auto& bi : seg[3].cast<py::list>()) {
            auto b = bi.cast<py::tuple>();
            if (b.size() != 4) throw AllocatorError("replay: a layout block is (offset, size, requested, ptr)");
            blocks.push_back({b[0].cast<std::size_t>(), b[1].cast<std::size_t>(), b[2].cast<std::int64_t>()});
            ptrs.push_back(b[3].cast<std::int64_t>());
          }
          std::vector<std::uintptr_t> at;
          try {
            at = alloc->adopt_segment(seg[0].cast<std::size_t>(), seg[1].cast<bool>(),
                                      seg[2].cast<StreamId>(), blocks);
          } catch (const OutOfMemoryError&) {
            at.assign(blocks.size(), 0);
            unplaced += static_cast<std::int64_t>(blocks.size());
          }
          for (std::size_t k = 0; k < blocks.size(); ++k) {
            initial.push_back({ptrs[k], reinterpret_cast<void*>(at[k]), blocks[k].requested});
          }
        }
        ReplayResult r;
        std::function<void()> tick;
        if (event_lag != 0) tick = [&device] { device->advance(); };
        {
          py::gil_scoped_release release;
          r = replay(*alloc, action.data(), ptr.data(), size.data(), stream.data(), n, steady_from,
                     tick, initial);
        }
        r.ooms += unplaced;
        py::dict d;
        d["events"] = r.events;
        d["peak_live_bytes"] = r.peak_live_bytes;
        d["peak_allocated_bytes"] = r.peak_allocated_bytes;
        d["peak_reserved_bytes"] = r.peak_reserved_bytes;
        d["device_allocs"] = r.device_allocs;
        d["device_frees"] = r.device_frees;
        d["ooms"] = r.ooms;
        d["ns_per_event"] = r.ns_per_event;
        d["planning_seconds"] = r.planning_seconds;
        d["first_planned_event"] = r.first_planned_event;
        d["steady_peak_reserved_bytes"] = r.steady_peak_reserved_bytes;
        d["steady_peak_live_bytes"] = r.steady_peak_live_bytes;
        d["steady_device_allocs"] = r.steady_device_allocs;
        d["steady_device_frees"] = r.steady_device_frees;
        d["unmap_waits"] = r.unmap_waits;
        d["steady_unmap_waits"] = r.steady_unmap_waits;
        d["ticks_waited"] = device->ticks_waited();
        d["plans"] = planned != nullptr ? planned->export_plans() : std::string();
        return d;
      },
      py::arg("action"), py::arg("ptr"), py::arg("size"), py::arg("stream"),
      py::arg("policy") = "pymemplan", py::arg("config") = "",
      py::arg("capacity") = std::size_t{80} << 30, py::arg("granularity") = 2 << 20,
      py::arg("steady_from") = -1, py::arg("event_lag") = 0, py::arg("plans") = "",
      py::arg("layout") = py::list(),
      "Replay a trace (parallel arrays) through a policy on a fresh simulated device; "
      "pymemplan-planned starts with `plans` (export_plans() text) and returns its own. "
      "`layout`: segments of a recorded layout the policy starts with (the model of "
      "PyTorch's allocator only): [(bytes, small, stream, [(offset, size, requested, ptr)])], "
      "ptr the trace pointer that frees the block.");
}
