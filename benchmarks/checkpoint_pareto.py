"""Checkpoint planning across budgets: predicted and measured memory vs recompute.

    python benchmarks/checkpoint_pareto.py                  # reduced sizes, all models
    python benchmarks/checkpoint_pareto.py --models gpt2 --scale full --points 16

For each model (real weights, on the CPU):

1. trace one training step (``device="cpu"``) and build the checkpoint problem with
   FLOP-based costs; the Pareto front from the least achievable peak to the unplanned one
   (solver, optimality, solve time per point);
2. baseline: checkpoint every repeated block (what ``gradient_checkpointing_enable()``
   does in Hugging Face models), its predicted peak and recompute cost; then our plan for
   that same peak as budget, to compare recompute at equal memory;
3. for three budgets across the range: apply the plan eagerly, run a real CPU step and
   measure its peak (``pymemplan.planner.measure``) and its time against the unplanned
   step, so predicted and measured memory and overhead sit side by side.

Writes ``results/checkpoint_pareto.json`` and ``results/checkpoint_pareto.png``.
Rockmate, if installed, would be a further baseline; it is reported as absent otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

SIZES = {  # (reduced, full): full are planner_accuracy.py's sizes
    "gpt2": (dict(batch=2, seq_len=256), dict(batch=4, seq_len=512)),
    "bert": (dict(batch=2, seq_len=256), dict(batch=4, seq_len=512)),
    "vit_b_16": (dict(batch=4), dict(batch=8)),
    "resnet50": (dict(batch=4), dict(batch=8)),
    "mlp": (dict(batch=1024, width=512), dict(batch=4096, width=1024)),
}


def every_block(p):
    """The largest group of numbered sibling modules (h.0, h.1, ...): the model's blocks."""
    groups: dict[str, list] = {}
    for c in p.candidates:
        parent, _, leaf = c.module.rpartition(".")
        if leaf.isdigit() and c.policy == "full":
            groups.setdefault(parent, []).append(c.index)
    if not groups:
        return None
    return max(groups.values(), key=lambda g: sum(p.candidates[i].saved_bytes for i in g))


def timed_step(model, inputs, loss_fn, repeats=2):
    from pymemplan.planner.measure import step_fn

    step = step_fn(model, inputs, loss_fn, None)
    step()
    model.zero_grad(set_to_none=True)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return best


def run_model(name, scale, points, measure):
    import numpy as np
    import torch

    import pymemplan
    from pymemplan.planner.checkpoint import make_plan
    from pymemplan.planner.measure import measure_step
    from pymemplan.planner.models import BUILTIN

    torch.manual_seed(0)
    w = BUILTIN[name](device="cpu", **SIZES[name][scale == "full"])
    t0 = time.perf_counter()
    t = pymemplan.trace(w.model, w.inputs, loss_fn=w.loss_fn, device="cpu")
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = t.checkpoint_problem(w.model, w.inputs)
    problem_s = time.perf_counter() - t0
    front = t.pareto(points, model=w.model, inputs=w.inputs)
    out = {"model": name, "sizes": SIZES[name][scale == "full"], "ops": t.graph.num_ops,
           "candidates": p.n, "unplanned_peak_bytes": t.peak_bytes,
           "least_peak_bytes": min(q["peak_bytes"] for q in front),
           "trace_seconds": trace_s, "problem_seconds": problem_s, "pareto": front}

    blocks = every_block(p)
    if blocks:
        x = np.zeros(p.n, dtype=np.int64)
        x[blocks] = 1
        base_peak, base_cost = p.peak(x), p.cost(x)
        ours = make_plan(p, base_peak)
        out["every_block"] = {
            "modules": [p.candidates[i].module for i in blocks], "peak_bytes": base_peak,
            "recompute_fraction": base_cost / p.forward_cost,
            "ours_at_same_peak": {"peak_bytes": ours.predicted_peak_bytes,
                                  "recompute_fraction": ours.recompute_cost["fraction_of_forward"],
                                  "solver": ours.solver, "optimal": ours.optimal}}
    if measure:
        base_time = timed_step(w.model, w.inputs, w.loss_fn)
        measured = []
        lo, hi = out["least_peak_bytes"], t.peak_bytes
        for frac in (0.25, 0.5, 0.75):
            budget = int(lo + frac * (hi - lo))
            plan = make_plan(p, budget)
            plan.apply(w.model)
            try:
                peak = measure_step(w.model, w.inputs, loss_fn=w.loss_fn).peak_bytes
                step_s = timed_step(w.model, w.inputs, w.loss_fn)
            finally:
                plan.remove(w.model)
            measured.append({
                "budget_bytes": budget, "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": peak, "measured_over_budget": peak / budget - 1,
                "prediction_error": peak / plan.predicted_peak_bytes - 1,
                "predicted_recompute_fraction": plan.recompute_cost["fraction_of_forward"],
                "measured_step_overhead": step_s / base_time - 1,
                "solver": plan.solver, "optimal": plan.optimal, "gap": plan.gap,
                "solve_seconds": plan.solve_seconds, "modules": plan.policies})
        out["measured"] = measured
        out["unplanned_step_seconds"] = base_time
    return out


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        pts = sorted(r["pareto"], key=lambda q: q["peak_bytes"])
        ax.step([q["peak_bytes"] / 2**20 for q in pts],
                [100 * q["recompute_fraction"] for q in pts], where="post", marker="o",
                label="pymemplan plan (predicted)")
        if "every_block" in r:
            e = r["every_block"]
            ax.scatter([e["peak_bytes"] / 2**20], [100 * e["recompute_fraction"]],
                       marker="x", color="red", s=60, label="checkpoint every block")
        for m in r.get("measured", []):
            ax.scatter([m["measured_peak_bytes"] / 2**20], [100 * m["predicted_recompute_fraction"]],
                       marker="s", facecolors="none", edgecolors="green", s=50)
        ax.set_title(r["model"])
        ax.set_xlabel("peak (MiB)")
        ax.set_ylabel("recompute (% of forward)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,resnet50,vit_b_16,bert,gpt2")
    ap.add_argument("--scale", choices=("reduced", "full"), default="reduced")
    ap.add_argument("--points", type=int, default=10)
    ap.add_argument("--no-measure", action="store_true", help="skip the real CPU steps")
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_pareto.json"))
    args = ap.parse_args()
    import torch

    try:
        import rockmate  # noqa: F401
        rockmate_status = "installed, not yet compared"
    except ImportError:
        rockmate_status = "not installed: no Rockmate baseline"
    results = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        r = run_model(name, args.scale, args.points, not args.no_measure)
        r["benchmark_seconds"] = time.perf_counter() - t0
        results.append(r)
        ms = r.get("measured", [])
        print(f"{name}: unplanned {r['unplanned_peak_bytes'] / 2**20:.1f} MiB, least "
              f"{r['least_peak_bytes'] / 2**20:.1f} MiB, {r['candidates']} candidates, "
              + "; ".join(f"budget {m['budget_bytes'] / 2**20:.1f} -> measured "
                          f"{m['measured_peak_bytes'] / 2**20:.1f} MiB "
                          f"({m['measured_over_budget']:+.2%} vs budget, "
                          f"{m['prediction_error']:+.2%} vs predicted)" for m in ms),
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"scale": args.scale, "torch": torch.__version__, "machine": platform.machine(),
           "python": platform.python_version(), "rockmate": rockmate_status,
           "results": results}
    out.write_text(json.dumps(doc, indent=1, default=float))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
