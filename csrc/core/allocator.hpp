// The caching allocator: one engine, three rule sets (PolicyKind), any Device. Its sources go by
// concern: allocator.cpp the rules, the entry points, allocation and freeing; allocator_pages.cpp
// pages (expandable segments, virtual memory); allocator_sharing.cpp page sharing;
// allocator_arena.cpp placement at fixed offsets (the arenas of plan-guided placement);
// allocator_events.cpp events and streams.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "allocator_api.hpp"
#include "block.hpp"
#include "config.hpp"
#include "device.hpp"
#include "locked_allocator.hpp"
#include "snapshot.hpp"
#include "stats.hpp"

namespace pymemplan {

// Sizes from PyTorch's c10/cuda/CUDACachingAllocator.cpp (namespace-level constants there).
constexpr std::size_t kMinBlockSize = 512;       // all sizes are rounded to multiples of 512 B
constexpr std::size_t kSmallSize = 1 * kMiB;     // largest "small" request
constexpr std::size_t kSmallBuffer = 2 * kMiB;   // segment size of the small pool
constexpr std::size_t kLargeBuffer = 20 * kMiB;  // segment for requests in (1 MiB, 10 MiB)
constexpr std::size_t kMinLargeAlloc = 10 * kMiB;
constexpr std::size_t kRoundLarge = 2 * kMiB;    // larger segments are rounded to 2 MiB

// Two pages of virtual segments to share (CachingAllocator::share_pages), by address: `keep`
// keeps its physical page, `alias` maps it too and gives its own back.
struct SharePair {
  std::uintptr_t keep = 0;
  std::uintptr_t alias = 0;
  std::vector<std::pair<std::size_t, std::size_t>> alias_used;  // its offsets in use, when found
};

// Address ranges [first, first + second), sorted by address.
using AddressRanges = std::vector<std::pair<std::uintptr_t, std::size_t>>;

// Wholly free segments, largest first: the order in which cache is released.
struct LargestFirst {
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size > b->size : a->addr < b->addr;
  }
};

class CachingAllocator : public LockedAllocator {
 public:
  CachingAllocator(std::shared_ptr<Device> device, PolicyConfig config);
  ~CachingAllocator() override;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Memory for `size` bytes used on `stream`. Throws AllocatorError for size <= 0 and
  // OutOfMemoryError (after releasing cache and retrying) when it cannot be served.
  void* malloc(std::int64_t size, StreamId stream) override;
  // As malloc, but returns nullptr on out-of-memory and leaves the message in last_error().
  // For callers that must not throw (the C ABI). Still throws AllocatorError on misuse.
  void* try_malloc(std::int64_t size, StreamId stream) override;
  // Throws AllocatorError for a pointer this allocator did not hand out or already freed.
  void free(void* ptr) override;
  // The block holding `ptr` is also used on `stream`: it is not reused until work queued on
  // `stream` at free time has completed.
  void record_stream(void* ptr, StreamId stream) override;
  // Whether `ptr` is a live allocation of this allocator.
  bool owns(const void* ptr) const override;
  bool free_pending(const void* ptr) const override;
  // Wait for pending frees, then give every wholly free segment back to the device.
  void empty_cache() override;

  // See Allocator::share_pages. Pages of virtual segments (arenas excepted) whose live bytes
  // lie at disjoint offsets are paired; a pair ends (one address unmapped, the other page
  // whole again) once either address has no live block left. Needs vmm and a device that
  // supports page sharing; 0 otherwise. share_pages() = share_pages(share_candidates()).
  std::size_t share_pages() override;
  bool stop_automatic_page_sharing() override;
  std::string self_check() const override;
  // The pairs share_pages() would make now (nothing changes), leaving out pages that a block
  // in use at one of the addresses `leave_out` (sorted) touches: blocks about to be freed,
  // whose pages would only be shared for a while.
  std::vector<SharePair> share_candidates(const std::vector<std::uintptr_t>& leave_out = {}) const;
  // Shares these pairs (each checked again; one that is not a valid pair any more is
  // skipped). Returns the bytes given back.
  std::size_t share_pages(const std::vector<SharePair>& pairs);
  // `holes` (as page_holes gives them) less the free space sharing `pairs` would take.
  std::vector<std::pair<std::uintptr_t, std::size_t>> holes_after_sharing(
      const std::vector<std::pair<std::uintptr_t, std::size_t>>& holes,
      const std::vector<SharePair>& pairs) const;

