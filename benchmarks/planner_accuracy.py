"""How exact is the planner? Predicted peak vs. the measured peak of a real step.

    python benchmarks/planner_accuracy.py             # CPU: writes results/planner_accuracy.json
    python benchmarks/planner_accuracy.py --markdown  # also print the table of docs/planner.md
    python benchmarks/planner_accuracy.py --gpu       # GPU machines only: device="cuda" check

CPU (always): for each model, for forward+backward and for forward+backward+Adam (the
steady-state step: Adam's state exists, gradients start as None), three figures:

- **measured**: a real eager step on the CPU under ``pymemplan.traces.record`` (the
  profiler's allocation events, checked against the allocator's running total). The peak
  of live tensor bytes is the bytes live when the step starts (parameters, buffers,
  inputs, optimizer state: their storages, counted once) plus the highest rise of the
  allocator's total during the step.
- **pymemplan**: ``pymemplan.trace(..., device="cpu")`` on fake tensors, with its default
  for the CPU target: each distinct op signature also runs once on real zero tensors to
  measure kernel scratch (oneDNN convolution's layout copies; ``planner/probe.py``). Its
  time includes that probe.
- **MemTracker**: PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` run on a
  real eager step (its ``peak`` snapshot, ``Total``), with the model, optimizer and inputs
  registered through ``track_external``.

GPU (``--gpu``, needs CUDA): ``pymemplan.trace(..., device="cuda")`` against
``torch.cuda.max_memory_allocated()`` of a real step on the GPU, peak stats reset after
the warm-up step.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "planner_accuracy.json"
TARGET_ERROR = 0.005

# Sizes chosen so a real eager CPU step takes seconds on a laptop.
MODELS = {
    "resnet50": dict(batch=8),
    "vit_b_16": dict(batch=8),
    "gpt2": dict(batch=4, seq_len=512),
    "bert": dict(batch=4, seq_len=512),
    "mlp": dict(batch=256),     # 24 x (Linear 2048, GELU)
}


def _workload(name, device):
    import torch
    from pymemplan.planner.models import BUILTIN

    torch.manual_seed(0)
    return BUILTIN[name](device=device, **MODELS[name])


def measure_cpu(name: str, with_adam: bool) -> dict:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    import pymemplan
    from pymemplan.planner.measure import measure_step, step_fn

    w = _workload(name, "cpu")
    w.model.train()

    t0 = time.perf_counter()
    pred = pymemplan.trace(w.model, w.inputs, loss_fn=w.loss_fn,
                           optimizer=torch.optim.Adam if with_adam else None, device="cpu")
    t_plan = time.perf_counter() - t0

    # The same steady-state step, for real (with Adam, a warm-up step first).
    opt = torch.optim.Adam(w.model.parameters()) if with_adam else None
    t0 = time.perf_counter()
    measured = measure_step(w.model, w.inputs, loss_fn=w.loss_fn, optimizer=opt).peak_bytes
    t_eager = time.perf_counter() - t0

    w.model.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(w.model, *(x for x in (opt,) if x is not None),
                      *(a for a in w.inputs if isinstance(a, torch.Tensor)))
    t0 = time.perf_counter()
    with mt:
        step_fn(w.model, w.inputs, w.loss_fn, opt)()
    t_mt = time.perf_counter() - t0
    mt_peak = int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    w.model.zero_grad(set_to_none=True)

    return {
        "model": name, "step": "fwd+bwd+adam" if with_adam else "fwd+bwd",
        "config": MODELS[name], "measured_peak_bytes": measured,
        "pymemplan_peak_bytes": pred.peak_bytes,
        "pymemplan_error": (pred.peak_bytes - measured) / measured,
        "memtracker_peak_bytes": mt_peak, "memtracker_error": (mt_peak - measured) / measured,
        "pymemplan_seconds": t_plan, "memtracker_seconds": t_mt,
        "eager_seconds": t_eager,  # real steps: warm-up (with Adam) + measured
        "pymemplan_ops": pred.graph.num_ops, "pymemplan_peak_phase": pred.peak_op.phase,
    }


def measure_gpu(name: str, with_adam: bool) -> dict:  # runs only with a GPU (see main)
    import torch

    import pymemplan
    from pymemplan.planner.measure import measure_step

    w = _workload(name, "cuda")
    t0 = time.perf_counter()
    pred = pymemplan.trace(w.model, w.inputs, loss_fn=w.loss_fn,
                           optimizer=torch.optim.Adam if with_adam else None, device="cuda")
    t_plan = time.perf_counter() - t0
    opt = torch.optim.Adam(w.model.parameters()) if with_adam else None
    measured = measure_step(w.model, w.inputs, loss_fn=w.loss_fn, optimizer=opt).peak_bytes
    return {"model": name, "step": "fwd+bwd+adam" if with_adam else "fwd+bwd",
            "config": MODELS[name], "measured_peak_bytes": measured,
            "pymemplan_peak_bytes": pred.peak_bytes,
            "pymemplan_error": (pred.peak_bytes - measured) / measured,
            "pymemplan_seconds": t_plan, "gpu": torch.cuda.get_device_name()}


def _err(r, who: str) -> str:
    delta = r[f"{who}_peak_bytes"] - r["measured_peak_bytes"]
    return f"{delta:+,} B ({100 * r[f'{who}_error']:+.4f}%)"


def markdown(rows) -> str:
    from pymemplan.units import format_bytes

    out = ["| model | step | measured peak | pymemplan | error | MemTracker | error | "
           "pymemplan time | MemTracker time | eager steps |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['step']} | {format_bytes(r['measured_peak_bytes'])} | "
            f"{format_bytes(r['pymemplan_peak_bytes'])} | {_err(r, 'pymemplan')} | "
            f"{format_bytes(r['memtracker_peak_bytes'])} | {_err(r, 'memtracker')} | "
            f"{r['pymemplan_seconds']:.1f} s | {r['memtracker_seconds']:.1f} s | "
            f"{r['eager_seconds']:.1f} s |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="compare device='cuda' predictions with "
                    "a real GPU step (needs CUDA)")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(HERE.parent))
    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu needs a CUDA device; none is available", file=sys.stderr)
            return 2
        rows = [measure_gpu(m, adam) for m in args.models for adam in (False, True)]
        out = args.out.with_name("planner_accuracy_gpu.json")
    else:
        rows = []
        for m in args.models:
            for adam in (False, True):
                r = measure_cpu(m, adam)
                print(f"{r['model']:10s} {r['step']:13s} measured {r['measured_peak_bytes']:>14,} "
                      f"pymemplan {100 * r['pymemplan_error']:+.4f}% "
                      f"MemTracker {100 * r['memtracker_error']:+.2f}%", flush=True)
                rows.append(r)
        out = args.out
    worst = max(abs(r["pymemplan_error"]) for r in rows)
    result = {"torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "target_error": TARGET_ERROR,
              "max_abs_error": worst, "within_target": worst <= TARGET_ERROR, "rows": rows}
    if not args.gpu:
        result["never_worse_than_memtracker"] = all(
            abs(r["pymemplan_error"]) <= abs(r["memtracker_error"]) for r in rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}; max |error| {100 * worst:.4f}%")
    if args.markdown and not args.gpu:
        print(markdown(rows))
    return 0 if worst <= TARGET_ERROR else 1


if __name__ == "__main__":
    sys.exit(main())
