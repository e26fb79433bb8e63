"""Page sharing (share_pages): two pages that blocks in use fill only at disjoint offsets are
backed by one physical page, without moving any allocation's address."""

from __future__ import annotations

import pytest

from pymemplan import _core
from allocator_checks import MiB, check_invariants


def _vmm(policy="pymemplan-vmm", config=""):
    device = _core.SimulatedDevice(1 << 30, auto_complete_events=False)
    return device, _core.Allocator(device, policy, config)


def _half_pages(alloc, n_pages):
    """Blocks of 1 MiB filling n_pages pages; then one half of each page is freed, the front
    half on even pages and the back half on odd ones. Returns (kept blocks, all blocks)."""
    blocks = [alloc.malloc(MiB) for _ in range(2 * n_pages)]
    base = blocks[0]
    assert base % (2 * MiB) == 0 and blocks == [base + i * MiB for i in range(2 * n_pages)], (
        "precondition: consecutive 1 MiB requests are laid out back to back from a page start")
    kept = []
    for page in range(n_pages):
        front, back = blocks[2 * page], blocks[2 * page + 1]
        alloc.free(back if page % 2 == 0 else front)
        kept.append(front if page % 2 == 0 else back)
    return kept


def test_pages_used_at_disjoint_offsets_are_shared_and_unshared_as_blocks_go():
    device, alloc = _vmm()
    kept = _half_pages(alloc, 4)
    live = {p: MiB for p in kept}
    reserved = alloc.stats()["reserved_bytes.all.current"]
    assert device.live_pages == 4

    assert alloc.share_pages() == 4 * MiB  # pages 0+1 and 2+3
    assert device.live_pages == 2 and device.device_synchronizations == 1
    assert alloc.stats()["reserved_bytes.all.current"] == reserved - 4 * MiB
    # The fuller page keeps its physical page; the other's live MiB was copied into its
    # free half, and the addresses did not move.
    assert device.bytes_copied == 2 * MiB
    phys = [device.translate(p) for p in kept]
    assert phys[0][0] == phys[1][0] and phys[2][0] == phys[3][0] and phys[0][0] != phys[2][0]
    assert [off for _, off in phys] == [0, MiB, 0, MiB]
    check_invariants(alloc, device, live)

    # Nothing is left to share: no second device-wide synchronize.
    assert alloc.share_pages() == 0 and device.device_synchronizations == 1

    # New requests never land on a shared page's other half (check_invariants compares
    # physical ranges); they get fresh pages.
    extra = [alloc.malloc(MiB) for _ in range(3)]
    live.update({p: MiB for p in extra})
    check_invariants(alloc, device, live)

    # Freeing every block at one address of a pair ends the pair: the other address owns
    # the page alone again, and its free half can be handed out.
    alloc.free(kept[1])
    del live[kept[1]]
    check_invariants(alloc, device, live)
    snap = alloc.snapshot()
    assert not any(a for s in snap["segments"] if s["is_expandable"] for a in s["page_aliased"][:2])
    for p in list(live):
        alloc.free(p)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    assert device.live_pages == 0 and device.mapped_pages == 0


def test_ending_a_pair_waits_for_the_streams_that_freed_there():
    device, alloc = _vmm()
    kept = _half_pages(alloc, 2)
    alloc.share_pages()
    # Freed on its stream (0), whose queued work may still touch it: the address is unmapped
    # only after that stream is synchronized.
    before = device.record_count
    alloc.free(kept[1])
    assert device.completed_through(0) > before
    assert device.live_pages == 1 and device.mapped_pages == 1
    check_invariants(alloc, device, {kept[0]: MiB})


def test_a_pair_lasts_while_another_stream_still_uses_a_freed_block():
    device, alloc = _vmm()
    kept = _half_pages(alloc, 2)
    alloc.share_pages()
    alloc.record_stream(kept[1], 7)
    alloc.free(kept[1])  # waits on stream 7's event: still in use
    assert _aliased(alloc) == 1 and device.mapped_pages == 2 and device.live_pages == 1
    device.complete_events(7)
    other = alloc.malloc(4 * MiB)  # events are processed on the next call
    assert _aliased(alloc) == 0 and device.live_pages == device.mapped_pages  # the pair ended
    check_invariants(alloc, device, {kept[0]: MiB, other: 4 * MiB})


def _aliased(alloc):
    return sum(sum(s["page_aliased"]) for s in alloc.snapshot()["segments"] if s["is_expandable"])


def test_blocks_waiting_on_events_are_not_moved_under_running_work():
    device, alloc = _vmm()
    kept = _half_pages(alloc, 2)
    # A freed block still used by queued work counts as used until the synchronize.
    alloc.record_stream(kept[0], 5)
    alloc.free(kept[0])
    # The pair (0, 1) is found, but after the device-wide synchronize page 0 holds nothing:
    # it is no pair any more, and nothing is copied.
    assert alloc.share_pages() == 0
    assert device.device_synchronizations == 1 and device.bytes_copied == 0
    check_invariants(alloc, device, {kept[1]: MiB})


@pytest.mark.parametrize("policy,config", [("pymemplan", ""), ("torch", ""),
                                           ("pymemplan-planned", "vmm:False")])