  // The memory limit (on reserved bytes; 0: none; a fraction is of the device capacity) and
  // the stats are LockedAllocator's.
  std::vector<SegmentInfo> snapshot() const override;
  // The size a request is rounded to under this policy.
  std::size_t round_size(std::size_t size) const override;

  std::string policy_name() const override { return config_.policy_name(); }
  std::string config_string() const override { return config_.to_string(); }
  std::int64_t reserved_bytes() const override;
  const PolicyConfig& config() const { return config_; }
  Device& device() { return *device_; }
  std::string last_error() const override;
  std::vector<std::uintptr_t> adopt_segment(std::size_t bytes, bool small, StreamId stream,
                                            const std::vector<AdoptedBlock>& blocks) override;

  // --- Placement at fixed offsets (plan-guided placement, planned.hpp) ---
  // An arena of at least `bytes`: a segment the best-fit search never looks at; memory in it
  // is handed out only through allocate_at. With vmm, a virtual range whose pages are mapped
  // on first use; otherwise a device segment. Returns its address, 0 when the device (or the
  // memory limit) refuses it.
  std::uintptr_t create_arena(std::size_t bytes);
  // Memory at arena + offset for `rounded` bytes (a multiple of 512, at least `requested`) if
  // that range is free now and safe for `stream`: every free block under it is owned by
  // `stream` or shared. Otherwise nullptr with nothing changed; a range freed by another stream
  // starts a drain of that stream, so that a later request may use it. No OOM is counted: the
  // caller falls back to malloc. Throws AllocatorError for an address that is not an arena.
  void* allocate_at(std::uintptr_t arena, std::size_t offset, std::size_t rounded,
                    std::int64_t requested, StreamId stream);
  // Free space that costs little memory (virtual segments of the pool, arenas excepted), as
  // (address, bytes) ranges: the free parts of mapped pages that a block in use also touches,
  // and whole free blocks that begin and end on such pages (the pages between are not kept:
  // see unkept_bytes). A plan places blocks there (allocate_in_hole) before it sizes its arena.
  std::vector<std::pair<std::uintptr_t, std::size_t>> page_holes() const;
  // Free blocks of the pool's virtual segments (arenas excepted) that begin on a page a block
  // in use keeps mapped and end past it on pages nobody keeps, as (address, bytes): a layout
  // started there shares its first page with that block (pymemplan-planned puts its arena
  // there where that saves a page).
  std::vector<std::pair<std::uintptr_t, std::size_t>> page_tails() const;
  // Bytes of the distinct pages under these ranges that no block in use keeps mapped: what
  // serving blocks there would map (or keep mapped) beyond the pages held anyway.
  std::size_t unkept_bytes(const std::vector<std::pair<std::uintptr_t, std::size_t>>& ranges) const;
  // As allocate_at, at an absolute address inside a virtual segment of the pool (not an arena):
  // nullptr, with nothing changed, unless [addr, addr + rounded) is free now and safe for
  // `stream`, or if no such segment holds it.
  void* allocate_in_hole(std::uintptr_t addr, std::size_t rounded, std::int64_t requested,
                         StreamId stream);
  // Reserves ranges (each inside one free block of a virtual pool segment, as page_holes
  // gives them) for allocate_in_hole: best fit no longer hands them out. Ranges that are not
  // free as a whole any more are skipped. Returns the bytes claimed.
  std::size_t claim(const std::vector<std::pair<std::uintptr_t, std::size_t>>& ranges);
  // Gives every claimed range back to best fit (blocks in use go back when freed).
  void unclaim_all();
  // The arena becomes an ordinary segment: its free space serves best fit, and it goes back
  // to the device once wholly free (at once if it is now).
  void retire_arena(std::uintptr_t arena);
  // A segment retired from being an arena (retire_arena) becomes the arena again, with the
  // pages it still has mapped, if nothing is allocated in it: returns its size, or 0 where it
  // is gone, in use or not a virtual segment.
  std::size_t reclaim_arena(std::uintptr_t addr);
  // Bytes of the arena's pages that are mapped (its size without vmm); 0 for no arena.
  std::size_t arena_mapped(std::uintptr_t arena) const;
  // Whether an allocated block (or one waiting on events) lies in the arena.
  bool arena_in_use(std::uintptr_t arena) const;
  // Bytes of the arena's blocks that are allocated or wait on events.
  std::size_t arena_busy_bytes(std::uintptr_t arena) const;
  // Gives back to the device what no live block uses: the unused pages of virtual segments
  // (in `arena`, only those from `arena_keep` bytes on) and the wholly free segments. Streams
  // that freed the memory are synchronized first. Returns the bytes given back. With `want`,
  // at most about that many bytes go back (whole pages), the pool's before the arena's.
  // Pages under `also_keep` (address ranges, sorted: a plan's holes) stay mapped too.
  std::size_t trim(std::uintptr_t arena, std::size_t arena_keep,
                   std::size_t want = std::numeric_limits<std::size_t>::max(),
                   const AddressRanges& also_keep = {});
  // What trim(arena, ...) would give back outside `arena`, without giving it back: the unused
  // pages of the other virtual segments. Known only where every segment is virtual and not
  // an expandable one (whole free segments and chunks go back by other rules): nullopt else.
  std::optional<std::size_t> trimmable_outside(std::uintptr_t arena);
  // Pages (or segments) that would take reserved memory past the grow mark are mapped only
  // after unused ones are given back (release_before_grow). The mark is the highest reserved
  // so far unless lowered here: it becomes max(reserved now, bytes).
  void set_grow_mark(std::size_t bytes);
  // The highest reserved so far (never reset, unlike the peak stat).
  std::int64_t reserved_high_water() const;
  // The same without taking the lock, for a caller that serializes its calls into this
  // allocator (PlannedAllocator notes it at every event).
  std::int64_t reserved_high_water_unlocked() const noexcept {
    return reserved_hwm_seen_.load(std::memory_order_relaxed);
  }
  // The highest reserved since the last call (which starts the next window at reserved now).
  std::int64_t take_window_peak();

