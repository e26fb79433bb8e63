"""Allocator policies on random training runs: workloads nobody tuned the policies for.

Each seed draws a training loop (synthetic_traces.random_training: depth, sizes, optimizer,
how steps vary, prefetching, kept outputs, a second stream) and replays it through every
policy on a simulated 80 GiB device with 2 MiB pages. Reported: the distribution of peak
reserved / peak live per policy (and for a layout made knowing the whole run: what better
placement could reach), and every seed where a policy of ours holds more than
PyTorch's allocator, or plan-guided placement more than the virtual-memory pool it runs over
(a plan must never make memory worse). Each run is also replayed once more through
pymemplan-planned starting with what the first replay exported, as a restarted job does
with save_plans / load_plans ("restarted": its plans and its prologue, the run's first
requests laid out in advance; every run here is shorter than a prologue, so it is the whole
run), with its plans only ("restarted, plans only": prologue:0), and with a prologue that
ends with the first pass a plan served whole ("restarted, prologue to the first planned
pass": prologue:1) or with the first one after a third of the run's requests ("restarted,
prologue to a third in"), which is where a run longer than a prologue goes over to its plans.
Last, "restarted after a run half as long": the whole run, restarted with what a run of its
first half exported (a short trial run, then the real one): its prologue is laid out to the
end of the pass that run stopped in, where the plan it was following takes over.

    python benchmarks/alloc_random.py              # 200 seeds, about 30 s
    python benchmarks/alloc_random.py --seeds 1000
    python benchmarks/alloc_random.py --loops evaluation --seeds 1000
    python benchmarks/alloc_random.py --seeds 30 --steps 40 --out /tmp/long.json  # long runs

Also counted: the driver calls (pages mapped and unmapped) of pymemplan-vmm and
pymemplan-planned over the second half of each run, once its steps repeat.

Writes benchmarks/results/alloc_random.json (alloc_random_evaluation.json with --loops
evaluation: synthetic_traces.evaluation_loop, an evaluation step every few steps).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from synthetic_traces import evaluation_loop, random_training  # noqa: E402

from pymemplan import _core  # noqa: E402
from pymemplan.traces import offline_layout, replay  # noqa: E402
from pymemplan.traces.replay import parse_policy  # noqa: E402

RESULTS = {"training": HERE / "results" / "alloc_random.json",
           "evaluation": HERE / "results" / "alloc_random_evaluation.json"}
EXPANDABLE = "torch=expandable_segments:True"  # PyTorch's own remedy for fragmentation
# The model of GMLake (csrc/core/gmlake.hpp), as it ships (only requests of 512 MiB and up
# stitched) and stitching every request over 1 MiB.
GMLAKE, GMLAKE_ALL = "gmlake", "gmlake=frag_limit_mb:0"
POLICIES = ("pymemplan", "pymemplan-vmm", "pymemplan-planned", "torch", EXPANDABLE, GMLAKE, GMLAKE_ALL)
# Differences under this share of the live bytes are one page on the smallest runs, not a
# pattern: a plan that arms, diverges and leaves the pool another layout may cost a page.
TOLERANCE = 0.005
# The same run again, pymemplan-planned starting with the plans the first run ended with
# (save_plans / load_plans: a restarted job).
RESTARTED = "pymemplan-planned, restarted"
# name -> the policy, given the number of requests in the run.
RESTARTED_VARIANTS = {"pymemplan-planned, restarted, plans only": lambda n: "pymemplan-planned=prologue:0",
                      "pymemplan-planned, restarted, prologue to the first planned pass":
                          lambda n: "pymemplan-planned=prologue:1",
                      "pymemplan-planned, restarted, prologue to a third in":
                          lambda n: f"pymemplan-planned=prologue:{max(n // 3, 1)}"}
AFTER_HALF = "pymemplan-planned, restarted after a run half as long"
CALLS = ("pymemplan-vmm", "pymemplan-planned")  # driver calls over the second half, counted


def second_half_calls(trace, policy: str) -> int:
    """Pages mapped and unmapped over the second half of the run (80 GiB, 2 MiB pages)."""
    r = _core.replay(trace.action, trace.ptr, trace.size, trace.stream, *parse_policy(policy),
                     80 << 30, 2 << 20, len(trace.action) // 2)
    return int(r["steady_device_allocs"] + r["steady_device_frees"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=200, help="runs to draw (seeds 0..N-1)")
    ap.add_argument("--loops", choices=sorted(RESULTS), default="training",
                    help="training: random_training; evaluation: evaluation_loop")
    ap.add_argument("--steps", type=int, default=None,
                    help="training loops: run this many steps (default: 3 to 7, drawn)")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/alloc_random[_evaluation].json")
    args = ap.parse_args()
    args.out = args.out or RESULTS[args.loops]
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    if args.steps is not None and (args.steps < 1 or args.loops != "training"):
        ap.error("--steps must be at least 1, and is for --loops training only")
    if args.loops == "training":
        def draw(seed):
            return random_training(seed, steps=args.steps)
    else:
        draw = evaluation_loop

    start = time.perf_counter()
    runs = []
    for seed in range(args.seeds):
        trace = draw(seed)
        results = {r.policy: r for r in replay(trace, POLICIES)}
        row = {"seed": seed, "events": int(len(trace.action)),
               "peak_live_bytes": results["torch"].peak_live_bytes}
        for name, r in results.items():
            row[name] = r.reserved_over_live
            if r.steady_peak_live_bytes:
                row[name + " steady"] = r.steady_peak_reserved_bytes / r.steady_peak_live_bytes
        row[RESTARTED] = replay(trace, ["pymemplan-planned"],
                                plans=results["pymemplan-planned"].plans)[0].reserved_over_live
        for name, variant in RESTARTED_VARIANTS.items():
            policy = variant(int((trace.action == 0).sum()))
            # A shorter prologue than the default: its first run exports another text.
            plans = (results["pymemplan-planned"].plans if policy.endswith(":0")
                     else replay(trace, [policy])[0].plans)
            row[name] = replay(trace, [policy], plans=plans)[0].reserved_over_live
        first_half = trace.head(len(trace) // 2)
        row[AFTER_HALF] = replay(trace, ["pymemplan-planned"],
                                 plans=replay(first_half, ["pymemplan-planned"])[0].plans)[0].reserved_over_live
        # What placing every block knowing the whole run would hold (pymemplan.traces.offline).
        row["offline"] = offline_layout(trace).peak_reserved_bytes / row["peak_live_bytes"]
        for name in CALLS:
            row[name + " second-half driver calls"] = second_half_calls(trace, name)
        runs.append(row)
    seconds = time.perf_counter() - start

    def over(a, b):
        return [r["seed"] for r in runs if r[a] > r[b] * (1 + TOLERANCE)]

    summary = {}
    for name in (*POLICIES, RESTARTED, *RESTARTED_VARIANTS, AFTER_HALF):
        x = np.array([r[name] for r in runs])
        summary[name] = {"median": float(np.median(x)), "p95": float(np.percentile(x, 95)),
                         "max": float(x.max()), "within_3pct": int((x <= 1.03).sum())}
    x = np.array([r["offline"] for r in runs])
    summary["offline"] = {"median": float(np.median(x)), "p95": float(np.percentile(x, 95)),
                          "max": float(x.max()), "within_3pct": int((x <= 1.03).sum())}
    steady = [r["pymemplan-planned steady"] for r in runs if "pymemplan-planned steady" in r]
    summary["pymemplan-planned steady"] = {
        "runs_with_a_plan": len(steady),
        "median": float(np.median(steady)) if steady else None,
        "within_1pct": int(sum(s <= 1.01 for s in steady)),
    }
    above = {
        "pymemplan-vmm above torch": over("pymemplan-vmm", "torch"),
        "pymemplan-planned above torch": over("pymemplan-planned", "torch"),
        "pymemplan-planned above pymemplan-vmm": over("pymemplan-planned", "pymemplan-vmm"),
        "pymemplan above torch": over("pymemplan", "torch"),
        "pymemplan-vmm above torch expandable": over("pymemplan-vmm", EXPANDABLE),
        "pymemplan-planned above torch expandable": over("pymemplan-planned", EXPANDABLE),
        "torch expandable above torch": over(EXPANDABLE, "torch"),
        "pymemplan-vmm above gmlake": over("pymemplan-vmm", GMLAKE),
        "pymemplan-vmm above gmlake stitching all": over("pymemplan-vmm", GMLAKE_ALL),
        "pymemplan-planned above gmlake": over("pymemplan-planned", GMLAKE),
        "pymemplan-planned above gmlake stitching all": over("pymemplan-planned", GMLAKE_ALL),
        "gmlake stitching all above torch": over(GMLAKE_ALL, "torch"),
        "restarted above pymemplan-planned": over(RESTARTED, "pymemplan-planned"),
        "pymemplan-planned above restarted": over("pymemplan-planned", RESTARTED),
    }
    summary["second-half driver calls"] = {name: sum(r[name + " second-half driver calls"] for r in runs)
                                           for name in CALLS}
    for name in (RESTARTED, *RESTARTED_VARIANTS, AFTER_HALF):
        summary[name]["lower"] = sum(r[name] < r["pymemplan-planned"] for r in runs)
        summary[name]["higher"] = sum(r[name] > r["pymemplan-planned"] for r in runs)
        summary[name]["max_over_first_run"] = max(r[name] / r["pymemplan-planned"] for r in runs)
    command = "python benchmarks/alloc_random.py" + ("" if args.loops == "training" else f" --loops {args.loops}")
    command += "" if args.seeds == 200 else f" --seeds {args.seeds}"
    command += "" if args.steps is None else f" --steps {args.steps}"
    out = {"command": command,
           "machine": platform.platform(), "seeds": args.seeds, "tolerance": TOLERANCE,
           "seconds": seconds, "summary": summary, "above": above, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")

    print(f"{args.seeds} random {args.loops} loops in {seconds:.0f} s; peak reserved / peak live:")
    names = (*POLICIES, RESTARTED, *RESTARTED_VARIANTS, AFTER_HALF, "offline")
    width = max(len(n) for n in names)
    print(f"  {'policy':{width}s} {'median':>8s} {'p95':>8s} {'max':>8s}  within 3%")
    for name in names:
        s = summary[name]
        label = "offline (knows the run)" if name == "offline" else name
        print(f"  {label:{width}s} {s['median']:8.4f} {s['p95']:8.4f} {s['max']:8.4f}  {s['within_3pct']}/{args.seeds}")
    s = summary["pymemplan-planned steady"]
    if steady:
        print(f"  pymemplan-planned, steady state: median {s['median']:.4f}, within 1% on "
              f"{s['within_1pct']} of the {s['runs_with_a_plan']} runs a plan served")
    calls = summary["second-half driver calls"]
    print("  driver calls (pages mapped and unmapped) over the second halves: "
          + ", ".join(f"{name} {n:,}" for name, n in calls.items()))
    for name in (RESTARTED, *RESTARTED_VARIANTS, AFTER_HALF):
        s = summary[name]
        print(f"  {name}: lower than pymemplan-planned on {s['lower']} runs, higher on {s['higher']} "
              f"(at most {s['max_over_first_run']:.3f} times)")
    for what, seeds in above.items():
        print(f"  {what} by more than {TOLERANCE:.1%}: {len(seeds)} runs{': seeds ' + str(seeds[:20]) if seeds else ''}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
