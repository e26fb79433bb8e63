"""Why a policy holds more memory than is live: its replay, stopped at its peak.

"Reserved but unallocated" is the number PyTorch's out-of-memory message ends with. At the
moment reserved memory first reaches its peak, it splits exactly into:

- live: the bytes the program asked for, in blocks in use;
- rounding: what the allocator added to those requests (512 B multiples, whole pages);
- pending: blocks freed while work queued on a stream may still use them (an event waits);
- cached: memory no block uses (segments wholly free, pages with no block on them): what
  ``torch.cuda.empty_cache()`` would give back;
- fragments: free space inside segments, or pages, that blocks in use also occupy. Nothing
  gives it back while those blocks live. This is fragmentation.

The segments (policies without virtual memory) or pages (with it) that hold the most
fragments are listed with the blocks in use on them, each with the trace events that made and
free it: which tensors, from when, pin the memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import _core
from ..units import format_bytes, parse_bytes
from .replay import parse_policy
from .trace import ALLOC, FREE, Trace


@dataclass
class HeldBlock:
    """A block in use on a segment or page that holds fragments."""
    size: int               # bytes requested
    made_at: int            # the trace event that allocated it
    freed_at: int | None    # the trace event that frees it; None: alive to the end


@dataclass
class Holder:
    """A segment or page that blocks in use keep reserved, with free space in it."""
    address: int
    bytes: int              # its size: a segment's, or a page's
    free_bytes: int         # fragments in it
    largest_free_bytes: int  # the largest free range in it: no larger request fits there
    blocks: list[HeldBlock] = field(default_factory=list)


@dataclass
class PeakExplanation:
    trace: str
    policy: str
    event: int              # reserved memory is at its peak after this event (the first such)
    events: int
    reserved_bytes: int
    live_bytes: int
    rounding_bytes: int
    pending_bytes: int
    cached_bytes: int
    fragment_bytes: int
    # Fragments in segments or pages whose blocks in use all live for at least half the trace
    # (parameters, optimizer state; a recording that ends by freeing the model frees them
    # too): kept step after step, where the rest goes with the step that made it.
    long_lived_fragment_bytes: int
    unit: str               # "segment" or "page": what holders are
    partly_used: int        # segments or pages that hold fragments
    holders: list[Holder] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The explanation as text, a line per finding."""
        r = self.reserved_bytes
        def part(b: int) -> str:
            return f"{format_bytes(b)} ({100 * b / r:.1f}%)" if r else format_bytes(b)
        out = [f"{self.trace} / {self.policy}: reserved peaks at {format_bytes(r)} after event "
               f"{self.event:,} of {self.events:,}",
               f"  live {part(self.live_bytes)}, rounding {part(self.rounding_bytes)}, "
               f"pending frees {part(self.pending_bytes)}, cached {part(self.cached_bytes)}, "
               f"fragments {part(self.fragment_bytes)} in {self.partly_used:,} partly used "
               f"{self.unit}s"]
        if self.fragment_bytes:
            out.append(f"  of the fragments, {part(self.long_lived_fragment_bytes)} are in "
                       f"{self.unit}s whose blocks in use all live for half the trace or more")
        for h in self.holders:
            out.append(f"  {self.unit} at {h.address:#x} ({format_bytes(h.bytes)}): "
                       f"{format_bytes(h.free_bytes)} free, at most {format_bytes(h.largest_free_bytes)} "
                       f"in one range, kept by {len(h.blocks)} block(s):")
            for b in sorted(h.blocks, key=lambda b: -b.size)[:4]:
                end = "alive to the end" if b.freed_at is None else f"freed at {b.freed_at:,}"
                out.append(f"    {format_bytes(b.size)} made at event {b.made_at:,}, {end}")
            if len(h.blocks) > 4:
                out.append(f"    and {len(h.blocks) - 4} more")
        return out


