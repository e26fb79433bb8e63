// Plan-guided placement (policy "pymemplan-planned"): training repeats the same allocation
// sequence every iteration. This allocator finds that period in the live stream of requests by
// itself, packs one period's blocks offline into one arena (packing.hpp), and serves the next
// iterations from the plan, checking each request against it. Everything else — requests
// before any plan exists, requests that diverge from the plan, blocks that outlive an
// iteration — goes to the online pool: a CachingAllocator with the "pymemplan-vmm" rules.
//
// One pool holds everything. The arena is a segment of that pool (CachingAllocator::
// create_arena): a virtual range whose pages are mapped only where the plan has placed a block,
// which best fit never searches; a planned request gets its range through allocate_at, which
// hands it out only if the range is free now and safe for the stream. Stats, snapshots, the
// memory limit, the OOM ladder and stream safety (events, record_stream, drains) are therefore
// the pool's, exactly: a planned block is a block of the pool. Before any plan exists the policy
// *is* pymemplan-vmm.
//
// Design (details at each function; the sources go by concern: planned.cpp the interface and
// configuration, planned_detect.cpp detection and the making of plans, planned_arm.cpp packing
// and arming, planned_serve.cpp serving a pass and its cut, planned_runs.cpp plans across runs):
// - Detection. Each allocation is a token (rounded size, stream); each free is a token (number
//   of allocations since the freed one was made). A rolling hash of the last `match_window`
//   tokens finds earlier places where the same window occurred (hash chains over the history);
//   each gives a candidate period P >= min_period. A candidate is scored by its coverage: the
//   share of the bytes allocated in the last P events whose lifetime is known (freed, or
//   predicted from the same allocation one period earlier) and at most P (>= 50% to be
//   planned; scored on a sample, exact for the winner). Confirmed candidates (the last P events
//   equal the P before) win ties; the best then gives way to the shortest candidate before it,
//   confirmed or not as it is, that leaves no more bytes of unknown lifetime (a request the
//   iteration does not usually make is one such block in every longer candidate); where the
//   window is all one shorter confirmed repetition (repeated layers), only its multiples by
//   powers of two are examined. Detection runs while
//   there is no plan, the active plan diverged within its last period, or the active plan is
//   too small to arm (a period of layers must not hide the iteration), at most once per (its
//   work / 32) events; while a plan worth arming matches, the window index is not even
//   updated (it catches up later). Candidates within 0.02 of the best coverage that predict
//   different periods (their events differ, read from their start) are a tie: the window
//   does not say which period comes (the start of a step, where steps of several shapes take
//   turns). The requests that follow drop the candidates that did not predict them, until
//   the rest agree or half the shortest period has passed; the best of them is planned from
//   the window the tie was found at. Ties are looked for only among unconfirmed candidates
//   whose window allocated enough to make a plan worth an arena.
// - Cut. The plan's period is rotated to start where the fewest planned bytes are alive (the
//   iteration boundary in training); blocks alive across it wrap around the circle. Blocks
//   living longer than a period (parameters, optimizer state) stay with the pool.
// - Packing (packing.hpp) happens only when a plan first arms, since most plans detection makes
//   (of repeated layers, of iterations seen once) never do. Lifetimes that were unknown when
//   the plan was made (allocations still alive then) and are known by then are filled in first.
//   Two variants: all planned blocks (arming at the cut), and all but the first `skip` slots
//   (arming when a stored plan is recognised by its first kPrefix requests, which the pool has
//   served already, or when a plan is made a few requests into a pass of it: below).
// - Arming, at the cut ("boundary") after a pass in which requests of less than 1/32 of its bound
//   failed to match it and slots of less than that were skipped, or at once when a stored plan is
//   recognised at the start of an iteration. A period that repeated the one before it event for
//   event but left more live bytes than it found (over 1/32 of the bound) validates nothing: its
//   passes keep what they make (a model's constructor, building identical layers). Where the
//   stream diverged at the cut (an evaluation step: fewer than kPrefix of its requests matched)
//   and the pool served it, the plan's first request coming back once what the pool made for it
//   is freed is a cut too. Only if its bound is >= 20% of the highest live bytes (periods of
//   repeated layers are not worth an arena). Arming
//   gives back what the pool holds beyond its live blocks (CachingAllocator::trim: unused pages,
//   wholly free segments; arena pages beyond what this plan needs), and lowers the pool's grow
//   mark to the footprint the plan expects (live pool pages + arena): from then on memory grows
//   past that only after unused pages, the arena's idle ones included, went back. The plan is used
//   only if that footprint is at most the highest reserved so far, or within plan_slack per mille
//   of the highest live bytes, but for the latter not right after a whole pass of its period that
//   the pool served (that pass measured what a pass takes without the plan); the packer gives up
//   as soon as it cannot meet that. An armed plan
//   whose pass took memory past that limit is dropped at its next cut; it may arm again before
//   the highest reserved rises only after a pass the pool served, for a page less than that
//   pass took (an estimate a page short must not lose the plan for good). Where the request that
//   starts the pass is one the pool serves (its slot has no block: it outlives the period, as an
//   input batch made before the last is released), the plan arms once it is served, so that the
//   pool's memory is measured with it; the block it replaces (the oldest live one of its token,
//   about a period old) is released within the pass and is not counted as held; nor, for a plan
//   that leaves a pass's first requests to the pool (recognised by them, or armed mid-pass), are
//   the whole pages inside those of their blocks that the pass frees before its peak
//   (freed_before_peak()).
// - Arming mid-pass (arm_mid_pass()). A plan made within two match windows (and a quarter of
//   its period) of its cut, with virtual memory, serves the rest of that pass (the second
//   step, where the first step's plan is found: often the run's peak, the first step with the
//   optimizer's state). What that pass needs at least is estimated as the live blocks the
//   plan does not place plus the plan's bound; the plan arms only where that is above the
//   highest reserved so far (or it replaces a plan that was serving), and only if its
//   footprint is within plan_slack of that estimate (to the end of a page), as a plan at its
//   cut may hold that much over the highest live bytes, or within what the pool held over the
//   live bytes when the pass began, where that is more. Its first `skip` slots stay with the
//   pool; the grow mark is what is reserved then, so the arena takes the pages those blocks
//   free before new ones. At the cut it arms whole, or stops serving (each pass would leave
//   its first requests to the pool beside the arena). The steady state (first_planned_request)
//   starts with the first pass a plan serves from its start.
// - Serving. A cursor walks the plan's allocations. A request that matches the slot at the
//   cursor (same rounded size and stream) gets arena + offset if that range is free and safe
//   now, otherwise the pool serves it: memory is never handed out twice. A mismatch looks
//   ahead: slots of one-off long-lived allocations are skipped freely, planned ones up to
//   `resync_window`; failing that the request goes to the pool and the pass counts as diverged
//   (which lets detection re-plan). Mismatched bytes above 1/16 of the bound in a pass disarm
//   the plan (its idle pages go back as the pool needs them). A pass in which slots without a
//   lifetime went to the pool (more than 1/32 of the bound) makes the plan again from that
//   pass, where every lifetime is known ("refinement"). A pass that matched every request but
//   took another number of events than the plan's period (its window held one-off events of
//   the first step, which each pass skips) makes the plan again from that pass, with the
//   pass's length as its period ("remake"), if the events that end the pass also ended the
//   stretch one pass earlier and no request of the pass failed (its free would be missing).
//   A block the old plan placed that is still alive keeps its range, and a request the new
//   layout puts there goes to the pool. After a refinement or a remake, the request that
//   starts the next pass is served from the plan as made again. Where the old layout served
//   the whole pass, the new one must hold no more than that pass did (packed against the
//   holes of now, it can hold more): otherwise the old plan serves on, and is not made again.
// - Several plans, keyed by the signature (hash) of their token sequence from the cut, up to
//   `max_plans` (least recently used evicted). The first `kPrefix` allocations of each plan
//   index it: after a mismatch, or while no plan is armed, the last kPrefix requests select the
//   plan that applies (alternating shapes, shapes that come back), but never one too small to
//   arm, nor, while the active plan matches, one whose last pass skipped many of its slots (a
//   wrong period): they would take the cursor from the iteration's plan while it waits for its
//   cut. A plan seen again is recognised by its signature and not re-packed. A plan armed by
//   its first requests (variant 1) arms with its whole layout (variant 0) at its cut. One
//   arena serves every plan. With virtual memory its address range is the device's memory,
//   so that every plan fits (a new range would move every mapped page into it); without, it
//   is a segment of the plan's size (a larger plan gets a new one, the old one is retired into
//   the pool). With virtual memory, an arena whose blocks are alive when its plan is left
//   (disarmed, or another plan adopted mid-iteration) is retired into the pool too, so that
//   the pool does not grow around free space it cannot use, and taken back as the arena at
//   the next arming if nothing is allocated in it by then, its pages still mapped; not for a
//   plan recognised by its first requests, which arms in it at once beside the few blocks
//   alive there (at most 1/32 of its bound).
// - Without virtual memory (vmm:False), the arena is a device segment of the plan's size and
//   trimming can only return wholly free segments of the pool.
// - Plans across runs (export_plans / import_plans): the plans that armed, as text, with the
//   run's highest reserved bytes. A loaded plan is a stored plan that arms at its cut after a
//   pass of this run matched it, held to that earlier peak rather than this run's so far
//   (which, in a first step, is no measure of the steps ahead); by its first requests only
//   once validated and where they select it alone; found by detection, it is the run's own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator.hpp"
#include "allocator_api.hpp"
#include "config.hpp"
#include "packing.hpp"

