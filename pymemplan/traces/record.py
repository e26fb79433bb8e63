"""Recording the allocation trace of a real eager PyTorch run, on CPU or any device.

With ``profile_memory=True`` the PyTorch profiler receives every allocation and free
that an allocator reports (c10's ``reportMemoryUsageToProfiler``): the pointer, the
signed size, and the allocator's running total of allocated bytes after the event. The
profiler keeps these as ``Allocation`` events in its event tree
(``prof.profiler.kineto_results.experimental_event_tree()``, extra fields
``_ExtraFields_Allocation``: ``ptr``, ``alloc_size``, ``total_allocated``, ``device``).

Completeness is proved, not assumed: replaying the signed sizes in order must give the
allocator's own total after every event. A lost or misordered event breaks that sum at
the next event, and :class:`RecordingError` says where.

What the allocator itself cannot see stays unseen: on CPU, c10 tracks only allocations
made on threads the profiler is active on (the calling thread; CPU autograd runs there).
A block allocated on that thread and freed on another (a gloo worker under DDP) is
never reported freed; the allocator hands its pointer out again, which is how its free
is found (see :func:`trace_from_events`).

    with record() as rec:
        loss = model(x).sum(); loss.backward(); opt.step()
    trace = rec.trace
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .trace import ALLOC, FREE, Trace, TraceError


class RecordingError(TraceError):
    """The profiler's memory events do not account for the allocator's totals."""


class RecordingWarning(UserWarning):
    """A recording that is complete but holds an inferred event (see trace_from_events)."""


@dataclass(frozen=True)
class AllocationEvent:
    """One allocator report, as the profiler kept it."""

    time_ns: int
    ptr: int
    delta: int            # bytes: > 0 allocation, < 0 free
    total_allocated: int  # the allocator's allocated bytes after this event
    device: str           # "cpu", "cuda:0", ...


def allocation_events(prof) -> list[AllocationEvent]:
    """Every allocator report in a finished ``torch.profiler.profile``, in record order
    (the order of the profiler's event tree, which is sorted by start time)."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth-first, children in order: allocations live under their op
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            out.append(AllocationEvent(node.start_time_ns, f.ptr, f.alloc_size,
                                       f.total_allocated, str(f.device)))
        stack.extend(reversed(node.children))
    return out


def choose_device(events: Iterable[AllocationEvent], device: Any = None) -> str:
    """The device whose events make the trace.

    Explicit ``device`` wins (``"cpu"``, ``"cuda:0"``, a ``torch.device``). Otherwise the
    only device seen, or else the only non-CPU one (a GPU step also makes small CPU
    tensors, such as optimizer step counts, that belong to another allocator).
    """
    counts: dict[str, int] = {}
    for e in events:
        counts[e.device] = counts.get(e.device, 0) + 1
    if device is not None:
        want = str(device)
        if want == "cuda":
            want = "cuda:0"
        return want
    if len(counts) <= 1:
        return next(iter(counts), "cpu")
    accel = [d for d in counts if d != "cpu"]
    if len(accel) == 1:
        return accel[0]
    listing = ", ".join(f"{d} ({n} events)" for d, n in sorted(counts.items()))
    raise RecordingError(f"allocations on several devices: {listing}; "
                         f"pass device=... to choose the one to record")


def trace_from_events(events: list[AllocationEvent], device: Any = None,
                      name: str = "recorded") -> Trace:
    """Turn allocator reports into a verified :class:`Trace` for one device.

    Events are ordered by time (ties kept in record order, then settled by the totals).
    Each event's total must equal the total before it plus its size; otherwise the
    record is incomplete or misordered and :class:`RecordingError` names the event.
    Frees of blocks allocated before recording are dropped (counted in
    ``meta["dropped_frees"]``, ``meta["dropped_free_bytes"]``, and listed as (pointer,
    bytes) in ``meta["dropped_free_blocks"]``) but still enter the sum.
    A pointer allocated again while its block is live was freed where the profiler does
    not see (on another thread, which reports nothing, so the totals still agree): that
    free is put just before the new allocation, the latest it can have been (counted in
    ``meta["unseen_frees"]``, ``meta["unseen_free_bytes"]``).
    ``meta["baseline_bytes"]`` is the allocator's total when recording began, so the
    trace's live bytes after each event are ``total_allocated - baseline_bytes +
    dropped free bytes - unseen free bytes so far``.
    """
    dev = choose_device(events, device)
    evs = [e for e in events if e.device == dev]
    evs.sort(key=lambda e: e.time_ns)  # stable: ties keep the profiler's order
    evs = _settle_ties(evs)

    n = len(evs)
    rows: list[tuple[int, int, int, int]] = []  # action, ptr, size, time
    baseline = evs[0].total_allocated - evs[0].delta if evs else 0
    running = baseline
    peak_total = baseline
    live: dict[int, int] = {}
    dropped = dropped_bytes = unseen = unseen_bytes = 0
    dropped_blocks: list[tuple[int, int]] = []  # (pointer, bytes) of those frees
    for i, e in enumerate(evs):
        running += e.delta
        if running != e.total_allocated:
            raise RecordingError(
                f"{name}: {dev} allocation event {i} of {n} ({e.delta:+d} bytes at {e.ptr:#x}): "
                f"the events so far sum to {running} bytes but the allocator reports "
                f"{e.total_allocated}; the profiler missed or misordered an allocation "
                f"(allocations on another thread, or a second profiler running?)")
        peak_total = max(peak_total, running)
        if e.delta > 0:
            owned = live.pop(e.ptr, None)
            if owned is not None:  # freed on a thread the profiler does not see
                unseen += 1
                unseen_bytes += owned
                rows.append((FREE, e.ptr, owned, e.time_ns))
            live[e.ptr] = e.delta
            rows.append((ALLOC, e.ptr, e.delta, e.time_ns))
        elif e.delta < 0:
            owned = live.pop(e.ptr, None)
            if owned is None:  # allocated before recording began
                dropped += 1
                dropped_bytes -= e.delta
                dropped_blocks.append((e.ptr, -e.delta))
                continue
            if owned != -e.delta:
                raise RecordingError(f"{name}: {dev} allocation event {i}: free of {-e.delta} "
                                     f"bytes at {e.ptr:#x}, which was allocated with {owned}")
            rows.append((FREE, e.ptr, -e.delta, e.time_ns))
        # a zero-byte report holds nothing

    if unseen:
        warnings.warn(f"{name}: {unseen} block(s) ({unseen_bytes} bytes) were freed where the "
                      f"profiler does not see (another thread, such as DDP's gloo workers); each "
                      f"free is placed at the next allocation of its pointer, so those lifetimes "
                      f"are upper bounds (meta['unseen_frees'])", RecordingWarning, stacklevel=2)
    table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    t0 = table[0, 3] if len(table) else 0
    meta = {
        "format": "torch-profiler", "device": dev, "baseline_bytes": baseline,
        "peak_total_allocated": peak_total, "final_total_allocated": running,
        "dropped_frees": dropped, "dropped_free_bytes": dropped_bytes,
        "dropped_free_blocks": dropped_blocks,
        "unseen_frees": unseen, "unseen_free_bytes": unseen_bytes,
        "events": len(table),
    }
    return Trace(table[:, 0].astype(np.uint8), table[:, 1], table[:, 2],
                 np.zeros(len(table), np.int64), (table[:, 3] - t0) / 1e9, name=name, meta=meta)


def _settle_ties(evs: list[AllocationEvent]) -> list[AllocationEvent]:
    """Within runs of equal timestamps, order events so the running total matches.

    Events on different threads can share a clock tick; the allocator's total shows which
    came first. Greedy: repeatedly take the tied event whose total follows from the
    running total. If none does, keep the order and let the caller's check report it.
    """
    out: list[AllocationEvent] = []
    i = 0
    while i < len(evs):
        j = i + 1
        while j < len(evs) and evs[j].time_ns == evs[i].time_ns:
            j += 1
        group = evs[i:j]
        if len(group) > 1 and out:
            running = out[-1].total_allocated
            ordered = []
            while group:
                k = next((k for k, e in enumerate(group) if running + e.delta == e.total_allocated), 0)
                e = group.pop(k)
                ordered.append(e)
                running = e.total_allocated
            group = ordered
        out.extend(group)
        i = j
    return out


def quiet_profiler_logs() -> None:
    """Keep the PyTorch profiler's own log lines off stderr, unless the user has set
    ``KINETO_LOG_LEVEL``. Kineto (torch 2.14) prints two lines at every profiler start and
    stop, and an error on a machine without a GPU; the planner's kernel probe starts one
    profiler per op signature, hundreds per trace. Kineto reads the level at its first use
    in the process, so this acts only where pymemplan profiles first."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


class record:
    """Context manager recording every allocation and free of the code it wraps.

    ``device``: which device's allocator to record (see :func:`choose_device`).
    After the block, ``.trace`` is the verified :class:`Trace` and ``.profile`` the
    ``torch.profiler.profile`` it came from. Nothing is built if the block raises.
    Another profiler must not be running at the same time.
    """

    def __init__(self, device: Any = None, name: str = "recorded") -> None:
        self.device = device
        self.name = name
        self.trace: Trace | None = None
        self.profile = None

    def __enter__(self) -> "record":
        import torch
        from torch.profiler import ProfilerActivity, profile

        # A second profiler does not fail: it silently cancels the first one's session,
        # which would leave an empty or partial trace behind. Refuse instead.
        if torch._C._autograd._profiler_enabled():
            raise RecordingError("a PyTorch profiler is already running (torch.profiler.profile "
                                 "or another record()); stop it before recording")
        # CPU activity is enough: allocator reports (CUDA ones included) reach the
        # profiler from the calling thread. No shapes or stacks: less overhead.
        quiet_profiler_logs()
        self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                               record_shapes=False, with_stack=False)
        self._torch_version = torch.__version__
        self.profile.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.profile.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.trace = trace_from_events(allocation_events(self.profile), self.device, self.name)
            self.trace.meta["torch_version"] = self._torch_version


def record_step(fn: Callable, *args, device: Any = None, name: str | None = None,
                **kwargs) -> Trace:
    """Run ``fn(*args, **kwargs)`` once under :class:`record` and return its trace.

    What ``fn`` returns stays alive until recording stops, as it would for a caller, and
    is then released. (Use :class:`record` directly to keep it.)"""
    with record(device=device, name=name or getattr(fn, "__name__", "recorded")) as rec:
        result = fn(*args, **kwargs)  # noqa: F841 - held so its tensors end live
    return rec.trace
