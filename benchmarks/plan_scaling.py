"""How the cost of computing plans grows with the number of blocks a training step allocates.

pymemplan-planned computes a plan when it arms (packing the step's blocks six ways, with the
pool's holes filled by each rule and without). That is a one-off per step shape, paid inside the
allocation that starts the pass, so it must stay small on deep models. This benchmark records
narrow GPT-2 models of growing depth on CPU (width 64: the blocks are many and small, as in
the deepest real models per byte), four AdamW steps each, and replays them:

    python benchmarks/plan_scaling.py                 # layers 6, 12, 24, 48, 96
    python benchmarks/plan_scaling.py --layers 12,48  # a subset
    python benchmarks/plan_scaling.py --baseline-core OLD/_core.cpython-311-x86_64-linux-gnu.so

With --baseline-core, the same traces are replayed in a second process through another build
of the core (an earlier commit's, say), and each row gains its planning seconds and peak
reserved bytes beside ours.

Per model: the blocks of the last plan, planning seconds over the run (and packings reused
instead of computed again; the least of three replays), one pack_blocks call on the plan's
blocks alone, and the replay's ns per event for pymemplan-planned against pymemplan-vmm (same
trace, same process). Traces
are cached in benchmarks/traces/ (deep_gpt2_<layers>.csv.gz).

Planning is not one-off where shapes take turns: a plan arms at most steps of its shape and
is packed against holes the other shapes' steps moved. So the same is measured on random
training loops of benchmarks/alloc_random.py whose batch size is drawn at each step, run for
100 steps (`--turns 1,9,11`, seeds; `--turns ""` for none). Writes
benchmarks/results/plan_scaling.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRACE_DIR = HERE / "traces"
RESULT = HERE / "results" / "plan_scaling.json"
PAGE = 2 << 20


def record_deep_gpt2(layers: int, path: Path, rerecord: bool = False):
    """The trace of four AdamW steps of a narrow GPT-2 of `layers` layers (batch 2 x 64 tokens),
    recorded once into `path` and read from there afterwards."""
    from pymemplan.traces import read_trace, record, write_csv

    if rerecord or not path.exists():
        import torch
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=2000, n_positions=128, n_embd=64,
                                         n_layer=layers, n_head=2, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(model.parameters(), 1e-4)
        with record() as rec:
            for _ in range(4):
                ids = torch.randint(0, 2000, (2, 64))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_csv(rec.trace, path)
    trace = read_trace(path)
    trace.name = path.name.split(".")[0]
    return trace


def plan_figures(trace):
    """pymemplan-planned's plan statistics after the trace, and the blocks of its last plan."""
    from alloc_replay import drive_planned

    alloc = drive_planned(trace)
    return alloc.plan_stats(), alloc.plan_blocks()


REPEAT = 3  # replays per figure, the least planning time kept: single runs vary by half here


def replay_planned(trace) -> dict:
    """pymemplan-planned over the trace in the core's replay loop (1 TiB device, 2 MiB pages),
    REPEAT times; the result of the run that spent least time planning."""
    from pymemplan import _core
    from pymemplan.traces.replay import parse_policy

    runs = [_core.replay(trace.action, trace.ptr, trace.size, trace.stream,
                         *parse_policy("pymemplan-planned"), 1 << 40, PAGE) for _ in range(REPEAT)]
    return min(runs, key=lambda r: r["planning_seconds"])


def measure(trace) -> dict:
    from pymemplan import _core
    from pymemplan.traces.replay import replay

    planned, vmm = replay(trace, ["pymemplan-planned", "pymemplan-vmm"], capacity="1TiB")
    planning = replay_planned(trace)["planning_seconds"]
    stats, blocks = plan_figures(trace)
    t0 = time.perf_counter()
    packed = _core.pack_blocks(blocks["start"], blocks["life"], blocks["size"], blocks["period"],
                               2, PAGE, 0)
    pack_s = time.perf_counter() - t0
    return {
        "trace": trace.name,
        "events": len(trace),
        "plan_blocks": len(blocks["size"]),
        "plan_period_events": blocks["period"],
        "plans_built": int(stats["plans_built"]),
        "arms": int(stats["arms"]),
        "remakes": int(stats["remakes"]),
        "packings_reused": int(stats["packings_reused"]),
        "planning_seconds": planning,
        "pack_blocks_seconds": pack_s,
        "pack_blocks_ratio": packed["ratio"],
        "ns_per_event_planned": planned.ns_per_event,
        "ns_per_event_vmm": vmm.ns_per_event,
        "planned_over_vmm_time": planned.ns_per_event / vmm.ns_per_event,
        "peak_live_bytes": planned.peak_live_bytes,
        "planned_steady_reserved_over_live": planned.steady_reserved_over_live,
        "vmm_reserved_over_live": vmm.reserved_over_live,
    }


