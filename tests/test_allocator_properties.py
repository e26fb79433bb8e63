"""Property-based tests: random alloc/free/record_stream/share_pages/empty_cache sequences and failing page
mappings, every policy, invariants checked after every step; stream safety checked against an independent model."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from pymemplan import _core
from allocator_checks import MiB, check_invariants

POLICIES = [
    ("pymemplan", ""),
    ("torch", ""),
    ("torch", "max_split_size_mb:24,roundup_power2_divisions:4"),
    ("torch", "expandable_segments:True"),
    ("pymemplan", "max_split_size_mb:24"),
    ("pymemplan", "release_before_grow:False,cross_stream_reuse:False"),
    ("pymemplan-vmm", ""),
    ("pymemplan-vmm", "vmm_segment_mb:64,release_before_grow:False"),
    ("nocache", ""),
    ("pymemplan-planned", ""),
    # Short periods, so that the repeated `iteration` rule below gets plans that serve.
    ("pymemplan-planned", "min_period:4,match_window:4"),
    ("pymemplan-planned", "min_period:4,match_window:4,vmm:False"),
    # The model of GMLake: stitching as it ships (requests of 512 MiB and up: none here),
    # for every large request, and with stitched blocks reused only where they fit closely.
    ("gmlake", ""),
    ("gmlake", "frag_limit_mb:0"),
    ("gmlake", "frag_limit_mb:0,reuse_limit:1.5"),
]
STREAMS = st.sampled_from([0, 1, 2])
SIZES = st.one_of(
    st.integers(1, 4096),
    st.integers(4097, MiB),
    st.integers(MiB + 1, 12 * MiB),
    st.integers(12 * MiB, 40 * MiB),
)


class AllocatorMachine(RuleBasedStateMachine):
    """Events complete only when a rule says so, so that reuse before completion is caught."""

    ptrs = Bundle("ptrs")

    @initialize(policy=st.sampled_from(POLICIES), capacity_mib=st.sampled_from([64, 160, 1024]),
                limit_mib=st.sampled_from([0, 0, 96]))
    def start(self, policy, capacity_mib, limit_mib):
        self.device = _core.SimulatedDevice(capacity_mib * MiB, auto_complete_events=False)
        self.alloc = _core.Allocator(self.device, policy[0], policy[1])
        self.limit = limit_mib * MiB
        if self.limit:
            self.alloc.set_memory_limit(self.limit)
        self.live: dict[int, tuple[int, int, set]] = {}  # ptr -> (size, stream, record_stream uses)
        # (lo, hi, owner stream, record_stream uses, device record count at the free)
        self.freed = []
        # A small training-like iteration, replayed by the `iteration` rule: ("a", key, size,
        # stream) / ("f", key); one block (key "carry") lives into the next iteration.
        self.program = [("f", "carry")]
        for i, size in enumerate([3 * MiB, 700 * 1024, 5 * MiB + 512, 40_000, 9 * MiB, 2 * MiB]):
            self.program.append(("a", i, size, 1 if i == 3 else 0))
            if i % 2:
                self.program.append(("f", i - 1))
        self.program += [("f", i) for i in (5, 3, 1)] + [("a", "carry", 6 * MiB, 0), ("f", 4)]
        self.held: dict = {}  # program key -> ptr
        self.mapped_at_free = []  # (page address, physical page, streams, record count)

    def _done_after(self, stream, t):
        # Work queued on `stream` before the free is done once an event recorded after the
        # free (number > t) has completed; the device counts records and completions.
        return self.device.completed_through(stream) > t

    @rule(target=ptrs, size=SIZES, stream=STREAMS)
    def malloc(self, size, stream):
        return self._malloc(size, stream)

    def _malloc(self, size, stream):
        try:
            p = self.alloc.malloc(size, stream)
        except _core.OutOfMemoryError as e:
            assert "out of memory" in str(e)
            return None
        lo, hi = p, p + size
        # Stream safety: memory freed by another stream, or used by other streams through
        # record_stream, is only handed out after that stream's work was seen to complete.
        keep = []
        for rec in self.freed:
            flo, fhi, owner, uses, t = rec
            if flo < hi and lo < fhi:
                for u in uses:
                    assert self._done_after(u, t), f"reused before record_stream on stream {u} completed"
                if owner != stream:
                    assert self._done_after(owner, t), (
                        f"stream {stream} reused memory freed on stream {owner} before it completed")
            else:
                keep.append(rec)
        self.freed = keep
        self.live[p] = (size, stream, set())
        return p

    @rule(p=consumes(ptrs))
    def free(self, p):
        if p is None or p not in self.live:
            return
        self._free(p)

    def _free(self, p):
        for key in [k for k, q in self.held.items() if q == p]:
            del self.held[key]
        size, stream, uses = self.live.pop(p)
        t = self.device.record_count
        rounded = self.alloc.round_size(size)
        page = self.device.granularity
        # The physical pages under the block (vmm): none may be unmapped while work queued on
        # its stream, or on streams that used it, before the free may still touch it.
        for at in range(p // page * page, p + rounded, page):
            handle, _ = self.device.translate(at)
            if handle:
                self.mapped_at_free.append((at, handle, {stream, *uses}, t))
        self.alloc.free(p)
        self.freed.append((p, p + rounded, stream, uses, t))

    @rule(times=st.integers(1, 4))
    def iteration(self, times):
        """The same allocation sequence again: plan detection, packing and serving run."""
        for _ in range(times):
            for op in self.program:
                if op[0] == "a":
                    _, key, size, stream = op
                    if key not in self.held:
                        p = self._malloc(size, stream)
                        if p is not None:
                            self.held[key] = p
                elif op[1] in self.held:
                    self._free(self.held.pop(op[1]))

    @rule(n=st.integers(24, 40), stream=STREAMS)
    def state_burst(self, n, stream):
        """An optimizer making its state: blocks in the sizes of the oldest live ones, one after
        another with no free between (pack_long_lived: the lowest free address that fits)."""
        sizes = [size for size, _, _ in self.live.values()][:8]
        for i in range(n if sizes else 0):
            self._malloc(sizes[i % len(sizes)], stream)

    @rule(p=ptrs, stream=STREAMS)
    def record_stream(self, p, stream):
        if p is None or p not in self.live:
            return
        self.alloc.record_stream(p, stream)
        if stream != self.live[p][1]:
            self.live[p][2].add(stream)

    @rule(stream=st.one_of(st.none(), STREAMS))
    def complete_events(self, stream):
        self.device.complete_events(stream)

    @rule()
    def share_pages(self):
        """Pages partly used at disjoint offsets mapped onto one (vmm policies; 0 elsewhere)."""
        before = self.device.live_pages
        given = self.alloc.share_pages()
        assert given % (2 * MiB) == 0 and self.device.live_pages == before - given // (2 * MiB)
        if not self.alloc.config or "vmm:True" not in self.alloc.config:
            assert given == 0

    @rule()
    def mapping_runs_out_of_memory(self):
        """The next page mapping fails as cuMemMap does when the page tables cannot grow: the
        OOM ladder maps again after giving cached memory back, or the request fails cleanly
        (vmm policies; the others map nothing)."""
        self.device.fail_next_maps(1)

    @rule()
    def empty_cache(self):
        self.alloc.empty_cache()
        assert self.device.pending_events == 0, "empty_cache left events pending"

    @invariant()
    def pages_stay_mapped_until_their_work_is_done(self):
        pending = []
        for at, handle, streams, t in self.mapped_at_free:
            if all(self._done_after(s, t) for s in streams):
                continue
            assert self.device.translate(at)[0] == handle, (
                f"page at {at:#x} unmapped while work queued before its free may touch it")
            pending.append((at, handle, streams, t))
        self.mapped_at_free = pending

    @invariant()
    def consistent(self):
        check_invariants(self.alloc, self.device, {p: v[0] for p, v in self.live.items()},
                             self.limit)

    def teardown(self):
        for p in list(self.live):
            self.alloc.free(p)
        self.alloc.empty_cache()
        stats = self.alloc.stats()
        assert stats["reserved_bytes.all.current"] == 0
        assert stats["allocated_bytes.all.current"] == 0
        assert stats["active_bytes.all.current"] == 0
        assert self.device.used == 0 and self.device.live_segments == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestAllocatorMachine = AllocatorMachine.TestCase
