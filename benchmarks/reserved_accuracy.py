"""Predicted reserved memory vs. the reserved memory of a recorded run.

    python benchmarks/reserved_accuracy.py             # writes results/reserved_accuracy.json
    python benchmarks/reserved_accuracy.py --markdown  # also print the table of docs/planner.md

``MemoryTrace.reserved_peak(policy)`` replays the planner's predicted allocation trace
through an allocator policy: what PyTorch (or pymemplan) will *reserve* over a run, which
is what decides an OOM. This checks it against the real thing on CPU: the recorded traces
of ``alloc_replay.py`` (building the model and Adam, then training steps, every
allocation and free of a real eager run), replayed through the same policy.

Each workload whose steps repeat (not the varying sequence lengths of ``*_varlen``) and
whose step can be written alone is traced as it was recorded: a module whose forward is
that step (it makes its own batch), with the run's optimizer and autocast, ``device="cpu"``
(kernel probe on, the CPU default), over the same number of steps. That is the workloads
written as (build the model, one step), trained with Adam, and four held-out ones written
as loops: t5_4l, convnext_t_b4, gpt2_4l_bf16 (bf16 autocast) and llama_4l_lora (AdamW).
Reported per policy: the predicted peak reserved against the replayed one, with the run's
first step predicted as a first step (the optimizer makes its state there, after
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
POLICIES = ("torch", "torch=expandable_segments:True", "pymemplan", "pymemplan-vmm", "pymemplan-planned")
SHORT = {"torch=expandable_segments:True": "torch expandable"}  # column names


def step_module(model, step):
    """A recorded step as a module: forward() makes the batch and returns the loss."""
    from torch import nn

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, _unused):
            return step(self.model)

    return Step()


def cases():
    """name -> (build the step module, optimizer factory, autocast dtype, steps), for every
    workload of alloc_replay.py whose steps repeat and whose step can be written alone."""
    import torch
    import torch.nn.functional as F

    from alloc_replay import (NO_REPEATED_ITERATION, convnext_model, gpt2_small_vocab_model,
                              lora_model, t5_model, workloads)

    def adam(p):
        return torch.optim.Adam(p, lr=1e-4)

    def adamw(p):
        return torch.optim.AdamW(p, lr=1e-4)

    out = {}
    for name, entry in workloads().items():
        # (build the model, step(model, i), steps): trained with Adam (_train).
        if isinstance(entry, tuple) and len(entry) == 3 and name not in NO_REPEATED_ITERATION:
            make, step, steps = entry
            out[name] = (lambda make=make, step=step: step_module(make(), lambda m: step(m, 0)),
                         adam, None, steps)

    # Held-out workloads written as loops: their steps, with the same batches.
    def lm_step(vocab, batch, seq):
        def step(model):
            ids = torch.randint(0, vocab, (batch, seq))
            return model(input_ids=ids, labels=ids).loss
        return step

    def t5_step(model):
        ids, labels = torch.randint(0, 8000, (8, 128)), torch.randint(0, 8000, (8, 64))
        return model(input_ids=ids, labels=labels).loss

    def convnext_step(model):
        return F.cross_entropy(model(torch.randn(4, 3, 96, 96)), torch.randint(0, 100, (4,)))

    out["t5_4l"] = (lambda: step_module(t5_model(4), t5_step), adamw, None, 4)
    out["convnext_t_b4"] = (lambda: step_module(convnext_model(), convnext_step), adamw, None, 3)
    out["gpt2_4l_bf16"] = (lambda: step_module(gpt2_small_vocab_model(4, 256),
                                               lm_step(8000, 4, 256)), adamw, torch.bfloat16, 4)
    out["llama_4l_lora"] = (lambda: step_module(lora_model(4), lm_step(16000, 4, 256)), adamw,
                            None, 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="workload names")
    ap.add_argument("--markdown", action="store_true", help="print the table of docs/planner.md")
    args = ap.parse_args()

    import torch

    import pymemplan
    from alloc_replay import record_traces
    from pymemplan.traces.replay import replay

    todo = {n: c for n, c in cases().items() if not args.only or n in args.only}
    traces = record_traces(list(todo))
    rows = []
    for name, (build, optimizer, autocast, steps) in todo.items():
        torch.manual_seed(0)
        model = build()
        t0 = time.perf_counter()
        t = pymemplan.trace(model, (torch.zeros(()),), device="cpu", optimizer=optimizer,
                            autocast=autocast)
        seconds = time.perf_counter() - t0
        recorded = {r.policy: r for r in replay(traces[name], POLICIES)}
        first = {r.policy: r for r in replay(t._repeated_trace(steps), POLICIES)}
        steady = {r.policy: r for r in replay(t._repeated_trace(steps, first_step=False),
                                              POLICIES)}
        row = {"workload": name, "steps": steps, "optimizer": t.graph.meta["optimizer"],
               "autocast": t.graph.meta["autocast"], "trace_seconds": round(seconds, 2),
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
        print("\n| workload | " + " | ".join(f"`{SHORT.get(p, p)}` recorded | predicted | error"
                                         for p in POLICIES)
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