def turns_trace(seed: int, steps: int = 100):
    """Random training loop `seed` of alloc_random.py, run for `steps` steps."""
    from synthetic_traces import random_training

    trace = random_training(seed, steps=steps)
    trace.name = f"random_training_{seed}_x{steps}"
    return trace


def measure_turns(trace) -> dict:
    from pymemplan.traces.replay import replay

    planned, vmm = replay(trace, ["pymemplan-planned", "pymemplan-vmm"], capacity="1TiB")
    stats, _ = plan_figures(trace)
    return {
        "trace": trace.name,
        "events": len(trace),
        "plans": int(stats["plans"]),
        "arms": int(stats["arms"]),
        "packings_reused": int(stats["packings_reused"]),
        "planning_seconds": replay_planned(trace)["planning_seconds"],
        "ns_per_event_planned": planned.ns_per_event,
        "ns_per_event_vmm": vmm.ns_per_event,
        "planned_over_vmm_time": planned.ns_per_event / vmm.ns_per_event,
        "planned_reserved_over_live": planned.reserved_over_live,
        "vmm_reserved_over_live": vmm.reserved_over_live,
    }


def with_baseline(row: dict, base: dict | None) -> dict:
    """`row` with the baseline build's planning seconds and peak reserved bytes beside ours."""
    if base:
        row["baseline_planning_seconds"] = base["planning_seconds"]
        row["baseline_peak_reserved_bytes"] = base["peak_reserved_bytes"]
        row["baseline_over_ours_planning"] = base["planning_seconds"] / max(row["planning_seconds"], 1e-9)
    return row


def growth(rows, key):
    """The exponent x in key ~ blocks^x between the smallest and the largest model."""
    a, b = rows[0], rows[-1]
    if len(rows) < 2 or a[key] <= 0 or b[key] <= 0 or a["plan_blocks"] == b["plan_blocks"]:
        return None
    return math.log(b[key] / a[key]) / math.log(b["plan_blocks"] / a["plan_blocks"])


def use_core(path: str) -> None:
    """Makes `import pymemplan._core` load the build at `path` (before pymemplan is imported)."""
    spec = importlib.util.spec_from_file_location("pymemplan._core", path)
    if spec is None or not Path(path).is_file():
        raise SystemExit(f"--core: {path} is not a built _core module (a .so file)")
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    sys.modules["pymemplan._core"] = core


