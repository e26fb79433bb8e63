"""How right is the compile backend's prediction of the compiled step's peak? Predicted
against measured, for every candidate partition the backend considers, on real CPU
training steps compiled by Inductor.

    python benchmarks/compiled_prediction_check.py                 # the four models, reduced
    python benchmarks/compiled_prediction_check.py --models mlp,resnet50

For each model (the reduced sizes of ``checkpoint_pareto.py``; one forward + backward
step, no optimizer) the unplanned compiled step is measured; a backend made for the
loosest eager budget of ``checkpoint_pareto.py`` compiles the model once and
``least_compiled_peak()`` makes its candidate partitions: the unplanned one, PyTorch's
under each ``activation_memory_budget``, the module-level least-peak plan, the op-level
recompute-all plan and op-level MILP plans; the plans the backend re-chooses for the
compiled budgets (0.3c, 0.5c, 0.7c) join them. Each distinct partition is then compiled
as it is (``compile_backend(plan=..., adapt=False)``) and its peak measured
(``pymemplan.planner.measure.measure_step``). Printed and written to
``results/compiled_prediction_check.json``, per candidate:

- ``graphs``: the prediction walked on the partitioned graphs (``compiled_memory.py``,
  the backend's default), raw (no calibration);
- ``eager``: the earlier prediction on the eager step's timeline (``EagerAxis``), raw;
- ``graphs+cal``: ``graphs`` plus the backend's calibration (measured unplanned peak
  minus its predicted one, when positive: it only ever raises predictions), as the
  backend uses it;
- ``eager+cal``: ``eager`` calibrated the same way, as the backend used it before.

``--report results/compiled_prediction_check.json`` prints the tables of a written run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MIB = 2 ** 20


def candidates_of(backend, model, inputs, t, budgets_c):
    """(label, plan) of every distinct partition the backend considers."""
    import dataclasses

    from checkpoint_pareto import compiled_kind, plan_key
    from pymemplan.planner.checkpoint.plan import BudgetTooSmallError

    out, seen = [], set()
    for pl, _ in backend._least_all:
        key = ("unplanned",) if pl is None else plan_key(pl)
        if key not in seen:
            seen.add(key)
            label = "unplanned" if pl is None else (
                f"{compiled_kind(pl)} ({getattr(pl, 'solver', '')})")
            out.append((label, pl))
    for f, b in budgets_c.items():
        try:
            start = t.plan(b, model=model, inputs=inputs)
        except BudgetTooSmallError as e:
            least = t.plan(e.least_peak_bytes, model=model, inputs=inputs)
            start = dataclasses.replace(least, budget_bytes=b)
        chosen, _ = backend.rechoose(start)
        key = plan_key(chosen)
        if key not in seen:
            seen.add(key)
            out.append((f"chosen at {f:g}c: {compiled_kind(chosen)}", chosen))
    return out


def predictions(backend, pl, none_plan):
    """Raw predictions (no calibration) of ``pl``'s compiled peak by both predictors."""
    ctx = backend._ctx
    cal = backend.calibration_bytes
    out = {}
    for name in ("graphs", "eager"):
        backend.predictor = name
        try:
            out[name] = int(backend._predict(ctx, pl if pl is not None else none_plan)) - cal
        finally:
            backend.predictor = "graphs"
    return out


