"""What reserved memory holds beyond the live bytes: at a replay's peak, or in a snapshot.

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

``explain_snapshot`` does the same for a memory snapshot as it is, without a replay: PyTorch's
own (``torch.cuda.memory._snapshot()``, taken at an out-of-memory error) or the plugin's
(``pymemplan.snapshot()``), naming where each block was allocated where the snapshot
recorded stacks.
"""

from __future__ import annotations

import os
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


@dataclass(kw_only=True)
class _Split:
    """Reserved memory, split: live + rounding + pending + cached + fragments."""
    reserved_bytes: int
    live_bytes: int
    rounding_bytes: int
    pending_bytes: int
    cached_bytes: int
    fragment_bytes: int
    unit: str               # "segment" or "page": what holders are
    partly_used: int        # segments or pages that hold fragments
    holders: list[Holder]   # those that hold the most fragments, the most first

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass(kw_only=True)
class PeakExplanation(_Split):
    """What a policy's reserved memory holds at its peak in a replay (explain_peak)."""
    trace: str
    policy: str
    event: int              # reserved memory is at its peak after this event (the first such)
    events: int
    # Fragments in segments or pages whose blocks in use all live for at least half the trace
    # (parameters, optimizer state; a recording that ends by freeing the model frees them
    # too): kept step after step, where the rest goes with the step that made it.
    long_lived_fragment_bytes: int

    def lines(self) -> list[str]:
        """The explanation as text, a line per finding."""
        head = (f"{self.trace} / {self.policy}: reserved peaks at "
                f"{format_bytes(self.reserved_bytes)} after event {self.event:,} of {self.events:,}")
        lasting = []
        if self.fragment_bytes:
            lasting = [f"  of the fragments, {_share(self.long_lived_fragment_bytes, self.reserved_bytes)} "
                       f"are in {self.unit}s whose blocks in use all live for half the trace or more"]
        def block(b: HeldBlock) -> str:
            end = "alive to the end" if b.freed_at is None else f"freed at {b.freed_at:,}"
            return f"made at event {b.made_at:,}, {end}"
        return _lines(self, head, lasting, block)


@dataclass
class SnapshotBlock:
    """A block in use on a segment or page that holds fragments, in a snapshot."""
    size: int               # bytes requested (the block's size where the snapshot has none)
    site: str | None        # where it was allocated: "file:line (function)", if recorded


@dataclass(kw_only=True)
class MemoryExplanation(_Split):
    """What a snapshot's reserved memory holds, on one device (explain_snapshot)."""
    device: int
    # Where asked for (compare=True) and the snapshot has allocation history: its requests
    # replayed under each allocator (pymemplan.traces.fit.FitComparison); else None.
    fit: object = None
    # Where that history could not be replayed: why (the TraceError's message); fit is None.
    fit_error: str | None = None

    def lines(self) -> list[str]:
        """The explanation as text, a line per finding."""
        head = f"device {self.device}: {format_bytes(self.reserved_bytes)} reserved"
        out = _lines(self, head, [], lambda b: f"allocated at {b.site or '(no stack recorded)'}")
        if self.fit is not None:
            out += ["", *self.fit.lines()]
        if self.fit_error is not None:
            out += ["", f"Which allocator would have fit is not told: the history cannot be "
                        f"replayed: {self.fit_error}",
                    "The split above does not need the history. If PyTorch or pymemplan wrote "
                    "the snapshot as it is, report this message (with PyTorch's version) to "
                    "pymemplan; --no-compare (compare=False from Python) leaves the replays out."]
        return out


def _share(b: int, whole: int) -> str:
    return f"{format_bytes(b)} ({100 * b / whole:.1f}%)" if whole else format_bytes(b)


def _lines(why, head: str, extra: list[str], describe) -> list[str]:
    """The text of an explanation: `head`, the parts, `extra`, then each holder and its largest
    blocks (`describe` says where a block comes from)."""
    r = why.reserved_bytes
    out = [head,
           f"  live {_share(why.live_bytes, r)}, rounding {_share(why.rounding_bytes, r)}, "
           f"pending frees {_share(why.pending_bytes, r)}, cached {_share(why.cached_bytes, r)}, "
           f"fragments {_share(why.fragment_bytes, r)} in {why.partly_used:,} partly used "
           f"{why.unit}s", *extra]
    for h in why.holders:
        out.append(f"  {why.unit} at {h.address:#x} ({format_bytes(h.bytes)}): "
                   f"{format_bytes(h.free_bytes)} free, at most {format_bytes(h.largest_free_bytes)} "
                   f"in one range, kept by {len(h.blocks)} block(s):")
        for b in sorted(h.blocks, key=lambda b: -b.size)[:4]:
            out.append(f"    {format_bytes(b.size)} {describe(b)}")
        if len(h.blocks) > 4:
            out.append(f"    and {len(h.blocks) - 4} more")
    return out


