"""The model of GMLake (policy "gmlake"): what it stitches, reuses and gives back, step by step
on the simulated device, every state checked against the invariants of all policies."""

from __future__ import annotations

import pytest

from pymemplan import _core
from pymemplan.traces import Trace, replay
from allocator_checks import MiB, check_invariants


def make(config="frag_limit_mb:0", capacity=1024 * MiB):
    device = _core.SimulatedDevice(capacity)
    return device, _core.Allocator(device, "gmlake", config)


def reserved(alloc):
    return alloc.stats()["reserved_bytes.all.current"]


def stitched_segments(alloc):
    """Segments whose pages all belong to other segments: stitched blocks."""
    return [s for s in alloc.snapshot()["segments"] if s["page_mapped"] and all(s["page_aliased"])]


def two_free_segments(alloc, sizes=(30, 40)):
    """Segments of these sizes (MiB), freed: free blocks that cannot merge."""
    blocks = [alloc.malloc(n * MiB, 0) for n in sizes]
    for p in blocks:
        alloc.free(p)
    return blocks


def test_free_blocks_of_two_segments_are_stitched_into_one_request_without_new_memory():
    device, alloc = make()
    a, b = two_free_segments(alloc)
    assert reserved(alloc) == 70 * MiB
    c = alloc.malloc(60 * MiB, 0)
    # 40 MiB and the front 20 of the 30: one new address range over pages already held.
    assert reserved(alloc) == 70 * MiB
    assert c not in (a, b)
    (s,) = stitched_segments(alloc)
    assert s["address"] == c and s["total_size"] == 60 * MiB and s["mapped_size"] == 0
    check_invariants(alloc, device, {c: 60 * MiB})
    # The 10 MiB the stitch left of the 30 MiB segment still serves a request of its size.
    d = alloc.malloc(10 * MiB, 0)
    assert reserved(alloc) == 70 * MiB
    check_invariants(alloc, device, {c: 60 * MiB, d: 10 * MiB})


def test_as_shipped_only_requests_of_512_mib_are_stitched():
    device, alloc = make(config="")
    two_free_segments(alloc)
    c = alloc.malloc(60 * MiB, 0)
    assert reserved(alloc) == 130 * MiB and not stitched_segments(alloc)
    alloc.free(c)
    alloc.empty_cache()
    two_free_segments(alloc, (300, 300))
    p = alloc.malloc(512 * MiB, 0)
    assert reserved(alloc) == 600 * MiB and len(stitched_segments(alloc)) == 1
    check_invariants(alloc, device, {p: 512 * MiB})


def test_a_freed_stitched_block_is_cached_and_serves_a_request_no_block_fits():
    device, alloc = make()
    a, b = two_free_segments(alloc)
    c = alloc.malloc(60 * MiB, 0)
    alloc.free(c)
    # A block that fits goes first, even where the stitched one fits as well.
    d = alloc.malloc(35 * MiB, 0)
    assert d == b
    alloc.free(d)
    # Larger than any block: the cached stitched block serves it with its first pages.
    e = alloc.malloc(45 * MiB, 0)
    assert e == c and reserved(alloc) == 70 * MiB and len(stitched_segments(alloc)) == 1
    check_invariants(alloc, device, {e: 45 * MiB})
    alloc.free(e)
    check_invariants(alloc, device, {})


def test_a_stitched_block_much_larger_than_the_request_is_not_reused():
    device, alloc = make(config="frag_limit_mb:0,reuse_limit:1.2")
    two_free_segments(alloc)
    c = alloc.malloc(60 * MiB, 0)
    alloc.free(c)
    # 60 MiB is more than 1.2 times 46: the free blocks are stitched again instead.
    e = alloc.malloc(45 * MiB, 0)
    assert e != c and len(stitched_segments(alloc)) == 2 and reserved(alloc) == 70 * MiB
    check_invariants(alloc, device, {e: 45 * MiB})


def test_giving_back_a_segment_under_a_stitched_block_in_use_unmaps_only_what_it_does_not_serve():
    device, alloc = make()
    two_free_segments(alloc, (40, 30, 12))
    s = alloc.malloc(82 * MiB, 0)  # all three, whole
    alloc.free(s)
    t = alloc.malloc(50 * MiB, 0)  # the stitched block again: the 40, and 10 of the 30
    assert t == s
    alloc.set_memory_limit(112 * MiB)
    # 32 MiB free, in two blocks: new memory, past the limit until the wholly free 12 MiB
    # segment goes back, and with it the tail of the stitched block that mapped it.
    u = alloc.malloc(40 * MiB, 0)
    assert reserved(alloc) == 110 * MiB
    (st,) = stitched_segments(alloc)
    assert st["total_size"] == 50 * MiB
    check_invariants(alloc, device, {t: 50 * MiB, u: 40 * MiB}, 112 * MiB)
    # Freed, the shortened stitched block is not cached: its address range goes back.
    alloc.free(t)
    assert not stitched_segments(alloc)
    check_invariants(alloc, device, {u: 40 * MiB}, 112 * MiB)
    alloc.free(u)
    alloc.empty_cache()
    assert reserved(alloc) == 0 and device.used == 0 and device.live_reservations == 0


