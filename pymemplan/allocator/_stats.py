"""Stats and snapshots of the live plugin, in PyTorch's shapes.

Under a pluggable allocator torch.cuda.memory_stats(), max_memory_allocated() and
torch.cuda.memory._snapshot() cannot see inside the allocator; these functions read the
same numbers from libpymemplan_alloc.so. None of them imports torch or initializes CUDA.
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import re
import sys
from typing import Any

from ..units import parse_bytes
from . import _library, _plans

_DEVICE_STRING = re.compile(r"^\s*(?:cuda(?::(\d+))?|(\d+))\s*$")


def _current_device() -> int:
    # Ask torch only if CUDA is already initialized there: torch.cuda.current_device() would
    # otherwise initialize CUDA, and then pymemplan.enable() could no longer take effect.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return 0


def device_index(device: Any = None) -> int:
    """A CUDA device index from None (the current device), 3, "cuda:3", "cuda" or torch.device."""
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise TypeError(f"not a CUDA device: {device!r}")
    if isinstance(device, int):
        index = device
    elif isinstance(device, str):
        m = _DEVICE_STRING.match(device)
        if m is None:
            raise ValueError(f"not a CUDA device: {device!r}; write 0, 'cuda' or 'cuda:0'")
        digits = m.group(1) or m.group(2)
        index = int(digits) if digits is not None else _current_device()
    elif hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        if device.type != "cuda":
            raise ValueError(f"not a CUDA device: {device!r}")
        index = device.index if device.index is not None else _current_device()
    else:
        raise TypeError(f"not a CUDA device: {device!r}; pass an int, 'cuda:N' or a torch.device")
    if index < 0:
        raise ValueError(f"a CUDA device index cannot be negative: {device!r}")
    return index


def _all_devices() -> list[int]:
    count = _library.load().pymemplan_device_count()
    return list(range(count)) if count > 0 else [0]  # no driver: device 0 reports zeros


def memory_stats(device: Any = None) -> "collections.OrderedDict[str, int]":
    """torch.cuda.memory_stats() for pymemplan: the same keys, sorted as torch sorts them.

    ``device`` here and in every function of this module: None (the current CUDA device, or
    0 before CUDA is initialized), an index, "cuda:N" or a torch.device. A device pymemplan
    has not allocated on yet reports zeros.
    """
    index = device_index(device)
    lib = _library.load()
    stats = _library.read_json(lib.pymemplan_stats_json, index, f"memory_stats(device={index})")
    return collections.OrderedDict(sorted(stats.items()))


def memory_allocated(device: Any = None) -> int:
    """Bytes in blocks handed out now (torch.cuda.memory_allocated())."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of memory_allocated() since the start or reset_peak_memory_stats()."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Any = None) -> int:
    """Bytes held from the device in segments, cached ones included (torch.cuda.memory_reserved())."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Any = None) -> int:
    """Peak of memory_reserved() since the start or reset_peak_memory_stats()."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Set every "peak" stat to its current value."""
    index = device_index(device)
    _library.check(_library.load().pymemplan_reset_peak_stats(index),
                   f"reset_peak_memory_stats(device={index})")


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zero the "allocated"/"freed" totals, retries, OOMs and device alloc/free counts."""
    index = device_index(device)
    _library.check(_library.load().pymemplan_reset_accumulated_stats(index),
                   f"reset_accumulated_memory_stats(device={index})")


def set_memory_limit(limit: int | str | None, device: Any = None) -> None:
    """Cap the bytes pymemplan reserves on a device: 20 << 30, "20GiB"; None or 0 lifts it.

    A request that would go over it runs the OOM ladder (free cached segments, retry) and
    then fails as an out-of-memory error whose message names the limit.
    """
    index = device_index(device)
    nbytes = 0 if limit is None else parse_bytes(limit)
    _library.check(_library.load().pymemplan_set_memory_limit(index, nbytes),
                   f"set_memory_limit({limit!r}, device={index})")


def empty_cache() -> None:
    """Give every wholly free cached segment of every device back to the driver."""
    _library.check(_library.load().pymemplan_empty_cache(-1), "empty_cache()")


def mark_step() -> None:
    """Tell the allocator that a training step starts here; optional, never needed.

    ``pymemplan-planned`` finds the repeated step in the stream of requests by itself; with
    marks it also takes the stretch between two marks as a step, cut at the mark, and serves
    the next steps from its plan sooner. The other policies ignore it, and it does nothing
    when pymemplan is not the active allocator, so a training loop may call it always::

        for batch in loader:
            pymemplan.mark_step()
            loss = model(batch).loss
            ...
    """
    from ._enable import is_enabled

    if is_enabled():
        _library.check(_library.load().pymemplan_mark_step(-1), "mark_step()")


def share_pages(device: Any = None) -> int:
    """Give back pages that tensors fill only partly; returns the bytes given back.

    Where two pages' live bytes lie at disjoint offsets, one page's bytes are copied into
    the other's free offsets and both addresses map that one page: no tensor moves. For
    policies with virtual memory (``pymemplan-vmm``, ``pymemplan-planned``, which also does
    this by itself when it arms a plan); 0 for the others. Useful after loading a model and
    optimizer state. It synchronizes the device first: call it where no other thread is
    launching work (not inside a CUDA graph capture).
    """
    from ._enable import is_enabled

    if not is_enabled():
        return 0
    index = -1 if device is None else device_index(device)
    given = ctypes.c_size_t(0)
    _library.check(_library.load().pymemplan_share_pages(index, ctypes.byref(given)),
                   f"share_pages(device={device!r})")
    return given.value


def save_plans(path: str | os.PathLike | None = None, device: Any = None) -> int:
    """Write the plans ``pymemplan-planned`` armed in this run on a device to `path` (text);
    returns how many. ``load_plans`` in a later run of the same job (a restart, the next run
    of a sweep with the same shapes) serves its first steps from them::

        pymemplan.enable("pymemplan-planned")
        if os.path.exists("plans.txt"):
            pymemplan.load_plans("plans.txt")
        train()
        pymemplan.save_plans("plans.txt")

    With several GPUs, save and load each device's plans in a file of its own.
    ``enable("pymemplan-planned", plans=path)`` does both by itself, saving at a normal exit;
    ``save_plans()`` with no path then saves to that file now (a job that may be killed by a
    signal calls it once its plans serve). Raises PluginError for another policy, or where
    nothing was allocated on the device yet, and ValueError for no path without plans=.
    """
    index = device_index(device)
    if path is None:
        from ._enable import _state

        if _state.plans is None:
            raise ValueError("save_plans() needs a path, or pymemplan.enable(..., plans=path) "
                             "first to save where that run loads its plans from")
        path = _plans.plan_path(_state.plans, index)
    text = _library.read_text(_library.load().pymemplan_export_plans, index,
                              f"save_plans(device={index})")
    _plans.write_atomic(path, text)
    return _plans.plan_count(text)


def load_plans(path: str | os.PathLike, device: Any = None) -> int:
    """Add the plans ``save_plans`` wrote (in an earlier run) to a device's allocator; returns
    how many were added. A plan is used once a step of this run has matched it, so plans of
    another workload cost nothing but the memory of their text.

    Raises FileNotFoundError, and PluginError for text save_plans did not write (nothing is
    added then) or a policy other than ``pymemplan-planned``.
    """
    from ._enable import is_enabled

    if not is_enabled():
        raise RuntimeError("load_plans: pymemplan is not PyTorch's allocator; call "
                           "pymemplan.enable('pymemplan-planned') first")
    index = device_index(device)
    with open(path) as f:
        text = f.read()
    added = ctypes.c_size_t(0)
    _library.check(_library.load().pymemplan_import_plans(index, text.encode(), ctypes.byref(added)),
                   f"load_plans({os.fspath(path)!r}, device={index})")
    return added.value


def last_error() -> str:
    """The plugin's last error in this thread (e.g. the OOM message under oom_action:null), or ""."""
    return _library.last_error()