def explain_snapshot(snapshot, *, device: int = 0, top: int = 5, compare: bool = False,
                     capacity=None, policies=None, name: str | None = None) -> MemoryExplanation:
    """What reserved memory holds in `snapshot` on `device`: a snapshot dict
    (``torch.cuda.memory._snapshot()``, ``pymemplan.snapshot()``), the list of segments
    ``torch.cuda.memory_snapshot()`` returns, or the path of a pickle of either
    (``torch.cuda.memory._dump_snapshot``, ``pymemplan.save_snapshot``).

    The split is that of `explain_peak`, at the moment the snapshot was taken. A block's site
    is the innermost Python frame of its stack outside PyTorch's package, where the snapshot has
    stacks (``torch.cuda.memory._record_memory_history()`` records them).

    Snapshots of the model of GMLake (``_core.Allocator(..., "gmlake")``) are not split right:
    they show the pages lent to a stitched block as free (see `explain_peak`).

    `compare`: where the snapshot has allocation history on `device`, also replay its
    requests under each allocator (`fit`: pymemplan.traces.snapshot_fit, with `capacity`
    and `policies`): which would have fit; `name` names the snapshot there (default: the
    file's name, or "device N"). Where that history cannot be replayed (an action this
    reader does not know, an inconsistent history), `fit` is None and `fit_error` says why:
    the split does not need the history.

    Raises TraceError (a ValueError) for a snapshot that is malformed or not one, naming what
    is wrong, ValueError for a snapshot without segments on `device`, a bad `top`, `capacity`
    or `policies`."""
    from .snapshot import checked_segments, load_snapshot_segments, segment_reserved
    from .trace import TraceError

    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    path_name = None
    if isinstance(snapshot, (str, os.PathLike)):
        where = str(snapshot)
        path_name = os.path.basename(snapshot)
        snapshot = load_snapshot_segments(snapshot)
    else:
        where = "snapshot"
        snapshot = checked_segments(snapshot, where)
    segments = [seg for seg in snapshot["segments"] if seg.get("device", 0) == device]
    if not segments:
        found = sorted({seg.get("device", 0) for seg in snapshot["segments"]})
        raise ValueError(f"the snapshot has no segment on device {device}"
                         + (f" (it has segments on devices {found})" if found else
                            " (it has no segment at all: nothing was allocated)"))
    reserved = allocated = requested = 0
    for seg in segments:
        reserved += segment_reserved(seg)
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                requested += b.get("requested_size") or b["size"]
                # A segment all of whose pages are another's (a GMLake stitch) adds no memory;
                # a page shared by page sharing holds both addresses' blocks: both count.
                if not seg.get("page_aliased") or not all(seg["page_aliased"]):
                    allocated += b["size"]
    pending, cached, units, paged = _layout(segments)
    holders = [Holder(address, nbytes, free, largest,
                      [SnapshotBlock(b.get("requested_size") or b["size"], _site(b.get("frames")))
                       for b in blocks])
               for address, nbytes, free, largest, blocks in units[:top]]
    fit = fit_error = None
    history = snapshot.get("device_traces")
    if compare and history is not None and (not isinstance(history, list)
                                            or device < len(history) and history[device]):
        from .fit import snapshot_fit

        # A history this reader cannot replay leaves the split standing: it is what is asked
        # for at an out-of-memory error, and it needs no history.
        try:
            fit = snapshot_fit(snapshot, device=device, capacity=capacity, policies=policies,
                               name=name or path_name or f"device {device}", where=where)
        except TraceError as e:
            fit_error = str(e)
    return MemoryExplanation(
        device=device, fit=fit, fit_error=fit_error, reserved_bytes=reserved, live_bytes=requested,
        rounding_bytes=allocated - requested, pending_bytes=pending, cached_bytes=cached,
        fragment_bytes=reserved - allocated - pending - cached,
        unit="page" if paged else "segment", partly_used=len(units), holders=holders)


def _site(frames) -> str | None:
    """Where a block was allocated: the innermost Python frame outside PyTorch's own files
    (the user's code), else the innermost Python frame, else the innermost frame. Stacks are
    innermost first; with C++ frames recorded (stacks="all"), those come first."""
    if not frames:
        return None
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    def torch_own(f: dict) -> bool:
        return "torch" in str(f["filename"]).replace("\\", "/").split("/")
    f = next((f for f in python if not torch_own(f)), python[0] if python else frames[0])
    return f"{f.get('filename', '?')}:{f.get('line', '?')} ({f.get('name', '?')})"