namespace pymemplan {

// Config keys of "pymemplan-planned" (all keys of "pymemplan-vmm" are accepted too and
// configure the pool; vmm:False gives the classic variant):
//   min_period       shortest period believed, in events (allocs + frees)      default 16
//   match_window     events that must repeat before a period is considered     default 32
//   max_period       longest period, in events (history kept: 2x this)         default 65536
//   max_plans        plans kept (least recently used evicted)                  default 8
//   resync_window    plan slots searched ahead after a mismatch                default 64
//   search_rounds    randomized skyline runs of the packer per plan, after     default 0
//                    its three deterministic ones (packing.hpp); on resnet50's
//                    iteration 60 of them take the arena from 1.0066 to 1.0020
//                    of the bound (0.6 s); a few gain nothing on the benchmark
//   plan_slack       a plan whose steady footprint is above the highest        default 10
//                    reserved so far is still used if within this many per
//                    mille of the highest live bytes (not where the pool has
//                    just served a whole pass of the plan's period)
//   holes            1: blocks of a plan go first to the free parts of pages      default 1
//                    that blocks outliving the period keep mapped (packing.hpp
//                    fill_holes); 0: everything to the arena
//   prologue         the run's first requests are recorded for export_plans()  default 65536
//                    until at least this many, then to the end of the next
//                    pass a plan serves whole (at most kPrologueCap); 0: no
//                    prologue is recorded, and none imported is served
// The pool's share_pages key (config.hpp) also decides whether, at each arming, pages that
// blocks outliving the period keep partly used are paired where their live bytes lie at
// disjoint offsets (CachingAllocator::share_pages).
struct PlannedConfig {
  PolicyConfig pool;
  std::size_t min_period = 16;
  std::size_t match_window = 32;
  std::size_t max_period = std::size_t{1} << 16;
  std::size_t max_plans = 8;
  std::size_t resync_window = 64;
  std::size_t search_rounds = 0;
  std::size_t plan_slack = 10;
  std::size_t holes = 1;
  std::size_t prologue = std::size_t{1} << 16;

