#include "fuzz.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "../core/allocator_api.hpp"
#include "../core/planned.hpp"
#include "../core/stats.hpp"
#include "../core/errors.hpp"
#include "../devices/simulated_device.hpp"

namespace pymemplan {
namespace {

struct LiveBlock {
  std::size_t size;
  StreamId stream;
  std::set<StreamId> uses;  // record_stream
};

// Memory freed while some stream's work may still touch it.
struct FreedRange {
  std::uintptr_t lo, hi;
  StreamId owner;
  std::set<StreamId> uses;
  std::uint64_t record_count;  // device record counter at the free
};

class Fuzzer {
 public:
  explicit Fuzzer(const FuzzOptions& o)
      : o_(o),
        rng_(o.seed),
        device_(std::make_shared<SimulatedDevice>(o.capacity, 2 << 20, !o.manual_events)),
        alloc_(make_allocator(device_, o.policy, o.config)) {
    if (o.limit) alloc_->set_memory_limit(o.limit);
    if (!o.plans.empty()) {
      auto* planned = dynamic_cast<PlannedAllocator*>(alloc_.get());
      if (planned == nullptr) throw AllocatorError("fuzz: plans are for pymemplan-planned, not " + o.policy);
      r_.plans_imported = planned->import_plans(o.plans);
    }
    // No page may be unmapped while work queued before the free of a block on it (on the
    // block's stream, or streams that used it) may still touch it.
    device_->set_unmap_hook([this](std::uintptr_t page) {
      auto it = freed_pages_.find(page);
      if (it == freed_pages_.end()) return;
      for (const FreedRange& f : it->second) {
        expect(done(f), "a page was unmapped while work queued before a free on it may touch it");
      }
      freed_pages_.erase(it);
    });
  }
  ~Fuzzer() { device_->set_unmap_hook(nullptr); }

  FuzzReport run() {
    if (o_.periodic) {
      programs_[0] = make_program();
      programs_[1] = make_program();
    }
    for (op_ = 0; op_ < o_.ops; ++op_) {
      if (o_.fail_map_every != 0 && op_ % o_.fail_map_every == 0) device_->fail_next_maps(1);
      if (!o_.periodic) {
        step();
      } else if (rng_() % 32 != 0) {
        periodic_step();
      } else {
        periodic_noise();
      }
      if (o_.full_check_every && op_ % o_.full_check_every == 0) full_check();
      if (op_ % 200000 == 199999) drain_to_zero();
    }
    drain_to_zero();
    r_.ops = o_.ops;
    if (const auto* planned = dynamic_cast<const PlannedAllocator*>(alloc_.get())) {
      r_.plans = planned->export_plans();
      for (const auto& [k, v] : planned->plan_stats()) {
        if (k == "plan_hits") r_.plan_hits = static_cast<std::uint64_t>(v);
        if (k == "prologue_hits") r_.prologue_hits = static_cast<std::uint64_t>(v);
        if (k == "prologue_handover") r_.prologue_handover = v != 0;
        if (k == "prologue_ahead") r_.prologue_ahead = static_cast<std::uint64_t>(v);
        if (k == "fallbacks") r_.plan_fallbacks = static_cast<std::uint64_t>(v);
        if (k == "hole_hits") r_.plan_hole_hits = static_cast<std::uint64_t>(v);
        if (k == "remakes") r_.plan_remakes = static_cast<std::uint64_t>(v);
        if (k == "layouts_kept") r_.plan_layouts_kept = static_cast<std::uint64_t>(v);
        if (k == "tail_layouts") r_.plan_tail_layouts = static_cast<std::uint64_t>(v);
        if (k == "full_rearms") r_.plan_full_rearms = static_cast<std::uint64_t>(v);
        if (k == "first_request_cuts") r_.plan_first_request_cuts = static_cast<std::uint64_t>(v);
        if (k == "busy_arenas_retired") r_.plan_busy_arenas_retired = static_cast<std::uint64_t>(v);
        if (k == "arenas_reclaimed") r_.plan_arenas_reclaimed = static_cast<std::uint64_t>(v);
      }
    }
    return r_;
  }

