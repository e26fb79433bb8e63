"""Allocation traces from PyTorch memory snapshots.

``torch.cuda.memory._record_memory_history()`` makes the CUDA caching allocator keep a
ring buffer of its recent actions; ``torch.cuda.memory._snapshot()`` returns them (and
the current segments) as plain dicts and lists, and ``_dump_snapshot(path)`` pickles
that. ``device_traces[d]`` is device ``d``'s list of entries, each a dict with
``action``, ``addr``, ``size``, ``stream``, ``time_us`` and ``frames``.

We keep what the *program* asked for, not what the recorded allocator decided:

* ``alloc`` -> ALLOC.
* ``free_completed`` -> FREE. ``free_requested`` is ignored: a block is reusable only
  once the streams that used it are done, which is when the free completes.
* ``oom`` -> ALLOC_FAILURE (pointer 0; ``size`` is the request that failed).
* ``segment_*``, ``snapshot``, ``annotate``: ignored (allocator decisions, markers).

The ring buffer may begin mid-run: a ``free_completed`` of a block allocated before it
is dropped and counted in ``meta["dropped_frees"]``. Blocks live at the end stay live.
"""

from __future__ import annotations

import io
import os
import pickle

import numpy as np

from ._files import read_bytes, trace_name
from ._pairing import pair_events
from .trace import ALLOC, ALLOC_FAILURE, FREE, Trace, TraceError

_KEPT = {"alloc": ALLOC, "free_completed": FREE, "oom": ALLOC_FAILURE}
_IGNORED = {"free_requested", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "snapshot", "annotate"}


class _PlainDataUnpickler(pickle.Unpickler):
    """A snapshot holds only dicts, lists, strings and numbers, so no class is ever
    needed; refusing all of them means a hostile pickle cannot run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"the pickle asks for {module}.{name}; a memory snapshot holds only plain "
            f"dicts and lists, and other pickles are not loaded because they can run code")


def _unpickle(path: str | os.PathLike, data: bytes | None) -> object:
    if data is None:
        data = read_bytes(path)
    try:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # pickle raises many types on bad input; all mean "not a snapshot"
        raise TraceError(f"{path}: cannot unpickle a memory snapshot: {e}") from None


def load_snapshot_segments(path: str | os.PathLike) -> dict:
    """A snapshot dict whose segments are what is wanted (not its history): a pickle file
    (gzipped or not) with a 'segments' list, as torch.cuda.memory._dump_snapshot and
    pymemplan.save_snapshot write."""
    snap = _unpickle(path, None)
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise TraceError(f"{path}: not a memory snapshot (no 'segments' list); write one with "
                         f"torch.cuda.memory._dump_snapshot(path) or pymemplan.save_snapshot(path)")
    return snap


def load_snapshot(path: str | os.PathLike, data: bytes | None = None) -> dict:
    """The snapshot dict from a pickle file (gzipped or not), checked to be one.
    ``data``: the file's content when the caller has already read it."""
    snap = _unpickle(path, data)
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise TraceError(
            f"{path}: not a PyTorch memory snapshot with allocation history (no "
            f"'device_traces'); record one with torch.cuda.memory._record_memory_history() "
            f"then torch.cuda.memory._dump_snapshot(path)")
    if not isinstance(snap["device_traces"], list) or not all(
            isinstance(d, list) for d in snap["device_traces"]):
        raise TraceError(f"{path}: 'device_traces' must be a list (one per device) of lists of events")
    return snap


def snapshot_devices(snap: dict) -> dict[int, int]:
    """Devices with allocation events, and how many (alloc, free_completed, oom) each has."""
    counts = {}
    for d, events in enumerate(snap["device_traces"]):
        n = sum(1 for e in events if isinstance(e, dict)
                and isinstance(e.get("action"), str) and e["action"] in _KEPT)
        if n:
            counts[d] = n
    return counts


