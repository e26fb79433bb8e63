"""The planner's CUDA autocast against CUDA's own, op by op, with no GPU.

A trace for ``device="cuda"`` runs fake CPU tensors under the CPU's autocast, whose kernels
pymemplan.planner.autocast makes follow CUDA's lists. CUDA's own autocast kernels run on fake
CUDA tensors once its thread-local state is set (its context manager refuses without a GPU),
so the two can be compared: for every op of benchmarks/planner_ops.py and for a GPT-2
forward pass, the sequence of ops and the dtype of each output, under bf16 and fp16.

    python benchmarks/autocast_check.py          # about 30 s

Ops whose CUDA kernels differ from the CPU's in what they dispatch (dropout's fused kernel,
RMS norm's fused kernel, batch norm's statistics, SDPA's backends, cuDNN's recurrent cells)
differ here for that reason, not for autocast's: they are listed as such (KERNELS), and the
planner models them elsewhere (pymemplan/planner/profile.py, capture.py). Any other
difference is a miss: exit status 1. Writes results/autocast_check.json.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "autocast_check.json"
sys.path.insert(0, str(HERE))

# Ops whose CUDA kernels dispatch otherwise than the CPU's, whatever autocast does.
KERNELS = {
    "dropout": "CUDA's fused native_dropout",
    "rms_norm": "CUDA's fused _fused_rms_norm",
    "batch_norm": "batch norm's statistics: fp32 on CUDA (the planner sets them, capture.py)",
    "instance_norm": "batch norm's statistics, as batch_norm",
    "sdpa": "SDPA's CUDA backends (the planner's cuda_sdpa)",
    "sdpa_causal": "SDPA's CUDA backends (the planner's cuda_sdpa)",
    "gru_cell": "cuDNN's cells: CUDA's kernel needs a driver even on fake tensors",
    "lstm": "cuDNN's LSTM",
    "fft_rfft": "bf16/fp16 FFTs: the CPU's fake kernel refuses them, CUDA's accepts",
}


def forward_ops(model, make_inputs, device: str, emulate: bool, dtype) -> list | str:
    """(op, output dtypes) of the forward pass on fake tensors: the CPU's autocast with the
    planner's CUDA kernels (emulate), or CUDA's own autocast on fake CUDA tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from pymemplan.planner.autocast import cuda_autocast

    log = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor))
            name = str(func)
            # Device copies (a constant made on the CPU, moved to CUDA) and lifts are not casts.
            moved = (func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor)
                     and args[0].device != out.device)
            if dtypes and not moved and not name.startswith("prim.") and "lift_fresh" not in name:
                log.append((name, dtypes))
            return out

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            state = {k: mode.from_tensor(v).to(device).detach().requires_grad_(v.requires_grad)
                     for k, v in model.named_parameters()}
            state.update({k: mode.from_tensor(v).to(device) for k, v in model.named_buffers()})
            inputs = make_inputs(device)
            if emulate:
                with torch.device(device), torch.autocast("cpu", dtype=dtype), \
                        cuda_autocast(dtype), Record():
                    functional_call(model, state, inputs)
            else:
                torch.set_autocast_enabled("cuda", True)
                torch.set_autocast_dtype("cuda", dtype)
                torch.autocast_increment_nesting()
                try:
                    with torch.device(device), Record():
                        functional_call(model, state, inputs)
                finally:
                    torch.autocast_decrement_nesting()
                    torch.set_autocast_enabled("cuda", False)
                    torch.clear_autocast_cache()
    except Exception as e:  # noqa: BLE001 - reported as the outcome
        return f"{type(e).__name__}: {str(e)[:120]}"
    return log


def compare(model, make_inputs, dtype) -> dict:
    ours = forward_ops(model, make_inputs, "cpu", True, dtype)
    cuda = forward_ops(model, make_inputs, "cuda", False, dtype)
    if isinstance(ours, str) or isinstance(cuda, str):
        same = isinstance(ours, str) and isinstance(cuda, str)
        return {"same": same, "ours": ours if isinstance(ours, str) else "ran",
                "cuda": cuda if isinstance(cuda, str) else "ran"}
    diff = [{"ours": ours[i1:i2][:4], "cuda": cuda[j1:j2][:4]}
            for tag, i1, i2, j1, j2 in
            difflib.SequenceMatcher(a=ours, b=cuda, autojunk=False).get_opcodes()
            if tag != "equal"]
    return {"same": not diff, "ops": len(cuda), "first_differences": diff[:2]}


def cases():
    """name -> (model, make_inputs(device))."""
    import torch

    import planner_ops as po

    class Op(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.lin = torch.nn.Linear(po.D, po.D)
            self.f = f
            self.p = torch.nn.Parameter(torch.randn(po.D) * 0.1)
            self.s = torch.nn.Parameter(torch.tensor(0.3))

        def forward(self, x):
            return self.f(self.lin(x), self)

    out = {name: (Op(f), lambda d: (torch.randn(po.N, po.D, device=d),))
           for name, f in po.ops().items()}
    from transformers import GPT2Config, GPT2LMHeadModel, logging

    logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                     bos_token_id=0, eos_token_id=0)

    class GPT2Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = GPT2LMHeadModel(cfg).eval()  # eval: dropout's kernels differ (KERNELS)

        def forward(self, ids):
            return self.m(ids, labels=ids).loss

    out["gpt2_eager_attention"] = (GPT2Loss(), lambda d: (torch.randint(0, 1000, (2, 64), device=d),))
    out["gpt2_eager_attention"][0].m.config._attn_implementation = "eager"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args()
    import torch

    warnings.filterwarnings("ignore")
    start = time.time()
    rows, misses = [], []
    for name, (model, make_inputs) in cases().items():
        for dtype in (torch.bfloat16, torch.float16):
            r = {"op": name, "dtype": str(dtype).removeprefix("torch."),
                 **compare(model, make_inputs, dtype)}
            if not r["same"]:
                r["known"] = KERNELS.get(name)
                if r["known"] is None:
                    misses.append(f"{name} {r['dtype']}")
            rows.append(r)
    same = sum(r["same"] for r in rows)
    summary = {"compared": len(rows), "same": same,
               "kernel_differences": sorted({r["op"] for r in rows
                                             if not r["same"] and r.get("known")}),
               "misses": misses}
    for r in rows:
        if not r["same"]:
            print(f"{r['op']:24s} {r['dtype']:9s} {'known: ' + r['known'] if r.get('known') else 'MISS'}"
                  f"  {json.dumps(r.get('first_differences') or [r.get('ours'), r.get('cuda')])[:160]}")
    print(f"{same} of {len(rows)} forward passes the same op for op as CUDA's autocast; "
          f"known kernel differences: {len(summary['kernel_differences'])} ops; misses: "
          f"{len(misses)}  ({time.time() - start:.0f} s) -> {args.out}")
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "autocast_check",
                                    "command": "python benchmarks/autocast_check.py",
                                    "torch": torch.__version__, "summary": summary,
                                    "rows": rows}, indent=1) + "\n")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