def mapped_ranges(segment: dict[str, Any]) -> list[dict[str, Any]]:
    """A segment as PyTorch's snapshot has it. A virtual segment (its pages mapped on
    demand) becomes one segment per run of mapped pages, as PyTorch reports its expandable
    segments, so that the sizes of a snapshot's segments add up to the memory reserved (in
    ``torch.cuda._memory_viz`` and at pytorch.org/memory_viz) rather than to the address
    space; free blocks are cut to the run. Each keeps its pages' flags (``page_mapped``, all
    true, and ``page_aliased``: a page another address holds too, counted once, there, in
    ``mapped_size``) for `pymemplan explain`. A segment of whole memory is returned as it is."""
    mapped = segment.get("page_mapped")
    if not mapped:
        return [segment] if mapped is None else []
    page, base = segment["page_size"], segment["address"]
    aliased = segment.get("page_aliased") or [False] * len(mapped)
    out, k = [], 0
    while k < len(mapped):
        if not mapped[k]:
            k += 1
            continue
        end = k
        while end < len(mapped) and mapped[end]:
            end += 1
        lo, hi = base + k * page, base + end * page
        blocks = []
        for b in segment["blocks"]:
            start, stop = max(b["address"], lo), min(b["address"] + b["size"], hi)
            if start >= stop:
                continue
            cut = dict(b, address=start, size=stop - start)
            if (start, stop) != (b["address"], b["address"] + b["size"]):
                cut["requested_size"] = 0  # only free blocks reach past mapped pages
            blocks.append(cut)
        flags = aliased[k:end]
        out.append(dict(
            segment, address=lo, total_size=hi - lo, page_mapped=[True] * (end - k),
            page_aliased=flags, mapped_size=(end - k - sum(flags)) * page, blocks=blocks,
            allocated_size=sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            active_size=sum(b["size"] for b in blocks if b["state"].startswith("active")),
            requested_size=sum(b["requested_size"] for b in blocks)))
        k = end
    return out


