"""What an allocator that knew the whole trace in advance would reserve.

An online allocator places each block when it is requested, not knowing how long it will
live or what comes next; the cost of that shows as pages that live blocks use only partly.
Knowing the trace, one can place every block at once: the whole trace becomes one offline
packing problem (blocks with known lifetimes, offsets in one address range), solved with the
packer of ``pymemplan-planned`` (``_core.pack_blocks``, a skyline greedy). Mapping pages on
demand, such an allocator holds at each moment the pages its live blocks touch.

This is an upper bound on the best such an allocator can do (the packer is a heuristic; the
problem is NP-hard), to be read beside the lower bound no allocator of whole pages beats:
the peak of live bytes rounded up to a page. Where the two meet, the optimum is known.
Streams are ignored: the clairvoyant allocator knows when each block's work is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _core
from ..units import parse_bytes
from .trace import ALLOC, FREE, Trace

# Requests are rounded as the allocators round them (torch's kMinBlockSize).
_ALIGN = 512


@dataclass
class OfflineLayout:
    granularity: int
    from_event: int             # the layout covers the events from this one on
    arena_bytes: int            # the address range the packing needs
    bound_bytes: int            # peak of live (rounded) bytes: no packing needs less
    # Bytes of the pages live blocks touch after each event from `from_event` on.
    reserved_after_event: np.ndarray

    @property
    def peak_reserved_bytes(self) -> int:
        return int(self.reserved_after_event.max()) if len(self.reserved_after_event) else 0


def offline_layout(trace: Trace, granularity="2MiB", search_rounds: int = 8,
                   from_event: int = 0) -> OfflineLayout:
    """Pack the blocks of `trace` knowing all lifetimes, and count the pages of
    `granularity` bytes its live blocks touch after each event.

    With `from_event` > 0, only the events from that one on are laid out (a steady state):
    blocks made earlier and still alive then are placed as if made at that event, as an
    allocator that knew the trace could have placed them for it.

    `search_rounds`: randomized packer runs after its three deterministic ones (packing.hpp);
    eight take gpt2_6l_generate from 1.032 to 1.017 of live, more changed no recorded trace.

    Raises TraceError (from `Trace.validate`) for a trace that is not replayable, ValueError
    for a granularity that is not a positive multiple of 512 bytes or an event out of range."""
    page = parse_bytes(granularity)
    if page <= 0 or page % _ALIGN:
        raise ValueError(f"granularity must be a positive multiple of {_ALIGN} bytes, "
                         f"got {granularity!r}")
    if search_rounds < 0:
        raise ValueError(f"search_rounds must be >= 0, got {search_rounds}")
    n = len(trace)
    if not 0 <= from_event <= n:
        raise ValueError(f"from_event must be between 0 and the trace's {n} events, "
                         f"got {from_event}")
    trace.validate()
    action = trace.action.tolist()
    alloc_at: dict[int, int] = {}  # ptr -> its block
    start: list[int] = []
    end: list[int] = []  # event index of the free; n for blocks never freed
    size: list[int] = []
    for i, (a, p, s) in enumerate(zip(action, trace.ptr.tolist(), trace.size.tolist())):
        if a == ALLOC:
            alloc_at[p] = len(start)
            start.append(i)
            end.append(n)
            size.append(-(-s // _ALIGN) * _ALIGN)
        elif a == FREE:
            end[alloc_at.pop(p)] = i
    # The window's blocks, on its own clock (time 0 = event from_event).
    keep = [b for b in range(len(start)) if end[b] > from_event]
    w_start = [max(start[b], from_event) - from_event for b in keep]
    w_end = [end[b] - from_event for b in keep]
    w_size = [size[b] for b in keep]
    m = n - from_event
    reserved = np.zeros(m, dtype=np.int64)
    if not keep:
        return OfflineLayout(page, from_event, 0, 0, reserved)
    life = [e - s for s, e in zip(w_start, w_end)]
    # The circle is longer than the window, so nothing wraps around.
    packed = _core.pack_blocks(w_start, life, w_size, m + 1, search_rounds, page)
    offsets = packed["offsets"]
    first_page = [o // page for o in offsets]
    last_page = [(o + s - 1) // page for o, s in zip(offsets, w_size)]
    made = [[] for _ in range(m)]   # blocks that become live at each event of the window
    freed = [-1] * m                # the block each event frees
    for k, (s, e) in enumerate(zip(w_start, w_end)):
        made[s].append(k)
        if e < m:
            freed[e] = k
    users = np.zeros(max(last_page) + 1, dtype=np.int32)
    touched = 0
    for i in range(m):
        k = freed[i]
        if k >= 0:
            pages = users[first_page[k]:last_page[k] + 1]
            pages -= 1
            touched -= int(np.count_nonzero(pages == 0))
        for k in made[i]:
            pages = users[first_page[k]:last_page[k] + 1]
            touched += int(np.count_nonzero(pages == 0))
            pages += 1
        reserved[i] = touched * page
    return OfflineLayout(page, from_event, int(packed["arena"]), int(packed["bound"]), reserved)