def read_snapshot_pickle(path: str | os.PathLike, device: int | str | None = None, *,
                         name: str | None = None, data: bytes | None = None) -> Trace:
    """Read one device's allocation trace from a ``torch.cuda.memory._dump_snapshot`` pickle.

    ``device``: an index (``1``) or ``"cuda:1"``; by default the device with the most
    allocation events. Times are seconds from the device's first kept event
    (``meta["time_origin_us"]`` holds that event's ``time_us``). ``data``: the file's
    content when the caller has already read it.
    """
    snap = load_snapshot(path, data)
    traces = snap["device_traces"]
    counts = snapshot_devices(snap)
    if device is None:
        if not counts:
            dev = 0
            if not traces:
                raise TraceError(f"{path}: the snapshot's 'device_traces' is empty: allocation "
                                 f"history was not recorded (call torch.cuda.memory."
                                 f"_record_memory_history() before the run)")
        else:
            dev = max(counts, key=lambda d: (counts[d], -d))
    else:
        dev = _device_index(device)
        if not 0 <= dev < len(traces):
            have = ", ".join(f"{d} ({n} events)" for d, n in counts.items()) or "none with events"
            raise TraceError(f"{path}: no device {device!r} in the snapshot; it has "
                             f"{len(traces)} device trace(s): {have}")
    return _device_trace(path, traces[dev], dev, counts, name or trace_name(path))


def _device_index(device) -> int:
    if isinstance(device, bool):
        raise TraceError(f"device must be an index or 'cuda:N', got {device!r}")
    if isinstance(device, int):
        return device
    text = str(device)
    head, _, idx = text.rpartition(":")
    if head in ("", "cuda") and idx.isdigit():
        return int(idx)
    raise TraceError(f"device must be an index or 'cuda:N', got {device!r}")


def _device_trace(path, events: list, dev: int, counts: dict, name: str) -> Trace:
    actions, ptrs, sizes, streams, times, source_index = [], [], [], [], [], []
    where = f"{path}: device {dev}"
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceError(f"{where}, event {i}: expected a dict, got {type(e).__name__}")
        act = e.get("action")
        if not isinstance(act, str):
            raise TraceError(f"{where}, event {i}: 'action' must be a string (such as "
                             f"'alloc' or 'free_completed'), got {type(act).__name__}")
        if act in _IGNORED:
            continue
        code = _KEPT.get(act)
        if code is None:
            raise TraceError(f"{where}, event {i}: unknown action {act!r} (expected one of: "
                             f"{', '.join(sorted([*_KEPT, *_IGNORED]))})")
        size = _int_field(e, "size", where, i)
        if size < 0:
            raise TraceError(f"{where}, event {i}: negative size {size} in {act!r}")
        # An oom entry has no address (its 'addr' field, if any, is free device memory).
        addr = 0 if code == ALLOC_FAILURE else _int_field(e, "addr", where, i)
        if addr < 0:
            raise TraceError(f"{where}, event {i}: negative address {addr}")
        stream = _int_field(e, "stream", where, i, default=0)
        t = e.get("time_us", 0)
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            raise TraceError(f"{where}, event {i}: 'time_us' is {t!r}, expected a number")
        actions.append(code)
        ptrs.append(addr)
        sizes.append(size)
        streams.append(stream)
        times.append(t)
        source_index.append(i)

    action = np.array(actions, dtype=np.uint8)
    ptr = np.array(ptrs, dtype=np.int64)
    size = np.array(sizes, dtype=np.int64)
    at = lambda k: f"{where}, event {source_index[k]}"  # noqa: E731
    pairing = pair_events(action, ptr, size, at, refer=lambda k: f"event {source_index[k]}",
                          drop_unknown_frees=True)
    keep = pairing.keep
    time_us = np.array(times, dtype=np.float64)[keep]
    origin = float(time_us[0]) if len(time_us) else 0.0
    meta = {
        "format": "torch-snapshot", "source": str(path), "device": dev,
        "devices": dict(counts), "time_origin_us": origin,
        "dropped_frees": pairing.dropped_frees,
        "dropped_free_bytes": pairing.dropped_free_bytes,
        "zero_size_allocs": pairing.zero_size_allocs,
    }
    return Trace(action[keep], ptr[keep], pairing.size[keep],
                 np.array(streams, dtype=np.int64)[keep], (time_us - origin) / 1e6,
                 name=name, meta=meta)


def _int_field(e: dict, key: str, where: str, i: int, default=None) -> int:
    v = e.get(key, default)
    if v is None:
        raise TraceError(f"{where}, event {i}: {e.get('action')!r} entry has no {key!r}")
    if not isinstance(v, int) or isinstance(v, bool):
        raise TraceError(f"{where}, event {i}: {key!r} is {v!r}, expected an integer")
    if v > 2**63 - 1:
        raise TraceError(f"{where}, event {i}: {key!r} {v} does not fit in 64 signed bits")
    return v