def snapshot(device: Any = None) -> dict[str, Any]:
    """The allocator's segments and blocks, in torch.cuda.memory._snapshot() shape.

    device=None takes every device, as torch's snapshot does; an index takes one. Each
    segment carries "device". "device_traces" has one list per device: its allocation
    history, where record_memory_history() keeps one (else empty). "allocator_settings"
    names pymemplan's policy ("pymemplan_policy"), so that `pymemplan explain` replays the
    history under it as the recorded allocator.
    """
    lib = _library.load()
    devices = _all_devices() if device is None else [device_index(device)]
    segments, traces, policy = [], [[] for _ in range(max(devices) + 1)], None
    for index in devices:
        part = _library.read_json(lib.pymemplan_snapshot_json, index, f"snapshot(device={index})")
        policy = part.get("policy") or policy
        for segment in part["segments"]:
            segment["device"] = index
            segments.extend(mapped_ranges(segment))
        traces[index] = _library.read_json(lib.pymemplan_history_json, index,
                                           f"history(device={index})")
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "pymemplan_policy": policy}}


def record_memory_history(max_entries: int = 100_000, device: Any = None) -> None:
    """Keep the last `max_entries` allocations, frees and out-of-memory errors of pymemplan's
    allocator (of `device`; every device by default), in snapshot()'s "device_traces", as
    ``torch.cuda.memory._record_memory_history(max_entries=...)`` does for PyTorch's own
    allocator (which, under a pluggable allocator, records nothing). ``max_entries=0`` stops
    and forgets. A snapshot saved with it (save_snapshot) is what ``pymemplan explain``
    replays under the other allocators. No stacks are recorded."""
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
        raise ValueError(f"max_entries must be an integer >= 0, got {max_entries!r}")
    lib = _library.load()
    index = -1 if device is None else device_index(device)
    _library.check(lib.pymemplan_record_history(index, max_entries),
                   f"record_memory_history(device={device!r})")