def test_policies_without_virtual_memory_share_nothing(policy, config):
    device = _core.SimulatedDevice(1 << 30)
    alloc = _core.Allocator(device, policy, config)
    ptrs = [alloc.malloc(MiB) for _ in range(8)]
    for p in ptrs[::2]:
        alloc.free(p)
    assert alloc.share_pages() == 0 and device.device_synchronizations == 0


def test_share_pages_config_key_is_checked():
    with pytest.raises(_core.AllocatorError, match="share_pages"):
        _core.Allocator(_core.SimulatedDevice(1 << 30), "pymemplan-planned", "share_pages:2")
    for policy in ("pymemplan-vmm", "pymemplan-planned"):
        with pytest.raises(_core.AllocatorError, match="bad value 'yes' for 'share_pages'"):
            _core.Allocator(_core.SimulatedDevice(1 << 30), policy, "share_pages:yes")
        for off in ("0", "False"):
            assert "share_pages:False" in _core.Allocator(_core.SimulatedDevice(1 << 30), policy,
                                                          f"share_pages:{off}").config


def _state_then_steps(config, pages=8):
    """Optimizer-state-like blocks made in the first iteration among its temporaries (each
    ends up alone on half of one of `pages` pages), then a repeated step that
    pymemplan-planned plans."""
    device = _core.SimulatedDevice(1 << 30)
    alloc = _core.Allocator(device, "pymemplan-planned", config)
    state, tmp = [], []
    for k in range(pages):
        pair = [alloc.malloc(MiB), alloc.malloc(MiB)]
        state.append(pair[k % 2])
        tmp.append(pair[1 - k % 2])
    for p in tmp:
        alloc.free(p)
    for _ in range(10):
        step = [alloc.malloc(n * MiB) for n in (6, 3, 8, 5, 4)]
        for p in reversed(step):
            alloc.free(p)
    return device, alloc, state


def test_planned_shares_the_pages_of_blocks_that_outlive_the_step_when_it_arms():
    _, unshared, _ = _state_then_steps("share_pages:0")
    device, alloc, state = _state_then_steps("")
    stats = alloc.plan_stats()
    assert stats["arms"] >= 1 and stats["shared_page_bytes"] == 8 * MiB
    # The eight half-used pages of state became four; the steps cost the same as unshared.
    assert (alloc.stats()["reserved_bytes.all.current"]
            == unshared.stats()["reserved_bytes.all.current"] - 8 * MiB)
    check_invariants(alloc, device, {p: MiB for p in state})
    for p in state:
        alloc.free(p)
    alloc.empty_cache()
    assert device.live_pages == 0 and device.mapped_pages == 0


def test_planned_shares_when_that_saves_a_single_page():
    """Two half-used pages become one when the plan arms: one page saved is enough to pay for
    the synchronize (asking for two left t5_4l a page above its floor)."""
    _, unshared, _ = _state_then_steps("share_pages:0", pages=2)
    device, alloc, state = _state_then_steps("", pages=2)
    assert alloc.plan_stats()["shared_page_bytes"] == 2 * MiB
    assert (alloc.stats()["reserved_bytes.all.current"]
            == unshared.stats()["reserved_bytes.all.current"] - 2 * MiB)
    check_invariants(alloc, device, {p: MiB for p in state})


def test_a_request_that_would_fail_gets_pages_given_back_by_sharing():
    """Out of pages, the OOM ladder pairs partly used pages before it gives up: the device
    is full with four half-used pages, and a 3 MiB request still succeeds."""
    device = _core.SimulatedDevice(8 * MiB)
    alloc = _core.Allocator(device, "pymemplan-vmm", "")
    kept = _half_pages(alloc, 4)
    assert device.used == 8 * MiB
    big = alloc.malloc(3 * MiB)
    stats = alloc.stats()
    assert stats["num_ooms"] == 0 and device.device_synchronizations == 1
    check_invariants(alloc, device, {**{p: MiB for p in kept}, big: 3 * MiB})
    # With the pairs made, nothing is left to give: the next request fails cleanly.
    with pytest.raises(_core.OutOfMemoryError, match="out of memory"):
        alloc.malloc(4 * MiB)
    check_invariants(alloc, device, {**{p: MiB for p in kept}, big: 3 * MiB})


@pytest.mark.parametrize("policy", ["pymemplan-vmm", "pymemplan-planned"])
@pytest.mark.parametrize("how", ["config", "stopped"])
def test_share_pages_off_leaves_pages_alone_until_asked(policy, how):
    """share_pages:False, or stopped at run time (the plugin does when two threads allocate
    at once), for programs whose other threads launch kernels while one allocates: the OOM
    ladder fails rather than synchronize, copy and remap; share_pages() on request still
    pairs."""
    device = _core.SimulatedDevice(8 * MiB)
    alloc = _core.Allocator(device, policy, "share_pages:False" if how == "config" else "")
    if how == "stopped":
        assert alloc.stop_automatic_page_sharing() is True
        assert alloc.stop_automatic_page_sharing() is False
    kept = _half_pages(alloc, 4)
    with pytest.raises(_core.OutOfMemoryError, match="out of memory"):
        alloc.malloc(3 * MiB)
    assert device.device_synchronizations == 0
    check_invariants(alloc, device, {p: MiB for p in kept})
    assert alloc.share_pages() == 4 * MiB and device.device_synchronizations == 1
    big = alloc.malloc(3 * MiB)
    check_invariants(alloc, device, {**{p: MiB for p in kept}, big: 3 * MiB})
