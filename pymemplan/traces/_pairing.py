"""Matching frees to allocations, shared by every reader and by the CSV writer.

A file's events are only a trace if each free names a live block and no live block is
allocated again. This pass checks that, names the offending line or event when it is
not so, and normalises what sources leave implicit (a free's size, zero-byte blocks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .trace import ALLOC, FREE, TraceError


@dataclass
class Pairing:
    keep: np.ndarray          # bool per input event: False for events the trace leaves out
    size: np.ndarray          # sizes with each free's size set to its allocation's size
    dropped_frees: int = 0    # frees of blocks allocated before the trace began
    dropped_free_bytes: int = 0
    zero_size_allocs: int = 0  # zero-byte allocations (and their frees) left out


def pair_events(action: np.ndarray, ptr: np.ndarray, size: np.ndarray,
                locate: Callable[[int], str], *, refer: Callable[[int], str] | None = None,
                drop_unknown_frees: bool = False, drop_zero_size: bool = True) -> Pairing:
    """Check that frees and allocations pair up, in order.

    ``locate(i)`` names event ``i`` in error messages ("file.csv: line 12"), and
    ``refer(i)`` names an earlier event within such a message ("line 3"; default locate).
    ``drop_unknown_frees``: a free of a pointer never allocated is dropped and counted
    (a trace recorded from mid-run) instead of raising.
    ``drop_zero_size``: zero-byte allocations are dropped with their frees, since they
    hold no memory and allocators may return the same pointer (often null) for all of
    them; otherwise they raise.
    A free whose size is 0 takes its allocation's size; a different non-zero size raises.
    """
    fast = _pair_vectorised(action, ptr, size)
    if fast is not None:
        return fast
    # Slow path, taken only when the fast path saw something to drop or to report: it
    # finds the first problem in event order and names it.
    return _pair_loop(action, ptr, size, locate, drop_unknown_frees, drop_zero_size, refer)


def _pair_loop(action, ptr, size, locate, drop_unknown_frees, drop_zero_size,
               refer=None) -> Pairing:
    """The same pairing as a Python loop over events, in order."""
    refer = refer or locate
    n = len(action)
    keep = np.ones(n, dtype=bool)
    out_size = np.array(size, dtype=np.int64, copy=True)
    live: dict[int, tuple[int, int]] = {}  # ptr -> (size, event index of its allocation)
    zero_live: Counter = Counter()         # ptrs of live zero-byte allocations
    result = Pairing(keep, out_size)
    for i, (a, p, s) in enumerate(zip(action.tolist(), ptr.tolist(), out_size.tolist())):
        if a == ALLOC:
            if s == 0:
                if not drop_zero_size:
                    raise TraceError(f"{locate(i)}: allocation of 0 bytes (allocations must be > 0 bytes)")
                keep[i] = False
                zero_live[p] += 1
                result.zero_size_allocs += 1
                continue
            prev = live.get(p)
            if prev is not None:
                raise TraceError(
                    f"{locate(i)}: pointer {p:#x} allocated again while still live "
                    f"(allocated at {refer(prev[1])} and not freed since)")
            live[p] = (s, i)
        elif a == FREE:
            entry = live.pop(p, None)
            if entry is None:
                if zero_live[p] > 0 and s == 0:
                    zero_live[p] -= 1
                    keep[i] = False
                elif drop_unknown_frees:
                    keep[i] = False
                    result.dropped_frees += 1
                    result.dropped_free_bytes += s
                else:
                    raise TraceError(
                        f"{locate(i)}: free of pointer {p:#x} that is not live "
                        f"(never allocated, or already freed)")
            elif s == 0:
                out_size[i] = entry[0]
            elif s != entry[0]:
                raise TraceError(
                    f"{locate(i)}: free of pointer {p:#x} with size {s}, but it was allocated "
                    f"with size {entry[0]} at {refer(entry[1])}")
    return result


def _pair_vectorised(action: np.ndarray, ptr: np.ndarray, size: np.ndarray) -> Pairing | None:
    """The pairing of a clean trace, in numpy; ``None`` if anything needs the slow path
    (a zero-byte allocation, an unknown free, a double allocation, a size mismatch).

    Sorted by pointer (stably, so each pointer's events stay in event order), a clean
    trace reads ALLOC, FREE, ALLOC, FREE, ... for every pointer, and each FREE's size is
    0 or that of the ALLOC just before it.
    """
    n = len(action)
    size = np.array(size, dtype=np.int64, copy=True)
    idx = np.flatnonzero((action == ALLOC) | (action == FREE))
    if ((action[idx] == ALLOC) & (size[idx] == 0)).any():
        return None
    order = idx[np.argsort(ptr[idx], kind="stable")]
    p, a = ptr[order], action[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = p[1:] != p[:-1]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))
    position = np.arange(len(order)) - group_start
    if not (a == np.where(position % 2 == 0, ALLOC, FREE)).all():
        return None
    frees = np.flatnonzero(a == FREE)          # positions in `order`; each follows its alloc
    free_size, alloc_size = size[order[frees]], size[order[frees - 1]]
    if ((free_size != 0) & (free_size != alloc_size)).any():
        return None
    size[order[frees]] = alloc_size
    return Pairing(np.ones(n, dtype=bool), size)
