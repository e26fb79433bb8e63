"""How exact is the sharded prediction? Each rank's predicted peak vs. a real 2-rank run.

    python benchmarks/whatif_sharding.py                        # gpt2, bert, resnet50 x ddp, fsdp
    python benchmarks/whatif_sharding.py --strategies ddp zero1 zero2 zero3 fsdp --markdown
    python benchmarks/whatif_sharding.py --models resnet50 --ranks 0

For GPT-2 small (12 layers), BERT-base (12 layers) and ResNet-50 (``pymemplan.planner
.models``, real random weights on the CPU), at reduced batch and sequence, with Adam:

- **measured**: ``pymemplan.whatif.sharding.measure_sharded``: two processes (spawned by
  torch.multiprocessing), the gloo backend, each wrapping its copy of the model with the
  strategy (``apply_strategy``: DDP; DDP + ZeroRedundancyOptimizer; FSDP2 ``fully_shard``
  with ``reshard_after_forward`` False / True / default), two warm-up steps, then one step
  under the profiler. A rank's exact peak is the highest total of the profiler's
  allocation events in that step, counted from before the model was copied (so
  parameters, buffers, DDP's buckets, optimizer state and inputs are included).
- **predicted**: ``trace_sharded(..., device="cpu")`` for that rank: the same strategy's
  torch code on fake tensors over a fake process group, kernel probes on (the CPU
  default), gloo's own collective buffers added (``_gloo_scratch``).

Both sides run with one intra-op thread (two ranks on two cores; the kernel probe
measures scratch at the thread count the ranks use). Results go to
``benchmarks/results/whatif_sharding.json``. ``run(models, strategies)`` is the same
benchmark as a function (``benchmarks/whatif_accuracy.py`` merges it).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "whatif_sharding.json"
TARGET_ERROR = 0.01

# Full architectures; batch and sequence small enough for 2 ranks on 2 cores.
MODELS = {
    "gpt2": dict(batch=1, seq_len=64),
    "bert": dict(batch=1, seq_len=64),
    "resnet50": dict(batch=2),          # 224 x 224 images
}
DEFAULT_STRATEGIES = ("ddp", "fsdp")


def _say(*args):
    print(*args, flush=True)


def run(models=tuple(MODELS), strategies=DEFAULT_STRATEGIES, *, world_size: int = 2,
        ranks=None, progress=_say) -> list[dict]:
    """Predicted vs. measured peak for every (model, strategy, rank): one row each with
    ``predicted_peak_bytes``, ``measured_peak_bytes``, ``error_bytes``, ``error``
    (relative), the bytes live when the step starts on both sides, the communication the
    traced step issued, and timings. ``ranks``: which ranks to trace (default: all)."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from pymemplan.whatif.sharding import (_load_workload, communication_bytes,
                                           measure_sharded, trace_sharded)

    torch.set_num_threads(1)
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    rows = []
    for name in models:
        size = MODELS[name]
        spec = {"builtin": name, "kwargs": dict(size, device="cpu")}
        t0 = time.perf_counter()
        measured = measure_sharded(spec, list(strategies), world_size,
                                   optimizer=torch.optim.Adam, threads=1, timeout=1800)
        t_measure = time.perf_counter() - t0
        progress(f"{name}: measured {', '.join(strategies)} on {world_size} gloo ranks "
                 f"in {t_measure:.0f} s")
        model, inputs, loss_fn = _load_workload(spec)
        for strategy in strategies:
            for rank in ranks:
                t0 = time.perf_counter()
                t = trace_sharded(model, inputs, strategy=strategy, world_size=world_size,
                                  rank=rank, loss_fn=loss_fn, optimizer=torch.optim.Adam,
                                  device="cpu")
                t_trace = time.perf_counter() - t0
                m = measured[strategy][rank]
                start = sum(x.size for x in t.graph.tensors if x.alloc_op == -1)
                err = t.peak_bytes - m["peak_bytes"]
                row = {"model": name, "strategy": strategy, "world_size": world_size,
                       "rank": rank, **size,
                       "predicted_peak_bytes": t.peak_bytes,
                       "measured_peak_bytes": m["peak_bytes"],
                       "error_bytes": err, "error": err / m["peak_bytes"],
                       "predicted_start_bytes": start,
                       "measured_start_bytes": m["start_bytes"],
                       "peak_phase": t.phase_of(t.peak_index),
                       "peak_breakdown": t.breakdown(),
                       "communication_bytes": communication_bytes(model, strategy, world_size,
                                                                  trace=t),
                       "trace_seconds": round(t_trace, 1),
                       "measured_step_seconds": m["seconds"]["step"],
                       "measure_seconds_all_strategies": round(t_measure, 1)}
                rows.append(row)
                progress(f"  {name:9s} {strategy:6s} rank {rank}: predicted "
                         f"{t.peak_bytes:>14,} measured {m['peak_bytes']:>14,} "
                         f"error {err:+,} B ({100 * row['error']:+.4f}%), trace {t_trace:.0f} s")
                del t
    return rows


def markdown(rows) -> str:
    from pymemplan.units import format_bytes

    out = ["| model | strategy | rank | measured peak | predicted | error | trace time |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['strategy']} | {r['rank']} | "
                   f"{format_bytes(r['measured_peak_bytes'])} | "
                   f"{format_bytes(r['predicted_peak_bytes'])} | "
                   f"{r['error_bytes']:+,} B ({100 * r['error']:+.4f}%) | "
                   f"{r['trace_seconds']:.0f} s |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--strategies", nargs="*", default=list(DEFAULT_STRATEGIES),
                    choices=["ddp", "zero1", "zero2", "zero3", "fsdp"])
    ap.add_argument("--ranks", nargs="*", type=int, default=None,
                    help="ranks to trace (default: all)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    import torch

    t0 = time.perf_counter()
    rows = run(args.models, args.strategies, ranks=args.ranks)
    worst = max(abs(r["error"]) for r in rows)
    result = {"torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "world_size": 2, "backend": "gloo (CPU)",
              "optimizer": "Adam", "sizes": {m: MODELS[m] for m in args.models},
              "command": "python benchmarks/whatif_sharding.py " + " ".join(argv or sys.argv[1:]),
              "target_error": TARGET_ERROR, "max_abs_error": worst,
              "within_target": worst <= TARGET_ERROR,
              "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _say(f"wrote {args.out}; max |error| {100 * worst:.4f}% in {result['seconds']:.0f} s")
    if args.markdown:
        _say(markdown(rows))
    return 0 if worst <= TARGET_ERROR else 1


if __name__ == "__main__":
    sys.exit(main())