def baseline(core: str, depths, turns) -> tuple[dict, dict]:
    """Planning seconds and peak reserved bytes per depth and per random loop, replayed through
    another build of the core in a process of its own (two builds cannot share one)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        subprocess.run([sys.executable, __file__, "--core", core, "--replay-only",
                        "--layers", ",".join(map(str, depths)),
                        "--turns", ",".join(map(str, turns)), "--out", str(out)], check=True)
        got = json.loads(out.read_text())
        return ({r["layers"]: r for r in got["results"]},
                {r["seed"]: r for r in got["taking_turns"]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="6,12,24,48,96",
                    help="comma-separated depths of the narrow GPT-2 models (default %(default)s)")
    ap.add_argument("--rerecord", action="store_true", help="record the traces again")
    ap.add_argument("--turns", default="1,9,11",
                    help="seeds of random loops whose shapes take turns, run 100 steps each "
                         "(comma-separated; empty for none; default %(default)s)")
    ap.add_argument("--out", default=str(RESULT), help="JSON output (default %(default)s)")
    ap.add_argument("--baseline-core", default=None,
                    help="another build of pymemplan's _core module to compare with")
    ap.add_argument("--core", default=None, help=argparse.SUPPRESS)  # used by --baseline-core
    ap.add_argument("--replay-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_core and not Path(args.baseline_core).is_file():
        ap.error(f"--baseline-core: no file {args.baseline_core} (give the path of a built "
                 "_core module, e.g. build/<tag>/_core.cpython-311-x86_64-linux-gnu.so of an "
                 "earlier commit)")
    if args.core:
        use_core(args.core)
    try:
        depths = sorted({int(x) for x in args.layers.split(",")})
    except ValueError:
        ap.error(f"--layers takes comma-separated whole numbers, got {args.layers!r}")
    if not depths or depths[0] < 1:
        ap.error("--layers: each depth must be at least 1")
    try:
        turns = [int(x) for x in args.turns.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--turns takes comma-separated seeds (whole numbers), got {args.turns!r}")
    if args.replay_only:  # the baseline's process: planning seconds and peak reserved only
        rows = []
        for layers in depths:
            r = replay_planned(record_deep_gpt2(layers, TRACE_DIR / f"deep_gpt2_{layers}.csv.gz"))
            rows.append({"layers": layers, "planning_seconds": r["planning_seconds"],
                         "peak_reserved_bytes": r["peak_reserved_bytes"]})
        turn_rows = []
        for seed in turns:
            r = replay_planned(turns_trace(seed))
            turn_rows.append({"seed": seed, "planning_seconds": r["planning_seconds"],
                              "peak_reserved_bytes": r["peak_reserved_bytes"]})
        Path(args.out).write_text(json.dumps({"results": rows, "taking_turns": turn_rows}))
        return 0
    for layers in depths:  # recorded here first (the baseline's process reads them)
        record_deep_gpt2(layers, TRACE_DIR / f"deep_gpt2_{layers}.csv.gz", args.rerecord)
    base, base_turns = baseline(args.baseline_core, depths, turns) if args.baseline_core else (None, None)
    rows = []
    print(f"{'layers':>6} {'events':>8} {'blocks':>7} {'planning s':>10} {'reused':>6} "
          f"{'pack_blocks s':>13} {'planned/vmm time':>16}" + (" baseline s" if base else ""))
    for layers in depths:
        trace = record_deep_gpt2(layers, TRACE_DIR / f"deep_gpt2_{layers}.csv.gz")
        row = with_baseline({"layers": layers, **measure(trace)}, base and base[layers])
        rows.append(row)
        print(f"{layers:>6} {row['events']:>8,} {row['plan_blocks']:>7,} "
              f"{row['planning_seconds']:>10.3f} {row['packings_reused']:>6} "
              f"{row['pack_blocks_seconds']:>13.3f} {row['planned_over_vmm_time']:>16.1f}"
              + (f" {row['baseline_planning_seconds']:>12.3f}" if base else ""), flush=True)
    turn_rows = []
    if turns:
        print(f"\n{'random loop':>26} {'events':>8} {'arms':>5} {'reused':>6} {'planning s':>10} "
              f"{'planned/vmm time':>16}" + (" baseline s" if base_turns else ""))
    for seed in turns:
        row = with_baseline({"seed": seed, **measure_turns(turns_trace(seed))},
                            base_turns and base_turns[seed])
        turn_rows.append(row)
        print(f"{row['trace']:>26} {row['events']:>8,} {row['arms']:>5} {row['packings_reused']:>6} "
              f"{row['planning_seconds']:>10.3f} {row['planned_over_vmm_time']:>16.1f}"
              + (f" {row['baseline_planning_seconds']:>12.3f}" if base_turns else ""), flush=True)
    summary = {"planning_seconds_growth_exponent": growth(rows, "planning_seconds"),
               "baseline_core": args.baseline_core,
               "baseline_planning_seconds_growth_exponent":
                   growth(rows, "baseline_planning_seconds") if base else None,
               "pack_blocks_growth_exponent": growth(rows, "pack_blocks_seconds")}
    print("planning time grows as blocks^{:.2f}, one pack_blocks call as blocks^{:.2f}".format(
        summary["planning_seconds_growth_exponent"] or float("nan"),
        summary["pack_blocks_growth_exponent"] or float("nan")))
    if base:
        print("the baseline's planning time grows as blocks^{:.2f}; ours is {:.1f}x faster on "
              "the deepest".format(summary["baseline_planning_seconds_growth_exponent"] or float("nan"),
                                   rows[-1]["baseline_over_ours_planning"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/plan_scaling.py", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "processor": platform.processor(),
                    "system": platform.platform()},
        "results": rows, "taking_turns": turn_rows, "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
