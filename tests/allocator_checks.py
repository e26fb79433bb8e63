"""Invariants every allocator state must satisfy, recomputed from a snapshot."""

from __future__ import annotations

MiB = 1 << 20
POOLS = ("all", "small_pool", "large_pool")


def check_invariants(alloc, device, live: dict[int, int], limit: int = 0) -> None:
    """`live` maps each pointer the caller holds to the size it asked for."""
    assert alloc.self_check() == ""
    snap = alloc.snapshot()
    stats = alloc.stats()
    segments = sorted(snap["segments"], key=lambda s: s["address"])
    recount = {f"{k}.{p}": 0 for p in POOLS for k in (
        "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
        "requested_bytes", "allocation", "segment", "active", "inactive_split")}
    allocated_blocks = {}
    prev_end = 0
    for seg in segments:
        pool = "small_pool" if seg["segment_type"] == "small" else "large_pool"
        # Segments never overlap one another.
        assert seg["address"] >= prev_end, "segments overlap"
        prev_end = seg["address"] + seg["total_size"]
        # Blocks tile their segment exactly, in address order.
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr, "blocks do not tile their segment"
            assert b["size"] > 0 and b["size"] % 512 == 0, f"block size {b['size']} not a multiple of 512"
            assert b["address"] % 512 == 0, "block not 512-byte aligned"
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"], "blocks do not cover their segment"
        # torch leaves expandable segments out of inactive_split, and so do our virtual ones
        # (free blocks there are mostly address space); GMLake's are mapped whole.
        releasable = seg.get("torch_expandable", False) or (
            seg.get("is_expandable", False) and not alloc.policy.startswith("gmlake"))
        split = len(seg["blocks"]) > 1 and not releasable
        for b in seg["blocks"]:
            for p in ("all", pool):
                if b["state"] == "active_allocated":
                    recount[f"allocated_bytes.{p}"] += b["size"]
                    recount[f"allocation.{p}"] += 1
                    recount[f"requested_bytes.{p}"] += b["requested_size"]
                if b["state"] in ("active_allocated", "active_pending_free"):
                    recount[f"active_bytes.{p}"] += b["size"]
                    recount[f"active.{p}"] += 1
                if b["state"] == "inactive" and split:
                    recount[f"inactive_split_bytes.{p}"] += b["size"]
                    recount[f"inactive_split.{p}"] += 1
            if b["state"] == "active_allocated":
                allocated_blocks[b["address"]] = b
        # Two free neighbours of the same owner would have been coalesced; we cannot see
        # owners in the snapshot, so only the allocated/free tiling is checked here.
        # A virtual segment (vmm) holds only its mapped pages, and every page under an
        # allocated or pending block must be mapped.
        held = seg["mapped_size"] if seg.get("is_expandable") else seg["total_size"]
        if seg.get("is_expandable"):
            page = seg["page_size"]
            # An aliased page maps a physical page another address holds (share_pages).
            assert all(m for m, a in zip(seg["page_mapped"], seg["page_aliased"]) if a)
            assert (sum(seg["page_mapped"]) - sum(seg["page_aliased"])) * page == seg["mapped_size"]
            for b in seg["blocks"]:
                if b["state"] == "inactive":
                    continue
                first = (b["address"] - seg["address"]) // page
                last = (b["address"] + b["size"] - 1 - seg["address"]) // page
                assert all(seg["page_mapped"][first:last + 1]), "a live block has unmapped pages"
        for p in ("all", pool):
            recount[f"reserved_bytes.{p}"] += held
            recount[f"segment.{p}"] += 1
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    for key, value in recount.items():
        assert stats[f"{key}.current"] == value, f"{key}.current = {stats[f'{key}.current']}, recount {value}"
        assert stats[f"{key}.peak"] >= value
    # Exactly the caller's live pointers are allocated, each big enough for its request.
    assert set(allocated_blocks) == set(live), "allocated blocks differ from live pointers"
    for ptr, size in live.items():
        b = allocated_blocks[ptr]
        assert b["requested_size"] == size
        assert b["size"] >= size
    reserved = stats["reserved_bytes.all.current"]
    if limit:
        assert reserved <= limit, f"reserved {reserved} exceeds the limit {limit}"
    virtual = [s for s in segments if s.get("is_expandable")]
    classic = [s for s in segments if not s.get("is_expandable")]
    mapped_pages = sum(sum(s["page_mapped"]) for s in virtual)
    held_pages = mapped_pages - sum(sum(s["page_aliased"]) for s in virtual)
    assert device.live_segments == len(classic)
    assert device.live_reservations == len(virtual)
    assert device.mapped_pages == mapped_pages, "a page is mapped that no segment knows of"
    assert device.live_pages == held_pages, "a page leaked"
    # The device holds exactly the segments (each rounded up to its granularity) and pages.
    g = device.granularity
    footprint = sum(-(-x["total_size"] // g) * g for x in classic) + held_pages * g
    assert device.used == footprint, (device.used, footprint)
    assert reserved <= footprint
    # One device call per segment, and per page (per chunk of an expandable segment).
    held_units = sum((sum(s["page_mapped"]) - sum(s["page_aliased"])) * s["page_size"]
                     // s["chunk_size"] for s in virtual)
    assert stats["num_device_alloc"] - stats["num_device_free"] == len(classic) + held_units
    # Blocks in use never share physical memory, even where two addresses map one page.
    pieces = []
    for seg in virtual:
        page = seg["page_size"]
        for b in seg["blocks"]:
            if b["state"] == "inactive":
                continue
            at, end = b["address"], b["address"] + b["size"]
            while at < end:
                phys, off = device.translate(at)
                assert phys != 0, "a block in use lies on an unmapped page"
                n = min(page - off, end - at)
                pieces.append((phys, off, off + n))
                at += n
    pieces.sort()
    for (p0, _, hi0), (p1, lo1, _) in zip(pieces, pieces[1:]):
        assert p0 != p1 or lo1 >= hi0, "two blocks in use share physical memory"


def replay_checked(alloc, device, trace, check_every: int = 0) -> tuple[int, int]:
    """Replays `trace` (pymemplan.traces.Trace) through `alloc`, checking that live blocks
    never overlap, and every invariant every `check_every` events (0: never). Returns the
    highest reserved bytes and the highest live (requested) bytes."""
    ptr, live = {}, {}
    high = live_bytes = live_high = 0
    for i, (a, p, n, s) in enumerate(zip(trace.action.tolist(), trace.ptr.tolist(),
                                         trace.size.tolist(), trace.stream.tolist())):
        if a == 0:
            q = alloc.malloc(n, s)
            assert all(q + n <= x or x + live[x] <= q for x in live), "overlapping live blocks"
            ptr[p], live[q] = q, n
            live_bytes += n
        else:
            q = ptr.pop(p)
            alloc.free(q)
            live_bytes -= live.pop(q)
        high = max(high, alloc.stats()["reserved_bytes.all.current"])
        live_high = max(live_high, live_bytes)
        if check_every and i % check_every == 0:
            check_invariants(alloc, device, live)
    return high, live_high