  // Throws AllocatorError naming the bad key or value and listing the valid keys.
  static PlannedConfig parse(const std::string& conf);
  std::string to_string() const;
};

class PlannedAllocator : public Allocator {
 public:
  PlannedAllocator(std::shared_ptr<Device> device, PlannedConfig config);
  ~PlannedAllocator() override = default;
  PlannedAllocator(const PlannedAllocator&) = delete;
  PlannedAllocator& operator=(const PlannedAllocator&) = delete;

  void* malloc(std::int64_t size, StreamId stream) override;
  void* try_malloc(std::int64_t size, StreamId stream) override;
  void free(void* ptr) override;
  void record_stream(void* ptr, StreamId stream) override;
  bool owns(const void* ptr) const override;
  bool free_pending(const void* ptr) const override;
  // The pool's empty_cache; an arena with no live block goes back too (a new one is made
  // at the next iteration boundary).
  void empty_cache() override;

  void set_memory_limit(std::size_t bytes) override;
  void set_memory_fraction(double fraction) override;
  std::size_t memory_limit() const override;

  Stats stats() const override;
  void reset_peak_stats() override;
  void reset_accumulated_stats() override;
  std::vector<SegmentInfo> snapshot() const override;
  std::string last_error() const override;
  std::size_t round_size(std::size_t size) const override;
  std::string policy_name() const override { return "pymemplan-planned"; }
  std::string config_string() const override;
  std::int64_t reserved_bytes() const override;