def test_out_of_memory_after_giving_back_the_cache_fails_cleanly():
    device, alloc = make(capacity=64 * MiB)
    a = alloc.malloc(40 * MiB, 0)
    b = alloc.malloc(4 * MiB, 0)  # a 20 MiB segment
    alloc.free(b)
    with pytest.raises(_core.OutOfMemoryError, match=r"gmlake: out of memory: tried to allocate 30\.00 MiB"):
        alloc.malloc(30 * MiB, 0)
    # The ladder gave the free 20 MiB segment back; nothing else changed.
    assert reserved(alloc) == 40 * MiB and alloc.stats()["num_ooms"] == 1
    check_invariants(alloc, device, {a: 40 * MiB})


def test_streams_keep_their_own_blocks_and_a_recorded_stream_delays_reuse():
    device = _core.SimulatedDevice(1024 * MiB, auto_complete_events=False)
    alloc = _core.Allocator(device, "gmlake", "frag_limit_mb:0")
    a = alloc.malloc(30 * MiB, 1)
    alloc.free(a)
    b = alloc.malloc(30 * MiB, 2)  # stream 2 never takes stream 1's block
    assert b != a and reserved(alloc) == 60 * MiB
    alloc.record_stream(b, 3)
    alloc.free(b)
    c = alloc.malloc(30 * MiB, 2)  # b waits for stream 3's work
    assert c != b
    device.complete_events(3)
    alloc.free(c)
    d = alloc.malloc(60 * MiB, 2)  # both stream-2 blocks, stitched, once b came back
    assert reserved(alloc) == 90 * MiB
    check_invariants(alloc, device, {d: 60 * MiB})


@pytest.mark.parametrize("config,capacity,limit", [
    ("frag_limit_mb:0", 1 << 30, 0), ("frag_limit_mb:0", 4 << 30, 96 * MiB),
    ("frag_limit_mb:0,reuse_limit:1.5", 1 << 30, 0), ("", 1 << 30, 0)])
def test_fuzz_with_page_mappings_running_out_of_memory(config, capacity, limit):
    # Random requests, frees, record_stream, events and empty_cache on three streams; every
    # 37th operation the next page mapping fails. Every invariant holds throughout (the
    # fuzzer's full checks: accounting recounted, no two blocks in use on the same physical
    # bytes, no page unmapped while work queued before a free on it may touch it).
    r = _core.fuzz(20000, 5, "gmlake", config, capacity, limit, 3, True, 500, False, fail_map_every=37)
    assert r["mallocs"] > 5000 and r["full_checks"] > 0 and r["drains_to_zero"] == 1


def test_bad_config_and_bad_frees_are_refused_with_what_to_do():
    with pytest.raises(_core.AllocatorError, match="valid keys: frag_limit_mb, reuse_limit"):
        make(config="vmm:True")
    with pytest.raises(_core.AllocatorError, match="frag_limit_mb.*an integer >= 0"):
        make(config="frag_limit_mb:-1")
    with pytest.raises(_core.AllocatorError, match="reuse_limit.*a number >= 1"):
        make(config="reuse_limit:0.5")
    assert _core.parse_config("gmlake", "") == "frag_limit_mb:512,reuse_limit:10"
    device, alloc = make()
    p = alloc.malloc(5 * MiB, 0)
    alloc.free(p)
    with pytest.raises(_core.AllocatorError, match="did not hand out or that was freed already"):
        alloc.free(p)
    check_invariants(alloc, device, {})


def test_stitching_holds_less_than_pytorchs_policy_where_freed_blocks_are_too_small_alone():
    # Each step frees two 24 MiB blocks of separate segments and asks for one of 40: PyTorch's
    # policy cannot use them and grows; stitched, they serve it.
    events = []
    def alloc(sz):
        events.append((0, len(events), sz, 0, 0.0))
        return len(events) - 1
    def free(p):
        events.append((1, p, 0, 0, 0.0))
    for _ in range(4):
        a, b = alloc(24 * MiB), alloc(24 * MiB)
        alloc(MiB + 1)  # kept: the next step's blocks come from new segments
        free(a), free(b)
        free(alloc(40 * MiB))
    trace = Trace.from_events(events, name="stitchable")
    r = {x.policy: x for x in replay(trace, ["torch", "gmlake", "gmlake=frag_limit_mb:0"])}
    assert r["gmlake=frag_limit_mb:0"].peak_reserved_bytes < r["torch"].peak_reserved_bytes
    assert r["gmlake"].peak_reserved_bytes >= r["gmlake=frag_limit_mb:0"].peak_reserved_bytes


@pytest.mark.parametrize("seed", [17, 87])
def test_a_random_training_loop_replayed_with_every_invariant_checked(seed):
    # Loops where stitching matters (GMLake below PyTorch's policy by a fifth): every
    # invariant holds throughout, and the replay engine's figure is this replay's.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from synthetic_traces import random_training

    from allocator_checks import replay_checked

    trace = random_training(seed)
    device = _core.SimulatedDevice(80 << 30)
    alloc = _core.Allocator(device, "gmlake", "frag_limit_mb:0")
    high, live = replay_checked(alloc, device, trace, check_every=3)
    r = {x.policy: x for x in replay(trace, ["torch", "gmlake=frag_limit_mb:0", "pymemplan-vmm"])}
    assert high == r["gmlake=frag_limit_mb:0"].peak_reserved_bytes
    assert high < 0.85 * r["torch"].peak_reserved_bytes
    assert r["pymemplan-vmm"].peak_reserved_bytes < high
    assert len(stitched_segments(alloc)) > 0
