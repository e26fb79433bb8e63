"""What `pymemplan explain` tells from a snapshot taken at an out-of-memory error.

For each recorded trace (benchmarks/traces, and the workloads never tuned on), the run is
made to fail: the model of PyTorch's allocator runs it on the largest device on which it
fails (alloc_replay.json's `oom_capacity_bytes`), and the snapshot PyTorch would dump at that
error is taken (pymemplan.traces.fit.oom_snapshot), with the whole allocation history and with
only its last N entries, as `_record_memory_history(max_entries=N)` keeps. From each, as
`pymemplan explain` does, each allocator is replayed on the device's memory estimated from the
snapshot (reserved plus free at the error) and its verdict (fits or not) is set beside the
truth: the same policy run over every request of the run up to the error, the failed one
included, on the true capacity.

History that begins mid-run leaves out the blocks made before it. They are placed at its start
(`earlier="place"`, the default); left out (`earlier="drop"`, as before), the program seems to
hold less than it did. Reported per history length and policy: verdicts that agree with the
truth (also over the runs whose history that length cut: the rest see the whole run), and how
far each replay's peak live bytes fall short of the run's up to the error (a history that
begins after the run's highest live bytes cannot know them).

    python benchmarks/oom_whatif.py            # about 2 minutes on 2 cores

Writes benchmarks/results/oom_whatif.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from pymemplan.traces import read_trace  # noqa: E402
from pymemplan.traces.fit import OTHER_POLICIES, compare_fit, oom_snapshot, snapshot_fit  # noqa: E402
from pymemplan.traces.snapshot import snapshot_trace  # noqa: E402

POLICIES = ["torch", *OTHER_POLICIES]
KEEP = [None, 10_000, 1_000]


def traces() -> list[Path]:
    return sorted((HERE / "traces").glob("*.csv.gz")) + sorted((HERE / "traces" / "unseen").glob("*.csv.gz"))


LABEL = {"torch": "torch", "torch=expandable_segments:True": "torch-exp", "pymemplan": "pymemplan",
         "pymemplan-vmm": "vmm", "pymemplan-planned": "planned"}
# The devices each run is made to fail on: the largest on which PyTorch's allocator fails,
# and the largest on which pymemplan-vmm does (there the verdicts differ between policies).
FAILING = {"torch fails": "torch", "vmm fails": "pymemplan-vmm",
           # A run under PyTorch's allocator with expandable segments, on the largest device
           # on which that fails: its layout of the blocks made before a history is not
           # rebuilt (mapped piecewise), they are placed together.
           "expandable fails": "torch=expandable_segments:True"}
# PYTORCH_CUDA_ALLOC_CONF of the recorded run, per device.
CONF = {"expandable fails": "expandable_segments:True"}


def fail_capacities() -> dict[tuple[str, str], int]:
    """(trace, policy) -> the largest capacity on which the policy fails the trace."""
    out = {}
    for name in ("alloc_replay.json", "alloc_replay_unseen.json"):
        for r in json.loads((HERE / "results" / name).read_text())["results"]:
            if r.get("oom_capacity_bytes"):
                out[(r["trace"], r["policy"])] = r["oom_capacity_bytes"]
    return out


def verdicts(fit) -> dict[str, bool]:
    return {r.policy: r.fits for r in fit.rows}


def measure(trace, cap: int, device: str) -> dict | None:
    """The truth on `cap`, and what snapshots of histories of each length tell."""
    try:
        snap_all, failed_at = oom_snapshot(trace, cap, conf=CONF.get(device, ""))
    except ValueError:  # PyTorch's allocator runs it there: no snapshot to take
        return None
    truth = compare_fit(trace.head(failed_at + 1), capacity=cap, policies=POLICIES, smallest=False)
    row = {"trace": trace.name, "device": device, "capacity_bytes": cap,
           "failed_at_event": failed_at, "events": len(trace), "truth": verdicts(truth),
           "peak_live_bytes": truth.peak_live_bytes, "histories": []}
    for keep in KEEP:
        part, _ = oom_snapshot(trace, cap, keep=keep, conf=CONF.get(device, ""))
        fit = snapshot_fit(part, policies=POLICIES, name=trace.name)
        dropped = compare_fit(snapshot_trace(part, earlier="drop"), capacity=fit.capacity_bytes,
                              policies=POLICIES, smallest=False)
        row["histories"].append({
            "keep": keep, "entries": len(part["device_traces"][0]),
            "cut": len(part["device_traces"][0]) < len(snap_all["device_traces"][0]),
            "capacity_bytes": fit.capacity_bytes,
            "earlier_blocks": int(snapshot_trace(part).meta["earlier_blocks"]),
            "placed": verdicts(fit), "placed_peak_live_bytes": fit.peak_live_bytes,
            "dropped": verdicts(dropped), "dropped_peak_live_bytes": dropped.peak_live_bytes})
    return row


def summarize(rows: list[dict]) -> list[dict]:
    summary = []
    for device in FAILING:
        at = [r for r in rows if r["device"] == device]
        for i, keep in enumerate(KEEP):
            for how in ("placed", "dropped"):
                hist = [(r, r["histories"][i]) for r in at]
                short = [1 - h[f"{how}_peak_live_bytes"] / r["peak_live_bytes"] for r, h in hist]
                summary.append({
                    "device": device, "keep": keep, "earlier": how, "runs": len(at),
                    "agree": {p: sum(h[how][p] == r["truth"][p] for r, h in hist) for p in POLICIES},
                    "all_agree": sum(all(h[how][p] == r["truth"][p] for p in POLICIES)
                                     for r, h in hist),
                    "capacity_exact": sum(h["capacity_bytes"] == r["capacity_bytes"] for r, h in hist),
                    # Runs whose history this length cut (the rest see the whole run).
                    "cut_runs": sum(h["cut"] for _, h in hist),
                    "agree_cut": {p: sum(h[how][p] == r["truth"][p] for r, h in hist if h["cut"])
                                  for p in POLICIES},
                    "all_agree_cut": sum(all(h[how][p] == r["truth"][p] for p in POLICIES)
                                         for r, h in hist if h["cut"]),
                    "live_short_max": max(short, default=0.0),
                    "live_short_median": sorted(short)[len(short) // 2] if short else 0.0})
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results" / "oom_whatif.json"))
    ap.add_argument("--only", nargs="*", help="trace names to run (default: all)")
    args = ap.parse_args()
    caps = fail_capacities()
    rows = []
    start = time.perf_counter()
    for path in traces():
        trace = read_trace(path)
        if args.only and trace.name not in args.only:
            continue
        for device, policy in FAILING.items():
            cap = caps.get((trace.name, policy))
            row = None if cap is None else measure(trace, cap, device)
            if row is None:
                continue
            rows.append(row)
            print(f"{trace.name:24s} {device:11s} {cap / 2**20:8.0f} MiB (event "
                  f"{row['failed_at_event']:,}): "
                  + " ".join(f"{LABEL[p]}:{'y' if v else 'n'}" for p, v in row["truth"].items()),
                  flush=True)
    summary = summarize(rows)
    truth_counts = {device: {p: sum(r["truth"][p] for r in rows if r["device"] == device)
                             for p in POLICIES} for device in FAILING}
    out = {
        "command": "python benchmarks/oom_whatif.py",
        "machine": platform.machine(),
        "seconds": round(time.perf_counter() - start, 1),
        "policies": POLICIES,
        "fits_in_truth": truth_counts,
        "summary": summary,
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    for device, counts in truth_counts.items():
        n = sum(r["device"] == device for r in rows)
        print(f"\nwhere {device}, the run up to the error fits under: "
              + ", ".join(f"{LABEL[p]} {k}/{n}" for p, k in counts.items()))
    print(f"\n{'device':>11} {'history':>8} {'earlier':>8}  "
          + "  ".join(f"{LABEL[p]:>9}" for p in POLICIES)
          + "  all agree  capacity exact  live short (max)   (of the runs the history cut: "
          + ", ".join(LABEL[p] for p in POLICIES) + ", all)")
    for s in summary:
        print(f"{s['device']:>11} {str(s['keep'] or 'all'):>8} {s['earlier']:>8}  "
              + "  ".join(f"{s['agree'][p]:>9}" for p in POLICIES)
              + f"  {s['all_agree']:>9}  {s['capacity_exact']:>14}  {s['live_short_max']:>16.1%}"
              + f"   {s['cut_runs']} cut: " + " ".join(str(s['agree_cut'][p]) for p in POLICIES)
              + f" {s['all_agree_cut']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
