"""Policy pymemplan-planned: plan-guided placement (csrc/core/planned.{hpp,cpp}, packing.*)."""

from __future__ import annotations

import glob
import itertools
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_checks import check_invariants, replay_checked
from pymemplan import _core

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
POLICY = "pymemplan-planned"


# ---------------------------------------------------------------------------------------------
# Synthetic training loops

def make_iteration(seed, layers=12, scale=1.0, stream=0):
    """One training step as ops ("a", key, size, stream) / ("f", key): a forward pass that keeps
    one activation per layer (plus temporaries), a backward pass that frees them in reverse,
    and gradients freed at the end. Layer sizes differ, so no shorter period exists."""
    rng = random.Random(seed)
    sizes = [int(rng.randint(2 * MiB, 24 * MiB) * scale) // 512 * 512 + rng.randint(0, 511)
             for _ in range(layers)]
    ops = []
    for i, s in enumerate(sizes):
        ops.append(("a", f"act{i}", s, stream))
        ops.append(("a", f"tmp{i}", s // 3 + 700, stream))
        ops.append(("f", f"tmp{i}"))
    for i in reversed(range(layers)):
        ops.append(("a", f"grad{i}", sizes[i] // 4 + 300, stream))
        ops.append(("a", f"bt{i}", sizes[i] // 2 + 100, stream))
        ops.append(("f", f"bt{i}"))
        ops.append(("f", f"act{i}"))
    for i in range(layers):
        ops.append(("f", f"grad{i}"))
    return ops


def prologue(n=40, seed=99):
    rng = random.Random(seed)
    return [("a", f"param{i}", rng.randint(1, 8 * MiB), 0) for i in range(n)]


class Runner:
    """Drives an allocator through ops, tracking live bytes, and optionally checking every
    invariant (no overlap, stats == recount) as it goes."""

    def __init__(self, policy=POLICY, config="", capacity=64 << 30, auto=True):
        self.device = _core.SimulatedDevice(capacity, auto_complete_events=auto)
        self.alloc = _core.Allocator(self.device, policy, config)
        self.ptr = {}      # key -> pointer
        self.live = {}     # pointer -> size
        self.ranges = {}   # pointer -> end
        self.live_bytes = 0
        self.peak_live = 0
        self.requests = 0

    def reset_peaks(self):
        self.alloc.reset_peak_stats()
        self.peak_live = self.live_bytes

    def run(self, ops, it=0, check_every=0):
        for n, op in enumerate(ops):
            if op[0] == "a":
                _, key, size, stream = op
                key = (it, key)
                p = self.alloc.malloc(size, stream)
                self.requests += 1
                for q, end in self.ranges.items():
                    assert end <= p or p + size <= q, "overlapping live blocks"
                self.ptr[key] = p
                self.live[p] = size
                self.ranges[p] = p + size
                self.live_bytes += size
                self.peak_live = max(self.peak_live, self.live_bytes)
            else:
                key = (it if (it, op[1]) in self.ptr else "persist", op[1])
                p = self.ptr.pop(key)
                self.alloc.free(p)
                self.live_bytes -= self.live.pop(p)
                del self.ranges[p]
            if check_every and n % check_every == 0:
                check_invariants(self.alloc, self.device, self.live)

    def stats(self):
        return self.alloc.stats()

    def plan(self):
        return self.alloc.plan_stats()


def run_trace(r, trace, live=None, start=0, stop=None):
    """Drives Runner r through events [start, stop) of a recorded or synthetic trace; returns
    the trace's live pointers mapped to r's (pass them back to go on)."""
    live = {} if live is None else live
    rows = zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
               trace.stream.tolist())
    for a, ptr, n, st in itertools.islice(rows, start, stop):
        if a == 0:
            live[ptr] = r.alloc.malloc(n, st)
        else:
            r.alloc.free(live.pop(ptr))
    return live


def run_prologue(r):
    for op in prologue():
        p = r.alloc.malloc(op[2], op[3])
        r.ptr[("persist", op[1])] = p
        r.live[p] = op[2]
        r.ranges[p] = p + op[2]
        r.live_bytes += op[2]
    r.peak_live = r.live_bytes


# ---------------------------------------------------------------------------------------------
# Config

def test_config_keys_are_validated_and_listed():
    d = _core.SimulatedDevice(1 << 30)
    a = _core.Allocator(d, POLICY, "min_period:64,max_plans:3,plan_slack:5,max_split_size_mb:64")
    assert a.policy == POLICY
    assert "min_period:64" in a.config and "max_plans:3" in a.config and "plan_slack:5" in a.config
    assert "max_split_size_mb:64" in a.config  # passed through to the pool
    assert "vmm:True" in a.config              # the pool is pymemplan-vmm's
    assert "vmm:False" in _core.parse_config(POLICY, "vmm:False")  # the classic variant
    assert "min_period:64" in _core.parse_config(POLICY, "min_period:64")
    for bad in ("max_plans:0", "min_period:x", "min_period:-3", "resync_window:", "nope:1",
                "min_period:100,max_period:50", "max_split_size_mb:3", "garbage",
                "plan_slack:1001", "search_rounds:-1", "vmm:maybe", "vmm_segment_mb:1", "holes:2"):
        with pytest.raises(_core.AllocatorError) as e:
            _core.Allocator(d, POLICY, bad)
        with pytest.raises(_core.AllocatorError):
            _core.parse_config(POLICY, bad)
        if bad.startswith("nope") or bad == "garbage":
            assert "min_period" in str(e.value) and "max_split_size_mb" in str(e.value)


def test_bad_input_raises_and_leaves_state_intact():
    r = Runner(capacity=1 << 30)
    p = r.alloc.malloc(1000, 0)
    before = r.stats()
    for size in (0, -5):
        with pytest.raises(_core.AllocatorError):
            r.alloc.malloc(size, 0)
    with pytest.raises(_core.AllocatorError):
        r.alloc.free(p + 512)
    with pytest.raises(_core.AllocatorError):
        r.alloc.free(12345)
    with pytest.raises(_core.AllocatorError):
        r.alloc.record_stream(12345, 1)
    assert r.stats() == before
    r.alloc.free(p)
    with pytest.raises(_core.AllocatorError):
        r.alloc.free(p)


def test_plan_stats_only_for_the_planned_policy():
    d = _core.SimulatedDevice(1 << 30)
    with pytest.raises(_core.AllocatorError):
        _core.Allocator(d, "pymemplan").plan_stats()
    with pytest.raises(_core.AllocatorError):
        _core.Allocator(d, "pymemplan-vmm").plan_blocks()


# ---------------------------------------------------------------------------------------------
# Packing

def _check_packing(start, life, size, period, res):
    offs = res["offsets"]
    n = len(start)

    def overlap_t(i, j):
        return (start[j] - start[i]) % period < life[i] or (start[i] - start[j]) % period < life[j]

    for i in range(n):
        assert offs[i] + size[i] <= res["arena"]
        for j in range(i + 1, n):
            if overlap_t(i, j):
                assert offs[i] + size[i] <= offs[j] or offs[j] + size[j] <= offs[i], (i, j)
    assert res["arena"] >= res["bound"]
    assert res["ratio"] == pytest.approx(res["arena"] / res["bound"] if res["bound"] else 1.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 99), st.integers(1, 100), st.integers(1, 64)),
                min_size=1, max_size=40))
def test_packing_never_overlaps_in_time_and_space(blocks):
    period = 100
    start = [b[0] for b in blocks]
    life = [b[1] for b in blocks]
    size = [b[2] * 512 for b in blocks]
    res = _core.pack_blocks(start, life, size, period)
    _check_packing(start, life, size, period, res)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 49), st.integers(1, 50), st.integers(1, 16),
                          st.integers(0, 3)),
                min_size=1, max_size=40),
       st.lists(st.integers(1, 24), min_size=0, max_size=5), st.sampled_from([50, 997]))
def test_hole_filling_never_overlaps_and_leaves_out_only_what_cannot_fit(blocks, holes, period):
    # 997 steps: the packer's time index puts several steps in one bucket, and lifetimes
    # that wrap around the circle span the last bucket and the first, or all the way round
    # to end in the bucket they started in (a few steps short of the period).
    start = [b[0] * period // 50 for b in blocks]
    life = [max(1, b[1] * period // 50 - b[3]) for b in blocks]
    size = [b[2] * 512 for b in blocks]
    hole_sizes = [h * 512 for h in holes]

    def overlap_t(i, j):
        return ((start[j] - start[i]) % period < life[i]) or ((start[i] - start[j]) % period < life[j])

    def check(r):
        placed = [i for i, h in enumerate(r["hole"]) if h >= 0]
        assert r["placed_bytes"] == sum(size[i] for i in placed)
        for i in placed:
            assert r["offset"][i] + size[i] <= hole_sizes[r["hole"][i]]
            for j in placed:
                if j > i and r["hole"][j] == r["hole"][i] and overlap_t(i, j):
                    a, b = r["offset"][i], r["offset"][j]
                    assert a + size[i] <= b or b + size[j] <= a, (i, j)
        return placed

    check(_core.fill_holes(start, life, size, period, hole_sizes, "skyline"))
    # Peak shaving only ever takes blocks off the arena's peak of live bytes.
    r = _core.fill_holes(start, life, size, period, hole_sizes, "peak-shave")
    placed = set(check(r))
    left = [i for i in range(len(blocks)) if i not in placed]

    def bound(ix):
        return _core.pack_blocks([start[i] for i in ix], [life[i] for i in ix],
                                 [size[i] for i in ix], period)["bound"] if ix else 0

    assert bound(left) <= bound(list(range(len(blocks))))
    for rule in ("greedy", "greedy-area", "greedy-life"):
        r = _core.fill_holes(start, life, size, period, hole_sizes, rule)
        placed = check(r)
        # Greedy, so maximal: a block left out finds no gap in any hole during its lifetime.
        for i in set(range(len(blocks))) - set(placed):
            for h, cap in enumerate(hole_sizes):
                taken = sorted((r["offset"][j], r["offset"][j] + size[j]) for j in placed
                               if r["hole"][j] == h and overlap_t(i, j))
                at = 0
                for lo, hi in taken:
                    if lo >= at + size[i]:
                        break
                    at = max(at, hi)
                assert at + size[i] > cap, (rule, i, h)


def test_hole_filling_prefers_blocks_alive_at_the_peak():
    # Two blocks fit the hole only one at a time; the one alive when live bytes peak wins,
    # though it is the smaller: it is the one that lowers the arena's bound.
    r = _core.fill_holes([6, 10, 12], [5, 5, 3], [2048, 1536, 4096], 20, [2048])
    assert r["hole"] == [-1, 0, -1] and r["placed_bytes"] == 1536
    with pytest.raises(_core.AllocatorError):
        _core.fill_holes([20], [1], [512], 20, [512])
    with pytest.raises(_core.AllocatorError, match="greedy"):
        _core.fill_holes([0], [1], [512], 20, [512], "best")


def test_peak_shaving_fills_a_hole_only_where_it_saves_more_than_its_pages():
    # A block of 3 KiB makes the peak; once it is out, one of 1 KiB, at another time. A 4 KiB
    # hole whose pages all cost (4 KiB pages, none kept) would take 4 KiB to save 3: it stays
    # empty. With its first 2 KiB on a kept page and 1 KiB pages, it costs 1 KiB to save all
    # 3: both blocks go there, one after the other.
    args = ([0, 5], [4, 2], [3072, 1024], 10, [4096], "peak-shave")
    assert _core.fill_holes(*args, free=[0], page=4096)["hole"] == [-1, -1]
    r = _core.fill_holes(*args, free=[2048], page=1024)
    assert r["hole"] == [0, 0] and r["offset"] == [0, 0] and r["placed_bytes"] == 4096
    with pytest.raises(_core.AllocatorError, match="free bytes for every hole"):
        _core.fill_holes(*args, free=[0, 0], page=4096)


def test_a_lifetime_that_wraps_round_into_its_own_bucket_keeps_its_blocks_apart():
    """Found by comparing the packer with a rewrite of it: the hole filler indexes blocks by
    stretches of the period (buckets of 11 steps here), and a block alive for all but the last 3
    steps of the period, starting mid-bucket, ends in the bucket it started in. It was listed in
    that one bucket, so blocks 2 and 5 were placed at the same offsets of the hole although
    both are alive from step 1004 to 2161 (the allocator would have found the range taken when
    serving it, and fallen back to the pool)."""
    start = [2146, 130, 1004, 1156, 2609, 845, 525, 1427, 1135]
    life = [1806, 118, 2161, 532, 243, 2627, 828, 2538, 1887]
    size = [512, 1024, 1536, 512, 1536, 1536, 1024, 512, 2048]
    for rule in ("greedy", "greedy-area", "greedy-life", "skyline", "peak-shave"):
        r = _core.fill_holes(start, life, size, 2630, [1536], rule, [768], 2 << 20)
        assert not (r["hole"][2] == r["hole"][5] == 0), rule  # 1536 + 1536 in a hole of 1536
        assert r["placed_bytes"] == sum(s for s, h in zip(size, r["hole"]) if h == 0)
        assert r["placed_bytes"] > 0 or rule == "peak-shave"  # not worth its page there


def _skyline_by_hand(start, life, size, period, weight, capacity=None):
    """The skyline rule written plainly: among the blocks left, the one whose lifetime's highest
    placed top is lowest (ties: the earliest in `weight` order) goes there. O(n^2 period)."""
    n = len(size)
    order = sorted(range(n), key=lambda i: (-weight(i), -size[i], i))
    rank = {b: r for r, b in enumerate(order)}
    sky = [0] * period
    steps = [[(start[i] + k) % period for k in range(life[i])] for i in range(n)]
    offsets, left = [None] * n, set(range(n))
    while left:
        key, i = min((max(sky[t] for t in steps[j]), rank[j], j) for j in left)[0::2]
        left.discard(i)
        if capacity is not None and key + size[i] > capacity:
            continue
        offsets[i] = key
        for t in steps[i]:
            sky[t] = key + size[i]
    return offsets


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 29), st.integers(1, 30), st.integers(1, 8)),
                min_size=1, max_size=30), st.integers(1, 40))