 private:
  struct Pool {
    bool small = false;
    FreeList free;
  };
  struct PendingEvent {
    EventHandle event;
    Block* block;  // a freed block waiting on this event; nullptr for a stream drain
    StreamId drained_stream;
    std::uint64_t drain_seq;
  };

  Block* allocate_locked(std::size_t size, StreamId stream, std::string* oom_message);
  // Counts an OOM and says why in *oom: the memory limit, or the device, refused `growth`
  // more bytes (of pages, or of a new segment). Returns nullptr.
  Block* refuse(std::size_t size, std::size_t rounded, StreamId stream, std::size_t growth,
                bool pages, std::string* oom);
  // With vmm every request shares the virtual segments: pages under free space go back to
  // the device, so small blocks cannot strand memory the way they do in shared segments.
  Pool& pool_for(std::size_t rounded) {
    return rounded <= kSmallSize && !config_.vmm ? small_ : large_;
  }
  std::size_t segment_size(std::size_t rounded) const;
  bool should_split(const Block* block, std::size_t rounded) const;

  Block* find_free_block(Pool& pool, std::size_t rounded, StreamId stream);
  Block* find_large_pool_fragment(std::size_t rounded, StreamId stream);
  Block* usable_best_fit(Pool& pool, std::size_t rounded, StreamId stream);
  Block* best_fit(Pool& pool, std::size_t rounded, StreamId key);
  // pack_long_lived: whether a request looks like a block made in the image of long-lived
  // ones, and the lowest free block of the pool's virtual segments that can serve it.
  bool long_lived(std::size_t rounded);
  Block* lowest_fit(std::size_t rounded, StreamId stream);
  bool acceptable(const Block* block, std::size_t rounded) const;
  Block* new_segment(Pool& pool, std::size_t bytes, StreamId stream);
  Block* add_segment(std::uintptr_t addr, std::size_t bytes, StreamId stream, bool small, bool vmm);
  // Expandable segments (torch, expandable_segments). A block of at least `rounded` bytes,
  // free and listed nowhere, made by mapping address space after (or in) a free block of
  // `stream`'s expandable segments, or in a new one; nullptr if the pages cannot be had.
  Block* expand(Pool& pool, std::size_t rounded, StreamId stream);
  // Maps the first `bytes` (rounded up to the segment's chunk) of the unmapped block `b`
  // (listed) and returns the free block it became, merged with free mapped neighbours and
  // listed; nullptr (nothing changed) if the pages cannot be had.
  Block* map_chunks(Block* b, std::size_t bytes);
  // Unmaps every whole chunk under free blocks of expandable segments (torch's
  // release_cached_blocks); returns bytes unmapped.
  std::size_t unmap_free_chunks();
  // Virtual memory (config_.vmm, large pool).
  Block* new_virtual_segment(std::size_t rounded, StreamId stream);
  bool back(Block* block, std::size_t rounded);
  bool map_pages(Segment* seg, std::uintptr_t lo, std::uintptr_t hi);
  // spare: the physical pages unmapped are kept in spare_pages_ rather than released.
  // `extra`: a free block listed nowhere (the one being backed), whose pages past
  // [keep_lo, keep_hi) may go back too.
  std::size_t reclaim_pages(const Segment* keep, std::uintptr_t keep_lo, std::uintptr_t keep_hi,
                            std::size_t want, bool spare = false, const Block* extra = nullptr,
                            const AddressRanges& also_keep = {});
  // Pages reclaim_pages may give back: mapped, no block in use touches them, starting inside
  // a free block (of `free_block` bytes).
  struct Victim {
    std::size_t free_block;
    std::uintptr_t addr;
    Segment* seg;
    bool idle;  // its work is known done (page_idle)
  };
  // The first `n` victims of the pool's segments (arenas excepted) in reclaim order (known
  // idle first, then from the largest free blocks down, top pages first), walking free blocks
  // from the largest only as far as needed; fewer if there are fewer.
  std::vector<Victim> pool_victims(const Segment* keep, std::uintptr_t keep_lo,
                                   std::uintptr_t keep_hi, std::size_t n, const Block* extra,
                                   const AddressRanges& also_keep) const;
  // Counts `b` (a block of a virtual segment) in or out of the users of its pages; out, its
  // stream and free_seq are noted on them (Segment::freed_by). Returns whether a mapped page
  // was left without users.
  bool count_use(const Block* b, int delta);
  // Unmaps pages [first, first + n) of `seg` (all mapped) in one device call, and releases
  // them (or, with spare, keeps them in spare_pages_); unmap_mapped: the mapped ones of
  // [from, to), run by run.
  void unmap_pages(Segment* seg, std::size_t first, std::size_t n, bool spare = false);
  void release_spares();
  void unmap_mapped(Segment* seg, std::size_t from, std::size_t to);
  void synchronize_stream(StreamId stream);
  // Unmapping a page must not race work queued on it, but waiting for a whole stream
  // (synchronize_stream) stalls the host. An epoch is an event recorded on a stream right
  // after a free: once complete, all that stream's work queued before frees up to `seq` is
  // done (idle_through_), and pages freed then unmap without waiting.
  struct Epoch {
    EventHandle event;
    StreamId stream;
    std::uint64_t seq;
  };
  bool page_idle(const Segment* seg, std::size_t index) const;
  bool page_idle_through(StreamId stream, std::uint64_t seq) const;  // frees up to seq done
  void start_epoch(StreamId stream);
  void poll_epochs();
  void synchronize_epochs();
  // Page sharing. side[0] keeps the physical page it had; side[1] is an alias of it. Each
  // side's guards cover the offsets the other side owns.
  struct Share {
    Segment* seg[2];
    std::size_t index[2];
    std::vector<Block*> guards[2];
  };
  // Per page of `seg`: the offsets [lo, hi) that blocks in use, or claimed by a plan, occupy.
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;
  std::vector<Ranges> page_uses(const Segment* seg) const;
  std::vector<SharePair> share_candidates_locked(const std::vector<std::uintptr_t>& leave_out) const;
  std::size_t share_pages_locked(const std::vector<SharePair>& pairs);
  Segment* segment_of(std::uintptr_t addr) const;
  bool share_pair(Segment* keep, std::size_t ki, Segment* alias, std::size_t ai,
                  const Ranges& alias_used);
  // The run of listed free blocks from `b` (which holds lo) to hi, as one block listed
  // nowhere; the parts outside [lo, hi) go back to the lists with their owners.
  Block* cut_run(Block* b, std::uintptr_t lo, std::uintptr_t hi);
  // A guard over [lo, hi) (free and listed now, inside one page).
  Block* make_guard(Segment* seg, std::uintptr_t lo, std::uintptr_t hi);
  void drop_guard(Block* g);
  // Ends the shares of pages [first, last] of `seg` whose address has no block but guards.
  void end_idle_shares(Segment* seg, std::size_t first, std::size_t last);
  void end_share(Share* s, int side);
  Block* take(Block* block, std::size_t rounded, std::size_t requested, StreamId stream);
  // `b` (free, in no list, of its final size) is handed out: stats, indexes.
  void mark_allocated(Block* b, std::size_t requested, StreamId stream);
  // `b` is free and listed nowhere: it keeps [addr, at); the returned block, with the same
  // owner, gets [at, end).
  Block* split(Block* b, std::uintptr_t at);
  // The first free block of a run of listed free blocks covering [lo, hi) in the segment `seg`,
  // all usable by `stream`; nullptr if there is none (`*foreign`: the owner stream that is
  // in the way, if that is the only reason).
  Block* free_run(const Segment* seg, std::uintptr_t lo, std::uintptr_t hi, StreamId stream,
                  StreamId* foreign);
  Segment* arena_segment(std::uintptr_t arena) const;
  void unclaim_locked();
  // allocate_at / allocate_in_hole once the segment is known; the caller holds the lock.
  void* allocate_range(Segment* seg, std::uintptr_t lo, std::size_t rounded,
                       std::int64_t requested, StreamId stream);
  void start_drain(StreamId owner);
  void free_block(Block* block);
  Block* merge(Block* first, Block* second);
  Block* coalesce(Block* block);

