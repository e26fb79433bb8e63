"""pymemplan-planned when a training loop logs its loss on the GPU: one request per iteration
that the recorded trace does not have.

Loops often keep a tiny tensor per step: `losses.append(loss.detach())` keeps one (a new
request of 512 B each step, never freed), `total = total + loss.detach()` (Hugging Face's
Trainer sums `tr_loss` this way) makes a new one and frees the last. Neither changes the live
bytes by more than a few KiB, but each is a request the step's plan has no slot for. This
replays every recorded trace of benchmarks/alloc_replay.py whose iterations repeat, as it is
and with such a request added once per iteration (the period of pymemplan-planned's last
plan, on traces where that is at least 200 events), at three points of it (its start, a
third in, two thirds in; "kept" and "summed"), and reports peak reserved / peak live over the
whole trace and over the steady state (as alloc_replay.py: from the first request a plan
served), with pymemplan-vmm, which has no plan, for reference.

    python benchmarks/alloc_logged_loss.py            # about 4 minutes
    python benchmarks/alloc_logged_loss.py --only gpt2 mamba_4l

Writes benchmarks/results/alloc_logged_loss.json. Records missing traces as alloc_replay.py
does (benchmarks/traces/).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from alloc_replay import NO_REPEATED_ITERATION, drive_planned, record_traces  # noqa: E402

from pymemplan import _core  # noqa: E402
from pymemplan.traces import replay  # noqa: E402
from pymemplan.traces.trace import ALLOC, FREE, Trace  # noqa: E402

RESULT = HERE / "results" / "alloc_logged_loss.json"
MIN_PERIOD = 200  # shorter plans are of repeated layers, not of the iteration
PHASES = (0, 1, 2)  # thirds of the period
MODES = ("kept", "summed")
LOSS_BYTES = 4  # a float32 scalar; the allocators round it to 512 B
EXTRA_ITERATIONS = 8


def with_logged_loss(trace: Trace, period: int, phase: int, mode: str) -> Trace:
    """`trace` with one LOSS_BYTES request every `period` events, from `phase` thirds in;
    "summed" frees the one before it right after (a running total), "kept" never does."""
    rows = zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
               trace.stream.tolist(), trace.time.tolist())
    out, ptr, prev = [], max(trace.ptr.tolist()) + 1, None
    offset = phase * period // 3
    for i, row in enumerate(rows):
        out.append(row)
        if i > offset and (i - offset) % period == 0:
            out.append((ALLOC, ptr, LOSS_BYTES, 0, row[4]))
            if mode == "summed" and prev is not None:
                out.append((FREE, prev, LOSS_BYTES, 0, row[4]))
            prev, ptr = ptr, ptr + 1
    return Trace.from_events(out, name=f"{trace.name} ({mode} loss, {phase}/3 in)")


def extended(trace: Trace, period: int, times: int) -> Trace | None:
    """`trace` cut after the last of its iterations that repeats the one before it event for
    event, then that iteration `times` more times (new pointers; a block it frees that an
    earlier iteration made is the block made a period earlier). None if no two iterations
    repeat exactly."""
    rows = list(zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist(),
                    trace.stream.tolist(), trace.time.tolist()))
    tokens = [(a, n, st) for a, _, n, st, _ in rows]
    end = next((e for e in range(len(rows), 2 * period - 1, -1)
                if tokens[e - period:e] == tokens[e - 2 * period:e - period]), None)
    if end is None:
        return None
    rows = rows[:end]
    made_by, open_ = {}, {}  # free event -> the event that made its block
    for i, (a, p, *_rest) in enumerate(rows):
        if a == ALLOC:
            open_[p] = i
        else:
            made_by[i] = open_.pop(p)
    ptr_of = {i: row[1] for i, row in enumerate(rows) if row[0] == ALLOC}
    nxt, span = max(trace.ptr.tolist()) + 1, rows[-1][4] - rows[end - period][4] + 1
    for k in range(1, times + 1):
        for j in range(end - period, end):
            a, _, n, st, t = rows[j]
            g = j + k * period
            if a == ALLOC:
                ptr_of[g] = nxt
                rows.append((ALLOC, nxt, n, st, t + k * span))
                nxt += 1
            else:
                rows.append((FREE, ptr_of[made_by[j] + k * period], n, st, t + k * span))
    return Trace.from_events(rows, name=f"{trace.name} (+{times} iterations)")


def figures(trace: Trace) -> dict:
    """Peak reserved / peak live over the whole trace, and pymemplan-planned's over its steady
    state (from the first request a plan served)."""
    res = {r.policy: r for r in replay(trace, ["pymemplan-vmm", "pymemplan-planned"])}
    planned, vmm = res["pymemplan-planned"], res["pymemplan-vmm"]
    return {"planned": planned.reserved_over_live, "planned_steady": planned.steady_reserved_over_live,
            "vmm": vmm.reserved_over_live}


def settled(trace: Trace, last: int) -> float:
    """pymemplan-planned's peak reserved / peak live over the last `last` events."""
    s = _core.replay(trace.action, trace.ptr, trace.size, trace.stream, "pymemplan-planned", "",
                     80 << 30, 2 << 20, len(trace) - last, plans="")
    return s["steady_peak_reserved_bytes"] / s["steady_peak_live_bytes"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="workload names")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    t0 = time.perf_counter()
    traces = record_traces(args.only)
    rows = []
    for name, trace in traces.items():
        if name in NO_REPEATED_ITERATION:
            continue
        period = int(drive_planned(trace).plan_stats()["active_plan_period"])
        if period < MIN_PERIOD:
            print(f"{name:20s} skipped: its last plan has a period of {period} events", flush=True)
            continue
        row = {"trace": name, "events": len(trace), "period": period, "as_recorded": figures(trace)}
        for mode in MODES:
            for phase in PHASES:
                row[f"{mode}_{phase}"] = figures(with_logged_loss(trace, period, phase, mode))
        longer = extended(trace, period, EXTRA_ITERATIONS)
        if longer is not None:
            # Two periods (with the request added, two more events each) at the end of a run
            # EXTRA_ITERATIONS iterations longer: what the plans settle into.
            row["settled"] = {"as_recorded": settled(longer, 2 * period)}
            for mode in MODES:
                for phase in PHASES:
                    row["settled"][f"{mode}_{phase}"] = settled(
                        with_logged_loss(longer, period, phase, mode), 2 * period + 4)
        rows.append(row)
        variants = [k for k in row if k.startswith(MODES)]
        worst = max(variants, key=lambda k: row[k]["planned"])
        print(f"{name:20s} planned {row['as_recorded']['planned']:.4f} -> worst {row[worst]['planned']:.4f}"
              f" ({worst}); vmm {row['as_recorded']['vmm']:.4f}", flush=True)

    variants = [f"{m}_{p}" for m in MODES for p in PHASES]

    def count(key, limit, variant):
        return sum(1 for r in rows if r[variant][key] is not None and r[variant][key] <= limit)

    summary = {
        "traces": len(rows),
        "planned_within_3pct": {v: count("planned", 1.03, v) for v in ["as_recorded", *variants]},
        "planned_steady_within_1pct": {v: count("planned_steady", 1.01, v) for v in ["as_recorded", *variants]},
        "vmm_within_3pct": {v: count("vmm", 1.03, v) for v in ["as_recorded", *variants]},
        "settled_traces": sum(1 for r in rows if "settled" in r),
        "planned_settled_within_1pct": {
            v: sum(1 for r in rows if "settled" in r and r["settled"][v] <= 1.01)
            for v in ["as_recorded", *variants]},
        # Settled a page or more above the trace as recorded: what the request costs for good.
        "planned_settled_higher": {
            v: sum(1 for r in rows if "settled" in r and r["settled"][v] > r["settled"]["as_recorded"] + 1e-9)
            for v in variants},
        # Traces where, with the logged loss, the plan holds more than the pool alone does.
        "planned_above_vmm": {v: sum(1 for r in rows if r[v]["planned"] > r[v]["vmm"] + 1e-9)
                              for v in ["as_recorded", *variants]},
    }
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({
        "command": "python benchmarks/alloc_logged_loss.py", "machine": platform.processor() or platform.machine(),
        "seconds": round(time.perf_counter() - t0, 1), "summary": summary, "results": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