  // Ordinal (0-based, among allocation requests) of the first request served from a plan, or
  // UINT64_MAX if none was.
  std::uint64_t first_planned_request() const override;
  // A training step starts here (optional; see mark_step in allocator_api.hpp). If the events
  // since the previous mark repeat the same number of events before them, they are the step:
  // planned with the cut at the mark and served at once (if enough of its bytes have known
  // lifetimes), unless a plan already serves the stream.
  void mark_step() override;
  std::size_t share_pages() override;
  bool stop_automatic_page_sharing() override;
  std::string self_check() const override;
  double planning_seconds() const override;
  // Figures about plans for benchmarks and tests: plan_hits (requests served at their planned
  // offset; hole_hits of them in a hole of the pool), fallbacks (requests the pool served), slot_busy (matched, but the planned range
  // was not free or not safe for the stream), divergences, plans, plans_built, plan_switches,
  // arms, arm_refusals, plan_arena_bytes / plan_bound_bytes / plan_ratio (packing of the last
  // plan built), arena_bytes, arena_mapped_bytes, first_planned_request, ...
  std::vector<std::pair<std::string, double>> plan_stats() const;
  // The blocks of the last plan built, on its circle of `period` events (start, life, size),
  // for tests and for studying the packer.
  std::pair<std::size_t, std::vector<PackBlock>> last_plan_blocks() const;
  // Plans that outlive the process (a restarted job, the next run of a sweep): export_plans()
  // writes, as text, the plans validated here that are worth an arena; import_plans() adds
  // them to this allocator, and returns how many it added (not those it has already, nor
  // more than max_plans). An imported plan is adopted when its first kPrefix requests come,
  // as a stored plan of this run is; it arms at its cut once a pass of this run has matched
  // it (so a first step that repeats the earlier run's steps serves the second one), and may
  // take this run as high as the earlier one went (not only as high as this one went so far).
  // Recognised again later, it arms at once where its first requests select it alone; found
  // by detection, it is a plan of this run. Its offsets are computed at arming, against this
  // run's pool. Slots on a stream other than the default one match only if the stream has
  // the same id. Bad text raises AllocatorError, and nothing is added.
  //
  // The text also carries the run's prologue: its requests from its first one (config key
  // `prologue`: at least that many, then to the end of the next pass a plan serves whole;
  // all of a shorter run), each with its rounded size, stream, event and lifetime (to the
  // prologue's end for blocks still alive then). A run that imports it before its first
  // request lays the prologue out at once, as an allocator that knew it in advance would
  // (the packer of plans over the whole stretch: the parameters, the first steps, the
  // optimizer's state made in them), and serves each request that matches the next slot
  // (size and stream; a few slots may be passed over) at its offset in an arena of its own.
  // No plan arms meanwhile. A request the prologue does not have goes to the pool; many in a
  // row, or many slots passed over, and the prologue is dropped. Once its last slot is
  // served, its arena, with the blocks alive in it, joins the pool (best fit serves its free
  // space), and the plan whose pass ended the prologue in the run it comes from arms at once,
  // at its cut (the other plans arm at theirs); the first to arm may take the run as high as
  // the run the prologue comes from went. A run that stopped before its prologue's end (a
  // short trial run) names the plan whose pass it stopped in, and where: the rest of that
  // pass is laid out with the prologue, as the plan has it, and that plan takes over at its
  // cut, so a longer run goes on from there as the short one would have.
  // In the text's prologue line, "<plan> <cursor>" (version 4).
  std::string export_plans() const;
  std::size_t import_plans(const std::string& text);

 private:
  static constexpr std::size_t kNoOffset = std::numeric_limits<std::size_t>::max();
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::size_t kPrefix = 8;
  // The prologue (export_plans()): at most this many requests are recorded; a run matches
  // each request against the next kPrologueWindow slots, and drops the prologue after
  // kPrologueMisses requests in a row that match none, or when the slots passed over exceed
  // an eighth of those served (and kPrologueMisses).
  static constexpr std::size_t kPrologueCap = std::size_t{1} << 18;
  static constexpr std::size_t kPrologueWindow = 16;
  static constexpr std::size_t kPrologueMisses = 32;
  // Randomized packer runs for the prologue (packing.hpp), once per run: on a generation
  // loop whose cache blocks grow a token at a time, 8 took its layout from 1.062 to 1.017 of
  // the live bytes.
  static constexpr std::size_t kPrologueRounds = 8;