def test_the_skyline_places_each_block_where_the_plain_rule_does(blocks, hole):
    """The packer keeps every block's key exact in a 2-d tree (raised by each placement over the
    blocks it overlaps) instead of computing it when the block comes up: same placements as the
    rule written plainly, lifetimes that wrap around the circle included."""
    period = 30
    start = [b[0] for b in blocks]
    life = [b[1] for b in blocks]
    size = [b[2] * 512 for b in blocks]
    area = lambda i: life[i] * size[i]  # noqa: E731 - the first tie rule, largest first
    # One run (a granule past any arena stops the search after it): the area rule's.
    r = _core.pack_blocks(start, life, size, period, 0, 1 << 40)
    assert r["runs"] == 1
    assert r["offsets"] == _skyline_by_hand(start, life, size, period, area)
    # A hole: each tie rule fills it, the one placing the most size x lifetime is kept.
    cap = hole * 512
    fills = [_skyline_by_hand(start, life, size, period, w, cap)
             for w in (area, lambda i: size[i], lambda i: life[i])]
    best = max(fills, key=lambda f: sum(area(i) for i, o in enumerate(f) if o is not None))
    got = _core.fill_holes(start, life, size, period, [cap], "skyline")
    assert got["hole"] == [-1 if o is None else 0 for o in best]
    assert [o for o, h in zip(got["offset"], got["hole"]) if h == 0] == [o for o in best if o is not None]