 private:
  // One operation of an iteration program: allocate `size` on `stream` under `key`, or free
  // the block held under `key` (if it is still held: a free of a key carried over from a
  // different program finds nothing).
  struct ProgramOp {
    bool alloc;
    std::size_t key;
    std::size_t size;
    StreamId stream;
  };
  static constexpr std::size_t kCarry = 3;  // blocks freed early in the next iteration
  static constexpr std::size_t kKept = std::size_t{1} << 40;  // keys of blocks no program frees
  // An input batch made before the last one is released (a loader's prefetch): each program
  // starts by making one under kBatch and freeing the one under kLastBatch; a new iteration
  // renames kBatch to kLastBatch. It lives a little longer than the iteration.
  static constexpr std::size_t kBatch = kKept - 1, kLastBatch = kKept - 2;

  std::vector<ProgramOp> make_program() {
    // A training-like iteration: allocations mostly freed in reverse order (activations),
    // some at once (temporaries), some at the end (gradients), and up to kCarry freed only at
    // the start of the next iteration. Keys kCarry.. are this iteration's; 0..kCarry-1 carry.
    std::vector<ProgramOp> ops;
    const std::size_t n = 8 + rng_() % 56;
    if (rng_() % 2 == 0) {
      ops.push_back({true, kBatch, 1 + rng_() % (3 << 20), 0});
      ops.push_back({false, kLastBatch, 0, 0});
    }
    for (std::size_t c = 0; c < kCarry; ++c) ops.push_back({false, c, 0, 0});
    std::vector<std::size_t> live;
    std::uniform_real_distribution<double> exp2(9.0, 24.0);  // 512 B .. 16 MiB
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t key = kCarry + i;
      const auto size = static_cast<std::size_t>(std::exp2(exp2(rng_))) + rng_() % 512;
      const StreamId stream = rng_() % 4 == 0 ? rng_() % static_cast<unsigned>(o_.streams) : 0;
      ops.push_back({true, key, size, stream});
      live.push_back(key);
      const auto dice = rng_() % 4;
      if (dice == 0) {  // a temporary: freed at once
        ops.push_back({false, key, 0, 0});
        live.pop_back();
      } else if (dice == 1 && live.size() > 1) {  // an earlier block dies (reverse order mostly)
        const std::size_t j = live.size() - 2 - (rng_() % 3 == 0 ? rng_() % (live.size() - 1) : 0);
        ops.push_back({false, live[j], 0, 0});
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
      }
    }
    // The rest dies at the end, but up to kCarry blocks that live into the next iteration.
    std::size_t carried = 0;
    while (!live.empty()) {
      const std::size_t key = live.back();
      live.pop_back();
      if (carried < kCarry && rng_() % 4 == 0) {
        ops.push_back({true, carried, 1 + rng_() % (1 << 20), 0});  // re-made under a carry key
        ops.push_back({false, key, 0, 0});
        ++carried;
      } else {
        ops.push_back({false, key, 0, 0});
      }
    }
    return ops;
  }