  struct Event {
    std::uint64_t token = 0;
    std::uint64_t free_at = kNever;  // allocation: event index of its free
    std::uint64_t chain = kNever;    // previous end of the window that ends after this event
    std::size_t size = 0;            // allocation: rounded size; free: 0
    std::int64_t live_before = 0;    // live bytes just before this event
    std::int64_t reserved_high = 0;  // the highest reserved bytes and live bytes so far, just
    std::int64_t live_high = 0;      // before this event (arm_mid_pass())
    StreamId stream = 0;
    bool alloc = false;
  };
  struct Slot {
    std::size_t size = 0;
    StreamId stream = 0;
    // Per packing variant (see pack()); kNoOffset: served by the pool (it outlives the period).
    std::size_t offset[2] = {kNoOffset, kNoOffset};
    // Per packing variant: an address in a hole of the pool (free space of pages that blocks
    // living longer than a period keep mapped) instead of an offset in the arena; 0: none.
    std::uintptr_t hole[2] = {0, 0};
    bool planned = false;  // has a block (a lifetime within the period)
    std::size_t time = 0;            // events since the plan's cut
  };
  struct Plan {
    std::uint64_t id = 0;  // unique: a plan replaced in place (refine) gets a new one
    std::uint64_t signature = 0;
    std::uint64_t prefix = 0;  // hash of the first kPrefix slots
    std::vector<Slot> slots;
    std::uint64_t built_at = 0;  // the window it was made from: [built_at - period, built_at)
    std::size_t cut = 0;         // time of the window where the plan starts
    std::vector<std::size_t> slot_of_alloc;  // k-th allocation of the window -> its slot
    std::size_t period = 0;  // events
    // Per packing variant: 0 all planned blocks, 1 all but those of the first `skip` slots.
    std::size_t skip = kPrefix;  // kPrefix, or the slots the pool served before a fresh plan armed
    std::size_t arena[2] = {0, 0};  // bytes the offsets need (once packed)
    std::size_t bound[2] = {0, 0};  // peak of live planned bytes
    bool packed[2] = {false, false};  // offsets are computed when the plan first arms
    bool holes[2] = {false, false};   // some blocks went to holes: packed again at each arming
    std::size_t hole_cost[2] = {0, 0};  // bytes of pages the blocks in holes add to what is held
    std::vector<std::pair<std::uintptr_t, std::size_t>> claims[2];  // hole ranges it uses
    std::vector<PackBlock> blocks;        // the planned blocks, on the circle from the cut
    std::vector<std::size_t> slot_block;  // per slot: its block, or kNoOffset
    std::uint64_t last_used = 0;
    bool validated = false;            // a pass over it matched (see kArmShare)
    // Its last pass passed over many of its slots: probably the wrong period (a step of
    // identical layers repeats within itself). Not adopted by its prefix while the active
    // plan matches.
    bool passed_over = false;
    // Made again from a pass (remake or refinement, boundary()), it would have held more than
    // its layout did over that pass: it keeps its layout and is not made again.
    bool keep_layout = false;
    // Made again from a pass (a refinement) whose blocks living across its cut had no known
    // lifetime: refresh() looks them up at its next arming, and its layouts are made again.
    bool refresh_at_arming = false;
    std::int64_t refused_at[2] = {-1, -1};  // per variant: arming refused at this highest reserved
    // Dropped after a pass took more than it was accepted against (boundary()), at this
    // highest reserved: until that rises, it may arm once more, after the pool's next pass,
    // for less than that pass took (drop_cap).
    std::int64_t dropped_at = -1;
    bool awaiting_pool_pass = false;
    std::size_t drop_cap = 0;
    std::uint64_t holes_key[2] = {0, 0};    // per variant: holes_key() of its last packing
    bool imported = false;        // from import_plans()
    std::size_t cap = 0;          // imported: the highest reserved of the run it comes from
    std::uint64_t arms_here = 0;  // times armed in this run (export_plans() takes those armed)
    std::size_t served_peak = 0;  // the highest reserved over the last pass it served (boundary())
  };
  struct Live {
    std::uint64_t id = 0;     // allocation ordinal
    std::uint64_t event = 0;  // event index of the allocation
    std::size_t size = 0;     // requested
  };