def explain_peak(trace: Trace, policy: str = "torch", *, capacity="80GiB", granularity="2MiB",
                 plans: str | None = None, top: int = 5) -> PeakExplanation:
    """Replay `trace` through `policy` (a name, or 'name=key:value,...') on a simulated device
    and explain reserved memory at the first event where it reaches its peak.

    `plans`: text of plans for pymemplan-planned to start with, as `replay` takes.
    `top`: how many holders of fragments to list (the most free bytes first).

    Raises TraceError for a trace that is not replayable, AllocatorError (a ValueError) for an
    unknown policy or a bad config, ValueError for a bad `top` or plans for another policy."""
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    name, config = parse_policy(policy)
    if plans is not None and name != "pymemplan-planned":
        raise ValueError(f"plans are for pymemplan-planned, not {name}")
    cap, gran = parse_bytes(capacity), parse_bytes(granularity)
    trace.validate()
    # The peak first, from the replay engine; then again, event by event, to stop there.
    peak = _core.replay(trace.action, trace.ptr, trace.size, trace.stream, name, config, cap,
                        gran, plans=plans or "")["peak_reserved_bytes"]
    alloc = _core.Allocator(_core.SimulatedDevice(cap, gran), name, config)
    if plans:
        alloc.import_plans(plans)
    action, ptr, size, stream = (trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
                                 trace.stream.tolist())
    live: dict[int, tuple[int | None, int, int]] = {}  # trace ptr -> (address, size, event)
    live_bytes = 0
    stop = len(action) - 1
    for i, a in enumerate(action):
        if a == ALLOC:
            try:
                address = alloc.malloc(size[i], stream[i])
            except _core.OutOfMemoryError:
                address = None  # refused, as the replay engine counts it; its free is skipped
            live[ptr[i]] = (address, size[i], i)
            live_bytes += size[i]
        elif a == FREE:
            address, s, _ = live.pop(ptr[i])
            if address is not None:
                alloc.free(address)
            live_bytes -= s
        if alloc.reserved_bytes() >= peak:
            stop = i
            break
    freed_at = _frees_after(action, ptr, stop)
    by_address = {address: (s, made) for address, s, made in live.values() if address is not None}
    in_use = sum(s for address, s, _ in live.values() if address is not None)
    stats = alloc.stats()
    reserved = stats["reserved_bytes.all.current"]
    allocated = stats["allocated_bytes.all.current"]
    pending = cached = 0
    units = []  # (address, bytes, free, largest free range, addresses of blocks in use)
    segments = alloc.snapshot()["segments"]
    for seg in segments:
        if "page_mapped" in seg:
            p_pending, p_cached, p_units = _pages(seg)
        else:
            p_pending, p_cached, p_units = _segment(seg)
        pending += p_pending
        cached += p_cached
        units.extend(p_units)
    units.sort(key=lambda u: -u[2])
    n = len(action)
    def long_lived(b: int) -> bool:  # a block of a GMLake stitch is looked up whole, not by piece
        if b not in by_address:
            return True
        made = by_address[b][1]
        return 2 * (freed_at.get(made, n) - made) >= n
    lasting = sum(free for _, _, free, _, blocks in units if all(long_lived(b) for b in blocks))
    holders = []
    for address, nbytes, free, largest, blocks in units[:top]:
        held = []
        for b in blocks:
            if b in by_address:
                s, made = by_address[b]
                held.append(HeldBlock(size=s, made_at=made, freed_at=freed_at.get(made)))
        holders.append(Holder(address, nbytes, free, largest, held))
    paged = any("page_mapped" in s for s in segments)
    return PeakExplanation(
        trace=trace.name, policy=policy, event=stop, events=len(action), reserved_bytes=reserved,
        live_bytes=in_use, rounding_bytes=allocated - in_use, pending_bytes=pending,
        cached_bytes=cached, fragment_bytes=reserved - allocated - pending - cached,
        long_lived_fragment_bytes=lasting, unit="page" if paged else "segment", partly_used=len(units), holders=holders)


def _frees_after(action: list[int], ptr: list[int], stop: int) -> dict[int, int]:
    """For blocks alive after event `stop`: the event that made each -> the event that frees it."""
    made: dict[int, int] = {}
    out: dict[int, int] = {}
    for i, (a, p) in enumerate(zip(action, ptr)):
        if a == ALLOC:
            made[p] = i
        elif a == FREE:
            m = made.pop(p)
            if i > stop:
                out[m] = i
    return out


def _segment(seg: dict) -> tuple[int, int, list]:
    """A segment without virtual memory: whole, or pinned by what is in use in it."""
    blocks = seg["blocks"]
    pending = sum(b["size"] for b in blocks if b["state"] == "active_pending_free")
    used = [b["address"] for b in blocks if b["state"] == "active_allocated"]
    if not used and not pending:
        return 0, seg["total_size"], []
    free = [b["size"] for b in blocks if b["state"] == "inactive"]
    if not free or not used:
        return pending, 0, []
    return pending, 0, [(seg["address"], seg["total_size"], sum(free), max(free), used)]


def _pages(seg: dict) -> tuple[int, int, list]:
    """A segment whose pages are mapped on demand: only mapped pages hold memory, and a page
    another address holds too (page sharing, or a GMLake stitch) is counted where it is its own."""
    page = seg["page_size"]
    base = seg["address"]
    mapped = seg["page_mapped"]
    aliased = seg.get("page_aliased") or [False] * len(mapped)
    n = len(mapped)
    used = [0] * n
    pending = [0] * n
    free_runs: list[list[int]] = [[] for _ in range(n)]
    on_page: list[list[int]] = [[] for _ in range(n)]
    for b in seg["blocks"]:
        lo, hi = b["address"] - base, b["address"] - base + b["size"]
        for k in range(lo // page, (hi - 1) // page + 1):
            if not mapped[k] or aliased[k]:
                continue
            overlap = min(hi, (k + 1) * page) - max(lo, k * page)
            if b["state"] == "active_allocated":
                used[k] += overlap
                on_page[k].append(b["address"])
            elif b["state"] == "active_pending_free":
                pending[k] += overlap
            else:
                free_runs[k].append(overlap)
    total_pending = cached = 0
    units = []
    for k in range(n):
        if not mapped[k] or aliased[k]:
            continue
        total_pending += pending[k]
        if used[k] == 0 and pending[k] == 0:
            cached += page
        elif used[k] and free_runs[k]:
            units.append((base + k * page, page, sum(free_runs[k]), max(free_runs[k]), on_page[k]))
    return total_pending, cached, units