@pytest.mark.parametrize("seed", range(4))
def test_the_skyline_fills_several_holes_where_the_plain_rule_does(seed):
    """Holes largest first, each filled as above by the blocks the holes before it left. The
    packer does it with one index of the blocks for all holes (a block placed is out of it), a
    smaller one of the blocks left once they are under a quarter of it (here after the first
    hole), and gives a run up once it cannot place more size x lifetime than the best."""
    rng = random.Random(seed)
    period, n = 40, 48
    start = [rng.randrange(period) for _ in range(n)]
    life = [rng.randint(1, period) if rng.random() < 0.2 else rng.randint(1, period // 4)
            for _ in range(n)]
    size = [rng.choice([1, 2, 3, 8]) * 512 for _ in range(n)]
    holes = [64 * 512] + [rng.randint(2, 12) * 512 for _ in range(4)]
    hole, offset, left = [-1] * n, [0] * n, set(range(n))
    for h in sorted(range(len(holes)), key=lambda h: -holes[h]):
        ix = sorted(i for i in left if size[i] <= holes[h])
        if not ix:
            continue
        sub = [[arr[i] for i in ix] for arr in (start, life, size)]
        area = lambda k: sub[1][k] * sub[2][k]  # noqa: E731
        fills = [_skyline_by_hand(*sub, period, w, holes[h])
                 for w in (area, lambda k: sub[2][k], lambda k: sub[1][k])]
        best = max(fills, key=lambda f: sum(area(k) for k, o in enumerate(f) if o is not None))
        for k, o in enumerate(best):
            if o is not None:
                hole[ix[k]], offset[ix[k]] = h, o
                left.discard(ix[k])
        if h == 0:
            assert len(left) * 4 < n  # the other holes run on the smaller index
    got = _core.fill_holes(start, life, size, period, holes, "skyline")
    assert got["hole"] == hole
    assert [o for o, h in zip(got["offset"], got["hole"]) if h >= 0] == \
        [o for o, h in zip(offset, hole) if h >= 0]


@pytest.mark.parametrize("seed", range(4))
def test_the_skyline_places_larger_random_sets_where_the_plain_rule_does(seed):
    """As above with 120 blocks (a deeper tree), a third of them wrapping round the circle."""
    rng = random.Random(seed)
    period, n = 90, 120
    start = [rng.randrange(period) for _ in range(n)]
    life = [rng.randint(1, period) if rng.random() < 0.3 else rng.randint(1, period // 4)
            for _ in range(n)]
    size = [rng.choice([1, 2, 3, 8, 32]) * 512 for _ in range(n)]
    area = lambda i: life[i] * size[i]  # noqa: E731
    r = _core.pack_blocks(start, life, size, period, 0, 1 << 40)
    assert r["offsets"] == _skyline_by_hand(start, life, size, period, area)
    cap = 40 * 512
    fills = [_skyline_by_hand(start, life, size, period, w, cap)
             for w in (area, lambda i: size[i], lambda i: life[i])]
    best = max(fills, key=lambda f: sum(area(i) for i, o in enumerate(f) if o is not None))
    got = _core.fill_holes(start, life, size, period, [cap], "skyline")
    assert got["hole"] == [-1 if o is None else 0 for o in best]


def test_skyline_hole_filling_packs_a_stack_of_lifetimes_into_one_hole():
    # Nested lifetimes (a stack of activations): the skyline reaches their peak of live bytes,
    # so a hole exactly that large takes them all; greedy (largest at the peak first) does not.
    start, life = [3, 2, 7, 6, 1, 0], [1, 3, 1, 3, 9, 11]
    size = [4096, 4608, 8192, 3584, 3072, 7680]
    bound = _core.pack_blocks(start, life, size, 12)["bound"]
    sky = _core.fill_holes(start, life, size, 12, [bound], "skyline")
    assert sky["hole"] == [0] * 6 and sky["placed_bytes"] == sum(size)
    assert _core.fill_holes(start, life, size, 12, [bound], "greedy")["placed_bytes"] < sum(size)


def test_packing_reaches_the_bound_on_simple_cases():
    # Disjoint lifetimes: one block's worth.
    r = _core.pack_blocks([0, 10, 20], [10, 10, 10], [4096, 1024, 2048], 30)
    assert r["arena"] == r["bound"] == 4096 and r["ratio"] == 1.0
    # Groups that live and die together (cliques): the largest group.
    r = _core.pack_blocks([0, 0, 0, 50, 50], [50, 50, 50, 50, 50], [512, 1024, 1536, 4096, 512], 100)
    assert r["arena"] == r["bound"] == 4608
    # Nested (stack) lifetimes, as forward/backward activations.
    start = [0, 1, 2, 3]
    life = [8, 6, 4, 2]
    size = [1024, 2048, 512, 4096]
    r = _core.pack_blocks(start, life, size, 10)
    _check_packing(start, life, size, 10, r)
    assert r["arena"] == r["bound"] == sum(size)
    # A block wrapping around the end of the period conflicts with blocks at the start.
    r = _core.pack_blocks([90, 5], [20, 3], [1024, 1024], 100)
    assert r["arena"] == r["bound"] == 2048
    with pytest.raises(_core.AllocatorError):
        _core.pack_blocks([100], [1], [512], 100)
    with pytest.raises(_core.AllocatorError, match="sizes add up past"):
        _core.pack_blocks([0, 1], [2, 2], [1 << 62, 1 << 62], 4)
    with pytest.raises(_core.AllocatorError, match="sizes add up past"):
        _core.fill_holes([0, 1], [2, 2], [1 << 62, 1 << 62], 4, [512], "greedy")


def _random_blocks(seed, n, period, max_life, max_units):
    """Blocks alive at random times on a circle of `period` steps: (start, life, size)."""
    rng = random.Random(seed)
    start = [rng.randrange(period) for _ in range(n)]
    life = [rng.randint(1, max_life) for _ in range(n)]
    size = [rng.randint(1, max_units) * 512 for _ in range(n)]
    return start, life, size


def test_packing_ratio_on_random_intervals_is_reported_and_small():
    period = 1000
    start, life, size = _random_blocks(5, 300, period, 200, 2000)
    r = _core.pack_blocks(start, life, size, period)
    _check_packing(start, life, size, period, r)
    assert 1.0 <= r["ratio"] < 1.25


def _laminar(rng, lo, hi, depth, out):
    """Nested or disjoint lifetimes inside [lo, hi): a stack of activations, recursively."""
    t = lo
    while t < hi - 1 and depth < 6:
        end = rng.randint(t + 1, hi)
        out.append((t, end - t, rng.randint(1, 64) * 512))
        _laminar(rng, t + 1, end - 1, depth + 1, out) if end - t > 2 else None
        t = end + rng.randint(0, 3)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_packing_reaches_the_bound_on_nested_lifetimes(seed):
    """The proven case (packing.hpp): on a laminar family the skyline packs at the bound."""
    rng = random.Random(seed)
    blocks = []
    _laminar(rng, 0, 400, 0, blocks)
    start, life, size = (list(x) for x in zip(*blocks))
    r = _core.pack_blocks(start, life, size, 1000, 0)
    _check_packing(start, life, size, 1000, r)
    assert r["arena"] == r["bound"], (r["arena"], r["bound"])


def test_packing_gives_up_and_stops_at_the_granule():
    period = 500
    start, life, size = _random_blocks(9, 200, period, 100, 200)
    full = _core.pack_blocks(start, life, size, period, 8)
    assert full["runs"] >= 1
    # An arena within one granule of the bound is as good as the bound: fewer runs.
    coarse = _core.pack_blocks(start, life, size, period, 8, granule=1 << 30)
    assert coarse["runs"] == 1 and coarse["arena"] >= coarse["bound"]
    # Nothing fits under the bound: no offsets, arena past the give-up level.
    none = _core.pack_blocks(start, life, size, period, 8, 1, full["bound"] - 512)
    assert none["offsets"] == [] and none["arena"] == full["bound"] - 512 + 1
    assert none["runs"] == 0  # known without a run: every arena holds the bound
    # Between the bound and what the runs reach: each run stops as soon as it must pass the
    # level, and the result is the same as without one wherever a run gets under it.
    assert full["arena"] > full["bound"]
    between = _core.pack_blocks(start, life, size, period, 8, 1, full["arena"] - 512)
    assert between["offsets"] == [] and between["runs"] == full["runs"]
    assert _core.pack_blocks(start, life, size, period, 8, 1, full["arena"]) == full


# ---------------------------------------------------------------------------------------------
# Detection and serving

def test_before_any_plan_it_is_pymemplan_vmm():
    """Until a plan serves, requests go to the pymemplan-vmm pool unchanged: same addresses,
    same reserved memory, same device calls."""
    rng = random.Random(3)
    ops, live = [], []
    for i in range(400):  # no repeated iteration
        if live and rng.random() < 0.45:
            ops.append(("f", live.pop(rng.randrange(len(live)))))
        else:
            ops.append(("a", i, rng.randint(1, 40 * MiB), rng.choice([0, 0, 1])))
            live.append(i)
    runs = [Runner(policy=p) for p in (POLICY, "pymemplan-vmm")]
    for r in runs:
        r.run(ops)
    assert runs[0].plan()["plan_hits"] == 0
    assert runs[0].ptr == runs[1].ptr
    keys = ("reserved_bytes.all.current", "reserved_bytes.all.peak", "num_device_alloc",
            "num_device_free", "allocated_bytes.all.current")
    assert {k: runs[0].stats()[k] for k in keys} == {k: runs[1].stats()[k] for k in keys}


def test_finds_the_iteration_after_a_prologue_and_serves_it_within_1_percent():
    r = Runner()
    run_prologue(r)
    it = make_iteration(1, scale=10)
    for i in range(4):
        r.run(it, i)
    ps = r.plan()
    assert ps["first_planned_request"] >= len(prologue())  # nothing planned in the prologue
    assert ps["plans"] >= 1 and ps["plan_ratio"] >= 1.0 and ps["arms"] >= 1
    # Steady state: the iterations come from the plan, and reserved memory is the live pool
    # blocks plus the arena.
    r.reset_peaks()
    before = ps
    for i in range(4, 8):
        r.run(it, i, check_every=37)
    ps = r.plan()
    per_it = sum(1 for op in it if op[0] == "a")
    hits = ps["plan_hits"] - before["plan_hits"]
    fallbacks = ps["fallbacks"] - before["fallbacks"]
    assert hits >= 4 * per_it * 0.95, (hits, fallbacks)
    assert fallbacks <= 4 * per_it * 0.05
    assert ps["slot_busy"] == before["slot_busy"] and ps["divergences"] == before["divergences"]
    s = r.stats()
    assert s["reserved_bytes.all.peak"] <= 1.01 * r.peak_live, s["reserved_bytes.all.peak"] / r.peak_live
    check_invariants(r.alloc, r.device, r.live)


def _with_small_saved(it, seed=4):
    """Each layer also saves a small block (norm statistics, masks) for backward."""
    rng = random.Random(seed)
    out = []
    for op in it:
        out.append(op)
        if op[0] == "a" and op[1].startswith("act"):
            out.append(("a", "small" + op[1][3:], rng.randint(8, 512) * 1024 + 100, op[3]))
        if op[0] == "f" and op[1].startswith("act"):
            out.append(("f", "small" + op[1][3:]))
    return out


def _with_optimizer_state(it, n=60, max_kib=600, seed=5):
    """``it`` as the first step runs it: optimizer state (small blocks that live on) is made
    after backward, while the activations' memory is free."""
    k = next(i for i, op in enumerate(it) if op[0] == "f" and op[1].startswith("grad"))
    rng = random.Random(seed)
    state = [("a", f"state{i}", rng.randint(1, max_kib) * 1024 + rng.randint(0, 511), 0)
             for i in range(n)]
    return it[:k] + state + it[k:]


def _keep_state(r):
    for key in [key for key in r.ptr if key[1].startswith("state")]:
        r.ptr[("persist", key[1])] = r.ptr.pop(key)


def _five_steps_with_state(config=""):
    """A planned run five steps in, whose first step left optimizer state on its pages."""
    r = Runner(config=config)
    run_prologue(r)
    it = _with_small_saved(make_iteration(3, scale=4))
    r.run(_with_optimizer_state(it), 0)
    _keep_state(r)
    for i in range(1, 5):
        r.run(it, i)
    return r, it


def test_holes_of_pages_kept_by_optimizer_state_serve_the_plan():
    """The first step also creates optimizer state: small blocks that live on, allocated after
    backward, so they land on the pages of the iteration's freed activations. Once the plan
    moves the iteration into its arena, those pages stay mapped for the state alone; the plan
    puts its small blocks into their free parts (holes) and needs less memory than without.
    Page sharing is off: it gives back such pages another way (without holes here, 1.0017
    against 1.0038 with them, where the plan is made again from the step as it repeats)."""
    peaks = {}
    for holes in (1, 0):
        r, it = _five_steps_with_state(f"holes:{holes},share_pages:0")
        r.reset_peaks()
        before = r.plan()
        for i in range(5, 9):
            r.run(it, i, check_every=23)
        ps = r.plan()
        assert ps["arms"] >= 1 and ps["slot_busy"] == before["slot_busy"]
        assert ps["plan_hits"] - before["plan_hits"] >= 4 * sum(op[0] == "a" for op in it) * 0.95
        assert (ps["plan_hole_bytes"] > 0) == bool(holes)
        check_invariants(r.alloc, r.device, r.live)
        peaks[holes] = r.stats()["reserved_bytes.all.peak"]
        assert peaks[holes] <= 1.01 * r.peak_live
    assert peaks[1] < peaks[0], peaks


def _steps_with_an_input_batch(prefetch, batch=1900 * 1024, steps=10):
    """A loop whose every step starts with an input batch of `batch` bytes (nearly a page),
    made before the last one is released (`prefetch`, as a loader's prefetch or a loop variable
    rebound) or after. The first step makes optimizer state. Peak reserved over the second
    half, and the peak of live bytes then."""
    r = Runner()
    run_prologue(r)
    it = _with_small_saved(make_iteration(3, scale=0.25))
    prev = None
    for i in range(steps):
        if prev is not None and not prefetch:
            r.alloc.free(prev)
            r.live_bytes -= batch
        x = r.alloc.malloc(batch)
        r.live_bytes += batch
        r.peak_live = max(r.peak_live, r.live_bytes)
        if prev is not None and prefetch:
            r.alloc.free(prev)
            r.live_bytes -= batch
        prev = x
        if i == steps // 2:
            r.reset_peaks()
        if i == 0:
            r.run(_with_optimizer_state(it), 0)
            _keep_state(r)
        else:
            r.run(it, i)
    return r.stats()["reserved_bytes.all.peak"], r.peak_live


def test_a_batch_made_before_the_last_is_released_costs_what_releasing_it_first_costs():
    """The batch lives a step and an event, so the pool serves it, and it is the request that
    starts each pass. The plan arms once the pool has served it (not before, when the pool's
    memory measured for the plan would leave out the page it takes), and does not count the
    batch it replaces, released within the pass, as held: the steady state holds what it holds
    when each batch is released before the next is made (before: a page more)."""
    prefetched, live = _steps_with_an_input_batch(prefetch=True)
    released_first, _ = _steps_with_an_input_batch(prefetch=False)
    assert prefetched == released_first, (prefetched / MiB, released_first / MiB)
    assert prefetched <= 1.02 * live


def test_claimed_holes_are_not_taken_by_requests_outside_the_plan():
    """While a plan serves, the parts of holes it uses are claimed: requests the pool serves
    (here small blocks allocated between steps, outside the plan) never land there, so every
    planned request finds its hole free. Without claims, best fit put such blocks in the
    holes and 45 planned requests went to the pool instead."""
    r, it = _five_steps_with_state()
    before = r.plan()
    noise = random.Random(9)
    for i in range(5, 9):
        r.run([("a", f"noise{j}", noise.randint(4, 256) * 1024, 0) for j in range(12)], i)
        r.run(it, i, check_every=23)
        r.run([("f", f"noise{j}") for j in range(12)], i)
    ps = r.plan()
    assert ps["hole_hits"] - before["hole_hits"] > 0
    assert ps["slot_busy"] == before["slot_busy"]
    check_invariants(r.alloc, r.device, r.live)


def test_the_layout_starts_in_the_free_tail_of_a_kept_page_where_that_saves_a_page():
    """An arena is a range of its own: where its blocks' peak runs a little past a whole
    number of pages, its last page is mostly empty. Here (forty parameters, a step of twelve
    layers) the plan's blocks peak 0.8 MiB past their last whole page, and one of the
    parameters' pages has more than that free at its end, where a free block runs on over
    pages nobody keeps: the layout goes there instead, sharing that page. The steady state
    holds the live peak in whole pages, the least any page allocator can (before: 336 MiB,
    a page more)."""
    r = Runner()
    run_prologue(r)
    step = make_iteration(9)
    for i in range(5):
        r.run(step, i)
    r.reset_peaks()
    for i in range(5, 8):
        r.run(step, i, check_every=17)
    ps = r.plan()
    assert ps["armed"] and ps["tail_layouts"] >= 1, ps
    assert ps["plan_arena_bytes"] == 0 and ps["plan_hole_cost_bytes"] > 0, ps
    page = 2 * MiB
    floor = -(-r.peak_live // page) * page
    assert r.stats()["reserved_bytes.all.peak"] == floor, (r.stats()["reserved_bytes.all.peak"] / MiB, floor / MiB)
    check_invariants(r.alloc, r.device, r.live)


def _identical_layers(layers=24, size=16 * MiB):
    """A step of identical layers: the sequence repeats within the step, not only across."""
    ops = []
    for i in range(layers):
        ops += [("a", f"act{i}", size, 0), ("a", f"tmp{i}", size // 3, 0), ("f", f"tmp{i}")]
    ops.append(("a", "loss", 4096, 0))
    for i in reversed(range(layers)):
        ops += [("a", f"grad{i}", size // 4, 0), ("a", f"bt{i}", size // 2, 0), ("f", f"bt{i}"),
                ("f", f"act{i}")]
    ops.append(("f", "loss"))
    ops += [("f", f"grad{i}") for i in range(layers)]
    return ops


@pytest.mark.parametrize("marks", [False, True])
def test_a_step_of_identical_layers_is_found_with_or_without_marks(marks):
    """Identical layers make shorter windows repeat inside the step, so detection may first
    take a wrong period; passing over planned slots counts as a divergence, and it looks
    again. mark_step() (optional) gives the step and its cut directly once a step repeated
    the one before it: the plan made at that mark arms at once."""
    r = Runner()
    run_prologue(r)
    it = _identical_layers()
    allocs = sum(op[0] == "a" for op in it)
    hits = []
    for i in range(5):
        if marks:
            r.alloc.mark_step()
        before = r.plan()["plan_hits"]
        r.run(it, i, check_every=17)
        hits.append(r.plan()["plan_hits"] - before)
    ps = r.plan()
    assert hits[2:] == [allocs] * 3, hits
    assert ps["active_plan_period"] == 2 * allocs and ps["marks"] == (5 if marks else 0)
    assert r.stats()["reserved_bytes.all.peak"] <= 1.01 * r.peak_live
    check_invariants(r.alloc, r.device, r.live)


def test_the_iteration_plan_keeps_the_cursor_through_an_optimizer_loop():
    """Layers and an optimizer loop over parameter groups repeat inside the step, so detection
    first finds short periods, some wrong. A plan too small to arm is not adopted by its first
    requests, nor is one whose pass skipped many of its slots; detection keeps looking while
    only such plans match. So the iteration's plan, once found, keeps the cursor through the
    loop, arms at its cut, and serves whole steps: before, a wrong period (143 events of a
    146-event step) kept being adopted, and one request per step came from a plan."""
    layers, size = 12, 16 * MiB
    ops = _identical_layers(layers, size)
    k = next(i for i, op in enumerate(ops) if op[0] == "f" and op[1].startswith("grad"))
    loop = []
    for i in range(layers):  # the same few temporaries per parameter group
        loop += [("a", f"m{i}", size // 8, 0), ("a", f"v{i}", size // 8, 0), ("f", f"m{i}"),
                 ("f", f"v{i}")]
    it = ops[:k] + loop + ops[k:]
    r = Runner()
    run_prologue(r)
    allocs = sum(op[0] == "a" for op in it)
    hits = []
    for i in range(6):
        before = r.plan()["plan_hits"]
        r.run(it, i, check_every=17)
        hits.append(r.plan()["plan_hits"] - before)
    assert hits[2:] == [allocs] * 4, hits
    assert r.plan()["active_plan_period"] == 2 * allocs
    assert r.stats()["reserved_bytes.all.peak"] <= 1.01 * r.peak_live
    check_invariants(r.alloc, r.device, r.live)


def test_a_short_repetition_whose_blocks_outlive_it_gets_a_period_that_covers_them():
    """Ten allocations repeat every 20 events, each block freed three repetitions later. The
    shortest period (20) covers no lifetime; multiples of it are examined, not skipped as mere
    repetitions of it, so a period that covers the lifetimes (80) is found."""
    sizes = [(3 + 2 * j) * MiB + 512 * j for j in range(10)]
    ops = []
    for i in range(40):
        ops += [("a", f"b{i}_{j}", s, 0) for j, s in enumerate(sizes)]
        if i >= 3:
            ops += [("f", f"b{i - 3}_{j}") for j in range(len(sizes))]
    r = Runner()
    r.run(ops, 0, check_every=13)
    ps = r.plan()
    assert ps["plans_built"] >= 1 and ps["active_plan_period"] == 80, ps


def _first_step_makes_what_later_steps_keep(steps):
    """A run whose first step differs from the rest as in PyTorch: gradients are made once and
    then zeroed, not freed (zero_grad(set_to_none=False)), and the optimizer's state is made
    after the first backward in the image of the parameters (same sizes, same order)."""
    r = Runner()
    run_prologue(r)
    full = make_iteration(1, scale=4)
    later = [op for op in full if not op[1].startswith("grad")]
    first = [op for op in full if not (op[0] == "f" and op[1].startswith("grad"))]
    state = [("a", f"state{i}", op[2], 0) for i, op in enumerate(prologue())]
    r.run(first + state, 0)
    for key in [k for k in r.ptr if k[1].startswith(("state", "grad"))]:
        r.ptr[("persist", key[1])] = r.ptr.pop(key)
    for i in range(1, steps):
        r.run(later, i, check_every=11)
    return r, later


def _state_then_steps(policy, state=True, steps=4, seed=8, config=""):
    """A loop whose first step makes the optimizer's state (60 blocks of up to 4 MiB), so that
    the second step, with it alive, needs more than any moment before: the run's peak."""
    r = Runner(policy=policy, config=config)
    run_prologue(r)
    it = _with_small_saved(make_iteration(seed, scale=2))
    r.run(_with_optimizer_state(it, n=60, max_kib=4096) if state else it, 0)
    _keep_state(r)
    second = r.requests
    r.run(it, 1)
    hits_in_second = r.plan()["plan_hits"] if policy == POLICY else 0
    for i in range(2, steps):
        r.run(it, i)
    return r, second, hits_in_second


def test_a_plan_found_early_in_the_second_step_serves_the_rest_of_it():
    """The plan of the first step is found a match window into the second, and serves the rest
    of it, the first step with the optimizer's state, where the pool alone reaches its peak:
    the run holds its page floor, a page below pymemplan-vmm. The steady state starts with the
    third step, the first one a plan serves from its start."""
    r, second, hits = _state_then_steps(POLICY)
    pool, _, _ = _state_then_steps("pymemplan-vmm")
    ps = r.plan()
    assert ps["mid_pass_arms"] == 1
    assert hits > 0
    floor = -(-r.peak_live // (2 * MiB)) * 2 * MiB
    assert r.stats()["reserved_bytes.all.peak"] == floor
    assert pool.stats()["reserved_bytes.all.peak"] > floor
    per_step = sum(1 for op in _with_small_saved(make_iteration(8, scale=2)) if op[0] == "a")
    # The allocator counts the prologue's requests too; the Runner does not.
    assert ps["first_planned_request"] == len(prologue()) + second + per_step
    check_invariants(r.alloc, r.device, r.live)


def test_a_plan_armed_mid_pass_is_held_to_what_the_pass_needs_within_plan_slack():
    """As a plan at its cut is accepted within plan_slack of the highest live bytes, a plan armed
    mid-pass is accepted within plan_slack of what the pass needs, in whole pages. Here its
    footprint is a page above that need's page floor: with plan_slack:0 it waits for its cut and
    the pool serves the second step (as pymemplan-vmm does, 1.011 of live); with the default 1%
    it serves the rest of that step, and the run holds two pages less (1.004)."""
    r, _, hits = _state_then_steps(POLICY, seed=2)
    strict, _, strict_hits = _state_then_steps(POLICY, seed=2, config="plan_slack:0")
    pool, _, _ = _state_then_steps("pymemplan-vmm", seed=2)
    assert r.plan()["mid_pass_arms"] == 1 and hits > 0
    assert strict.plan()["mid_pass_arms"] == 0 and strict_hits == 0
    peak = r.stats()["reserved_bytes.all.peak"]
    assert peak <= 1.01 * r.peak_live
    assert peak < strict.stats()["reserved_bytes.all.peak"] == pool.stats()["reserved_bytes.all.peak"]
    check_invariants(r.alloc, r.device, r.live)


@pytest.mark.parametrize("seed,pool_mib,planned_mib", [(18, 532, 526), (362, 154, 152)])
def test_a_plan_armed_mid_pass_may_hold_over_the_need_what_the_pool_held_over_live(
        seed, pool_mib, planned_mib):
    """A plan found a little way into the second step is held within plan_slack of what the
    step needs, or within what the pool held over the live bytes when the step began, where
    that is more: the pool serving the step would hold at least as much over it. On random
    training loops 18 and 362 (benchmarks/alloc_random.py) the pool's first step ended a few
    percent over live; held to plan_slack, the plan waited and the pool served the second
    step, the run's peak (1.024 and 1.051 of live, as pymemplan-vmm); now the plan serves it
    (1.012 and 1.037)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    peaks = {}
    for policy in (POLICY, "pymemplan-vmm"):
        r = Runner(policy=policy)
        run_trace(r, random_training(seed))
        peaks[policy] = r.stats()["reserved_bytes.all.peak"]
        if policy == POLICY:
            assert r.plan()["mid_pass_arms"] == 1
    assert peaks["pymemplan-vmm"] == pool_mib * MiB
    assert peaks[POLICY] == planned_mib * MiB


def _constructor(layers=24):
    """A model's constructor: identical layers made one after another, each keeping its weights
    and a buffer and dropping the temporaries it made them from."""
    ops = []
    for i in range(layers):
        ops += [("a", f"w{i}a", MiB + 1000, 0), ("a", f"w{i}b", 3 * MiB // 4, 0)]
        for j in range(4):
            ops += [("a", f"t{i}_{j}", 3 * MiB + 17, 0), ("a", f"u{i}_{j}", MiB // 2, 0),
                    ("f", f"t{i}_{j}")]
        ops += [("a", f"m{i}", 8 * MiB, 0), ("a", f"buf{i}", 2048, 0), ("f", f"m{i}")]
        ops += [("f", f"u{i}_{j}") for j in range(4)]
    return ops


def test_a_period_whose_passes_keep_what_they_make_is_not_planned():
    """Detection finds the period of a constructor's layers, which repeat event for event, but
    each pass leaves its weights alive: the plan is not validated, and not armed (before, it
    armed at each of the layers' cuts, shifted the pool's layout and took the run to 240 MiB,
    where the pool alone holds 232). The training steps after it are served as by
    pymemplan-vmm."""
    peaks = {}
    for policy in (POLICY, "pymemplan-vmm"):
        r = Runner(policy=policy)
        r.run(_constructor(), 0)
        for key in list(r.ptr):
            r.ptr[("persist", key[1])] = r.ptr.pop(key)
        if policy == POLICY:
            ps = r.plan()
            assert ps["plans_built"] >= 1 and ps["arms"] == 0 and ps["first_planned_request"] == -1, ps
        step = make_iteration(3)
        for i in range(1, 5):
            r.run(step, i, check_every=11)
        check_invariants(r.alloc, r.device, r.live)
        peaks[policy] = r.stats()["reserved_bytes.all.peak"]
    assert peaks[POLICY] <= peaks["pymemplan-vmm"]


def test_no_plan_arms_mid_pass_where_the_pass_needs_no_more_than_the_pool_held():
    """Without new memory in the second step (no optimizer state made in the first), the plan
    found in it waits for its cut, as before: the pool has held what the step needs, and a plan
    armed mid-pass would only add driver calls."""
    r, second, hits = _state_then_steps(POLICY, state=False)
    ps = r.plan()
    assert ps["mid_pass_arms"] == 0 and hits == 0
    assert ps["arms"] >= 1
    assert ps["first_planned_request"] >= len(prologue()) + second


def test_a_plan_made_from_the_first_step_is_made_again_from_the_step_as_it_repeats():
    """The state's sizes repeat the parameters', so the first period found pairs them: its window
    holds the first step, one-off allocations included. Later passes skip those slots and match,
    but take fewer events than its period; once one has, the plan is made again from it (a
    "remake"), with the step's own period. The request that starts the next pass is served from
    the plan as made again: the arena is laid out by it from then on."""
    r, later = _first_step_makes_what_later_steps_keep(steps=5)
    ps = r.plan()
    assert ps["remakes"] == 1 and ps["active_plan_period"] == len(later), ps
    assert ps["armed"] == 1 and ps["slot_busy"] == 0, ps
    # The plan made again has the first one's blocks in the same order of allocations and
    # frees (the one-off requests between them aside): packed against the same holes, it
    # reuses the packings the first one computed (the layouts are checked as the steps run).
    assert ps["packings_reused"] >= 1, ps
    r.reset_peaks()
    hits = ps["plan_hits"]
    for i in range(5, 8):
        r.run(later, i, check_every=13)
    ps = r.plan()
    allocs = sum(op[0] == "a" for op in later)
    assert ps["plan_hits"] - hits == 3 * allocs and ps["slot_busy"] == 0 and ps["remakes"] == 1
    assert r.stats()["reserved_bytes.all.peak"] <= 1.01 * r.peak_live
    check_invariants(r.alloc, r.device, r.live)


@pytest.mark.parametrize("config", ["holes:0", ""])
def test_a_plan_is_made_again_while_a_block_it_placed_lives_across_the_cut(config):
    """A block made at the end of each step and released early in the next (a loss kept for
    logging) sits in the plan's layout when the pass ends. The plan is made again all the
    same; the block keeps its range, and every block stays apart (checked as the steps run).
    With holes, the first plan's layout starts in the free tail of a parameters' page, and
    here the layout made again is not used: packed against the holes of then (the block holds
    part of that tail), it would hold more than the pass did, and by the rule for plans made
    again the first layout serves on. The steps are served as fully either way."""
    r = Runner(config=config)
    run_prologue(r)
    base = make_iteration(2, scale=4)
    carry = ("a", "carry", 3 * MiB + 123, 0)
    state = [("a", f"state{i}", op[2], 0) for i, op in enumerate(prologue())]
    r.run(base + [carry] + state, 0)
    for key in [k for k in r.ptr if k[1].startswith("state")]:
        r.ptr[("persist", key[1])] = r.ptr.pop(key)

    def step(i):
        r.ptr[(i, "carry_old")] = r.ptr.pop((i - 1, "carry"))
        r.run(base[:1] + [("f", "carry_old")] + base[1:] + [carry], i, check_every=7)

    for i in range(1, 9):
        step(i)
    ps = r.plan()
    assert ps["remakes"] == 1, ps
    if config == "holes:0":
        assert ps["active_plan_period"] == len(base) + 2, ps
    r.reset_peaks()
    hits = ps["plan_hits"]
    for i in range(9, 13):
        step(i)
    ps = r.plan()
    assert ps["plan_hits"] - hits == 4 * (sum(op[0] == "a" for op in base) + 1) and ps["slot_busy"] == 0
    assert r.stats()["reserved_bytes.all.peak"] <= 1.01 * r.peak_live
    check_invariants(r.alloc, r.device, r.live)


@pytest.mark.parametrize("seed", [33, 160, 680])
def test_random_loops_whose_first_step_differs_reach_the_steady_state_of_their_step(seed):
    """Random training loops (benchmarks/alloc_random.py) whose first plan was made from a
    window holding the first step. Before remakes, their steady state was 1.0196, 1.0095 and
    1.0222 (seed 680 1.0806 with remakes but the first request of the next pass served from the
    old layout); now each is within a page of its page floor."""
    import sys

    from pymemplan.traces import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    planned = replay(random_training(seed), [POLICY])[0]
    page = 2 * MiB
    floor = -(-planned.steady_peak_live_bytes // page) * page
    assert planned.steady_peak_reserved_bytes <= floor + page, (
        seed, planned.steady_reserved_over_live)


@pytest.mark.parametrize("seed,bound", [(187, 1.02), (416, 1.025)])
def test_random_loops_whose_passes_pass_over_the_first_steps_slots_are_made_again(seed, bound):
    """Random training loops (benchmarks/alloc_random.py) whose first plan held planned slots of
    the first step that later passes skip: such a pass counts as passed over (a wrong period,
    perhaps), and is still made again from it. Steady state before: 1.0262 and 1.0275; now
    1.0128 and 1.0201."""
    import sys

    from pymemplan.traces import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    planned = replay(random_training(seed), [POLICY])[0]
    assert planned.steady_reserved_over_live <= bound, (seed, planned.steady_reserved_over_live)


def test_a_plan_made_again_replaces_a_layout_that_leaves_requests_to_the_pool():
    """Random training loop 341 (benchmarks/alloc_random.py): its plan arms with a footprint of
    952 MiB; the next pass, shorter than its period, makes it again (a remake), and the new
    layout, packed against the holes of then, would hold 956 MiB. A plan made again is held to
    what the old layout's pass took, and the old layout then serves on, unless that layout
    leaves requests of its passes to the pool (slots it has no offset for), as this one does:
    it would at every step, and the pool moved pages for them at each (1,820 driver calls over
    20 steps, against 1,837 over 7 for the layout made again, and none after). The new layout
    may then take the run up to its highest reserved: the steady state is 1.0052 (1.0031 with
    the old layout kept), within 1%, and the warm steps make no driver call. (Random loop 18
    showed the kept layout first: 1.0122 before the rule, 1.0084 with it; its layout made
    again now starts in the free tail of a kept page and holds no more, and serves.)"""
    import sys

    from pymemplan import _core
    from pymemplan.traces import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    short, long_ = random_training(341), random_training(341, steps=20)
    planned = replay(short, [POLICY])[0]
    assert planned.steady_reserved_over_live < 1.006, planned.steady_reserved_over_live
    # The layout made again serves with its claims taken: every invariant holds throughout.
    device = _core.SimulatedDevice(80 << 30)
    alloc = _core.Allocator(device, POLICY, "")
    replay_checked(alloc, device, short, check_every=10)
    stats = alloc.plan_stats()
    assert stats["remakes"] == 1 and stats["layouts_kept"] == 0
    assert stats["plan_hits"] > 0 and stats["armed"] == 1
    # The 13 more steps of the longer run make no driver call.
    longer = replay(long_, [POLICY])[0]
    assert longer.device_allocs + longer.device_frees == planned.device_allocs + planned.device_frees


def test_mark_step_is_ignored_by_policies_without_plans_and_never_needed():
    for policy in ("pymemplan", "pymemplan-vmm", "torch"):
        r = Runner(policy=policy)
        it = make_iteration(2)
        for i in range(3):
            r.alloc.mark_step()
            r.run(it, i)
        check_invariants(r.alloc, r.device, r.live)
    # Marks at odd places (twice in a row, mid-step) leave a planned run correct.
    r = Runner()
    it = make_iteration(3, scale=3)
    for i in range(6):
        r.alloc.mark_step()
        r.alloc.mark_step()
        r.run(it[: len(it) // 3], i)
        r.alloc.mark_step()
        r.run(it[len(it) // 3:], i, check_every=11)
    assert r.plan()["plan_hits"] > 0
    check_invariants(r.alloc, r.device, r.live)


def test_steady_state_makes_no_driver_calls():
    r = Runner()
    run_prologue(r)
    it = make_iteration(2, scale=5)
    for i in range(5):
        r.run(it, i)
    calls = (r.stats()["num_device_alloc"], r.stats()["num_device_free"])
    hits = r.plan()["plan_hits"]
    for i in range(5, 9):
        r.run(it, i)
    assert r.plan()["plan_hits"] > hits
    assert (r.stats()["num_device_alloc"], r.stats()["num_device_free"]) == calls


def test_divergence_falls_back_without_overlap_then_replans():
    r = Runner()
    run_prologue(r)
    it = make_iteration(1)
    for i in range(4):
        r.run(it, i)
    assert r.plan()["armed"] == 1
    d0 = r.plan()
    # Mid-iteration, a different shape (e.g. another sequence length): every request is checked
    # against the plan, falls back to the pool, and no two live blocks ever overlap (Runner
    # checks each new block against all live ones).
    half = it[: len(it) // 2]
    r.run(half, 4, check_every=5)
    other = make_iteration(7, layers=12, scale=0.7)
    for i in range(5, 9):
        r.run(other, i, check_every=13)
    ps = r.plan()
    assert ps["divergences"] > d0["divergences"] and ps["fallbacks"] > d0["fallbacks"]
    for key in [k for k in r.ptr if k[0] == 4]:  # the half iteration's blocks
        p = r.ptr.pop(key)
        r.alloc.free(p)
        r.live_bytes -= r.live.pop(p)
        del r.ranges[p]
    # The new shape gets a plan of its own, then the old one comes back (several plans).
    assert ps["plans"] >= 2 and ps["plan_hits"] > d0["plan_hits"]
    hits = ps["plan_hits"]
    for i in range(9, 12):
        r.run(it, i, check_every=29)
    assert r.plan()["plan_hits"] > hits
    check_invariants(r.alloc, r.device, r.live)
    # Everything returns to the device, pages included.
    for key in list(r.ptr):
        r.alloc.free(r.ptr.pop(key))
    r.live.clear()
    r.alloc.empty_cache()
    s = r.stats()
    assert s["reserved_bytes.all.current"] == 0 and r.device.used == 0
    assert r.device.mapped_pages == 0 and r.device.live_pages == 0
    assert s["allocated_bytes.all.current"] == 0 and s["active_bytes.all.current"] == 0


def test_a_plan_that_diverges_gives_its_arena_to_the_pool():
    """A new shape mid-iteration disarms the plan while its blocks are still live in the arena.
    The arena's free space then joins the pool: the pool would otherwise grow around an arena
    that best fit never searches, and the plan would have made memory worse."""
    ratio = {}
    for policy in (POLICY, "pymemplan-vmm"):
        r = Runner(policy=policy)
        run_prologue(r)
        it = make_iteration(1)
        for i in range(4):
            r.run(it, i)
        r.run(it[: len(it) // 2], 4)  # half a step: planned blocks live in the arena
        if policy == POLICY:
            assert r.plan()["armed"] == 1 and r.plan()["arena_mapped_bytes"] > 0
        r.reset_peaks()
        other = make_iteration(7, layers=12, scale=0.7)
        r.run(other[: len(other) // 2], 5, check_every=7)
        ratio[policy] = r.stats()["reserved_bytes.all.peak"] / r.peak_live
        if policy == POLICY:
            assert r.plan()["armed"] == 0 and r.plan()["arena_bytes"] == 0
        check_invariants(r.alloc, r.device, r.live)
        for key in list(r.ptr):
            r.alloc.free(r.ptr.pop(key))
        r.live.clear()
        r.alloc.empty_cache()
        assert r.stats()["reserved_bytes.all.current"] == 0 and r.device.mapped_pages == 0
    # Before the fix: 1.022 against 1.002 for the pool alone.
    assert ratio[POLICY] <= ratio["pymemplan-vmm"] + 0.01, ratio


def test_alternating_shapes_keep_several_plans():
    r = Runner()
    run_prologue(r)
    shapes = {"A": make_iteration(1), "B": make_iteration(2, layers=9, scale=1.5)}
    seq = "AABBAABBBAAB"
    for i, c in enumerate(seq):
        r.run(shapes[c], i)
    ps = r.plan()
    assert ps["plans"] >= 2
    assert ps["plan_switches"] >= 1
    hits = ps["plan_hits"]
    tail = "ABBABA"
    for i, c in enumerate(tail, start=len(seq)):
        r.run(shapes[c], i, check_every=41)
    n_allocs = sum(1 for c in tail for op in shapes[c] if op[0] == "a")
    assert r.plan()["plan_hits"] - hits >= 0.8 * n_allocs
    check_invariants(r.alloc, r.device, r.live)


def test_a_plan_recognised_by_its_first_requests_serves_them_from_its_next_pass():
    """Alternating shapes: after a step of B, the step of A is recognised by its first
    kPrefix requests, which the pool has served already, and A arms with a layout that leaves
    them out. At its cut a whole pass of A is ahead, so it arms with its whole layout: the
    next step of A is served from the plan from its first request."""
    r = Runner()
    run_prologue(r)
    a, b = make_iteration(1), make_iteration(2, layers=9, scale=1.5)
    for i, ops in enumerate([a, a, a, b, b, a]):
        r.run(ops, i)
    before = r.plan()
    assert before["plan_switches"] >= 1  # back to A, by its first requests
    hits = before["plan_hits"]
    r.run(a, 6, check_every=13)
    after = r.plan()
    assert after["full_rearms"] >= 1
    assert after["plan_hits"] - hits == sum(op[0] == "a" for op in a), (before, after)
    check_invariants(r.alloc, r.device, r.live)


def make_evaluation(seed, layers=12, scale=2.0):
    """An evaluation step: a forward pass at twice the batch that keeps nothing (each layer's
    output frees the one before it)."""
    rng = random.Random(seed)
    sizes = [int(rng.randint(2 * MiB, 24 * MiB) * scale) // 512 * 512 + rng.randint(0, 511)
             for _ in range(layers)]
    ops, prev = [("a", "x", 8 * MiB, 0)], "x"
    for i, s in enumerate(sizes):
        ops += [("a", f"y{i}", s, 0), ("a", f"t{i}", s // 3 + 700, 0), ("f", f"t{i}"), ("f", prev)]
        prev = f"y{i}"
    return ops + [("f", prev)]


@pytest.mark.parametrize("every", [4, 8])
def test_an_evaluation_every_few_steps_keeps_the_plan_of_the_training_step(every):
    """Training with an evaluation step every few steps, as most loops do. The evaluation
    diverges from the plan of the training step, which is back in step from the first request
    of the step after it and arms again there. Once, blocks an earlier plan had placed
    were still alive in the arena: they took the ranges of later blocks (slots busy, served by
    the pool), and the plan held as much as the pool alone (1.0119 of the peak of live bytes,
    with every 4 and 8); then the step's plan was replaced after each evaluation by one
    spanning it (made again, four plans built, a busy arena retired): 1.0058. Now the step's
    plan stays: 1.0058 with two plans, the step's and, once it repeats, the whole cycle's."""
    peak, runs = {}, {}
    for policy in (POLICY, "pymemplan-vmm"):
        r = runs[policy] = Runner(policy=policy)
        run_prologue(r)
        train, evaluation = make_iteration(1), make_evaluation(1)
        for i in range(6 * every):
            r.run(evaluation if i % every == every - 1 else train, i, check_every=97)
            if i == 2 * every - 1:
                r.reset_peaks()  # from the third evaluation cycle on
        peak[policy] = r.stats()["reserved_bytes.all.peak"] / r.peak_live
        check_invariants(r.alloc, r.device, r.live)
    assert peak[POLICY] <= 1.01 and peak[POLICY] < peak["pymemplan-vmm"], peak
    ps = runs[POLICY].plan()
    assert ps["slot_busy"] == 0 and ps["plans_built"] <= 2 and ps["remakes"] == 0, ps



def test_the_training_step_after_an_evaluation_is_planned_from_its_first_request():
    """An evaluation every fourth step begins at the cut of the training step's plan and
    diverges from it: the plan is left, and the pool serves the evaluation. The next training
    step starts where the plan does: the plan arms at its first request and serves every
    request of it. Before, it armed only at its next cut, and the pool served that step whole
    (on the evaluation loops of alloc_random, a step that took 112 MiB where planned ones take
    108: steady state within 1% on 192 of the 1,000 loops, now 449)."""
    r = Runner()
    run_prologue(r)
    train, evaluation = make_iteration(1), make_evaluation(1)
    allocs = sum(op[0] == "a" for op in train)
    for i in range(4):  # three training steps (the plan arms in the third), an evaluation
        r.run(evaluation if i == 3 else train, i)
    peak = []
    for i in (4, 5):  # the step after the evaluation, and one after a planned step
        before = r.plan()
        r.reset_peaks()
        r.run(train, i, check_every=13)
        after = r.plan()
        assert after["plan_hits"] - before["plan_hits"] == allocs, (i, before, after)
        assert after["fallbacks"] == before["fallbacks"], (i, before, after)
        # The step after the evaluation is the pass its first request started.
        assert after["first_request_cuts"] - before["first_request_cuts"] == (i == 4), (i, after)
        peak.append(r.stats()["reserved_bytes.all.peak"])
    assert peak[0] <= peak[1], peak
    check_invariants(r.alloc, r.device, r.live)


def test_a_training_step_after_an_evaluation_that_matched_some_slots_is_planned():
    """synthetic_periodic_eval (benchmarks/synthetic_traces.py): 32 layers, an evaluation every
    fourth step. A few of the evaluation's requests have the size of a slot of the training
    step's plan and match it, so the plan's cursor is no longer at its start when the next
    training step comes. Its first request still starts a pass, since fewer than 8 requests of
    the pass matched and what the evaluation made is freed. Before, such a step was left to the
    pool until the plan's cut: 1.0174 of the live bytes in the steady state, now 1.0061."""
    import sys

    from pymemplan.traces import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import periodic_eval

    planned, vmm = replay(periodic_eval(), [POLICY, "pymemplan-vmm"])
    assert planned.steady_reserved_over_live <= 1.01, planned.steady_reserved_over_live
    assert planned.peak_reserved_bytes <= vmm.peak_reserved_bytes

def _calls(r):
    s = r.stats()
    return s["num_device_alloc"] + s["num_device_free"]


def test_a_plan_left_mid_step_takes_its_arena_back():
    """A step that begins as the planned one does and leaves it a third into its forward pass:
    the plan disarms with its first blocks alive in the arena, and the arena is retired into
    the pool (which must not grow around free space it cannot use). Once nothing is allocated
    in it, the next arming takes it back as the arena, with the pages it kept mapped: the
    planned step after the odd one made 1,417 page maps and unmaps in a new arena, now 268."""
    step = make_iteration(5, scale=8)
    k = 12  # the odd step's first requests are the planned step's; the rest are larger
    odd = step[:k] + [(op[0], op[1], int(op[2] * 1.7) // 512 * 512, op[3]) if op[0] == "a" else op
                      for op in step[k:]]
    peaks = {}
    for policy in (POLICY, "pymemplan-vmm"):
        r = Runner(policy=policy)
        run_prologue(r)
        per = []
        for i, ops in enumerate([step] * 4 + [odd] + [step] * 4):
            before = _calls(r)
            r.run(ops, i, check_every=17)
            per.append(_calls(r) - before)
        check_invariants(r.alloc, r.device, r.live)
        peaks[policy] = r.stats()["reserved_bytes.all.peak"]
        if policy == POLICY:
            assert per[5] < 500 and per[-2:] == [0, 0], per
            ps = r.plan()
            assert ps["busy_arenas_retired"] == 1 and ps["arenas_reclaimed"] == 1, ps
            assert ps["arenas_made"] == 1, ps
    assert peaks[POLICY] <= peaks["pymemplan-vmm"], peaks


def test_shrinking_workload_gives_memory_back():
    """After a bigger shape, a smaller one that repeats: once its plan serves and the bigger
    shape's plan last served some of its periods ago, the pool's unused pages go back, so
    reserved memory follows the smaller iteration (pymemplan-vmm would keep the pages of the
    bigger one)."""
    big, small = make_iteration(5, scale=6), make_iteration(6, scale=2)
    results = {}
    for policy in (POLICY, "pymemplan-vmm"):
        r = Runner(policy=policy)
        run_prologue(r)
        for i in range(3):
            r.run(big, i)
        # Its plan is made and arms; the pages kept for the bigger shape go back once that
        # has not run for 16 of its periods (where shapes take turns, they would be mapped
        # again at its next step).
        for i in range(3, 21):
            r.run(small, i)
        r.reset_peaks()
        for i in range(21, 24):
            r.run(small, i, check_every=31)
        results[policy] = r.stats()["reserved_bytes.all.peak"] / r.peak_live
        check_invariants(r.alloc, r.device, r.live)
    assert results[POLICY] <= 1.01, results
    assert results["pymemplan-vmm"] > 1.5, results


def _long_random_run(seed):
    """Random training loop `seed` of benchmarks/alloc_random.py run for 40 steps: the plans
    call the driver no more than pymemplan-vmm over the second half, never hold more, and hold
    the steady state within 1%. Returns the trace."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    trace = random_training(seed, steps=40)
    res = {policy: _core.replay(trace.action, trace.ptr, trace.size, trace.stream, policy, "",
                                80 << 30, 2 * MiB, len(trace) // 2)
           for policy in (POLICY, "pymemplan-vmm")}
    late = {k: r["steady_device_allocs"] + r["steady_device_frees"] for k, r in res.items()}
    planned, vmm = res[POLICY], res["pymemplan-vmm"]
    assert late[POLICY] <= late["pymemplan-vmm"], late
    assert planned["peak_reserved_bytes"] <= vmm["peak_reserved_bytes"]
    assert planned["steady_peak_reserved_bytes"] <= 1.01 * planned["steady_peak_live_bytes"]
    return trace


def test_plans_that_take_turns_keep_their_pages_mapped():
    """Batch sizes drawn at random from three, over 40 steps (a random training loop of
    benchmarks/alloc_random.py, run longer): each size's plan, as it armed, gave back the pages
    the others' steps had mapped, and the next step of another size mapped them again, 400 to
    800 pages at a time: 10,010 page maps and unmaps over the second half, against 2,156 for
    pymemplan-vmm. An arming now keeps mapped what plans that served lately took (754; 1,230
    since plans recognised by their first requests arm at the largest size's steps too, each
    change of size moving 30 to 110 pages), at the same peak and steady state."""
    _long_random_run(15)


def test_a_plan_armed_again_keeps_the_pages_of_the_holes_it_fills():
    """Evaluation loop 84 of benchmarks/alloc_random.py: the training step's plan places most
    of its blocks in the free parts of the pool's pages (holes), and arms again after each
    evaluation. Each arming gave back every unused page, those inside its holes too, and its
    pass mapped them again: 3,112 page maps and unmaps over the second half, about what
    pymemplan-vmm makes (3,168). A plan that served before now keeps them, as far as its last
    pass went: 2,192, at the same peak and steady state."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import evaluation_loop

    trace = evaluation_loop(84)
    res = {policy: _core.replay(trace.action, trace.ptr, trace.size, trace.stream, policy, "",
                                80 << 30, 2 * MiB, len(trace) // 2)
           for policy in (POLICY, "pymemplan-vmm")}
    late = {k: r["steady_device_allocs"] + r["steady_device_frees"] for k, r in res.items()}
    assert late[POLICY] <= 0.8 * late["pymemplan-vmm"], late
    assert res[POLICY]["peak_reserved_bytes"] == 938 * MiB
    assert res[POLICY]["steady_peak_reserved_bytes"] == 934 * MiB


def test_plans_that_take_turns_reuse_the_packings_of_their_earlier_armings():
    """Batch sizes drawn at random from three, over 40 steps (random training loop 9 of
    benchmarks/alloc_random.py, run longer): a plan arms at most steps of its size, packed
    against the holes the other sizes' steps left, which are often holes it met at an earlier
    arming. Those packings are kept and reused: with the four most recent kept, none was (three
    plans, two packings an arming with pages to share); now up to 64, within 65,536 blocks."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    r = Runner()
    run_trace(r, random_training(9, steps=40))
    ps = r.plan()
    assert ps["arms"] >= 20, ps
    assert ps["packings_reused"] >= ps["arms"] // 2, ps  # 48 for 42 armings


def test_a_window_every_step_shares_waits_for_the_requests_that_tell_the_steps_apart():
    """Batch sizes drawn at random from three, over 40 steps (random training loop 1 of
    benchmarks/alloc_random.py, run longer). Detection ran at a point every step shares (the
    end of a step, the fixed-size start of the next): its candidates one, two and three steps
    back covered their bytes alike, and the longest won, a plan of several steps in an order
    that did not come again. Adopted at each step of its first size, it diverged at the next:
    18,766 page maps and unmaps over the second half, against 5,784 for pymemplan-vmm. Such
    candidates are now a tie, narrowed by the requests that follow: those of the new step
    leave the candidates of its size, and the plan made is one step of that size."""
    trace = _long_random_run(1)

    r = Runner()
    run_trace(r, trace)
    assert r.plan()["detection_ties"] >= 1


def test_a_plan_recognised_by_its_first_requests_counts_what_they_free_before_its_peak():
    """Batch sizes drawn at random from three, over 40 steps (random training loop 9 of
    benchmarks/alloc_random.py, run longer; Adam, whose gradients peak at the end of the
    step). Each step's plan is recognised by its first requests, which the pool has served,
    and arms with a layout that leaves them out. Their blocks were counted as held for good,
    though the step's first activations are freed before its peak: the largest size's plan,
    weighed at 16,987 MB against a pool that held 16,813, was refused at every step, the pool
    served those steps, and the next planned step mapped back the arena pages they took:
    78,249 page maps and unmaps over the second half, against 26,270 for pymemplan-vmm."""
    trace = _long_random_run(9)

    r = Runner()
    half = len(trace) // 2
    live = run_trace(r, trace, stop=half)
    hits = r.plan()["plan_hits"]
    run_trace(r, trace, live, start=half)
    requests = int((trace.action[half:] == 0).sum())
    # Every size's plan serves its steps (73% of the requests before).
    assert r.plan()["plan_hits"] - hits >= 0.9 * requests


def test_a_plan_armed_mid_pass_counts_what_the_pass_frees_before_its_peak_as_a_recognised_one_does():
    """Random training loop 68 of benchmarks/alloc_random.py (2.3 GB live). The plan found in
    the second step arms for the rest of it (arm_mid_pass), leaving the requests the pool served
    since its cut out of its layout; their blocks freed before the step's peak were counted as
    held for good, and the plan, 23 MB over what it may take, was refused: the pool served the
    step at the peak pymemplan-vmm has (1.0134 of live). Counted as a recognised plan's are,
    the plan serves it (1.0065)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    trace = random_training(68)
    r = Runner()
    run_trace(r, trace)
    assert r.plan()["mid_pass_arms"] >= 1
    peak = r.alloc.stats()["reserved_bytes.all.peak"]
    vmm = _core.replay(trace.action, trace.ptr, trace.size, trace.stream, "pymemplan-vmm", "",
                       80 << 30, 2 * MiB, -1)
    assert peak <= 1.008 * vmm["peak_live_bytes"] < vmm["peak_reserved_bytes"], (peak, vmm)


def test_a_recognised_plan_leaves_uncounted_only_whole_pages_its_first_blocks_free():
    """Evaluation loop 988 of benchmarks/alloc_random.py (195 MiB live). What a plan recognised
    by its first requests does not count as held is the whole pages inside those of their
    blocks that its pass frees before its peak. Counted in bytes, the blocks of a few MiB that
    share pages with others made the plan's footprint three pages too low: it was accepted,
    went past the pool's peak (1.024 of live, against 1.003 for pymemplan-vmm) and was
    dropped with that peak kept."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import evaluation_loop

    trace = evaluation_loop(988)
    peak = {policy: _core.replay(trace.action, trace.ptr, trace.size, trace.stream, policy, "",
                                 80 << 30, 2 * MiB, -1)["peak_reserved_bytes"]
            for policy in (POLICY, "pymemplan-vmm")}
    assert peak[POLICY] <= peak["pymemplan-vmm"], peak


def test_steps_the_pool_serves_between_planned_ones_keep_their_pages_mapped():
    """Batch sizes drawn at random from three over 60 steps (random training loop 5 of
    benchmarks/alloc_random.py, run longer): the plans of the smaller sizes serve, the pool
    serves the largest. Each arming of a smaller size's plan gave back what the pool had
    mapped for the largest size's steps (1,048 MiB held down to 894), and the next such step
    mapped it again: 27,894 page maps and unmaps over the run, against 6,197 for
    pymemplan-vmm. An arming now keeps mapped what the steps between passes of plans had live,
    as it keeps what plans that served lately took."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    trace = random_training(5, steps=60)
    r = Runner()
    live = {}
    low = high = None
    half = len(trace) // 2
    for i, (a, ptr, n, st) in enumerate(zip(trace.action.tolist(), trace.ptr.tolist(),
                                            trace.size.tolist(), trace.stream.tolist())):
        if a == 0:
            live[ptr] = r.alloc.malloc(n, st)
        else:
            r.alloc.free(live.pop(ptr))
        if i >= half:
            reserved = r.alloc.stats()["reserved_bytes.all.current"]
            low = reserved if low is None else min(low, reserved)
            high = reserved if high is None else max(high, reserved)
    assert r.plan()["plan_hits"] > 0
    # Over the second half only the pool's slack above the live bytes goes back (7 pages).
    assert low >= 0.97 * high, (low / MiB, high / MiB)
    vmm = _core.replay(trace.action, trace.ptr, trace.size, trace.stream, "pymemplan-vmm", "",
                       80 << 30, 2 * MiB, -1)
    assert r.alloc.stats()["reserved_bytes.all.peak"] <= vmm["peak_reserved_bytes"]


def test_the_arena_is_a_virtual_segment_of_the_pool():
    r = Runner()
    run_prologue(r)
    it = make_iteration(3)
    for i in range(5):
        r.run(it, i)
    # Mid-iteration: some planned blocks are live.
    r.run(it[: len(it) // 2], 99)
    check_invariants(r.alloc, r.device, r.live)
    ps = r.plan()
    assert ps["arena_bytes"] > 0 and ps["arena_mapped_bytes"] > 0
    # Pages are mapped only where the plan placed blocks: at most the packed arena, rounded up.
    assert ps["arena_mapped_bytes"] <= ps["plan_arena_bytes"] + 2 * MiB
    arena = [s for s in r.alloc.snapshot()["segments"]
             if s["total_size"] == ps["arena_bytes"] and s["mapped_size"] == ps["arena_mapped_bytes"]]
    assert arena and arena[0]["is_expandable"]
    assert any(b["state"] == "active_allocated" for b in arena[0]["blocks"])


def test_classic_variant_without_virtual_memory():
    r = Runner(config="vmm:False")
    run_prologue(r)
    it = make_iteration(4, scale=3)
    for i in range(6):
        r.run(it, i, check_every=23)
    ps = r.plan()
    assert ps["plan_hits"] > 0
    snap = r.alloc.snapshot()["segments"]
    assert snap and not any(s["is_expandable"] for s in snap)
    check_invariants(r.alloc, r.device, r.live)


def test_memory_limit_counts_the_arena():
    r = Runner()
    run_prologue(r)
    it = make_iteration(4)
    for i in range(5):
        r.run(it, i)
    limit = r.stats()["reserved_bytes.all.peak"]
    r.alloc.set_memory_limit(limit)
    for i in range(5, 8):
        r.run(it, i, check_every=50)
    assert r.stats()["reserved_bytes.all.current"] <= limit
    check_invariants(r.alloc, r.device, r.live, limit=limit)


def test_cross_stream_reuse_of_planned_slots_waits_for_events():
    """Iterations on two streams with events completing only when told: a slot freed on one
    stream (or after record_stream) is not handed to another stream before the owner's work is
    seen complete."""
    r = Runner(auto=False)
    freed = []  # (lo, hi, owner, uses, record count at free)
    it = []
    rng = random.Random(11)
    for i in range(30):
        s = rng.randint(1, 6) * MiB + 512
        it.append(("a", f"x{i}", s, i % 2))
        if i >= 2:
            it.append(("f", f"x{i - 2}"))
    it += [("f", "x28"), ("f", "x29")]
    uses = {}
    for n_it in range(8):
        for op in it:
            if op[0] == "a":
                _, key, size, stream = op
                p = r.alloc.malloc(size, stream)
                keep = []
                for (lo, hi, owner, u, t) in freed:
                    if lo < p + size and p < hi:
                        for v in u | ({owner} - {stream}):
                            assert r.device.completed_through(v) > t, "unsafe cross-stream reuse"
                    else:
                        keep.append((lo, hi, owner, u, t))
                freed = keep
                r.ptr[(n_it, key)] = (p, size, stream)
                if rng.random() < 0.2:
                    other = 1 - stream
                    r.alloc.record_stream(p, other)
                    uses[p] = {other}
            else:
                p, size, stream = r.ptr.pop((n_it, op[1]))
                t = r.device.record_count
                r.alloc.free(p)
                freed.append((p, p + size, stream, uses.pop(p, set()), t))
            if rng.random() < 0.3:
                r.device.complete_events(rng.choice([0, 1]))
    assert r.plan()["plan_hits"] > 0


# ---------------------------------------------------------------------------------------------
# Property-based: repeated random iterations with injected divergences

@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), iterations=st.integers(4, 8),
       diverge=st.lists(st.integers(0, 7), max_size=3), limit_mib=st.sampled_from([0, 0, 900]))
def test_random_loops_with_divergences_keep_every_invariant(seed, iterations, diverge, limit_mib):
    r = Runner(config="min_period:8,match_window:16", capacity=2 << 30)
    limit = limit_mib * MiB
    if limit:
        r.alloc.set_memory_limit(limit)
    rng = random.Random(seed)
    base = make_iteration(seed, layers=rng.randint(2, 6), scale=rng.choice([0.05, 0.3, 1.0]))
    try:
        for i in range(iterations):
            ops = base
            if i in diverge:
                ops = make_iteration(seed + 1000 + i, layers=rng.randint(2, 6), scale=0.2)
            r.run(ops, i, check_every=7)
            check_invariants(r.alloc, r.device, r.live, limit=limit)
    except _core.OutOfMemoryError:
        pass  # a limit can refuse requests; state must still be consistent
    check_invariants(r.alloc, r.device, r.live, limit=limit)
    for key in list(r.ptr):
        p = r.ptr.pop(key)
        r.alloc.free(p)
        del r.live[p]
    r.alloc.empty_cache()
    check_invariants(r.alloc, r.device, {}, limit=limit)
    assert r.stats()["reserved_bytes.all.current"] == 0 and r.device.used == 0


# ---------------------------------------------------------------------------------------------
# Recorded traces

def _recorded_traces():
    bench = sorted(glob.glob(str(ROOT / "benchmarks" / "traces" / "*.csv.gz")))
    small = sorted(glob.glob(str(ROOT / "tests" / "data" / "*.csv.gz")))
    return bench or small


def test_recorded_traces_never_above_torch():
    from pymemplan.traces import read_trace, replay

    paths = _recorded_traces()
    assert paths, "no traces found: the test would pass on nothing"
    for path in paths:
        trace = read_trace(path)
        res = {r.policy: r for r in replay(trace, [POLICY, "torch"])}
        planned, torch = res[POLICY], res["torch"]
        assert planned.ooms == 0
        assert planned.peak_reserved_bytes <= torch.peak_reserved_bytes, Path(path).name


def test_a_tensor_kept_each_step_that_the_plan_lacks_leaves_the_plan_in_step():
    """A loss kept for logging (512 B, one per step, never freed) is a request the step's plan
    has no slot for, and its size is that of later small slots. Taken as a sign that the slots
    before such a slot were missing, it moved the cursor past the step's next blocks, the pass
    fell out of step, and the steady state rose from 1.001 to 1.004 of live (a page) on this
    GPT-2 trace; 1.004 -> 1.020 on vit_b_16."""
    from pymemplan.traces import read_trace, replay
    from pymemplan.traces.trace import ALLOC, Trace

    trace = read_trace(ROOT / "tests" / "data" / "gpt2_6l_s512.csv.gz")
    alloc = _core.Allocator(_core.SimulatedDevice(80 << 30), POLICY)
    live = {}
    for a, p, s, stream in zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
                               trace.stream.tolist()):
        if a == ALLOC:
            live[p] = alloc.malloc(s, stream)
        else:
            alloc.free(live.pop(p))
    period = int(alloc.plan_stats()["active_plan_period"])
    assert period > 0
    rows = list(zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
                    trace.stream.tolist(), trace.time.tolist()))
    logged, extra = [], max(trace.ptr.tolist()) + 1
    for i, row in enumerate(rows):
        logged.append(row)
        if i > 0 and i % period == 0:
            logged.append((ALLOC, extra, 512, 0, row[4]))
            extra += 1
    with_log = Trace.from_events(logged, name="gpt2_6l_s512 with a logged loss")

    def steady(t):
        r = replay(t, [POLICY], capacity="80GiB")[0]
        assert r.steady_peak_live_bytes, "no plan served"
        return r.steady_peak_reserved_bytes / r.steady_peak_live_bytes

    plain, logging = steady(trace), steady(with_log)
    assert plain < 1.002
    assert logging < 1.002, (plain, logging)


def test_a_request_the_layers_lack_does_not_make_detection_plan_many_layers_at_once():
    """A loss logged on the GPU in the middle of repeated layers: candidates for the period
    now span that request, none is confirmed, and each covers every byte but its 512 B, a
    larger share the longer it is. The longest won (20 layers and the request, 801 events),
    and detection then slept for half of it; at a step's start that lost the first step's
    plan for the second (mamba_4l 1.010 -> 1.040 of live over the whole trace). A longer
    candidate that leaves the same bytes uncovered covers nothing more: one layer and the
    request are planned, then the layer again."""
    alloc = _core.Allocator(_core.SimulatedDevice(80 << 30), POLICY)
    alloc.malloc(64 * MiB, 0)  # weights

    def layer():  # 40 events
        kept = alloc.malloc(MiB, 0)
        for k in range(19):
            alloc.free(alloc.malloc((k + 1) * 64 * 1024, 0))
        alloc.free(kept)

    for _ in range(20):
        layer()
    assert alloc.plan_stats()["active_plan_period"] == 40
    alloc.malloc(4, 0)  # the logged loss, kept
    periods = []
    for _ in range(10):
        layer()
        periods.append(int(alloc.plan_stats()["active_plan_period"]))
    assert max(periods) <= 41, periods
    assert periods[-1] == 40, periods


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6))
def test_random_training_loops_never_above_torch_and_plans_cost_at_most_their_slack(seed):
    """Training loops drawn at random (benchmarks/alloc_random.py draws 200): the vmm policies
    hold no more than PyTorch's allocator, and a plan at most what the pool alone holds, or
    its plan_slack (1%) over the live bytes, give or take two pages of layout."""
    import sys

    from pymemplan.traces import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import random_training

    trace = random_training(seed)
    res = {r.policy: r for r in replay(trace, [POLICY, "pymemplan-vmm", "torch"])}
    live = res["torch"].peak_live_bytes
    vmm, planned, torch = (res[k].peak_reserved_bytes for k in ("pymemplan-vmm", POLICY, "torch"))
    assert all(r.ooms == 0 for r in res.values())
    assert vmm <= torch and planned <= torch, (seed, vmm / live, planned / live, torch / live)
    assert planned <= max(vmm, 1.01 * live) + 4 * MiB, (seed, vmm / live, planned / live)


@pytest.mark.parametrize("seed", [4, 72, 89, 146, 226, 467, 561])
def test_random_loops_with_an_evaluation_every_few_steps_cost_at_most_the_plan_slack(seed):
    """Evaluation loops drawn at random (benchmarks/synthetic_traces.py evaluation_loop): a
    plan holds at most what the pool alone holds, or its plan_slack (1%) over the live bytes,
    give or take two pages. Seeds 89 and 146 were 5.5 and 6 MiB over before plans armed by
    their first requests armed whole at their cut; seeds 4 and 72 (a 52 MiB workload at 1.20
    of live) were 6 and 8 MiB over before a plan left mid-iteration gave its busy arena to the
    pool; seeds 226, 467 and 561 were 7.9, 8 and 6.5 MiB over before a plan back in step
    after an evaluation stopped detection."""
    import sys

    from pymemplan.traces import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import evaluation_loop

    res = {r.policy: r for r in replay(evaluation_loop(seed), [POLICY, "pymemplan-vmm", "torch"])}
    live = res["torch"].peak_live_bytes
    vmm, planned, torch = (res[k].peak_reserved_bytes for k in ("pymemplan-vmm", POLICY, "torch"))
    assert all(r.ooms == 0 for r in res.values())
    assert vmm <= torch and planned <= torch, (seed, vmm / live, planned / live, torch / live)
    assert planned <= max(vmm, 1.01 * live) + 4 * MiB, (seed, vmm / live, planned / live)


def test_a_plan_back_in_step_after_an_evaluation_is_not_replaced_by_one_spanning_it():
    """Evaluation loop 554 (benchmarks/synthetic_traces.py): 15 layers, an evaluation every 8
    steps. After the first evaluation the training plan is back in step from its first
    requests, but detection, woken by the divergence, found a "period" from the end of the
    step before the evaluation to the same point of the step after it: it spans the
    evaluation, which had happened once. That plan replaced the training plan, diverged at
    once, and the pool served a step around its retired arena: 180 MiB against 172 for the
    pool alone. A validated plan back in step from its start stops detection."""
    import sys

    from pymemplan import _core
    from pymemplan.traces import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_traces import evaluation_loop

    trace = evaluation_loop(554)
    planned, vmm = replay(trace, [POLICY, "pymemplan-vmm"])
    assert planned.peak_reserved_bytes <= vmm.peak_reserved_bytes, (
        planned.reserved_over_live, vmm.reserved_over_live)
    alloc = _core.Allocator(_core.SimulatedDevice(80 << 30), POLICY, "")
    ptr = {}
    for a, p, n, st in zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
                           trace.stream.tolist()):
        if a == 0:
            ptr[p] = alloc.malloc(n, st)
        else:
            alloc.free(ptr.pop(p))
    stats = alloc.plan_stats()
    # The step's plan, then the whole cycle's (7 steps and the evaluation) once it repeats.
    assert stats["plans_built"] == 2 and stats["remakes"] == 0, stats
    assert stats["busy_arenas_retired"] == 0, stats


def test_threads_share_one_allocator():
    """The allocator releases the GIL in malloc/free: threads running their own loops hit its
    one mutex concurrently; the state stays consistent."""
    import threading

    r = Runner(capacity=16 << 30)
    errors = []

    def worker(t):
        try:
            it = make_iteration(t, layers=4, scale=0.1, stream=t % 2)
            for i in range(6):
                ptrs = {}
                for op in it:
                    if op[0] == "a":
                        ptrs[op[1]] = r.alloc.malloc(op[2], op[3])
                    else:
                        r.alloc.free(ptrs.pop(op[1]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    r.alloc.empty_cache()
    check_invariants(r.alloc, r.device, {})
    assert r.stats()["reserved_bytes.all.current"] == 0 and r.device.used == 0


def test_recorded_benchmark_traces_steady_state():
    """From the first request a plan served, peak reserved over peak live. Measured on the
    shipped GPT-2 trace (6 layers, sequence 512): 1.0018 (pymemplan-vmm 1.0042; both within 1%)."""
    from pymemplan.traces import read_trace, replay

    # A recorded GPT-2 (6 layers, sequence 512) training run ships in tests/data; the
    # benchmark's BERT trace is checked when it has been recorded.
    paths = [ROOT / "tests" / "data" / "gpt2_6l_s512.csv.gz"]
    paths += [p for p in [ROOT / "benchmarks" / "traces" / "bert_base.csv.gz"] if p.exists()]
    for path in paths:
        res = {r.policy: r for r in replay(read_trace(path), [POLICY, "pymemplan-vmm", "torch"])}
        planned = res[POLICY]
        assert planned.steady_reserved_over_live is not None, path.name
        assert planned.steady_reserved_over_live <= 1.01, (path.name, planned.steady_reserved_over_live)
        assert planned.reserved_over_live <= 1.03
        assert planned.peak_reserved_bytes <= res["torch"].peak_reserved_bytes


def test_plan_blocks_are_exported_for_the_packer():
    r = Runner()
    it = make_iteration(8)
    for i in range(4):
        r.run(it, i)
    b = r.alloc.plan_blocks()
    assert b["period"] > 0 and len(b["start"]) == len(b["life"]) == len(b["size"]) > 0
    res = _core.pack_blocks(b["start"], b["life"], b["size"], b["period"])
    _check_packing(b["start"], b["life"], b["size"], b["period"], res)


# ---------------------------------------------------------------------------------------------
# The real CUDA code path (CudaDevice over the fake driver, virtual memory included)

def test_planned_policy_over_the_fake_driver_with_faults():
    """Iterations through the plugin: every block is filled with its own byte and checked before
    it is freed (two live blocks sharing memory would corrupt each other), the plan arms, then
    page creation fails mid-run: requests fail cleanly (NULL), nothing leaks, and it recovers."""
    from test_plugin import FAKE, PLUGIN, ok

    if not (PLUGIN.exists() and FAKE.exists()):
        pytest.skip("plugin or fake driver not built")
    ok("""
        import random
        rng = random.Random(4)
        sizes = [rng.randint(1, 6 * MiB) for _ in range(12)]
        def iteration(tag):
            held, failed = [], 0
            for i, n in enumerate(sizes):
                p = alloc(n)
                if not p:
                    failed += 1
                    continue
                ctypes.memset(p, (tag + i) % 251, n)
                held.append((p, n, (tag + i) % 251))
                if i % 3 == 2:                    # a temporary: checked and freed at once
                    q, m, v = held.pop()
                    assert ctypes.string_at(q, m) == bytes([v]) * m, "memory shared by two blocks"
                    free(q)
            for q, m, v in reversed(held):
                assert ctypes.string_at(q, m) == bytes([v]) * m, "memory shared by two blocks"
                free(q)
            return failed
        for t in range(10):
            assert iteration(t) == 0, err()
        s = stats()
        assert s["allocated_bytes.all.current"] == 0
        reserved = s["reserved_bytes.all.current"]
        assert fake.fakecuda_bytes_in_use(0) == reserved > 0
        lib.pymemplan_empty_cache(0)
        fake.fakecuda_fail_alloc_error(1)        # CUDA_ERROR_INVALID_VALUE: a driver failure
        fake.fakecuda_fail_create_at(3)          # ... of the third page created from now on
        assert iteration(10) == 1 and "CUDA_ERROR_INVALID_VALUE" in err()
        fake.fakecuda_set_capacity(16 * MiB)     # and then too little memory
        assert iteration(11) >= 1 and "out of memory" in err()
        fake.fakecuda_set_capacity(256 * MiB)
        for t in range(12, 20):
            assert iteration(t) == 0, err()
        assert stats()["allocated_bytes.all.current"] == 0
        assert lib.pymemplan_empty_cache(0) == 0
        assert fake.fakecuda_bytes_in_use(0) == 0 and stats()["reserved_bytes.all.current"] == 0
        assert fake.fakecuda_live_handles(0) == 0 and fake.fakecuda_live_mappings() == 0
    """, policy=POLICY, config="oom_action:null,min_period:8,match_window:8")


@pytest.mark.parametrize("seed,streams,limit", [(15, 1, 0), (12, 3, 0), (13, 3, 1 << 30),
                                                (14, 3, 64 << 20)])
def test_periodic_fuzz_serves_arena_and_holes_without_a_violation(seed, streams, limit):
    """The C++ fuzzer's periodic mode: training-like programs with divergences, alternating
    shapes, blocks outside the programs (they keep pages mapped: holes), record_stream, events
    completing late, empty_cache and a memory limit (a tight one makes the pool take back
    the plan's claimed holes before it fails). Every invariant is checked as it runs (it
    raises on a violation); the long runs are benchmarks/fuzz_allocator.py's."""
    r = _core.fuzz(30000, seed, POLICY, "", 4 << 30, limit, streams, True, 1000, True)
    assert r["mallocs"] - r["ooms"] == r["frees"] > 0  # all freed at the end
    assert r["plan_hits"] > 0 and r["plan_hole_hits"] > 0, r
    # Plans armed by their first requests then armed whole, and arenas retired into the pool
    # with live blocks and taken back as the arena later, happened under the checks too.
    assert r["plan_full_rearms"] > 0 and r["plan_busy_arenas_retired"] > 0, r
    assert r["plan_arenas_reclaimed"] > 0, r
    if streams == 3:  # and passes started by a plan's first request after a divergence at its cut
        assert r["plan_first_request_cuts"] > 0, r


def test_holes_over_the_fake_driver_keep_every_block_intact():
    """The hole scenario (optimizer state left on the first iteration's pages) through the
    plugin over the fake CUDA driver, whose memory is real: every block is filled with its own
    byte and checked before it is freed, the state at the very end, so a block served in a
    hole that overlapped anything would show. The same requests on the simulated device are
    served partly in holes."""
    from test_plugin import FAKE, PLUGIN, ok

    it = _with_small_saved(make_iteration(3, scale=0.5))
    steps = [_with_optimizer_state(it, n=40, max_kib=300)] + [it] * 9
    r = Runner()
    for i, ops in enumerate(steps):
        r.run(ops, i)
        _keep_state(r)
    assert r.plan()["hole_hits"] > 0

    if not (PLUGIN.exists() and FAKE.exists()):
        pytest.skip("plugin or fake driver not built")
    ok(f"""
        steps = {steps!r}
        live, kept = {{}}, {{}}
        for t, ops in enumerate(steps):
            for j, op in enumerate(ops):
                if op[0] == "a":
                    _, key, n, _stream = op
                    p = alloc(n)
                    assert p, err()
                    v = (7 * t + j) % 251
                    ctypes.memset(p, v, n)
                    (kept if key.startswith("state") else live)[key] = (p, n, v)
                else:
                    p, n, v = live.pop(op[1])
                    assert ctypes.string_at(p, n) == bytes([v]) * n, "memory shared by two blocks"
                    free(p)
        assert not live
        for p, n, v in kept.values():
            assert ctypes.string_at(p, n) == bytes([v]) * n, "optimizer state overwritten"
            free(p)
        assert stats()["allocated_bytes.all.current"] == 0
        assert lib.pymemplan_empty_cache(0) == 0
        assert fake.fakecuda_bytes_in_use(0) == 0 and fake.fakecuda_live_mappings() == 0
    """, policy=POLICY, config="oom_action:null", FAKECUDA_CAPACITY=str(2 << 30))


def test_without_virtual_memory_a_plan_is_held_to_what_the_pool_reached_alone():
    # tests/data/random_loop_novmm.csv.gz, a random training loop found by a red-team
    # search. Without virtual memory each arena is a segment of its own beside the pool's;
    # plans were accepted against the highest reserved so far, which counted the earlier
    # arenas, and that limit rose with each arming: 1.51 of live, where the pool alone
    # holds 1.001. Now every arming is held to what the pool reached with no arena. The
    # pool still grows beside an armed plan that mostly falls back (1.26 of live here:
    # what is left to do for vmm:False).
    from pymemplan.traces import read_trace
    from pymemplan.traces.replay import replay

    trace = read_trace(Path(__file__).parent / "data" / "random_loop_novmm.csv.gz")
    pool, planned = replay(trace, ["pymemplan", "pymemplan-planned=vmm:False"])
    assert pool.reserved_over_live < 1.002
    assert planned.reserved_over_live < 1.3


def test_a_refused_plan_leaves_the_pool_as_it_was():
    # tests/data/sgd_plain_cnn.csv.gz (a red-team recording: a VGG-like CNN, plain SGD,
    # five identical steps): every plan of its steps is refused (its packing needs more than
    # the pool holds). Arming gave the pool's unused pages back before it weighed the plan,
    # refused or not, and the next step mapped them again: 782 page maps and unmaps where
    # pymemplan-vmm makes 238, at the same peak. A plan is now weighed as if the pool were
    # trimmed, and the pool trimmed only for a plan that is used.
    import sys

    from pymemplan.traces import read_trace
    from pymemplan.traces.replay import replay

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from alloc_replay import plan_figures

    trace = read_trace(Path(__file__).parent / "data" / "sgd_plain_cnn.csv.gz")
    stats = plan_figures(trace)
    assert stats["arm_refusals"] > 0 and stats["arms"] == 0
    vmm, planned = replay(trace, ["pymemplan-vmm", "pymemplan-planned"])
    assert planned.peak_reserved_bytes == vmm.peak_reserved_bytes
    assert (planned.device_allocs, planned.device_frees) == (vmm.device_allocs, vmm.device_frees)


def test_the_largest_failing_capacity_is_found_where_failing_is_not_monotone(monkeypatch):
    # PyTorch's allocator model ran a red-team's diffusion UNet at 420-428 MiB and failed at
    # 430 (its cache is freed and retried at other moments); the bisection reported 418.
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import alloc_replay
    from pymemplan.traces import read_trace

    fails_at = {416, 418, 430}
    monkeypatch.setattr(_core, "replay", lambda *a, **k: {"ooms": int(a[6] // MiB in fails_at)})
    trace = read_trace(ROOT / "tests" / "data" / "mlp_adam.csv.gz")
    assert alloc_replay.oom_capacity(trace, "torch", 416 * MiB, 440 * MiB) == 430 * MiB
    fails_at = {416, 418}
    assert alloc_replay.oom_capacity(trace, "torch", 416 * MiB, 440 * MiB) == 418 * MiB
    assert alloc_replay.oom_capacity(trace, "torch", 420 * MiB, 440 * MiB) is None


def test_pages_over_a_target_counts_the_pages_a_peak_must_lose():
    # The benchmark reports how far a miss is, in 2 MiB pages: on a small workload one page
    # can be most of the margin.
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import alloc_replay

    # 3% of 100 MiB allows 103 MiB, so at most 102 MiB in whole pages.
    assert alloc_replay.pages_over(102 * MiB, 100 * MiB, 1.03) == 0
    assert alloc_replay.pages_over(104 * MiB, 100 * MiB, 1.03) == 1
    assert alloc_replay.pages_over(106 * MiB, 100 * MiB, 1.03) == 2
    assert alloc_replay.pages_over(105 * MiB, 100 * MiB, 1.03) == 2  # a partial page counts
    # 1% over 59.9 MiB allows 60.5 MiB, 60 in whole pages: 62 MiB is a page over.
    assert alloc_replay.pages_over(62 * MiB, int(59.9 * MiB), 1.01) == 1
    assert alloc_replay.pages_over(90 * MiB, 100 * MiB, 1.03) == 0
    assert alloc_replay.pages_over(2 * MiB, 0, 1.03) is None


def test_the_planning_scaling_benchmark_measures_a_recorded_deep_model(tmp_path, monkeypatch):
    """benchmarks/plan_scaling.py on a 2-layer model: a plan is made and armed, its blocks
    counted, the planning time measured, and the steady state no worse than the pool alone."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import plan_scaling

    monkeypatch.setattr(plan_scaling, "TRACE_DIR", tmp_path)
    trace = plan_scaling.record_deep_gpt2(2, tmp_path / "deep_gpt2_2.csv.gz")
    row = plan_scaling.measure(trace)
    assert row["plan_blocks"] > 100 and row["arms"] >= 1 and row["planning_seconds"] > 0
    assert row["pack_blocks_ratio"] >= 1.0
    assert row["planned_steady_reserved_over_live"] <= row["vmm_reserved_over_live"]
    rows = [{"plan_blocks": 1000, "t": 0.5}, {"plan_blocks": 4000, "t": 8.0}]
    assert plan_scaling.growth(rows, "t") == pytest.approx(2.0)
    # A loop whose batch sizes take turns: its plans arm again and again, and reuse packings.
    turns = plan_scaling.measure_turns(plan_scaling.turns_trace(9, steps=24))
    assert turns["plans"] >= 2 and turns["arms"] >= 4 and turns["planning_seconds"] > 0, turns
    assert turns["packings_reused"] >= 1, turns
    assert turns["planned_reserved_over_live"] <= turns["vmm_reserved_over_live"], turns



def test_the_benchmark_records_a_table_of_workloads_once_into_its_folder(tmp_path):
    # alloc_replay.py --unseen records the workloads of unseen_workloads.py into a folder of
    # their own, through the same record_traces() as the 63: each recorded once, then read.
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import alloc_replay
    import unseen_workloads

    runs = []

    def step():
        runs.append(1)
        x = torch.ones(1024, 256)
        (x @ x.t()).sum()

    traces = alloc_replay.record_traces(None, table={"tiny": step}, trace_dir=tmp_path / "unseen")
    assert (tmp_path / "unseen" / "tiny.csv.gz").exists() and len(runs) == 1
    assert traces["tiny"].peak_live_bytes() >= 1024 * 256 * 4 + 1024 * 1024 * 4
    again = alloc_replay.record_traces(None, table={"tiny": step}, trace_dir=tmp_path / "unseen")
    assert len(runs) == 1  # read from the folder, not recorded again
    assert again["tiny"].size.tolist() == traces["tiny"].size.tolist()
    # The unseen set is a table of the same kind, and its workloads are not among the 63.
    names = set(unseen_workloads.workloads())
    assert len(names) == 18 and not names & set(alloc_replay.workloads())
    assert unseen_workloads.NO_REPEATED_ITERATION <= names
