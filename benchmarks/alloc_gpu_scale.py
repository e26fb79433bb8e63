"""Allocator policies on training runs the size of a GPU's memory, predicted without one.

The recorded traces of alloc_replay.py are CPU runs of 19 MiB to 1.6 GiB, where one 2 MiB page
is up to 11% of the peak. A training job on an 80 GiB GPU holds gigabytes: each workload here
is a model at a batch size that fills 6 to 65 GiB, traced by the planner under fake tensors
(`pymemplan.trace(..., device="cuda")`: CUDA's sizes, no memory) and run for STEPS steps under
AdamW (the first one makes the optimizer's state, as `MemoryTrace.reserved_peak`'s run does; in
four of them the sequence length or the batch changes from step to step, a run made by
`pymemplan.planner.run_trace`, and four more run those for LONG steps in an order drawn at
random, as a loader that buckets by length serves them), then replayed through every policy on
a simulated 80 GiB device with 2 MiB pages. Reported per workload and policy:
- peak reserved over peak live, over the run and in the steady state (from the first request
  a plan served, as in alloc_replay.py);
- driver calls per step (segments or pages mapped and unmapped: on a GPU each page map or unmap
  is a driver call with some synchronous work, and PyTorch's allocator makes none once warm),
  and their mean over the last third of the steps (at least the last LAST);
- pymemplan-planned's planning time, and the offline bound (every block placed knowing the run).

    python benchmarks/alloc_gpu_scale.py              # about 3 minutes
    python benchmarks/alloc_gpu_scale.py --only gpt2_b12 bert_b32

Writes benchmarks/results/alloc_gpu_scale.json. A predicted run is not a recorded one: it has
no CPU kernel's scalars and no library's scratch buffers beyond the planner's kernel model, so
its allocations are cleaner than a real run's; what it shows is how the policies behave at the
scale of a GPU job, where page granularity no longer decides the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "alloc_gpu_scale.json"
POLICIES = ("torch", "torch=expandable_segments:True", "gmlake", "pymemplan", "pymemplan-vmm",
            "pymemplan-planned")
STEPS = 8
LONG = 24  # steps of the runs whose shapes come in a random order
LAST = 3  # steady driver calls: the mean over the last third of the steps, at least LAST
CAPACITY = 80 << 30
GiB = 1 << 30
SHORT = {"torch=expandable_segments:True": "expandable", "pymemplan-vmm": "vmm",
         "pymemplan-planned": "planned"}


@dataclass
class GpuWorkload:
    name: str
    build: Callable  # (shape) -> pymemplan.planner.models.Workload, on the meta device
    autocast: str | None = None  # "bfloat16"
    description: str = ""
    shapes: tuple | None = None  # each step's shape (sequence length, batch); None: one shape
    steps: int = STEPS


def warm_steps(steps: int) -> int:
    """How many of the last steps the steady driver calls are the mean of."""
    return max(LAST, steps // 3)


def _vision(name: str, batch: int | None = None):
    from pymemplan.planner.models import _torchvision

    return lambda shape=None: _torchvision(name, shape or batch, "meta")


def workloads() -> dict[str, GpuWorkload]:
    from pymemplan.planner import models as m

    def w(name, build, autocast=None, description="", shapes=None):
        return name, GpuWorkload(name, build, autocast, description, shapes)

    def long(name_and_workload):
        # The same shapes over LONG steps, each drawn at random (seeded by the name): the
        # steady state of a loader that buckets by length, past the shapes' first steps.
        name, base = name_and_workload
        rng = random.Random(name)
        drawn = tuple(rng.choice(sorted(set(base.shapes))) for _ in range(LONG))
        return (f"{name}_long", GpuWorkload(f"{name}_long", base.build, base.autocast,
                                            f"{base.description}, {LONG} steps in a random order",
                                            drawn, LONG))

    single = [
        w("gpt2_b8", lambda: m.gpt2(batch=8), None, "GPT-2 small, 8 x 1024"),
        w("gpt2_b12", lambda: m.gpt2(batch=12), None, "GPT-2 small, 12 x 1024"),
        w("gpt2_b16_bf16", lambda: m.gpt2(batch=16), "bfloat16", "GPT-2 small, 16 x 1024, bf16 autocast"),
        w("bert_b16", lambda: m.bert(batch=16), None, "BERT-base, 16 x 512"),
        w("bert_b32", lambda: m.bert(batch=32), None, "BERT-base, 32 x 512"),
        w("bert_b64_bf16", lambda: m.bert(batch=64), "bfloat16", "BERT-base, 64 x 512, bf16 autocast"),
        w("llama_8l_bf16", lambda: m.llama_7b(batch=2, layers=8), "bfloat16",
          "LLaMA-2-7B's shapes, 8 layers, 2 x 2048, bf16 autocast"),
        w("llama3_4l_bf16", lambda: m.llama3_8b(batch=4, layers=4), "bfloat16",
          "LLaMA-3-8B's shapes, 4 layers, 4 x 2048, bf16 autocast"),
        w("llama_16l_s4096_bf16", lambda: m.llama_7b(batch=1, seq_len=4096, layers=16), "bfloat16",
          "LLaMA-2-7B's shapes, 16 layers, 1 x 4096, bf16 autocast"),
        w("resnet50_b128", _vision("resnet50", 128), None, "ResNet-50, 128 images of 224 x 224"),
        w("resnet50_b256_bf16", _vision("resnet50", 256), "bfloat16", "ResNet-50, 256 images, bf16 autocast"),
        w("vit_b_16_b64", _vision("vit_b_16", 64), None, "ViT-B/16, 64 images"),
        w("convnext_t_b64", _vision("convnext_tiny", 64), None, "ConvNeXt-T, 64 images"),
        w("densenet121_b64", _vision("densenet121", 64), None, "DenseNet-121, 64 images"),
        w("effnet_b0_b128", _vision("efficientnet_b0", 128), None, "EfficientNet-B0, 128 images"),
        w("swin_t_b64", _vision("swin_t", 64), None, "Swin-T, 64 images"),
        w("mlp_b4096", lambda: m.mlp(batch=4096, width=4096), None, "24-layer MLP, width 4096, batch 4096"),
    ]
    # Steps of several shapes, as a loader that buckets by length (or the last, short batch of
    # an epoch) makes them: where PyTorch's allocator fragments most.
    varying = [
        w("bert_b32_varlen", lambda seq: m.bert(batch=32, seq_len=seq), None,
          "BERT-base, batch 32, sequence lengths 128 to 512", (256, 512, 128, 384, 512, 256, 384, 128)),
        w("gpt2_b8_varlen", lambda seq: m.gpt2(batch=8, seq_len=seq), None,
          "GPT-2 small, batch 8, sequence lengths 256 to 1024", (512, 1024, 256, 768, 1024, 512, 768, 256)),
        w("llama_8l_varlen_bf16", lambda seq: m.llama_7b(batch=2, seq_len=seq, layers=8), "bfloat16",
          "LLaMA-2-7B's shapes, 8 layers, batch 2, sequence lengths 512 to 2048, bf16 autocast",
          (1024, 2048, 512, 1536, 2048, 1024, 1536, 512)),
        w("vit_b_16_varbatch", _vision("vit_b_16"), None, "ViT-B/16, batches of 32 to 64 images",
          (64, 48, 32, 64, 48, 32, 64, 48)),
    ]
    return dict(single + varying + [long(x) for x in varying])


def predicted_run(workload: GpuWorkload, steps: int | None = None):
    """The planner's allocation trace of `steps` (default: the workload's) training steps with
    AdamW, on CUDA (the workload's shapes, one per step, where it has them)."""
    import torch

    import pymemplan
    from pymemplan.planner import run_trace

    autocast = getattr(torch, workload.autocast) if workload.autocast else None
    steps = steps or workload.steps
    shapes = workload.shapes[:steps] if workload.shapes else (None,) * steps
    traced = {}
    for shape in dict.fromkeys(shapes):
        built = workload.build(shape) if shape is not None else workload.build()
        traced[shape] = pymemplan.trace(built.model, built.inputs, loss_fn=built.loss_fn,
                                        optimizer=torch.optim.AdamW, device="cuda",
                                        autocast=autocast)
    run = run_trace([traced[shape] for shape in shapes])
    run.name = workload.name
    return run


def calls_per_step(run, policy: str, capacity: int = CAPACITY) -> tuple[list[int], dict]:
    """Driver calls (device allocations + frees: segments, or pages mapped and unmapped) made
    in each step of `run` under `policy` (the first step's count includes the parameters'
    allocations before it), and pymemplan-planned's plan_stats() at the end."""
    from pymemplan import _core
    from pymemplan.traces.replay import parse_policy

    name, config = parse_policy(policy)
    alloc = _core.Allocator(_core.SimulatedDevice(capacity), name, config)
    starts = set(run.meta["step_starts"][1:]) | {len(run)}
    live, counts, before = {}, [], 0
    for i, (a, p, n, st) in enumerate(zip(run.action.tolist(), run.ptr.tolist(),
                                          run.size.tolist(), run.stream.tolist())):
        if a == 0:
            try:
                live[p] = alloc.malloc(n, st)
            except _core.OutOfMemoryError:  # counted by replay() as an OOM; skipped with its free
                pass
        elif a == 1 and p in live:
            alloc.free(live.pop(p))
        if i + 1 in starts:
            s = alloc.stats()
            now = s["num_device_alloc"] + s["num_device_free"]
            counts.append(now - before)
            before = now
    stats = alloc.plan_stats() if name == "pymemplan-planned" else {}
    return counts, stats


def measure(workload: GpuWorkload) -> dict:
    from pymemplan.traces import offline_layout, replay

    t0 = time.perf_counter()
    run = predicted_run(workload)
    traced_s = time.perf_counter() - t0
    results = {r.policy: r for r in replay(run, POLICIES, capacity=CAPACITY, granularity="2MiB")}
    live = results[POLICIES[0]].peak_live_bytes
    row = {"workload": workload.name, "description": workload.description, "events": len(run),
           "steps": workload.steps, "peak_live_bytes": live, "trace_seconds": round(traced_s, 2),
           "offline_over_live": offline_layout(run, "2MiB").peak_reserved_bytes / live,
           "policies": {}}
    for policy in POLICIES:
        r = results[policy]
        counts, stats = calls_per_step(run, policy)
        warm = warm_steps(len(counts))
        entry = {"reserved_over_live": r.reserved_over_live,
                 "steady_reserved_over_live": r.steady_reserved_over_live,
                 "peak_reserved_bytes": r.peak_reserved_bytes,
                 "steady_peak_reserved_bytes": r.steady_peak_reserved_bytes,
                 "ooms": r.ooms, "calls_per_step": counts,
                 "steady_calls_per_step": sum(counts[-warm:]) / warm}
        if stats:
            entry["planning_seconds"] = stats["pack_seconds"]
            entry["plans_armed"] = stats["arms"]
        row["policies"][policy] = entry
    return row


def verdicts(row: dict) -> dict:
    """The targets of alloc_replay.py on this run: pymemplan-vmm within 3% of live over the
    run; pymemplan-planned within 3% over the run and 1% in the steady state; both at most
    torch; and whether each stops making driver calls once warm (as torch does)."""
    p = row["policies"]
    torch_peak = p["torch"]["peak_reserved_bytes"]
    out = {}
    for name in ("pymemplan-vmm", "pymemplan-planned"):
        e = p[name]
        v = {"within_3pct": e["reserved_over_live"] <= 1.03,
             "at_most_torch": e["peak_reserved_bytes"] <= torch_peak,
             "no_calls_when_warm": e["steady_calls_per_step"] == 0}
        if name == "pymemplan-planned" and e["steady_reserved_over_live"] is not None:
            v["steady_within_1pct"] = e["steady_reserved_over_live"] <= 1.01
        out[name] = v
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="workload names")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args()
    chosen = workloads()
    if args.only:
        unknown = sorted(set(args.only) - set(chosen))
        if unknown:
            ap.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.only}
    rows = []
    for w in chosen.values():
        row = measure(w)
        row["verdicts"] = verdicts(row)
        rows.append(row)
        p = row["policies"]
        print(f"{w.name:22s} {row['peak_live_bytes'] / GiB:6.2f} GiB live | " + "  ".join(
            f"{SHORT.get(k, k)}: {p[k]['reserved_over_live']:.4f} ({p[k]['steady_calls_per_step']:.0f}/step)"
            for k in POLICIES), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/alloc_gpu_scale.py" + (" --only " + " ".join(args.only) if args.only else ""),
        "machine": platform.platform(), "capacity_bytes": CAPACITY, "steps": STEPS,
        "policies": list(POLICIES), "results": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