  void* allocate_locked(std::size_t size, StreamId stream);
  const Slot* match_plan(std::size_t rounded, StreamId stream, bool* crossed);
  bool boundary(bool arm_now = true);
  void arm_at_cut();
  bool arm(int variant);
  // The whole pages inside the blocks of variant 1's skipped requests that are alive now and
  // freed before the pass's peak (see arm()).
  std::size_t freed_before_peak(const Plan& p) const;
  // Variant 1 of p leaves out its first `skip` slots from now on (repacked when next armed).
  void set_skip(Plan& p, std::size_t skip);
  // A plan just made, a little way into a pass of it (its first requests, which the pool
  // served, are in the window it was made from): it arms now for the rest of the pass
  // (build_plan()).
  // `replaces`: a plan was serving when this one was made.
  void arm_mid_pass(Plan& p, std::size_t cursor, std::uint64_t n, bool replaces,
                    std::uint64_t began);  // began: the event this pass began at
  // The most that a plan which served within its last kRecentPeriods periods took (or the
  // pool between such passes), at least `footprint`; forgets the older ones.
  std::size_t recent_floor(std::size_t footprint);
  // The armed plan served a pass that ended at `event`.
  void note_pass(std::uint64_t event, std::size_t period);
  // Gives back what the armed plan kept mapped for other plans, once they no longer serve.
  void trim_kept();
  // Whether the plan's bound is a large enough share of the highest live bytes to arm.
  bool worth_an_arena(const Plan& p) const;
  void disarm();
  // With virtual memory, an arena with live blocks is retired into the pool (see disarm()).
  void retire_busy_arena();
  // Not serving from the active plan any more (armed_ false), its holes released.
  void stop_serving();
  // Packs a variant; false (nothing set) if no packing fits in give_up bytes.
  using Ranges = std::vector<std::pair<std::uintptr_t, std::size_t>>;
  bool pack(Plan& p, int variant, std::size_t give_up, const Ranges& holes);
  // One way pack() places a variant's blocks: some in holes (fill), the rest in the arena
  // (packed; arena_block: their indices among the variant's blocks).
  struct Candidate {
    HoleFill fill;
    PackResult packed;
    std::vector<std::size_t> arena_block;
    std::size_t hole_cost = 0;
    std::size_t raw_arena = 0;  // packed.arena before rounding up to a page
    std::size_t footprint() const { return packed.arena + hole_cost; }
  };
  // Recent packings and what they were computed from, by way of fill_holes' rules (and no
  // holes): a plan made again from a pass alike (its blocks' sizes and order of allocations and
  // frees the same), or packed again at a later arming against the same holes, asks for the
  // same packings, each up to a second on plans of 10,000 blocks. A packing given up on at one
  // level is known at any other above the bound's page (pack_blocks makes the same runs).
  struct Try {
    bool filled = false;    // c.fill, c.arena_block and c.hole_cost are set
    bool packed = false;    // result is pack_blocks' at give-up level `level`
    Candidate c;
    PackResult result;
    std::size_t level = 0;
  };
  struct Packed {
    std::vector<PackBlock> blocks;  // in_time_order()
    Ranges holes;
    std::uint64_t holes_key = 0;
    std::vector<Try> tries;  // one per fill rule, then no holes
  };
  // Packings kept: at least the last four; more (up to 64) while they hold no more than
  // kPackedBlocks blocks in all (about 216 bytes a block with its six tries: 14 MiB at most
  // beyond the four): where shapes take turns, each shape's plan is packed again at most of
  // its armings, often against holes seen at an earlier one.
  static constexpr std::size_t kPackedKept = 4;
  static constexpr std::size_t kPackedMost = 64;
  static constexpr std::size_t kPackedBlocks = std::size_t{1} << 16;
  std::vector<Packed> packed_;  // the most recently used last
  std::uint64_t packings_reused_ = 0;
  std::vector<Candidate> candidates(const std::vector<PackBlock>& all, std::size_t period,
                                    std::size_t give_up, const Ranges& holes, Packed& memo,
                                    std::size_t* last_bound);
  // One packing variant of a plan (what pack() sets), to compare packings of a plan.
  struct Packing {
    std::vector<std::size_t> offset;
    std::vector<std::uintptr_t> hole;
    std::size_t arena = 0, bound = 0, hole_cost = 0;
    bool packed = false, holes = false;
    Ranges claims;
    std::uint64_t holes_key = 0;
  };
  Packing save_packing(const Plan& p, int variant) const;
  void restore_packing(Plan& p, int variant, Packing&& k) const;
  // What a packing with holes depends on: the holes (address, size) and the pages using them
  // would add. Equal keys: the plan's last packing is still what pack() would compute.
  std::uint64_t holes_key(const Ranges& holes) const;
  // The blocks a packing variant places (and the slot of each).
  std::vector<PackBlock> variant_blocks(const Plan& p, int variant,
                                        std::vector<std::size_t>* slot_of) const;
  std::size_t page() const;

  std::uint64_t record_event(const Event& e);
  bool should_plan(std::uint64_t n) const;
  std::uint64_t range_hash(std::uint64_t lo, std::uint64_t hi) const;
  const Event& ev(std::uint64_t g) const { return events_[static_cast<std::size_t>(g - base_)]; }
  Event& ev(std::uint64_t g) { return events_[static_cast<std::size_t>(g - base_)]; }
  void index_windows(std::uint64_t n);
  void detect();
  // Detection found candidate periods tied on coverage that predict different periods: each
  // event from now drops those that did not predict it, until the rest agree (or half the
  // shortest period has passed); then the best of them is planned.
  void narrow_tie(std::uint64_t n);
  bool same_period(std::uint64_t n, std::size_t p, std::size_t q) const;
  bool large_window(std::uint64_t n, std::size_t period) const;
  // `uncovered`: the bytes whose lifetime is not known (estimated from the sample).
  double coverage(std::uint64_t n, std::size_t period, std::vector<std::size_t>* lifetimes,
                  std::size_t stride = 1, double* uncovered = nullptr) const;
  // replace: the index of the plan this one replaces (refine()), or kNoOffset for a new one.
  // at_mark: the window starts at a step mark and repeats the one before it (mark_step()): the
  // cut is at the mark, and the plan is validated at once.
  // ahead: events since the window's end (n) that have happened already (a tie narrowed).
  void build_plan(std::uint64_t n, std::size_t period, const std::vector<std::size_t>& lifetimes,
                  std::size_t replace = kNoOffset, bool at_mark = false, std::size_t ahead = 0);
  // Makes the active plan again from the last `period` events (the pass that just ended).
  void refine(std::size_t period);
  // Lifetimes unknown when the plan was made (allocations still alive then) that are known
  // now: their slots get blocks. Only while the plan's window is in the history. True if any
  // did.
  bool refresh(Plan& p);
  // Forgets p's packing of variant v (offsets, holes, claims): made again when it next arms.
  void unpack(Plan& p, int v);
  void adopt(std::size_t plan_index, std::size_t cursor);
  // Whether adopting the plan at this cursor arms it at once (recognised by its first requests).
  bool arms_at_once(std::size_t plan_index, std::size_t cursor) const;
  // The prologue of this run (export_plans()): recording stops here, and blocks still alive
  // live to its end.
  void close_prologue();
  // A request served from an imported prologue, or nullptr (the pool serves it).
  void* serve_prologue(std::size_t rounded, std::int64_t size, StreamId stream);
  // The imported prologue serves no more: its arena joins the pool. Served to its last slot
  // (`whole`), the plan that ended it in the run it comes from takes over at its cut.
  void end_prologue(bool whole);
  std::uint64_t recent_prefix_hash() const;

