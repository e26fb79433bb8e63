"""Would the same requests have fit under another allocator?

An out-of-memory error is a verdict on a request *and* an allocator: the same program may
have run under another one, or under PyTorch's with other settings. Given the requests (a
trace; for a snapshot, its history, with the blocks made before it), each policy is
replayed on a simulated device of the capacity the program had, with the requests that
failed asked again, and on devices of every size down to the smallest that holds its
requests. The model of the recorded allocator starts from the layout the snapshot says the
run had where the history begins; the others, whose layout of those blocks nothing
recorded, place them first, in address order:

    fit = compare_fit(read_trace("oom.pickle"), capacity="79GiB")
    print(fit)        # a row per allocator: peak reserved, smallest device, fits or not

A failed request is asked again where it failed, and freed at once: the recorded program
stopped there (or went another way), so nothing says how long it would have lived; the
verdict is about the requests the program made, that one included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .. import _core
from ..units import format_bytes, parse_bytes
from .replay import parse_policy
from .trace import ALLOC, ALLOC_FAILURE, FREE, Trace

# The most pages a simulated device models (simulated_device.hpp: kMaxPages).
_MAX_PAGES = 1 << 25

# What users pick between, besides the recorded allocator.
OTHER_POLICIES = ("torch=expandable_segments:True", "pymemplan", "pymemplan-vmm",
                  "pymemplan-planned")


@dataclass
class AllocatorFit:
    """One allocator's verdict on a trace's requests."""
    policy: str                 # a replay policy ("torch=expandable_segments:True", ...)
    peak_reserved_bytes: int    # with memory to spare
    # The smallest device (a multiple of the granularity) found to hold every request, by
    # bisection between the live peak and peak_reserved_bytes; failing is not monotone in
    # the capacity for every allocator, so a smaller one may happen to run too. None: not
    # even the largest device the simulation models (64 TiB of 2 MiB pages) holds them, or
    # not asked for (compare_fit's smallest=False).
    smallest_device_bytes: int | None
    ooms: int | None = None     # requests refused on the device of `capacity_bytes`
    fits: bool | None = None    # all served there; None where no capacity is known


@dataclass
class FitComparison:
    """Every allocator's verdict on one trace (compare_fit)."""
    trace: str
    events: int
    peak_live_bytes: int        # the lower bound: no allocator holds less
    capacity_bytes: int | None
    capacity_source: str        # where the capacity comes from, in words
    failed_requests: int        # requests the recorded allocator refused, asked again here
    rows: list[AllocatorFit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    advice: str | None = None   # how to switch to the allocator that fits with least change

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        where = ("" if self.capacity_bytes is None else
                 f" on a device of {format_bytes(self.capacity_bytes)} ({self.capacity_source})")
        asked = (f", the {self.failed_requests:,} that failed asked again"
                 if self.failed_requests else "")
        out = [f"{self.trace}: the same {self.events:,} events{asked}, under each allocator{where}:"]
        width = max(len(r.policy) for r in self.rows) if self.rows else 10
        for r in self.rows:
            verdict = "" if r.fits is None else (
                "  fits" if r.fits else f"  does not fit ({r.ooms:,} request(s) refused)")
            runs = ("no device" if r.smallest_device_bytes is None
                    else format_bytes(r.smallest_device_bytes))
            out.append(f"  {r.policy:<{width}}  peak reserved {format_bytes(r.peak_reserved_bytes):>11}"
                       f"  runs on {runs:>11}{verdict}")
        out.append(f"  {'live bytes':<{width}}  peak          {format_bytes(self.peak_live_bytes):>11}"
                   "  (no allocator holds less)")
        out.extend(f"  {n}" for n in self.notes)
        if self.advice:
            out.append(f"  What to do: {self.advice}")
        return out


def retry_failures(trace: Trace) -> Trace:
    """The trace with each refused request (ALLOC_FAILURE) asked again, and freed at once,
    under a pointer no other block has."""
    fail = np.flatnonzero(trace.action == ALLOC_FAILURE)
    if not len(fail):
        return trace
    n = len(trace) + len(fail)
    # Each failure i becomes two events: an allocation at its place, its free right after.
    at = np.arange(len(trace)) + np.searchsorted(fail, np.arange(len(trace)), side="left")
    fresh = (int(trace.ptr.max(initial=0)) + 1 + np.arange(len(fail))).astype(np.int64)
    action = np.empty(n, np.uint8)
    ptr = np.empty(n, np.int64)
    size = np.empty(n, np.int64)
    stream = np.empty(n, np.int64)
    time = np.empty(n, np.float64)
    for col, src in ((action, trace.action), (ptr, trace.ptr), (size, trace.size),
                     (stream, trace.stream), (time, trace.time)):
        col[at] = src
    alloc_at = at[fail]
    action[alloc_at], ptr[alloc_at] = ALLOC, fresh
    action[alloc_at + 1], ptr[alloc_at + 1] = FREE, fresh
    for col, src in ((size, trace.size), (stream, trace.stream), (time, trace.time)):
        col[alloc_at + 1] = src[fail]
    return Trace(action, ptr, size, stream, time, name=trace.name, meta=dict(trace.meta))


def compare_fit(trace: Trace, *, capacity=None, policies=None, recorded: str | None = None,
                granularity="2MiB", capacity_source: str = "given",
                smallest: bool = True, recorded_layout: list | None = None) -> FitComparison:
    """Each allocator's verdict on `trace`'s requests, the refused ones asked again.

    `capacity`: the device's memory for the program (bytes or "79GiB"); with it, each row
    says whether every request is served on it. `policies`: replay policies (default: the
    `recorded` one, PyTorch's as the run had it, e.g. "torch=expandable_segments:True",
    then PyTorch's with expandable segments, pymemplan, pymemplan-vmm and
    pymemplan-planned). Each row also has the smallest device that holds every request
    (`smallest`; else None: a dozen replays fewer each). `recorded_layout`: where `trace`
    begins with blocks made before it (``meta["earlier_blocks"]``), the layout the recorded
    allocator had for them (``snapshot.history_start_layout``): its row starts from that
    layout instead of placing them itself.

    Raises ValueError for a bad policy or capacity, TraceError for a malformed trace."""
    cap = None if capacity is None else parse_bytes(capacity)
    if cap is not None and cap <= 0:
        raise ValueError(f"capacity must be > 0 bytes, got {capacity!r}")
    gran = parse_bytes(granularity)
    if policies is None:
        policies = [recorded or "torch"]
        policies += [p for p in ("torch", *OTHER_POLICIES) if p not in policies]
    parsed = []
    for spec in policies:
        try:
            parsed.append((spec, *parse_policy(spec)))
        except _core.AllocatorError as e:
            raise ValueError(f"policy {spec!r}: {e}") from None
    trace.validate()
    failed = int((trace.action == ALLOC_FAILURE).sum())
    asked = retry_failures(trace)
    live = asked.peak_live_bytes()

    # The recorded allocator's row: the history without the blocks placed first, which the
    # layout holds instead.
    skip = int(trace.meta.get("earlier_blocks", 0)) if recorded_layout is not None else 0
    cols = (asked.action[skip:], asked.ptr[skip:], asked.size[skip:], asked.stream[skip:])

    def run(name, config, capacity_bytes, spec=None):
        try:
            if recorded_layout is not None and spec == recorded:
                return _core.replay(*cols, name, config, capacity_bytes, gran,
                                    layout=recorded_layout)
            return _core.replay(asked.action, asked.ptr, asked.size, asked.stream, name, config,
                                capacity_bytes, gran)
        except _core.AllocatorError as e:  # a capacity or granularity the device cannot model
            raise ValueError(str(e)) from None

    # Memory to spare: more than any allocator reserves for these requests (a segment or
    # page per request at most, over twice the live peak).
    ample = max(2 * live + int(asked.size.max(initial=0)) + 64 * gran, 1 << 30)
    ample = min(-(-ample // gran) * gran, _MAX_PAGES * gran)
    out = FitComparison(trace=trace.name, events=len(trace), peak_live_bytes=live,
                        capacity_bytes=cap, capacity_source=capacity_source if cap else "",
                        failed_requests=failed)
    for spec, name, config in parsed:
        spare = run(name, config, ample, spec)
        reserved = spare["peak_reserved_bytes"]
        least = None if spare["ooms"] or not smallest else _smallest_device(
            lambda c: run(name, config, c, spec)["ooms"] == 0, live, reserved, gran, ample)
        row = AllocatorFit(spec, reserved, least)
        if cap is not None:
            row.ooms = run(name, config, cap, spec)["ooms"]
            row.fits = row.ooms == 0
        out.rows.append(row)
    # The recorded allocator's row, where it was among those asked for: not the first row.
    rec = next((r for r in out.rows if recorded is not None and r.policy == recorded), None)
    if cap is not None and failed and rec is not None and rec.fits:
        why = ("the blocks made before the history began are placed together here, where the "
               "run's own layout of them left holes, or " if trace.meta.get("earlier_blocks") else "")
        out.notes.append(
            f"The model of the recorded allocator ({rec.policy}) serves every request on this "
            f"device, where the run failed: {why}memory outside these blocks was in use "
            f"(another memory pool, CUDA graphs, NCCL, other processes), or the capacity is "
            f"overstated. A longer history (max_entries), or the device's memory as the "
            f"capacity, makes the comparison closer.")
    if cap is not None and failed:
        out.advice = _advice([r for r in out.rows if r.policy != recorded], out.rows, cap, live)
    if trace.meta.get("earlier_blocks"):
        out.notes.append(
            f"{trace.meta['earlier_blocks']:,} block(s) ({format_bytes(trace.meta['earlier_bytes'])}) "
            f"were made before the history began; they are placed first, in address order, so "
            f"how they lie is an estimate (their bytes are exact).")
    return out


def _how_to_use(policy: str) -> str:
    """The setting that makes a program run under a replay policy."""
    name, _, config = policy.partition("=")
    if name == "torch":
        return f"set PYTORCH_CUDA_ALLOC_CONF={config} before the program starts" if config \
            else "use PyTorch's allocator with its defaults (unset PYTORCH_CUDA_ALLOC_CONF)"
    conf = ",".join(filter(None, [f"policy:{name}", config]))
    def literal(v: str) -> str:
        return v if v.isdigit() or v in ("True", "False") else repr(v)

    kwargs = "".join(f", {k}={literal(v)}"
                     for k, _, v in (i.partition(":") for i in config.split(",") if i))
    return (f'call pymemplan.enable("{name}"{kwargs}) before CUDA is first used, or run with '
            f'PYMEMPLAN_ENABLE=1 PYMEMPLAN_ALLOC_CONF="{conf}"')


# Which of the allocators that fit to advise: a setting of PyTorch's first, then ours, the
# one that holds least first.
_PREFERENCE = {"torch": 0, "pymemplan-vmm": 1, "pymemplan-planned": 2, "pymemplan": 3}


def _advice(others: list[AllocatorFit], rows: list[AllocatorFit], cap: int, live: int) -> str:
    """How to switch to the allocator among `others` that fits with least change; where none
    does, the least device any of `rows` needs."""
    fitting = [r for r in others if r.fits]
    if fitting:
        best = min(fitting, key=lambda r: _PREFERENCE.get(r.policy.partition("=")[0], 9))
        room = ("" if best.smallest_device_bytes is None else
                f" (it runs on {format_bytes(best.smallest_device_bytes)}, "
                f"{format_bytes(cap - best.smallest_device_bytes)} less than this device)")
        return f"{_how_to_use(best.policy)}{room}."
    ran = [r for r in rows if r.smallest_device_bytes is not None]
    need = min(ran, key=lambda r: r.smallest_device_bytes) if ran else None
    least = ("" if need is None else
             f"; the least any needs is {format_bytes(need.smallest_device_bytes)} ({need.policy})")
    return (f"no allocator fits these requests on {format_bytes(cap)}: their live bytes alone "
            f"peak at {format_bytes(live)}{least}. Bring the peak down: `pymemplan plan` traces "
            f"precision, checkpointing, batch size and sharding on your model.")


def _smallest_device(runs, live: int, reserved: int, gran: int, ample: int) -> int:
    """The smallest multiple of `gran` found by bisection at which runs(capacity) holds,
    between the live peak (below which nothing runs) and `reserved` (the peak with memory to
    spare, at which it runs, unless a limit changes the allocator's course: then above)."""
    lo = max(live - 1, 0) // gran * gran  # below the live peak: nothing runs
    hi = max(-(-reserved // gran) * gran, lo + gran)
    while not runs(hi):
        if hi >= ample:
            return ample
        lo, hi = hi, min(hi + 2 * (hi - lo), ample)
    while hi - lo > gran:  # invariant: not runs(lo), runs(hi)
        mid = (lo + hi) // 2 // gran * gran
        if runs(mid):
            hi = mid
        else:
            lo = mid
    return hi


def snapshot_fit(snapshot, *, device: int | None = None, capacity=None, policies=None,
                 granularity="2MiB", name: str | None = None,
                 where: str | None = None) -> FitComparison:
    """compare_fit over a snapshot's allocation history (a dict, as
    ``torch.cuda.memory._snapshot()`` returns, or the path of a pickle of one), with the
    blocks made before the history placed first.

    The recorded allocator is PyTorch's as the snapshot's ``allocator_settings`` say it was
    set (PyTorch 2.5 and later record them; else its defaults). `capacity`, if not given, is
    what PyTorch could have had at the history's last out-of-memory error: what it had
    reserved then, plus what the driver reported free. `device`: by default the device with
    the most allocation events.

    Raises TraceError where the snapshot has no allocation history on the device (record it
    with ``torch.cuda.memory._record_memory_history()``) or one that cannot be replayed,
    ValueError for bad arguments.
    `name` names the trace in the text (default: the file's name); `where`, a snapshot dict
    in error messages (default: "snapshot")."""
    import os

    from .replay import torch_policy_from_conf
    from .snapshot import (history_start_layout, load_snapshot, snapshot_allocator_conf,
                           snapshot_oom_capacity, snapshot_trace)
    from .trace import TraceError

    if isinstance(snapshot, (str, os.PathLike)):
        where = str(snapshot)
        snap = load_snapshot(snapshot)
    else:
        where, snap = where or "snapshot", snapshot
    trace = snapshot_trace(snap, device, name=name or os.path.basename(where), where=where)
    dev = trace.meta["device"]
    if not trace.meta["devices"].get(dev):
        raise TraceError(f"{where}: no allocation history on device {dev}: record it with "
                         f"torch.cuda.memory._record_memory_history(max_entries=...) before the "
                         f"run, so that its requests can be replayed under other allocators")
    conf = snapshot_allocator_conf(snap)
    ours = (snap.get("allocator_settings") or {}).get("pymemplan_policy")
    if isinstance(ours, str) and ours:  # pymemplan.save_snapshot: the plugin's own policy
        try:
            parse_policy(ours)
        except _core.AllocatorError as e:  # the snapshot's fault, not the caller's
            raise TraceError(f"{where}: the snapshot's pymemplan policy {ours!r}: {e}") from None
        name, _, config = ours.partition("=")
        # Named alone where its config is the policy's default.
        default = _core.parse_config(name, "") == _core.parse_config(name, config)
        recorded, left = (name if default else ours), []
    else:
        recorded, left = torch_policy_from_conf(conf)
    source = "given"
    if capacity is None:
        at_oom = snapshot_oom_capacity(snap, dev)
        if at_oom is not None:
            capacity = at_oom[0]
            source = (f"at the out-of-memory error: {format_bytes(at_oom[1])} reserved + "
                      f"{format_bytes(at_oom[2])} free")
    layout = None
    if trace.meta.get("earlier_blocks") and recorded.partition("=")[0] == "torch" \
            and "expandable_segments:True" not in recorded:
        layout = history_start_layout(snap, trace)
    fit = compare_fit(trace, capacity=capacity, policies=policies, recorded=recorded,
                      granularity=granularity, capacity_source=source, recorded_layout=layout)
    if layout is not None and any(r.policy == recorded for r in fit.rows):
        fit.notes = [n for n in fit.notes if "were made before the history began" not in n]
        fit.notes.append(
            f"{trace.meta['earlier_blocks']:,} block(s) ({format_bytes(trace.meta['earlier_bytes'])}) "
            f"were made before the history began: {recorded} starts from the layout the run had "
            f"then (the snapshot's segments, less those the history made, with those blocks at "
            f"their addresses); the others place them first, in address order, so how they lie "
            f"there is an estimate (their bytes are exact).")
    if conf is None:
        fit.notes.append("The snapshot does not say how PyTorch's allocator was set (PyTorch "
                         "before 2.5): its defaults are assumed for the recorded run.")
    if left:
        fit.notes.append(f"Settings of the recorded run the model of PyTorch's allocator leaves "
                         f"out: {', '.join(left)}.")
    return fit


def oom_snapshot(trace: Trace, capacity, *, keep: int | None = None,
                 conf: str = "") -> tuple[dict, int]:
    """The snapshot PyTorch would dump at the first out-of-memory error of `trace` run on a
    device of `capacity` bytes, as the model of its allocator (PYTORCH_CUDA_ALLOC_CONF=`conf`)
    runs it: segments and blocks in ``torch.cuda.memory._snapshot()``'s format, and the
    allocation history of the last `keep` entries (all by default; PyTorch keeps
    ``max_entries``) with the segments made and given back, ending with the "oom" entry.
    For testing and measuring what a snapshot
    tells, where no GPU is at hand. Also returns the event of `trace` that failed.
    Raises ValueError where the trace runs on that device."""
    from .replay import parse_policy
    from .snapshot import segment_reserved

    cap = parse_bytes(capacity)
    name, config = parse_policy("torch=" + conf if conf else "torch")
    dev = _core.SimulatedDevice(cap)
    alloc = _core.Allocator(dev, name, config)
    history, addr = [], {}
    segments, reserved = {}, 0

    def segment_actions(i):
        # The segments made and given back since the last look, and the memory mapped into
        # or out of expandable ones, as PyTorch records them.
        nonlocal segments, reserved
        if alloc.reserved_bytes() == reserved:
            return
        now = {g["address"]: (segment_reserved(g), g["stream"]) for g in alloc.snapshot()["segments"]}
        for a in sorted(segments.keys() - now.keys()):
            history.append({"action": "segment_free", "addr": a, "size": segments[a][0],
                            "stream": segments[a][1], "time_us": i})
        for a in sorted(now.keys() & segments.keys()):
            grew = now[a][0] - segments[a][0]
            if grew:
                history.append({"action": "segment_map" if grew > 0 else "segment_unmap",
                                "addr": a, "size": abs(grew), "stream": now[a][1], "time_us": i})
        for a in sorted(now.keys() - segments.keys()):
            history.append({"action": "segment_alloc", "addr": a, "size": now[a][0],
                            "stream": now[a][1], "time_us": i})
        segments, reserved = now, alloc.reserved_bytes()

    rows = zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
               trace.stream.tolist())
    for i, (a, p, s, stream) in enumerate(rows):
        if a == ALLOC:
            try:
                addr[p] = alloc.malloc(s, stream)
            except _core.OutOfMemoryError:
                segment_actions(i)
                history.append({"action": "oom", "size": s, "stream": stream, "time_us": i,
                                "device_free": cap - alloc.reserved_bytes()})
                break
            segment_actions(i)
            history.append({"action": "alloc", "addr": addr[p], "size": s, "stream": stream,
                            "time_us": i})
        elif a == FREE:
            where = addr.pop(p)
            alloc.free(where)
            history.append({"action": "free_completed", "addr": where, "size": s,
                            "stream": stream, "time_us": i})
            segment_actions(i)
    else:
        raise ValueError(f"{trace.name} runs on {format_bytes(cap)} under {name}: no "
                         f"out-of-memory error to take a snapshot at")
    snap = alloc.snapshot()
    snap["device_traces"] = [history if keep is None else history[max(len(history) - keep, 0):]]
    snap["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": conf,
                                  "expandable_segments": "expandable_segments:True" in conf}
    return snap, i