def explain_peak(trace: Trace, policy: str = "torch", *, capacity="80GiB", granularity="2MiB",
                 plans: str | None = None, top: int = 5) -> PeakExplanation:
    """Replay `trace` through `policy` (a name, or 'name=key:value,...') on a simulated device
    and explain reserved memory at the first event where it reaches its peak.

    `plans`: text of plans for pymemplan-planned to start with, as `replay` takes.
    `top`: how many holders of fragments to list (the most free bytes first).

    Raises TraceError for a trace that is not replayable, AllocatorError (a ValueError) for an
    unknown policy or a bad config, ValueError for gmlake (whose snapshots cannot be split), a
    bad `top` or plans for another policy."""
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    name, config = parse_policy(policy)
    if name == "gmlake":
        # Its snapshots show the pages it lends to a stitched block as free where they lie,
        # and the stitch apart: which memory a stitch in use holds is not in them.
        raise ValueError("explain_peak: the model of GMLake is for comparing peaks; its "
                         "snapshots do not say which pages its stitched blocks hold, so its "
                         "reserved memory cannot be split. Replay it without --explain.")
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
    stop = len(action) - 1
    for i, a in enumerate(action):
        if a == ALLOC:
            try:
                address = alloc.malloc(size[i], stream[i])
            except _core.OutOfMemoryError:
                address = None  # refused, as the replay engine counts it; its free is skipped
            live[ptr[i]] = (address, size[i], i)
        elif a == FREE:
            address, _, _ = live.pop(ptr[i])
            if address is not None:
                alloc.free(address)
        if alloc.reserved_bytes() >= peak:
            stop = i
            break
    freed_at = _frees_after(action, ptr, stop)
    by_address = {address: (s, made) for address, s, made in live.values() if address is not None}
    in_use = sum(s for address, s, _ in live.values() if address is not None)
    stats = alloc.stats()
    reserved = stats["reserved_bytes.all.current"]
    allocated = stats["allocated_bytes.all.current"]
    segments = alloc.snapshot()["segments"]
    pending, cached, units, paged = _layout(segments)
    n = len(action)
    def long_lived(b: dict) -> bool:
        made = by_address[b["address"]][1]
        return 2 * (freed_at.get(made, n) - made) >= n
    lasting = sum(free for _, _, free, _, blocks in units if all(long_lived(b) for b in blocks))
    holders = []
    for address, nbytes, free, largest, blocks in units[:top]:
        held = []
        for b in blocks:
            s, made = by_address[b["address"]]
            held.append(HeldBlock(size=s, made_at=made, freed_at=freed_at.get(made)))
        holders.append(Holder(address, nbytes, free, largest, held))
    return PeakExplanation(
        trace=trace.name, policy=policy, event=stop, events=len(action), reserved_bytes=reserved,
        live_bytes=in_use, rounding_bytes=allocated - in_use, pending_bytes=pending,
        cached_bytes=cached, fragment_bytes=reserved - allocated - pending - cached,
        long_lived_fragment_bytes=lasting, unit="page" if paged else "segment",
        partly_used=len(units), holders=holders)


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


def _layout(segments: list[dict]) -> tuple[int, int, list, bool]:
    """Pending and cached bytes, the partly used units (address, bytes, free, largest free range,
    blocks in use; the most free first), and whether units are pages."""
    pending = cached = 0
    units = []
    for seg in segments:
        p_pending, p_cached, p_units = _pages(seg) if "page_mapped" in seg else _segment(seg)
        pending += p_pending
        cached += p_cached
        units.extend(p_units)
    units.sort(key=lambda u: -u[2])
    return pending, cached, units, any("page_mapped" in seg for seg in segments)


def _segment(seg: dict) -> tuple[int, int, list]:
    """A segment without virtual memory: whole, or pinned by what is in use in it."""
    blocks = seg["blocks"]
    pending = sum(b["size"] for b in blocks if b["state"] == "active_pending_free")
    used = [b for b in blocks if b["state"] == "active_allocated"]
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
    on_page: list[list[dict]] = [[] for _ in range(n)]
    for b in seg["blocks"]:
        lo, hi = b["address"] - base, b["address"] - base + b["size"]
        for k in range(lo // page, (hi - 1) // page + 1):
            if not mapped[k] or aliased[k]:
                continue
            overlap = min(hi, (k + 1) * page) - max(lo, k * page)
            if b["state"] == "active_allocated":
                used[k] += overlap
                on_page[k].append(b)
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
