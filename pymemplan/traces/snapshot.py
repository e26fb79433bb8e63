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
* ``segment_*``, ``snapshot``, ``annotate``, ``user_defined``: ignored (allocator decisions,
  markers; ``user_defined`` is what some 2.x releases write for an annotation).
* Any other action is refused (TraceError): it may change memory, in a PyTorch newer than
  this reader, and skipping it could make a replay wrong without a word.

The history may begin mid-run: the ring buffer keeps the last ``max_entries`` actions, and
recording often starts after the model is built. Blocks made before it are then still
memory the program held. By default (``earlier="place"``) they are allocated at the
history's start, in address order: those whose ``free_completed`` the history holds, and
those the snapshot's ``segments`` show in use at an address the history never names (the
weights, when recording began after the model was built); ``meta["earlier_blocks"]`` and
``meta["earlier_bytes"]`` count them. Their order and placement before the history are not
known, so a replay's layout of them is an estimate; the live bytes are exact.
``earlier="drop"`` leaves them out (frees dropped and counted in ``meta["dropped_frees"]``).
Blocks live at the end stay live.
"""

from __future__ import annotations

import bisect
import io
import os
import pickle

import numpy as np

from ..units import format_bytes
from ._files import read_bytes, trace_name
from ._pairing import pair_events
from .trace import ALLOC, ALLOC_FAILURE, FREE, Trace, TraceError

_KEPT = {"alloc": ALLOC, "free_completed": FREE, "oom": ALLOC_FAILURE}
_IGNORED = {"free_requested", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "snapshot", "annotate",
            # An annotation (record_function's start and end) under global_record_annotations=True
            # in the PyTorch 2.x releases that wrote it so; later ones write "annotate".
            "user_defined"}


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
    pymemplan.save_snapshot write, or of the list alone (torch.cuda.memory_snapshot()),
    checked as checked_segments does."""
    return checked_segments(_unpickle(path, None), str(path))


def checked_segments(snap, where: str = "snapshot") -> dict:
    """`snap` with its segments and their blocks checked to hold what reading them needs,
    once, so that a malformed snapshot is refused with what is wrong (TraceError) instead of
    failing midway. A list is the segments alone, as torch.cuda.memory_snapshot() returns
    them; PyTorch's _memory_viz reads it so too. `where` names it in messages."""
    if isinstance(snap, list):
        snap = {"segments": snap, "device_traces": []}
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise TraceError(
            f"{where}: not a memory snapshot (no 'segments' list): expected a dict with a "
            f"'segments' list, as torch.cuda.memory._snapshot() returns, or the list of segments "
            f"torch.cuda.memory_snapshot() returns; write one with "
            f"torch.cuda.memory._dump_snapshot(path) or pymemplan.save_snapshot(path)")
    for k, seg in enumerate(snap["segments"]):
        at = f"{where}: segment {k}"
        _check_fields(seg, at, _SEGMENT_FIELDS)
        if "device" in seg:
            _check(seg, "device", at, _is_count, "a device index")
        paged = "page_mapped" in seg  # pymemplan's virtual segments: memory is per page
        if paged:
            _check(seg, "page_mapped", at, lambda v: isinstance(v, list), "a list, a flag per page")
            _check(seg, "page_size", at, lambda v: _is_count(v) and v > 0, "an integer > 0")
            _check(seg, "mapped_size", at, _is_count, "an integer >= 0")
            aliased = seg.get("page_aliased")
            if aliased is not None and (not isinstance(aliased, list)
                                        or len(aliased) != len(seg["page_mapped"])):
                raise TraceError(f"{at}: 'page_aliased' is {aliased!r:.60}, expected a list of "
                                 f"{len(seg['page_mapped'])} flags, as 'page_mapped'")
            end = seg["address"] + len(seg["page_mapped"]) * seg["page_size"]
        for j, b in enumerate(seg["blocks"]):
            bat = f"{at}, block {j}"
            _check_fields(b, bat, _BLOCK_FIELDS)
            if b.get("requested_size") is not None:
                _check(b, "requested_size", bat, _is_count, "an integer >= 0")
            frames = b.get("frames")
            if frames is not None and (not isinstance(frames, list)
                                       or not all(isinstance(f, dict) for f in frames)):
                raise TraceError(f"{bat}: 'frames' is {frames!r:.60}, expected a list of dicts "
                                 f"(a stack, with 'filename', 'line' and 'name')")
            if paged and not seg["address"] <= b["address"] <= b["address"] + b["size"] <= end:
                raise TraceError(f"{bat} (at {b['address']:#x}, {format_bytes(b['size'])}) lies "
                                 f"outside the segment's {len(seg['page_mapped'])} page(s) of "
                                 f"{format_bytes(seg['page_size'])} from {seg['address']:#x}")
    return snap


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# What reading a segment and a block needs: (key, test, what is expected).
_SEGMENT_FIELDS = (("address", _is_count, "an integer >= 0"),
                   ("total_size", _is_count, "an integer >= 0"),
                   ("blocks", lambda v: isinstance(v, list), "a list of its blocks"))
