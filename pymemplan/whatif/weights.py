"""Smaller weights: frozen quantized Linear weights, and structured pruning.

Both start from a traced step and change it on the traced graph:

- ``int8`` / ``nf4``: the step is traced with the Linear weights frozen (no gradient, no
  optimizer state: fine-tuning with adapters), then each frozen weight's storage is
  resized to its quantized size (int8: one byte a weight plus an fp32 scale per output
  row, as LLM.int8; NF4: half a byte a weight plus an fp32 absmax per block of 64, as
  bitsandbytes without double quantization), and every matmul of that layer holds its
  weight dequantized to the compute dtype while it runs.
- ``prune-F``: structured pruning of a fraction F of each Linear layer's output channels:
  the weights and biases, their gradients and optimizer state, and the tensors the
  layers' own ops make shrink by F. An estimate: in a really pruned model the next
  layer's inputs shrink too.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from ..planner.errors import PlannerError
from ..planner.graph import OPTIMIZER_STATE, PARAMETER, StepGraph

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def parse(spec: str) -> tuple[str, float]:
    if spec in ("int8", "nf4"):
        return spec, 0.0
    if spec.startswith("prune-"):
        try:
            f = float(spec[len("prune-"):])
        except ValueError:
            f = -1.0
        if 0.0 < f < 1.0:
            return "prune", f
    raise PlannerError(f"unknown weight technique {spec!r}: use 'int8', 'nf4' or "
                       f"'prune-F' with 0 < F < 1 (e.g. 'prune-0.3')")


def describe(spec: str) -> str:
    kind, f = parse(spec)
    return {"int8": "frozen int8 weights", "nf4": "frozen 4-bit (NF4) weights"}.get(
        kind, f"structured pruning {f:.0%}")


def code_snippet(spec: str) -> str:
    kind, f = parse(spec)
    if kind == "int8":
        return ("# pip install bitsandbytes peft\n"
                "from transformers import BitsAndBytesConfig\n"
                "model = AutoModel.from_pretrained(name, quantization_config="
                "BitsAndBytesConfig(load_in_8bit=True))\n"
                "model = peft.get_peft_model(model, peft.LoraConfig(r=16))")
    if kind == "nf4":
        return ("# pip install bitsandbytes peft\n"
                "from transformers import BitsAndBytesConfig\n"
                "model = AutoModel.from_pretrained(name, quantization_config="
                "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))\n"
                "model = peft.get_peft_model(model, peft.LoraConfig(r=16))")
    return (f"# remove {f:.0%} of each Linear layer's output channels (e.g. torch-pruning's\n"
            f"# DependencyGraph), then fine-tune; torch.nn.utils.prune only masks weights\n"
            f"# and saves no memory")


def linear_weights(model) -> dict[str, str]:
    """Parameter name -> module path of each Linear-like layer's weight (nn.Linear and
    Hugging Face's Conv1D), leaving out weights tied to an embedding."""
    import torch

    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D":
            w = getattr(m, "weight", None)
            if isinstance(w, torch.nn.Parameter) and id(w) not in embedded:
                out[f"{path}.weight" if path else "weight"] = path
    return out


@contextlib.contextmanager
def prepared(model, spec: str):
    """Freeze the Linear weights while tracing a quantized configuration."""
    kind, _ = parse(spec)
    frozen = []
    if kind in ("int8", "nf4"):
        names = linear_weights(model)
        if not names:
            raise PlannerError("the model has no Linear layers to quantize")
        for name, p in model.named_parameters():
            if name in names and p.requires_grad:
                p.requires_grad_(False)
                frozen.append(p)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def rewrite(t, model, spec: str):
    """The traced step ``t`` with ``spec`` applied to its graph; a new MemoryTrace."""
    from ..planner.api import MemoryTrace
    from ..planner.profile import get_profile

    kind, f = parse(spec)
    profile = get_profile(t.device)
    names = linear_weights(model)
    paths = set(names.values())
    shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters() if n in names)
    g = t.graph

    def resized(x, nbytes: int):
        nbytes = max(int(nbytes), 0)
        return replace(x, nbytes=nbytes, size=profile.device_bytes(nbytes) if nbytes else 0)

    tensors = list(g.tensors)
    ops = list(g.ops)
    if kind in ("int8", "nf4"):
        for i, x in enumerate(tensors):
            if x.category == PARAMETER and x.name in names:
                n = 1
                for d in shapes[x.name]:
                    n *= d
                rows = shapes[x.name][0] if shapes[x.name] else 1
                q = n + 4 * rows if kind == "int8" else (n + 1) // 2 + 4 * ((n + 63) // 64)
                tensors[i] = resized(x, q)
        # Dequantized weight per layer, in the dtype its matmuls run in.
        deq = {}
        for name, path in names.items():
            n = 1
            for d in shapes[name]:
                n *= d
            deq[path] = n
        for i, op in enumerate(ops):
            if op.flops and op.module in deq:
                extra = profile.device_bytes(deq[op.module] * _DTYPE_BYTES.get(op.dtype, 4))
                ops[i] = replace(op, scratch=op.scratch + extra)
    else:
        keep = 1.0 - f

        def owner(x) -> str | None:
            if x.category == PARAMETER:
                return x.name.rpartition(".")[0] if x.name.endswith((".weight", ".bias")) \
                    else None
            if x.category == OPTIMIZER_STATE:
                return x.name.rsplit(".", 2)[0]  # "<module>.weight.exp_avg"
            return x.module  # gradients (their parameter's module) and what its ops made

        for i, x in enumerate(tensors):
            if owner(x) in paths:
                tensors[i] = resized(x, x.nbytes * keep)
    graph = StepGraph(ops=ops, tensors=tensors, device=g.device, phase_starts=g.phase_starts,
                      meta={**g.meta, "weights": spec},
                      first_optimizer_step=g.first_optimizer_step, op_calls=g.op_calls,
                      op_reads=g.op_reads)
    return MemoryTrace(graph)