def run_model(name, log):
    import torch

    import pymemplan
    from checkpoint_pareto import (SIZES, compile_and_measure, inductor_with_budget,
                                   setup_compile)
    from pymemplan.planner.checkpoint.milp import least_peak
    from pymemplan.planner.checkpoint.plan import make_plan
    from pymemplan.planner.checkpoint.compile_backend import compiled_costs
    from pymemplan.planner.models import BUILTIN

    torch.manual_seed(0)
    size = SIZES[name][0]
    w = BUILTIN[name](device="cpu", **size)
    model, inputs, loss_fn = w.model, w.inputs, w.loss_fn
    model.train()
    t = pymemplan.trace(model, inputs, loss_fn=loss_fn, device="cpu")
    p = t.checkpoint_problem(model, inputs)
    least, _ = least_peak(p)
    loosest = int(least + 0.7 * (t.peak_bytes - least))  # checkpoint_pareto's 0.7 budget
    setup_compile()
    _, _, base_peak = compile_and_measure(model, inductor_with_budget(1.0), inputs, loss_fn)
    log(f"\n== {name} {size}: unplanned compiled step measured {base_peak / MIB:.1f} MiB")
    backend = pymemplan.compile_backend(plan=t.plan(loosest, model=model, inputs=inputs),
                                        unplanned_peak_bytes=base_peak)
    compile_and_measure(model, backend, inputs, loss_fn)
    fixed_c = backend.least_compiled_peak()
    budgets_c = {f: int(fixed_c + f * (base_peak - fixed_c)) for f in (0.3, 0.5, 0.7)}
    none_plan = make_plan(compiled_costs(p), int(p.base.max()))
    rows = []
    for label, pl in candidates_of(backend, model, inputs, t, budgets_c):
        pred = predictions(backend, pl, none_plan)
        if pl is None:
            measured = base_peak
        else:
            be = pymemplan.compile_backend(plan=pl, adapt=False)
            measured = compile_and_measure(model, be, inputs, loss_fn)[2]
        row = {"candidate": label, "measured_bytes": int(measured),
               "graphs_bytes": pred["graphs"], "eager_bytes": pred["eager"],
               "graphs_calibrated_bytes": pred["graphs"] + backend.calibration_bytes}
        for k in ("graphs", "eager"):
            row[f"{k}_error_bytes"] = pred[k] - int(measured)
        row["graphs_calibrated_error_bytes"] = row["graphs_calibrated_bytes"] - int(measured)
        rows.append(row)
        log(f"  {label:42s} measured {measured / MIB:8.1f}  graphs {pred['graphs'] / MIB:8.1f} "
            f"({row['graphs_error_bytes'] / MIB:+6.1f})  eager {pred['eager'] / MIB:8.1f} "
            f"({row['eager_error_bytes'] / MIB:+6.1f})  graphs+cal "
            f"{row['graphs_calibrated_error_bytes'] / MIB:+6.1f} MiB")
    calibrate_eager(rows, base_peak)
    return {"model": name, "sizes": size, "unplanned_measured_bytes": int(base_peak),
            "calibration_bytes": int(backend.calibration_bytes),
            "graph_prediction_error": backend.graph_prediction_error,
            "candidates": rows}


def calibrate_eager(rows, base_peak):
    """The eager-timeline predictor as the backend used it before: calibrated by the
    measured unplanned step (its own calibration: measured minus its raw prediction)."""
    raw = next(r["eager_bytes"] for r in rows if r["candidate"] == "unplanned")
    for r in rows:
        r["eager_calibrated_bytes"] = r["eager_bytes"] + int(base_peak) - raw
        r["eager_calibrated_error_bytes"] = r["eager_calibrated_bytes"] - r["measured_bytes"]


def summary(results) -> str:
    lines = ["| model | candidates | graphs | graphs+cal | eager | eager+cal (before) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        rows = r["candidates"]

        def worst(k):
            e = max(rows, key=lambda x: abs(x[k]))
            m = e["measured_bytes"]
            return f"{e[k] / MIB:+.1f} MiB ({e[k] / m:+.1%})"
        lines.append(f"| {r['model']} | {len(rows)} | {worst('graphs_error_bytes')} | "
                     f"{worst('graphs_calibrated_error_bytes')} | "
                     f"{worst('eager_error_bytes')} | "
                     f"{worst('eager_calibrated_error_bytes')} |")
    lines.append("")
    lines.append("Largest error over the candidates (predicted - measured), per predictor.")
    return "\n".join(lines)


def table(results) -> str:
    """Every candidate: measured, and each prediction's error, in MiB."""
    lines = ["| model | candidate | measured | graphs | graphs+cal | eager+cal (before) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for c in r["candidates"]:
            lines.append(f"| {r['model']} | {c['candidate']} | "
                         f"{c['measured_bytes'] / MIB:.1f} | "
                         f"{c['graphs_error_bytes'] / MIB:+.1f} | "
                         f"{c['graphs_calibrated_error_bytes'] / MIB:+.1f} | "
                         f"{c['eager_calibrated_error_bytes'] / MIB:+.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,gpt2,bert,resnet50")
    ap.add_argument("--out", default=str(HERE / "results" / "compiled_prediction_check.json"))
    ap.add_argument("--report", metavar="JSON", help="print the tables of a written run")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            results = json.load(f)["results"]
        for r in results:
            if "eager_calibrated_bytes" not in r["candidates"][0]:
                calibrate_eager(r["candidates"], r["unplanned_measured_bytes"])
        print(table(results) + "\n\n" + summary(results))
        return
    t0 = time.perf_counter()
    results = [run_model(m, lambda s: print(s, flush=True)) for m in args.models.split(",")]
    print("\n" + table(results) + "\n\n" + summary(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import torch
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "seconds": time.perf_counter() - t0,
                   "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
