"""The allocation trace: one ordered list of alloc/free events, as parallel numpy arrays.

Every reader produces a :class:`Trace`, every writer and the replay engine consume one.
Columns are arrays rather than a list of objects so that a trace of millions of events
costs tens of megabytes and crosses into the C++ replay loop without copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Event kinds (the `action` column).
ALLOC = 0
FREE = 1
ALLOC_FAILURE = 2  # an allocation the recorded allocator refused (RMM's "allocate failure")

ACTION_NAMES = {ALLOC: "allocate", FREE: "free", ALLOC_FAILURE: "allocate failure"}


class TraceError(ValueError):
    """A trace is malformed or inconsistent; the message names the file/line or event."""


@dataclass
class Trace:
    """An ordered allocation trace.

    ``ptr`` identifies a block: an address (recorded traces) or any id unique among live
    blocks. A ``FREE`` names the ``ptr`` of an earlier, still-live ``ALLOC``; its ``size``
    is the allocated size when the source records it, else 0. ``time`` is seconds from an
    arbitrary origin (0 where the source has no clock). ``stream`` is an opaque stream id.
    """

    action: np.ndarray
    ptr: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    time: np.ndarray
    name: str = "trace"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.action = np.ascontiguousarray(self.action, dtype=np.uint8)
        self.ptr = np.ascontiguousarray(self.ptr, dtype=np.int64)
        self.size = np.ascontiguousarray(self.size, dtype=np.int64)
        self.stream = np.ascontiguousarray(self.stream, dtype=np.int64)
        self.time = np.ascontiguousarray(self.time, dtype=np.float64)
        n = len(self.action)
        for col in ("ptr", "size", "stream", "time"):
            if len(getattr(self, col)) != n:
                raise TraceError(f"trace column {col!r} has {len(getattr(self, col))} rows, expected {n}")

    def __len__(self) -> int:
        return len(self.action)

    @classmethod
    def from_events(cls, events, name: str = "trace", meta: dict | None = None) -> "Trace":
        """Build from an iterable of ``(action, ptr, size, stream, time)`` tuples."""
        rows = list(events)
        if not rows:
            z = np.zeros(0)
            return cls(z, z, z, z, z, name=name, meta=meta or {})
        a, p, s, st, t = zip(*rows)
        return cls(np.array(a), np.array(p, dtype=np.int64), np.array(s, dtype=np.int64),
                   np.array(st, dtype=np.int64), np.array(t, dtype=np.float64), name=name,
                   meta=meta or {})

    def head(self, n: int) -> "Trace":
        """The first ``n`` events: the same program stopped early (a short trial run). Blocks
        alive at event ``n`` stay alive, as in a process that exits without freeing them."""
        if not 0 <= n <= len(self):
            raise TraceError(f"{self.name}: head({n}) of a trace of {len(self)} events "
                             f"(expected 0 to {len(self)})")
        return Trace(self.action[:n], self.ptr[:n], self.size[:n], self.stream[:n], self.time[:n],
                     name=f"{self.name} (first {n} events)", meta=dict(self.meta))

    def live_bytes(self) -> np.ndarray:
        """Live requested bytes after each event (frees subtract the size of their alloc)."""
        self.validate()
        delta = np.zeros(len(self), dtype=np.int64)
        alloc_size: dict[int, int] = {}
        for i, (a, p, s) in enumerate(zip(self.action.tolist(), self.ptr.tolist(), self.size.tolist())):
            if a == ALLOC:
                alloc_size[p] = s
                delta[i] = s
            elif a == FREE:
                delta[i] = -alloc_size.pop(p)
        return np.cumsum(delta)

    def peak_live_bytes(self) -> int:
        lb = self.live_bytes()
        return int(lb.max()) if len(lb) else 0

    def validate(self) -> "Trace":
        """Check the trace is replayable: sizes positive, every free names a live block,
        no block allocated twice while live. Raises :class:`TraceError` naming the event."""
        live: set[int] = set()
        for i, (a, p, s) in enumerate(zip(self.action.tolist(), self.ptr.tolist(), self.size.tolist())):
            if a == ALLOC:
                if s <= 0:
                    raise TraceError(f"{self.name}: event {i}: allocation of {s} bytes (must be > 0)")
                if p in live:
                    raise TraceError(f"{self.name}: event {i}: pointer {p:#x} allocated again while still live")
                live.add(p)
            elif a == FREE:
                if p not in live:
                    raise TraceError(f"{self.name}: event {i}: free of pointer {p:#x} that is not live")
                live.remove(p)
            elif a != ALLOC_FAILURE:
                raise TraceError(f"{self.name}: event {i}: unknown action code {a}")
        return self