def explain_memory(device: Any = None, *, compare: bool = True, capacity=None):
    """What reserved memory holds now on `device`: live, rounding, pending frees, cached,
    fragments, and the segments or pages holding the most fragments
    (pymemplan.traces.explain_snapshot). Of pymemplan's pool where it is in use, else of
    PyTorch's own allocator once it has initialized CUDA. At an out-of-memory error,
    ``print(pymemplan.explain_memory())`` says what "reserved but unallocated" is made of;
    where allocation history is recorded (``torch.cuda.memory._record_memory_history()``, or
    record_memory_history() under pymemplan) and `compare`, also which allocator would have
    fit its requests (`fit`), on `capacity` or the memory the last OOM had.

    Raises ValueError where the device has no memory reserved."""
    from ..traces.explain import explain_snapshot
    from ._enable import is_enabled

    index = device_index(device)
    torch = sys.modules.get("torch")
    if not is_enabled() and torch is not None and torch.cuda.is_initialized():
        snap = torch.cuda.memory._snapshot()
    else:
        snap = snapshot(index)
    return explain_snapshot(snap, device=index, compare=compare, capacity=capacity)


def save_snapshot(path: str | os.PathLike[str]) -> None:
    """Pickle snapshot() of every device to `path`, as torch.cuda.memory._dump_snapshot does.

    Read it with `python -m torch.cuda._memory_viz stats PATH` or at pytorch.org/memory_viz.
    """
    data = snapshot()
    with open(path, "wb") as f:
        pickle.dump(data, f)


# --- memory_summary: the layout of torch.cuda.memory_summary() ---

_WIDTH = 75


def _format_size(n: int, reference: int) -> str:
    # The unit follows the row's first value, so a column of one row reads in one unit.
    units = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    unit = 0
    while unit + 1 < len(units) and reference >= 768 * 1024:
        unit += 1
        n //= 1024
        reference //= 1024
    return f"{n:6d} {units[unit]}"


def _format_count(n: int, reference: int) -> str:
    units = [" ", "K", "M"]
    unit = 0
    while unit + 1 < len(units) and reference >= 750 * 1000:
        unit += 1
        n //= 1000
        reference //= 1000
    return f"{n:7d} {units[unit]} "


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A readable table of memory_stats(), laid out like torch.cuda.memory_summary()."""
    index = device_index(device)
    stats = memory_stats(index)

    def line(text: str = "", fill: str = " ") -> str:
        return "|" + text.ljust(_WIDTH, fill) + "|"

    rule, double_rule = line(fill="-"), line(fill="=")
    out = [double_rule,
           line(f"pymemplan CUDA memory summary, device ID {index}".center(_WIDTH)),
           rule,
           line(f"  {'':9} CUDA OOMs: {stats.get('num_ooms', 0):<12d} | "
                f"{'':6} cudaMalloc retries: {stats.get('num_alloc_retries', 0):<8d}"),
           line(f"  {'':5} Device allocs: {stats.get('num_device_alloc', 0):<12d} | "
                f"{'':12} Device frees: {stats.get('num_device_free', 0):<8d}"),
           double_rule,
           line("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")]
    metrics = [
        ("allocated_bytes", "Allocated memory", _format_size),
        ("active_bytes", "Active memory", _format_size),
        ("requested_bytes", "Requested memory", _format_size),
        ("reserved_bytes", "GPU reserved memory", _format_size),
        ("inactive_split_bytes", "Inactive split memory", _format_size),
        ("allocation", "Allocations", _format_count),
        ("active", "Active allocs", _format_count),
        ("segment", "GPU reserved segments", _format_count),
        ("inactive_split", "Inactive split allocs", _format_count),
    ]
    columns = ("current", "peak", "allocated", "freed")
    for key, name, fmt in metrics:
        out.append(rule)
        pools = [("all", name)]
        if not abbreviated:
            pools += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        reference = [stats.get(f"{key}.all.{c}", 0) for c in columns]
        for pool, label in pools:
            cells = [fmt(stats.get(f"{key}.{pool}.{c}", 0), ref) for c, ref in zip(columns, reference)]
            out.append(line(f" {label:<21} | " + " | ".join(cells) + " "))
    for key, name in (("oversize_allocations", "Oversize allocations"),
                      ("oversize_segments", "Oversize GPU segments")):
        out.append(rule)
        values = [stats.get(f"{key}.{c}", 0) for c in columns]
        out.append(line(f" {name:<21} | " + " | ".join(_format_count(v, v) for v in values) + " "))
    out.append(double_rule)
    return "\n".join(out) + "\n"