  void insert_free(Block* block);
  void erase_free(Block* block);
  void release_segment(Block* block);
  // Release wholly free segments, largest first, until `needed` bytes are released (or all
  // of them with needed == SIZE_MAX). Returns bytes released.
  std::size_t release_cached(std::size_t needed);
  void collapse_free_segments();
  bool release_oversize_for(Pool& pool, std::size_t rounded, StreamId stream);

  void process_events();
  void complete_event(const PendingEvent& p);
  void synchronize_and_free_events();
  void drain_other_streams(Pool& pool, StreamId stream);
  void share_blocks_of(StreamId owner, std::uint64_t up_to_seq);
  EventHandle get_event();
  void return_event(EventHandle e);

  std::string oom_message(std::size_t size, std::size_t rounded, StreamId stream,
                          const char* reason) const;
  Block* block_at(void* ptr, const char* what) const;
  void update_stat(StatArray Stats::*field, bool small, std::int64_t delta);
  Block* new_block();
  void delete_block(Block* b);

  PolicyConfig config_;
  Pool small_;
  Pool large_;
  std::unordered_map<std::uintptr_t, Block*> allocated_;  // by address, allocated or pending
  std::map<std::uintptr_t, Segment*> segments_;           // by address, to find a pointer's segment
  std::set<Block*, LargestFirst> unused_segments_;        // free blocks spanning a whole segment
                                                          // (arenas excepted)
  std::set<Block*, BlockByAddress> arena_free_;           // free blocks of arenas, and claimed ones
  // pack_long_lived: the large pool's free blocks of virtual segments, by address, one set per
  // power-of-two size class (lowest_fit in a few set lookups, not a walk of every block). Kept
  // only through a run of allocations that asked for it (made at its first such request,
  // dropped at the next free), so that the requests of other times pay nothing for it.
  static constexpr int kSizeClasses = 64;
  std::set<Block*, BlockByAddress> by_address_[kSizeClasses];
  bool index_live_ = false;
  bool indexed(const Block* b) const;
  void make_index();
  void drop_index();
  std::size_t claimed_blocks_ = 0;                        // blocks (free or not) marked claimed
  std::unordered_map<std::uintptr_t, Share*> shares_;     // by page address, both sides
  std::deque<PendingEvent> pending_;
  std::vector<EventHandle> event_pool_;
  std::vector<StreamId> draining_;  // streams with a drain event in flight
  std::vector<Epoch> epochs_;       // in flight, at most one per stream
  // Physical pages unmapped to be mapped again at once elsewhere (back()); held, counted in
  // reserved_, and released before the allocator lock is let go.
  std::vector<PageHandle> spare_pages_;
  std::unordered_map<StreamId, std::uint64_t> idle_through_;    // frees up to this seq: done
  std::unordered_map<StreamId, std::uint64_t> last_idle_free_;  // last free leaving a page unused
  std::vector<Block*> block_pool_;
  std::uint64_t free_seq_ = 0;
  std::int64_t reserved_ = 0;
  std::int64_t reserved_hwm_ = 0;  // highest reserved ever; unlike the stat, never reset
  std::atomic<std::int64_t> reserved_hwm_seen_{0};  // reserved_hwm_, for the unlocked read
  // pack_long_lived (allocator.cpp: long_lived): allocations and frees so far, allocations
  // since the last free, and the sizes of blocks alive since the first quarter of those
  // events (made again at most every kOldSizesEvery events, when asked).
  std::uint64_t events_ = 0;
  std::uint64_t run_ = 0;
  std::uint64_t old_sizes_at_ = 0;
  bool old_sizes_made_ = false;
  std::unordered_set<std::size_t> old_sizes_;
  std::int64_t window_hwm_ = 0;    // highest reserved since take_window_peak()
  std::int64_t grow_mark_ = 0;     // see set_grow_mark: reserved_hwm_ unless lowered
  std::string last_error_;  // of any thread; last_error() prefers the calling thread's own
  const std::uint64_t id_ = next_id();
  void set_last_error(std::string message);  // under mutex_
  static std::uint64_t next_id();
};

}  // namespace pymemplan