  void periodic_step() {
    if (pc_ == current_.size()) {
      // The next iteration: the same program mostly; sometimes the other one (alternating
      // shapes), sometimes a mutated one-off (a divergence: other sizes, or two ops swapped).
      ++r_.iterations;
      if (auto batch = keys_.find(kBatch); batch != keys_.end() && keys_.count(kLastBatch) == 0) {
        const std::uintptr_t p = batch->second;
        keys_.erase(batch);
        keys_[kLastBatch] = p;
        key_of_[p] = kLastBatch;
      }
      const auto dice = rng_() % 32;
      if (dice == 0) which_ = 1 - which_;
      current_ = programs_[which_];
      if (dice == 1 || dice == 2) {
        for (ProgramOp& op : current_) {
          if (op.alloc && rng_() % 3 == 0) op.size = op.size / 2 + 512;
        }
      } else if (dice == 3 && current_.size() > 2) {
        const std::size_t a = rng_() % current_.size(), b = rng_() % current_.size();
        std::swap(current_[a], current_[b]);  // may free before allocating: skipped then
      }
      if (r_.iterations == 1) {
        // The first iteration also makes what later ones keep, as an optimizer makes its state
        // at its first step: blocks in the image of the program's first allocations, never
        // freed by a program. A plan found in a window holding them is made again later.
        std::size_t made = 0;
        for (std::size_t i = 0; i < programs_[which_].size() && made < 16; ++i) {
          const ProgramOp& op = programs_[which_][i];
          if (op.alloc) current_.push_back({true, kKept + made++, op.size, 0});
        }
      }
      pc_ = 0;
    }
    const ProgramOp op = current_[pc_++];
    auto held = keys_.find(op.key);
    if (op.alloc) {
      if (held != keys_.end()) return;  // still held (a swap put the free later): skip
      if (std::uintptr_t p = do_malloc(op.size, op.stream)) {
        keys_[op.key] = p;
        key_of_[p] = op.key;
      }
    } else if (held != keys_.end()) {
      do_free(held->second);  // forgets the key too
    }
  }

  void periodic_noise() {
    // Between program operations: what else happens in a training process.
    const auto dice = static_cast<unsigned>(rng_() % 100);
    const StreamId stream = rng_() % static_cast<unsigned>(o_.streams);
    if (dice < 45 && !live_.empty()) {
      const std::uintptr_t p = random_live();
      alloc_->record_stream(reinterpret_cast<void*>(p), stream);
      auto& b = live_.at(p);
      if (stream != b.stream) b.uses.insert(stream);
      ++r_.record_streams;
    } else if (dice < 90) {
      device_->complete_events(stream, rng_() % 4 == 0);
    } else if (dice < 95) {
      do_malloc(random_size(), stream);  // a block outside the programs (freed at random)
    } else if (dice < 99 && !live_.empty()) {
      const std::uintptr_t p = random_live();
      if (key_of_.count(p) == 0) do_free(p);
    } else if (rng_() % 2 == 0) {
      share_pages();
    } else {
      alloc_->empty_cache();
      expect(device_->pending_events() == 0, "empty_cache left events pending");
      ++r_.empty_caches;
    }
  }

  void share_pages() {
    const std::size_t before = device_->live_pages();
    const std::size_t given = alloc_->share_pages();
    expect(device_->live_pages() + given / device_->granularity() == before,
           "share_pages gave back other than the pages it reports");
    if (given != 0) {
      ++r_.page_shares;
      physical_check();
    }
  }

