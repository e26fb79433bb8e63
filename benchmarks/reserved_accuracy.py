"""Predicted reserved memory vs. the reserved memory of a recorded run.

    python benchmarks/reserved_accuracy.py             # writes results/reserved_accuracy.json
    python benchmarks/reserved_accuracy.py --markdown  # also print the README table

``MemoryTrace.reserved_peak(policy)`` replays the planner's predicted allocation trace
through an allocator policy: what PyTorch (or pymemplan) will *reserve* over a run, which
is what decides an OOM. This checks it against the real thing on CPU: the recorded traces
of ``alloc_replay.py`` (building the model and Adam, then training steps, every
allocation and free of a real eager run), replayed through the same policy.

Each workload of ``alloc_replay.workloads()`` written as (build the model, one step), and
whose steps repeat (not the varying sequence lengths of ``*_varlen``), is
traced as it was recorded: a module whose forward is that step (it makes its own batch),
with Adam, ``device="cpu"`` (kernel probe on, the CPU default), over the same number of
steps. Reported per policy: the predicted peak reserved against the replayed one, with the
run's first step predicted as a first step (the optimizer makes its state there, after
backward) and, for comparison, as the steady-state step with the state made before the
run (the prediction before that was modelled).
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
RESULT = HERE / "results" / "reserved_accuracy.json"
POLICIES = ("torch", "pymemplan", "pymemplan-vmm")


def step_module(model, step):
    """The recorded step as a module: forward() makes the batch and returns the loss."""
    from torch import nn

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, _unused):
            return step(self.model, 0)

    return Step()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="workload names")
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    args = ap.parse_args()

    import torch

    import pymemplan
    from alloc_replay import NO_REPEATED_ITERATION, record_traces, workloads
    from pymemplan.traces.replay import replay

    steps_of = {name: entry for name, entry in workloads().items()
                if isinstance(entry, tuple) and len(entry) == 3
                and name not in NO_REPEATED_ITERATION}  # one step traced: it must repeat
    names = [n for n in steps_of if not args.only or n in args.only]
    traces = record_traces(names)
    rows = []
    for name in names:
        make, step, steps = steps_of[name]
        torch.manual_seed(0)
        model = step_module(make(), step)
        t0 = time.perf_counter()
        t = pymemplan.trace(model, (torch.zeros(()),), device="cpu",
                            optimizer=lambda p: torch.optim.Adam(p, lr=1e-4))
        seconds = time.perf_counter() - t0
        recorded = {r.policy: r for r in replay(traces[name], POLICIES)}
        first = {r.policy: r for r in replay(t._repeated_trace(steps), POLICIES)}
        steady = {r.policy: r for r in replay(t._repeated_trace(steps, first_step=False),
                                              POLICIES)}
        row = {"workload": name, "steps": steps, "trace_seconds": round(seconds, 2),
               "live": {"recorded": recorded["torch"].peak_live_bytes,
                        "predicted": t.peak_bytes}}
        for p in POLICIES:
            real = recorded[p].peak_reserved_bytes
            row[p] = {"recorded": real,
                      "predicted": first[p].peak_reserved_bytes,
                      "error": first[p].peak_reserved_bytes / real - 1,
                      "predicted_state_before_run": steady[p].peak_reserved_bytes,
                      "error_state_before_run": steady[p].peak_reserved_bytes / real - 1}
        rows.append(row)
        print(f"{name:18s} " + " | ".join(
            f"{p} {row[p]['error']:+.3f} (state before the run {row[p]['error_state_before_run']:+.3f})"
            for p in POLICIES), flush=True)

    def worst(key):
        return {p: max(abs(r[p][key]) for r in rows) for p in POLICIES}

    out = {"command": "python benchmarks/reserved_accuracy.py", "torch": torch.__version__,
           "machine": platform.platform(), "policies": list(POLICIES),
           "largest_error": worst("error"),
           "largest_error_state_before_run": worst("error_state_before_run"), "results": rows}
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULT}")
    if args.markdown:
        mib = 1 << 20
        print("\n| workload | " + " | ".join(f"`{p}` recorded | predicted | error" for p in POLICIES)
              + " |")
        print("|---|" + "---|---|---|" * len(POLICIES))
        for r in rows:
            cells = []
            for p in POLICIES:
                x = r[p]
                cells += [f"{x['recorded'] / mib:,.0f} MiB", f"{x['predicted'] / mib:,.0f} MiB",
                          f"{x['error']:+.1%} ({x['error_state_before_run']:+.1%})"]
            print(f"| {r['workload']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