_BLOCK_FIELDS = (("address", _is_count, "an integer >= 0"),
                 ("size", _is_count, "an integer >= 0"),
                 ("state", lambda v: isinstance(v, str), "a string such as 'active_allocated'"))


def _check_fields(d, at: str, fields) -> None:
    if not isinstance(d, dict):
        keys = ", ".join(repr(k) for k, _, _ in fields[:-1]) + f" and {fields[-1][0]!r}"
        raise TraceError(f"{at} is a {type(d).__name__}, expected a dict (with {keys})")
    for key, ok, expected in fields:
        _check(d, key, at, ok, expected)


def _check(d: dict, key: str, at: str, ok, expected: str) -> None:
    if key not in d:
        raise TraceError(f"{at} has no {key!r} (expected {expected})")
    if not ok(d[key]):
        raise TraceError(f"{at}: {key!r} is {d[key]!r:.60}, expected {expected}")


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
                         name: str | None = None, data: bytes | None = None,
                         earlier: str = "place") -> Trace:
    """Read one device's allocation trace from a ``torch.cuda.memory._dump_snapshot`` pickle.

    ``device``: an index (``1``) or ``"cuda:1"``; by default the device with the most
    allocation events. Times are seconds from the device's first kept event
    (``meta["time_origin_us"]`` holds that event's ``time_us``). ``data``: the file's
    content when the caller has already read it. ``earlier``: "place" (default) or "drop",
    what to do with blocks made before the history began (see the module's docstring).
    """
    if earlier not in ("place", "drop"):
        raise ValueError(f"earlier must be 'place' or 'drop', got {earlier!r}")
    snap = load_snapshot(path, data)
    return snapshot_trace(snap, device, name=name or trace_name(path), earlier=earlier,
                          where=str(path))


def snapshot_trace(snap: dict, device: int | str | None = None, *, name: str = "snapshot",
                   earlier: str = "place", where: str = "snapshot") -> Trace:
    """read_snapshot_pickle for a snapshot dict already loaded (``load_snapshot``, or
    ``torch.cuda.memory._snapshot()``); `where` names it in error messages."""
    if earlier not in ("place", "drop"):
        raise ValueError(f"earlier must be 'place' or 'drop', got {earlier!r}")
    if not isinstance(snap, dict) or not isinstance(snap.get("device_traces"), list):
        raise TraceError(f"{where}: not a PyTorch memory snapshot with allocation history (no "
                         f"'device_traces' list)")
    traces = snap["device_traces"]
    if not all(isinstance(d, list) for d in traces):
        raise TraceError(f"{where}: 'device_traces' must be a list (one per device) of lists "
                         f"of events")
    counts = snapshot_devices(snap)
    if device is None:
        if not counts:
            dev = 0
            if not traces:
                raise TraceError(f"{where}: the snapshot's 'device_traces' is empty: allocation "
                                 f"history was not recorded (call torch.cuda.memory."
                                 f"_record_memory_history() before the run)")
        else:
            dev = max(counts, key=lambda d: (counts[d], -d))
    else:
        dev = _device_index(device)
        if not 0 <= dev < len(traces):
            have = ", ".join(f"{d} ({n} events)" for d, n in counts.items()) or "none with events"
            raise TraceError(f"{where}: no device {device!r} in the snapshot; it has "
                             f"{len(traces)} device trace(s): {have}")
    segments = snap.get("segments") if earlier == "place" else None
    return _device_trace(where, traces[dev], dev, counts, name,
                         segments if isinstance(segments, list) else None, earlier == "place")


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