  std::shared_ptr<Device> device_;
  PlannedConfig config_;
  std::unique_ptr<CachingAllocator> pool_;
  mutable std::mutex mutex_;

  // Request stream.
  std::vector<Event> events_;
  std::vector<std::uint64_t> prefix_;  // prefix_[k]: hash of events [.., base_ + k)
  std::uint64_t base_ = 0;             // global index of events_[0]
  std::uint64_t allocs_ = 0;           // allocation requests so far
  std::unordered_map<std::uint64_t, std::uint64_t> last_end_;  // window hash -> newest end
  std::uint64_t indexed_ = 0;          // windows ending at or before this are indexed
  std::uint64_t next_detect_ = 0;
  std::vector<std::size_t> tied_;  // candidate periods of a tie being narrowed (narrow_tie())
  std::uint64_t tie_since_ = 0, tie_checked_ = 0;
  std::size_t tie_pause_ = 0;
  std::size_t tie_unit_ = 0;  // the shortest tied period, if all are multiples of it; else 0
  std::uint64_t last_mark_ = kNever;   // event index of the last mark_step()
  std::uint64_t marks_ = 0;
  std::uint64_t recent_[kPrefix] = {};  // last kPrefix allocation tokens (ring)
  std::int64_t live_bytes_ = 0, live_hwm_ = 0;  // requested bytes

  // Plans and serving.
  std::vector<Plan> plans_;
  std::uint64_t plan_ids_ = 0;
  std::size_t active_ = kNoOffset;  // index into plans_
  std::size_t cursor_ = 0;
  // A request served at a slot past planned ones while the cursor stayed (match_plan()): the
  // slot, and the plan it belongs to (a plan made again has other slots).
  std::size_t held_slot_ = kNoOffset;
  std::uint64_t held_plan_ = 0;
  bool at_cut_ = false;  // the cursor wrapped to the plan's start: boundary() is due
  bool armed_ = false;
  int variant_ = 0;  // the packing variant served
  std::uint64_t last_divergence_ = 0;  // event index
  bool ever_diverged_ = false;
  std::uint64_t pass_matches_ = 0;   // requests matched since the last boundary
  std::size_t pass_miss_bytes_ = 0;  // bytes of requests not matched since then
  std::size_t pass_unplanned_bytes_ = 0;  // bytes of matched slots the plan had no offset for
  std::size_t pass_skipped_bytes_ = 0;    // bytes of planned slots passed over to match
  std::uint64_t pass_start_ = kNever;     // event index of the pass's first request
  std::int64_t live_at_cut_ = 0;          // live bytes at the last boundary()
  bool pass_failed_ = false;              // a request of the pass could not be served (OOM)
  std::int64_t arm_limit_ = 0;       // reserved memory the armed plan was accepted against
  std::int64_t pool_only_high_ = 0;  // highest reserved after a request, with no arena
  std::size_t arm_cap_ = std::numeric_limits<std::size_t>::max();  // see boundary()
  bool pool_pass_ = false;  // arming at a cut after a whole pass the pool served (boundary())
  std::size_t mid_pass_need_ = 0;  // arm_mid_pass(): what the rest of the pass holds at least
  bool mid_pass_ = false;  // serving the rest of the pass a plan armed in (arm_mid_pass())
  std::uintptr_t arena_ = 0;         // the pool's arena segment (0: none)
  std::size_t arena_size_ = 0;
  // The last arena retired with live blocks (retire_busy_arena): taken back as the arena at
  // the next arming if nothing is allocated in it by then, with the pages it kept mapped.
  std::uintptr_t lent_arena_ = 0;
  std::unordered_map<std::uintptr_t, Live> live_;