  void physical_check() {
    // Two addresses may map one physical page (share_pages): blocks in use must not overlap
    // in physical memory either, (page, offset) by (page, offset).
    struct Piece {
      PageHandle page;
      std::size_t lo, hi;
    };
    std::vector<Piece> pieces;
    for (const SegmentInfo& seg : alloc_->snapshot()) {
      if (!seg.is_virtual) continue;
      for (const BlockInfo& b : seg.blocks) {
        if (b.state == "inactive") continue;
        for (std::uintptr_t at = b.address; at < b.address + b.size;) {
          const auto [page, offset] = device_->translate(at);
          expect(page != 0, "a block in use lies on an unmapped page");
          const std::size_t n = std::min<std::size_t>(seg.page_size - offset, b.address + b.size - at);
          pieces.push_back({page, offset, offset + n});
          at += n;
        }
      }
    }
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
      return a.page != b.page ? a.page < b.page : a.lo < b.lo;
    });
    for (std::size_t i = 1; i < pieces.size(); ++i) {
      expect(pieces[i].page != pieces[i - 1].page || pieces[i].lo >= pieces[i - 1].hi,
             "two blocks in use share physical memory");
    }
  }

  [[noreturn]] void fail(const std::string& what) {
    throw std::logic_error("invariant violated at op " + std::to_string(op_) + " (seed " +
                           std::to_string(o_.seed) + ", policy " + o_.policy + "): " + what);
  }
  void expect(bool ok, const char* what) {
    if (!ok) fail(what);
  }
  // Whether the work queued before a free, on its stream and on streams that used it, is done.
  bool done(const FreedRange& f) const {
    if (device_->completed_through(f.owner) <= f.record_count) return false;
    for (StreamId u : f.uses) {
      if (device_->completed_through(u) <= f.record_count) return false;
    }
    return true;
  }

  std::size_t random_size() {
    // Log-uniform over 1 B .. 64 MiB, with a bias towards the small pool as in real traces.
    std::uniform_real_distribution<double> exp2(0.0, rng_() % 4 == 0 ? 26.0 : 20.0);
    return static_cast<std::size_t>(std::exp2(exp2(rng_))) + rng_() % 512;
  }

  void step() {
    const auto dice = static_cast<unsigned>(rng_() % 1000);
    const StreamId stream = rng_() % static_cast<unsigned>(o_.streams);
    if (dice < 500 || live_.empty()) {
      do_malloc(random_size(), stream);
    } else if (dice < 900) {
      do_free(random_live());
    } else if (dice < 950) {
      std::uintptr_t p = random_live();
      alloc_->record_stream(reinterpret_cast<void*>(p), stream);
      auto& b = live_.at(p);
      if (stream != b.stream) b.uses.insert(stream);
      ++r_.record_streams;
    } else if (dice < 996) {
      device_->complete_events(stream, rng_() % 4 == 0);
    } else if (dice < 997) {
      burst(stream);
    } else if (dice < 998) {
      share_pages();
    } else {
      alloc_->empty_cache();
      expect(device_->pending_events() == 0, "empty_cache left events pending");
      ++r_.empty_caches;
    }
  }

  void burst(StreamId stream) {
    // An optimizer making its state: blocks in the sizes of live ones, one after another with
    // no free between (pack_long_lived places them at the lowest free addresses).
    if (order_.empty()) return;
    const std::size_t n = 24 + rng_() % 41;
    std::vector<std::size_t> sizes;
    for (std::size_t i = 0; i < n; ++i) sizes.push_back(live_.at(random_live()).size);
    for (std::size_t size : sizes) do_malloc(size, stream);
    ++r_.bursts;
  }

  std::uintptr_t random_live() {
    // Random element of an unordered_map without a linear walk: keep a side vector.
    std::size_t i = rng_() % order_.size();
    return order_[i];
  }

  std::uintptr_t do_malloc(std::size_t size, StreamId stream) {
    ++r_.mallocs;
    void* ptr = alloc_->try_malloc(static_cast<std::int64_t>(size), stream);
    if (ptr == nullptr) {
      ++r_.ooms;
      expect(!alloc_->last_error().empty(), "OOM without a message");
      return 0;
    }
    const auto lo = reinterpret_cast<std::uintptr_t>(ptr);
    const std::uintptr_t hi = lo + size;
    expect(lo % 512 == 0, "pointer not 512-byte aligned");
    // No overlap with any live block.
    auto next = by_addr_.lower_bound(lo);
    if (next != by_addr_.end()) expect(next->first >= hi, "new block overlaps a live block");
    if (next != by_addr_.begin()) {
      auto prev = std::prev(next);
      expect(prev->second <= lo, "new block overlaps a live block");
    }
    // Stream safety: freed memory other streams may still use is not handed out early.
    for (FreedRange& f : take_freed_overlapping(lo, hi)) {
      for (StreamId u : f.uses) {
        expect(device_->completed_through(u) > f.record_count,
               "memory reused before record_stream's stream completed");
      }
      if (f.owner != stream) {
        expect(device_->completed_through(f.owner) > f.record_count,
               "memory reused by another stream before its owner completed");
      }
    }
    by_addr_.emplace(lo, hi);
    live_.emplace(lo, LiveBlock{size, stream, {}});
    index_[lo] = order_.size();
    order_.push_back(lo);
    r_.max_live_blocks = std::max(r_.max_live_blocks, live_.size());
    const Stats s = alloc_->stats();
    const std::int64_t reserved = s.reserved_bytes[kAllPools].current;
    if (o_.limit) expect(reserved <= static_cast<std::int64_t>(o_.limit), "reserved exceeds limit");
    expect(reserved <= static_cast<std::int64_t>(o_.capacity), "reserved exceeds capacity");
    expect(device_->used() <= o_.capacity, "physical bytes in use exceed the capacity");
    r_.max_reserved = std::max(r_.max_reserved, reserved);
    return lo;
  }

  void do_free(std::uintptr_t p) {
    ++r_.frees;
    if (auto k = key_of_.find(p); k != key_of_.end()) {  // a program's block (random frees too)
      keys_.erase(k->second);
      key_of_.erase(k);
    }
    LiveBlock b = live_.at(p);
    const std::uint64_t t = device_->record_count();
    constexpr std::uintptr_t kPage = 2 << 20;
    for (std::uintptr_t at = p / kPage * kPage; at < p + alloc_->round_size(b.size); at += kPage) {
      if (device_->translate(at).first != 0) freed_pages_[at].push_back({p, p, b.stream, b.uses, t});
    }
    alloc_->free(reinterpret_cast<void*>(p));
    const std::uintptr_t hi = p + alloc_->round_size(b.size);
    take_freed_overlapping(p, hi);  // stale records of memory since reused and freed again
    freed_.emplace(p, FreedRange{p, hi, b.stream, b.uses, t});
    live_.erase(p);
    by_addr_.erase(p);
    const std::size_t i = index_.at(p);
    index_[order_.back()] = i;
    order_[i] = order_.back();
    order_.pop_back();
    index_.erase(p);
  }

  // Freed ranges are disjoint (a range is dropped once any of it is handed out again), so an
  // ordered map finds the overlapping ones in O(log n + k).
  std::vector<FreedRange> take_freed_overlapping(std::uintptr_t lo, std::uintptr_t hi) {
    std::vector<FreedRange> out;
    auto it = freed_.lower_bound(lo);
    if (it != freed_.begin() && std::prev(it)->second.hi > lo) --it;
    while (it != freed_.end() && it->second.lo < hi) {
      out.push_back(it->second);
      it = freed_.erase(it);
    }
    return out;
  }

  void full_check() {
    ++r_.full_checks;
    const Stats s = alloc_->stats();
    std::int64_t allocated = 0, reserved = 0, active = 0, requested = 0, inactive_split = 0;
    const bool gmlake = alloc_->policy_name().rfind("gmlake", 0) == 0;
    std::int64_t n_alloc = 0;
    std::size_t matched = 0;
    std::uintptr_t prev_end = 0;
    for (const SegmentInfo& seg : alloc_->snapshot()) {
      expect(seg.address >= prev_end, "segments overlap");
      prev_end = seg.address + seg.total_size;
      // A virtual segment holds only its mapped pages; live blocks must be fully mapped.
      reserved += static_cast<std::int64_t>(seg.is_virtual ? seg.mapped_size : seg.total_size);
      std::uintptr_t at = seg.address;
      for (const BlockInfo& b : seg.blocks) {
        expect(b.address == at && b.size > 0, "blocks do not tile their segment");
        at += b.size;
        if (seg.is_virtual && b.state != "inactive") {
          for (std::size_t i = (b.address - seg.address) / seg.page_size;
               i <= (b.address + b.size - 1 - seg.address) / seg.page_size; ++i) {
            expect(seg.page_mapped[i], "a live block lies on an unmapped page");
          }
        }
        if (b.state == "active_allocated") {
          allocated += static_cast<std::int64_t>(b.size);
          requested += static_cast<std::int64_t>(b.requested_size);
          ++n_alloc;
          auto it = live_.find(b.address);
          expect(it != live_.end(), "allocated block the caller does not hold");
          expect(it->second.size == b.requested_size && b.size >= b.requested_size,
                 "allocated block does not match its request");
          ++matched;
        }
        if (b.state != "inactive") active += static_cast<std::int64_t>(b.size);
        // Left out as torch leaves its expandable segments out, and our virtual ones (mostly
        // address space where free); GMLake's are mapped whole.
        const bool releasable = seg.torch_expandable || (seg.is_virtual && !gmlake);
        if (b.state == "inactive" && seg.blocks.size() > 1 && !releasable) {
          inactive_split += static_cast<std::int64_t>(b.size);
        }
      }
      expect(at == seg.address + seg.total_size, "blocks do not cover their segment");
    }
    expect(matched == live_.size(), "a live pointer has no allocated block");
    expect(s.allocated_bytes[kAllPools].current == allocated, "allocated_bytes != recount");
    expect(s.reserved_bytes[kAllPools].current == reserved, "reserved_bytes != recount");
    expect(s.active_bytes[kAllPools].current == active, "active_bytes != recount");
    expect(s.requested_bytes[kAllPools].current == requested, "requested_bytes != recount");
    expect(s.allocation[kAllPools].current == n_alloc, "allocation count != recount");
    expect(s.inactive_split_bytes[kAllPools].current == inactive_split,
           "inactive_split_bytes != recount");
    expect(device_->used() >= static_cast<std::size_t>(reserved), "device holds less than reserved");
    physical_check();
    const std::string index = alloc_->self_check();
    if (!index.empty()) fail(index);
    for (auto it = freed_pages_.begin(); it != freed_pages_.end();) {  // forget what is done
      auto& v = it->second;
      v.erase(std::remove_if(v.begin(), v.end(), [&](const FreedRange& f) { return done(f); }), v.end());
      it = v.empty() ? freed_pages_.erase(it) : std::next(it);
    }
  }

  void drain_to_zero() {
    while (!order_.empty()) do_free(order_.back());
    alloc_->empty_cache();
    const Stats s = alloc_->stats();
    if (s.reserved_bytes[kAllPools].current != 0) {
      std::string left;  // what is still held, for the report
      for (const SegmentInfo& seg : alloc_->snapshot()) {
        left += " segment of " + std::to_string(seg.total_size) + " B (" +
                std::to_string(seg.blocks.size()) + " blocks)";
      }
      fail("reserved not 0 after freeing all + empty_cache:" + left);
    }
    expect(s.active_bytes[kAllPools].current == 0, "active not 0 after freeing all + empty_cache");
    expect(device_->used() == 0 && device_->live_segments() == 0, "device still holds segments");
    expect(device_->live_pages() == 0 && device_->mapped_pages() == 0,
           "a page is still mapped or alive after freeing everything and empty_cache");
    freed_.clear();
    freed_pages_.clear();
    ++r_.drains_to_zero;
  }

  FuzzOptions o_;
  std::mt19937_64 rng_;
  std::shared_ptr<SimulatedDevice> device_;
  std::unique_ptr<Allocator> alloc_;
  std::uint64_t op_ = 0;
  std::unordered_map<std::uintptr_t, LiveBlock> live_;
  std::map<std::uintptr_t, std::uintptr_t> by_addr_;  // live [lo, hi)
  std::vector<std::uintptr_t> order_;
  std::unordered_map<std::uintptr_t, std::size_t> index_;
  std::map<std::uintptr_t, FreedRange> freed_;
  std::unordered_map<std::uintptr_t, std::vector<FreedRange>> freed_pages_;  // by page address
  FuzzReport r_;
  // Periodic mode.
  std::vector<ProgramOp> programs_[2], current_;
  std::size_t pc_ = 0;
  int which_ = 0;
  std::unordered_map<std::size_t, std::uintptr_t> keys_;  // program key -> block held
  std::unordered_map<std::uintptr_t, std::size_t> key_of_;
};

}  // namespace

FuzzReport fuzz(const FuzzOptions& options) { return Fuzzer(options).run(); }

}  // namespace pymemplan
