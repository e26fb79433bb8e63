"""The trace edits of benchmarks/alloc_logged_loss.py: a request added per iteration, and a
run made longer by repeating its last iteration."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pymemplan.traces.trace import ALLOC, FREE, Trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from alloc_logged_loss import extended, with_logged_loss  # noqa: E402

MiB = 1 << 20


def _loop(steps: int, first_differs: bool = True) -> Trace:
    """Weights, then steps that each make an input (released in the next step: a prefetching
    loader), two activations and a temporary; the first step also makes optimizer state."""
    ev, ptr, t = [], 0, 0.0

    def alloc(size):
        nonlocal ptr, t
        ptr += 1
        t += 1
        ev.append((ALLOC, ptr, size, 0, t))
        return ptr

    def free(p, size):
        nonlocal t
        t += 1
        ev.append((FREE, p, size, 0, t))

    alloc(8 * MiB)
    prev = None
    for step in range(steps):
        x = alloc(MiB)
        if prev is not None:
            free(prev, MiB)
        a, b = alloc(3 * MiB), alloc(2 * MiB)
        tmp = alloc(4 * MiB)
        free(tmp, 4 * MiB)
        free(b, 2 * MiB)
        free(a, 3 * MiB)
        if step == 0 and first_differs:
            alloc(8 * MiB)  # optimizer state, made once
        prev = x
    return Trace.from_events(ev, name="loop")


def _tokens(rows):
    return [(a, n, st) for a, _, n, st, _ in rows]


def _rows(trace):
    return list(zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
                    trace.stream.tolist(), trace.time.tolist()))


def test_a_logged_loss_adds_one_request_per_iteration_kept_or_summed():
    trace = _loop(6)
    period = 8  # events per step: the input, the last one freed, three made and freed
    for mode in ("kept", "summed"):
        t = with_logged_loss(trace, period, 1, mode)
        t.validate()
        added = len(t) - len(trace)
        allocs = int((t.action == ALLOC).sum()) - int((trace.action == ALLOC).sum())
        assert allocs >= 2
        assert added == (allocs if mode == "kept" else 2 * allocs - 1)
        # kept: the live bytes at the end grow by one loss per iteration; summed: by one in all
        grown = t.live_bytes()[-1] - trace.live_bytes()[-1]
        assert grown == (allocs * 4 if mode == "kept" else 4)


def test_a_run_made_longer_repeats_its_last_iteration_and_frees_what_it_made():
    trace = _loop(4)
    period = 8
    longer = extended(trace, period, 5)
    assert longer is not None
    longer.validate()  # every free is of a block alive then: the prefetched inputs map across
    rows = _rows(longer)
    assert len(rows) == len(trace) + 5 * period
    assert _tokens(rows[-period:]) == _tokens(rows[-2 * period:-period])
    assert _tokens(rows[:len(trace)]) == _tokens(_rows(trace))
    # the live bytes come back to the same level at the end of every repeated iteration
    live = longer.live_bytes()
    ends = [live[len(trace) - 1 + k * period] for k in range(6)]
    assert len(set(ends)) == 1


def test_a_run_whose_iterations_never_repeat_is_not_made_longer():
    ev, t = [], 0.0
    for i in range(40):
        ev += [(ALLOC, i + 1, (i + 1) * 512, 0, t), (FREE, i + 1, (i + 1) * 512, 0, t + 1)]
        t += 2
    assert extended(Trace.from_events(ev, name="ramp"), 8, 3) is None


@pytest.mark.parametrize("mode", ["kept", "summed"])
def test_the_added_request_lands_at_the_phase_asked(mode):
    trace = _loop(6, first_differs=False)
    period = 8
    for phase in (0, 1, 2):
        rows = _rows(with_logged_loss(trace, period, phase, mode))
        first = next(i for i, r in enumerate(rows) if r[2] == 4)
        assert first == period + phase * period // 3 + 1