  // The prologue: this run's (recorded), and one imported (served).
  struct PrologueSlot {
    std::size_t size = 0;      // rounded
    StreamId stream = 0;
    std::uint64_t start = 0;   // event index
    std::uint64_t life = 0;    // events; 0 while alive and recording
    std::size_t offset = 0;    // in the arena (imported)
  };
  // The prologue of a run that stopped within a pass of `p`, its next request that of slot
  // `cursor`: the rest of that pass is laid out with it (slots after the prologue's, to
  // `events`, the plan's cut), and blocks alive at its end live on as the plan says.
  // The prologue's offsets (import_plans()): of `blocks`, or of `continued` (the prologue
  // and the rest of the pass the run that wrote it stopped in; `*ahead` says which).
  // `takes_over`: a plan arms where the prologue ends.
  PackResult lay_out_prologue(const std::vector<PackBlock>& blocks, std::uint64_t events,
                              const std::vector<PackBlock>& continued, std::uint64_t continued_events,
                              bool takes_over, bool* ahead) const;
  static void continue_prologue(std::vector<PrologueSlot>& prologue, std::uint64_t& events,
                                const Plan& p, std::size_t cursor);
  std::vector<PrologueSlot> prologue_;
  bool prologue_open_ = true;
  std::uint64_t prologue_events_ = 0;  // events it spans, once closed
  std::uint64_t prologue_plan_ = 0;    // signature of the plan whose pass closed it; 0: none
  std::vector<PrologueSlot> loaded_;
  std::size_t loaded_cap_ = 0;         // the highest reserved of the run it comes from
  std::uintptr_t loaded_arena_ = 0;    // 0: no imported prologue serves
  std::uint64_t loaded_plan_ = 0;      // its prologue_plan_
  std::size_t loaded_cursor_ = 0, loaded_misses_ = 0, loaded_skipped_ = 0;
  std::uint64_t prologue_hits_ = 0;
  bool prologue_dropped_ = false;  // ended by misses rather than by its last slot
  bool prologue_handover_ = false;  // the plan it names took over where it ended
  std::size_t prologue_ahead_ = 0;  // slots of the loaded prologue laid out past the recorded ones
  bool in_step_ = false;  // the last request matched the active plan (or adopted it)

  // Figures.
  std::uint64_t first_planned_ = kNever;
  std::uint64_t hole_hits_ = 0;  // plan hits served in a hole of the pool
  std::uint64_t plan_hits_ = 0, fallbacks_ = 0, slot_busy_ = 0, divergences_ = 0;
  std::uint64_t plans_built_ = 0, plan_switches_ = 0, arms_ = 0, arm_refusals_ = 0;
  std::uint64_t refinements_ = 0;
  std::uint64_t ties_ = 0;  // ties between candidate periods narrowed (narrow_tie())
  std::uint64_t remakes_ = 0;  // plans made again from a pass of another length (boundary())
  std::uint64_t layouts_kept_ = 0;  // plans made again whose new layout held more (boundary())
  std::uint64_t tail_layouts_ = 0;  // packings laid out from a kept page's free tail (pack())
  std::uint64_t imported_ = 0;  // plans added by import_plans()
  std::uint64_t full_rearms_ = 0;     // plans armed by their first requests, then whole (boundary())
  std::uint64_t first_request_cuts_ = 0;  // passes started by the plan's first request after a divergence
  std::uint64_t busy_arenas_retired_ = 0;  // arenas retired into the pool with live blocks
  std::uint64_t arenas_made_ = 0;          // address ranges reserved for plans
  std::uint64_t arenas_reclaimed_ = 0;     // retired arenas taken back (lent_arena_)
  std::uint64_t mid_pass_arms_ = 0;  // fresh plans armed a little way into a pass (arm_mid_pass())
  double last_ratio_ = 0.0, last_coverage_ = 0.0;
  std::size_t last_bound_ = 0, last_arena_ = 0, last_period_ = 0;
  std::size_t last_hole_bytes_ = 0;  // bytes of the last plan packed that went to holes
  std::size_t last_hole_cost_ = 0;   // pages those added to what the pool held
  std::size_t last_held_ = 0, last_footprint_ = 0;  // at the last arming
  // Plans that served lately: the end of their last pass, their footprint and period (arm()
  // keeps what they took mapped).
  struct RecentPass {
    std::uint64_t event;
    std::size_t footprint;
    std::size_t period;
  };
  std::vector<RecentPass> recent_passes_;
  // Highest live bytes while no plan was armed, since a plan last served: what the steps
  // between its passes need (a shape the pool serves, in turn with planned ones).
  std::size_t between_high_ = 0;
  // Reserved memory the armed plan kept mapped for them; above its footprint, pages were kept.
  std::size_t kept_floor_ = 0;
  double mid_pass_over_ = 1.0;  // arm_mid_pass(): the pool's reserved over live as the pass began
  std::size_t armed_footprint_ = 0;  // the armed plan's (last_footprint_ may be a refused one's)
  std::vector<PackBlock> last_blocks_;
  double pack_seconds_ = 0.0;  // time spent packing, in all
  std::size_t shared_bytes_ = 0;  // given back by share_pages, in all
  std::size_t replaced_bytes_ = 0;  // see arm(): the block the request arming the plan replaces
};

}  // namespace pymemplan
