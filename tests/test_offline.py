"""The offline layout: what an allocator that knew the whole trace would reserve."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymemplan.traces import ALLOC, FREE, Trace, TraceError, replay
from pymemplan.traces.offline import offline_layout

MiB = 1 << 20
PAGE = 2 * MiB


def make(events, name="t"):
    return Trace.from_events([(a, p, s, 0, 0.0) for a, p, s in events], name=name)


def interleaved(n=4):
    """Long- and short-lived 1 MiB blocks made in turn, the short ones freed, then one
    request as large as all of them: placed as they come, every page keeps a long-lived
    block and the large request needs pages of its own."""
    ev = []
    for i in range(n):
        ev += [(ALLOC, 2 * i + 1, MiB), (ALLOC, 2 * i + 2, MiB)]
    ev += [(FREE, 2 * i + 2, MiB) for i in range(n)]
    ev += [(ALLOC, 100, n * MiB)]
    ev += [(FREE, 100, n * MiB)] + [(FREE, 2 * i + 1, MiB) for i in range(n)]
    return make(ev, "interleaved")


def test_knowing_lifetimes_avoids_pages_an_online_allocator_strands():
    t = interleaved(4)
    layout = offline_layout(t)
    live = t.peak_live_bytes()
    assert live == 8 * MiB
    # Long-lived blocks together, short-lived ones together: the peak takes 4 pages.
    assert layout.peak_reserved_bytes == 4 * PAGE
    assert layout.bound_bytes == 8 * MiB
    online = replay(t, ["pymemplan-vmm"])[0]
    assert online.peak_reserved_bytes == 6 * PAGE  # the large block maps 2 more pages
    assert layout.peak_reserved_bytes < online.peak_reserved_bytes


def test_reserved_follows_the_trace_event_by_event():
    t = make([(ALLOC, 1, 3 * MiB), (ALLOC, 2, MiB), (FREE, 1, 0), (FREE, 2, 0)])
    layout = offline_layout(t)
    assert len(layout.reserved_after_event) == 4
    assert layout.reserved_after_event[0] == 2 * PAGE      # 3 MiB spans two pages
    assert layout.reserved_after_event[1] == 2 * PAGE      # 1 MiB fits the second one's rest
    assert layout.reserved_after_event[-1] == 0


def test_a_window_is_laid_out_for_itself():
    # From event 3 on, the 3 MiB block freed early does not count: the window holds block 1,
    # made before it, and two 1 MiB blocks, all placed for the window.
    t = make([(ALLOC, 1, MiB), (ALLOC, 2, 3 * MiB), (FREE, 2, 0),
              (ALLOC, 3, MiB), (ALLOC, 4, MiB), (FREE, 3, 0), (FREE, 4, 0), (FREE, 1, 0)])
    assert offline_layout(t).bound_bytes == 4 * MiB
    tail = offline_layout(t, from_event=3)
    assert tail.from_event == 3 and len(tail.reserved_after_event) == 5
    assert tail.bound_bytes == 3 * MiB
    # Blocks 1 and 3 share a page; block 4 takes a second one until block 3 and 4 are gone.
    assert list(tail.reserved_after_event) == [PAGE, 2 * PAGE, 2 * PAGE, PAGE, 0]
    assert offline_layout(t, from_event=8).peak_reserved_bytes == 0


def test_blocks_never_freed_stay_to_the_end_and_sizes_are_rounded():
    t = make([(ALLOC, 1, 1), (ALLOC, 2, 513)])
    layout = offline_layout(t, granularity=1024)
    # 512 + 1024 rounded bytes, packed into 1536 bytes: two 1 KiB pages.
    assert layout.arena_bytes == 1536
    assert list(layout.reserved_after_event) == [1024, 2048]


def test_empty_trace():
    layout = offline_layout(make([]))
    assert layout.peak_reserved_bytes == 0 and layout.arena_bytes == 0


def test_bad_input_is_named():
    with pytest.raises(TraceError, match="not live"):
        offline_layout(make([(ALLOC, 1, MiB), (FREE, 2, MiB)]))
    with pytest.raises(ValueError, match="multiple of 512"):
        offline_layout(interleaved(), granularity=1000)
    with pytest.raises(ValueError, match="not a size"):
        offline_layout(interleaved(), granularity="two pages")
    with pytest.raises(ValueError, match="search_rounds"):
        offline_layout(interleaved(), search_rounds=-1)
    with pytest.raises(ValueError, match="from_event must be between 0 and the trace's 18"):
        offline_layout(interleaved(), from_event=19)


@st.composite
def traces(draw):
    n = draw(st.integers(1, 60))
    live, ev, nxt = [], [], 1
    for _ in range(n):
        if live and draw(st.booleans()):
            p = live.pop(draw(st.integers(0, len(live) - 1)))
            ev.append((FREE, p, 0))
        else:
            ev.append((ALLOC, nxt, draw(st.integers(1, 5 * MiB))))
            live.append(nxt)
            nxt += 1
    return make(ev)


@settings(max_examples=150, deadline=None)
@given(traces(), st.sampled_from([PAGE, 64 * 1024]))
def test_never_below_the_live_bytes_in_whole_pages(t, page):
    layout = offline_layout(t, granularity=page)
    sizes = {}
    rounded_live = []
    cur = 0
    for a, p, s in zip(t.action.tolist(), t.ptr.tolist(), t.size.tolist()):
        if a == ALLOC:
            sizes[p] = -(-s // 512) * 512
            cur += sizes[p]
        else:
            cur -= sizes.pop(p)
        rounded_live.append(cur)
    floor = -(-np.array(rounded_live) // page) * page
    assert np.all(layout.reserved_after_event >= floor)
    # Nothing live, nothing held; and never more pages than the arena has.
    assert np.all(layout.reserved_after_event[np.array(rounded_live) == 0] == 0)
    assert layout.peak_reserved_bytes <= -(-layout.arena_bytes // page) * page
    assert layout.arena_bytes >= layout.bound_bytes == max(rounded_live)