def _device_trace(path, events: list, dev: int, counts: dict, name: str,
                  segments: list | None = None, place_earlier: bool = False) -> Trace:
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
                             f"{', '.join(sorted([*_KEPT, *_IGNORED]))}); what it does to "
                             f"memory is not known, so the history is not replayed")
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

    earlier = []
    if place_earlier:
        earlier = _earlier_blocks(actions, ptrs, sizes, streams, segments or [], dev, where)
        if earlier:
            first = times[0] if times else 0
            actions[:0] = [ALLOC] * len(earlier)
            ptrs[:0] = [b[0] for b in earlier]
            sizes[:0] = [b[1] for b in earlier]
            streams[:0] = [b[2] for b in earlier]
            times[:0] = [first] * len(earlier)
            source_index[:0] = [None] * len(earlier)

    action = np.array(actions, dtype=np.uint8)
    ptr = np.array(ptrs, dtype=np.int64)
    size = np.array(sizes, dtype=np.int64)

    def at(k):
        if source_index[k] is None:
            return f"{where}, a block made before the history began at {ptrs[k]:#x}"
        return f"{where}, event {source_index[k]}"
    pairing = pair_events(action, ptr, size, at,
                          refer=lambda k: "the history's start" if source_index[k] is None
                          else f"event {source_index[k]}",
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
        "earlier_blocks": len(earlier), "earlier_bytes": sum(b[1] for b in earlier),
    }
    return Trace(action[keep], ptr[keep], pairing.size[keep],
                 np.array(streams, dtype=np.int64)[keep], (time_us - origin) / 1e6,
                 name=name, meta=meta)


# States of a block a tensor still uses (PyTorch's snapshot says "active_pending_free" for
# one freed while streams may still use it; its docs say "active_awaiting_free").
_IN_USE = {"active_allocated", "active_pending_free", "active_awaiting_free"}


def _earlier_blocks(actions, ptrs, sizes, streams, segments, dev, where):
    """(address, size, stream) of the blocks made before the history began, in address
    order: those it frees without having made them, and those the snapshot's segments
    show in use at an address it never names."""
    open_, named, out = set(), set(), {}
    for a, p, s, st in zip(actions, ptrs, sizes, streams):
        named.add(p)
        if a == ALLOC and s > 0:
            open_.add(p)
        elif a == FREE:
            if p in open_:
                open_.discard(p)
            elif p not in out and s > 0:
                out[p] = (p, s, st)
    for k, seg in enumerate(segments):
        if not isinstance(seg, dict) or seg.get("device", dev) != dev:
            continue
        blocks = seg.get("blocks")
        if not isinstance(blocks, list):
            raise TraceError(f"{where}: segment {k} of the snapshot has no 'blocks' list")
        for b in blocks:
            if not isinstance(b, dict) or b.get("state") not in _IN_USE:
                continue
            addr = b.get("address")
            size = b.get("requested_size") or b.get("size")
            if not isinstance(addr, int) or not isinstance(size, int) or size <= 0:
                raise TraceError(f"{where}: segment {k} has a block in use without an integer "
                                 f"'address' and a positive 'size': {b!r:.120}")
            if addr not in named:
                stream = seg.get("stream", 0)
                out[addr] = (addr, size, stream if isinstance(stream, int) else 0)
    return sorted(out.values())


def _int_field(e: dict, key: str, where: str, i: int, default=None) -> int:
    v = e.get(key, default)
    if v is None:
        raise TraceError(f"{where}, event {i}: {e.get('action')!r} entry has no {key!r}")
    if not isinstance(v, int) or isinstance(v, bool):
        raise TraceError(f"{where}, event {i}: {key!r} is {v!r}, expected an integer")
    if v > 2**63 - 1:
        raise TraceError(f"{where}, event {i}: {key!r} {v} does not fit in 64 signed bits")
    return v


_GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def segment_reserved(seg: dict) -> int:
    """The device memory a snapshot's segment holds: its mapped pages where it says which
    (pymemplan's virtual segments, whose total_size is address space), else its size."""
    return int(seg["mapped_size"] if "page_mapped" in seg else seg.get("total_size", 0))


def snapshot_oom_capacity(snap: dict, device: int) -> tuple[int, int, int] | None:
    """(capacity, reserved, free) at the device's last out-of-memory error in the history:
    the memory PyTorch could have had then, as what it had reserved (the snapshot's segments,
    less the segments made and plus those given back since) and what the driver reported
    free (the "oom" entry's ``device_free``). None where the history has no OOM or no
    segments to count from."""
    events = snap["device_traces"][device] if 0 <= device < len(snap["device_traces"]) else []
    last = max((i for i, e in enumerate(events)
                if isinstance(e, dict) and e.get("action") == "oom"), default=None)
    segments = [s for s in snap.get("segments") or []
                if isinstance(s, dict) and s.get("device", 0) == device]
    if last is None or not segments:
        return None
    free = events[last].get("device_free")
    if not isinstance(free, int) or isinstance(free, bool) or free < 0:
        return None
    reserved = sum(segment_reserved(s) for s in segments)
    for e in events[last + 1:]:
        sign = _GROWS.get(e.get("action")) if isinstance(e, dict) else None
        if sign and isinstance(e.get("size"), int):
            reserved -= sign * e["size"]
    return reserved + free, reserved, free


def snapshot_allocator_conf(snap: dict) -> str | None:
    """The PYTORCH_CUDA_ALLOC_CONF the recorded run's allocator had, from the snapshot's
    ``allocator_settings`` (PyTorch 2.5 and later write them); None where it has none."""
    settings = snap.get("allocator_settings")
    if not isinstance(settings, dict):
        return None
    conf = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(conf, str) and conf.strip():
        return conf
    if settings.get("expandable_segments") is True:
        return "expandable_segments:True"
    return ""


def history_start_layout(snap: dict, trace: Trace) -> list | None:
    """The layout PyTorch's allocator had where the history of `trace` (read from `snap` with
    earlier="place") begins: the segments it held then, each with the blocks in use in it,
    as ``_core.replay``'s `layout` takes it: [(bytes, small, stream, [(offset, size,
    requested, ptr)])], ptr the block's address (its pointer in the trace). The segments are
    the snapshot's, less those the history made and plus those it gave back; the blocks are
    those made before the history began. None where that cannot be told: expandable segments
    (mapped piecewise), or a block outside every segment."""
    dev = trace.meta["device"]
    events = snap["device_traces"][dev]
    segments = {}
    for s in snap.get("segments") or []:
        if isinstance(s, dict) and s.get("device", 0) == dev:
            if s.get("is_expandable"):
                return None
            segments[s["address"]] = [s["total_size"], s.get("segment_type") == "small",
                                      s.get("stream", 0), {b["address"]: b["size"] for b in s["blocks"]
                                                           if b.get("state") in _IN_USE}]
    for e in reversed(events):  # undo the history's segment actions, last first
        act = e.get("action") if isinstance(e, dict) else None
        if act in ("segment_map", "segment_unmap"):
            return None
        if act == "segment_alloc":
            segments.pop(e.get("addr"), None)
        elif act == "segment_free" and isinstance(e.get("addr"), int) and isinstance(e.get("size"), int):
            # A segment of 2 MiB is the small pool's (the large pool's are 20 MiB, or at least
            # the 10 MiB of the request they were made for).
            segments[e["addr"]] = [e["size"], e["size"] == 2 << 20, e.get("stream", 0), {}]
    n = int(trace.meta.get("earlier_blocks", 0))
    # Those the history frees are not the blocks the snapshot may show at their addresses.
    freed = set(trace.ptr[n:][trace.action[n:] == FREE].tolist())
    starts = sorted(segments)
    blocks: dict[int, list] = {a: [] for a in starts}
    for addr, requested in zip(trace.ptr[:n].tolist(), trace.size[:n].tolist()):
        k = bisect.bisect_right(starts, addr) - 1
        if k < 0 or addr >= starts[k] + segments[starts[k]][0]:
            return None
        blocks[starts[k]].append((addr, requested))
    out = []
    for a in starts:
        size, small, stream, sizes = segments[a]
        placed = sorted(blocks[a])
        rows = []
        for i, (addr, requested) in enumerate(placed):
            end = placed[i + 1][0] if i + 1 < len(placed) else a + size
            block = (None if addr in freed else sizes.get(addr)) or -(-requested // 512) * 512
            # The large pool leaves no free block of 1 MiB or less beside one in use: a gap
            # that small after it is its own, unsplit tail.
            if not small and 0 < end - (addr + block) <= 1 << 20:
                block = end - addr
            if addr + block > end:
                return None
            rows.append((addr - a, block, requested, addr))
        out.append((size, small, stream if isinstance(stream, int) else 0, rows))
    return out
