"""``pymemplan plan``: what fits the GPU, quantified on the model, with the code."""

from __future__ import annotations

import argparse
import os
import sys

from ..units import format_bytes
from ..planner.cli import add_density_option

DEFAULT_CAPACITY = "24GiB"
DEFAULT_BATCH = 16  # for the built-in default model: GPT-2 small, 16 x 1024, on 24 GiB


def add_parser(sub) -> None:
    from ..planner.cli import OPTIMIZERS
    from ..planner.models import BUILTIN, DEFAULT_MODEL
    from .advise import TECHNIQUES

    p = sub.add_parser(
        "plan", help="what fits your GPU: every memory technique, traced on your model",
        description="Trace one training step of MODEL in every configuration users reach "
                    "for when short of memory (mixed precision, the largest batch, gradient "
                    "accumulation, activation checkpointing, another optimizer, quantized "
                    "frozen weights, sharding) and print what each takes, whether it fits, "
                    "its compute cost and its code; then the cheapest combination that fits. "
                    f"With no MODEL: {DEFAULT_MODEL}, batch {DEFAULT_BATCH}, on a "
                    f"{DEFAULT_CAPACITY} GPU. No GPU is needed.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"a built-in example ({', '.join(BUILTIN)}) or path/to/file.py:factory "
                        f"returning (model, inputs) or (model, inputs, loss_fn)")
    p.add_argument("--capacity", default=DEFAULT_CAPACITY,
                   help=f"the GPU's memory (default {DEFAULT_CAPACITY})")
    p.add_argument("--batch", type=int, help="batch size (default: the model's example)")
    p.add_argument("--seq-len", type=int, help="sequence length, for language models")
    p.add_argument("--target-batch", type=int,
                   help="effective batch to reach with gradient accumulation (default: --batch)")
    p.add_argument("--world-size", type=int, default=1,
                   help="GPUs to shard over: adds DDP, ZeRO-1/2/3 and FSDP rows (default 1)")
    p.add_argument("--optimizer", default="adamw", choices=[k for k in OPTIMIZERS if k != "none"],
                   help="the optimizer the step uses (default adamw)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="device whose memory is predicted (default cuda)")
    p.add_argument("--policy", default=None,
                   help="allocator whose reserved memory decides the fit on CUDA: torch "
                        "(PyTorch's), torch=expandable_segments:True (PyTorch's with "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), pymemplan or "
                        "pymemplan-vmm (default: PyTorch's, as PYTORCH_CUDA_ALLOC_CONF sets it)")
    p.add_argument("--techniques", default=",".join(TECHNIQUES),
                   help=f"comma-separated subset of {','.join(TECHNIQUES)}")
    p.add_argument("--no-probe", action="store_true",
                   help="with --device cpu: do not run kernels to measure their scratch memory")
    add_density_option(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--html", metavar="HTML", help="write a self-contained report page")
    p.add_argument("--plot", metavar="PNG", help="write the best configuration's timeline")
    p.set_defaults(func=run)


def text_timeline(total, capacity: int, width: int = 72, height: int = 8) -> str:
    """Live bytes over the step as a block chart, with the capacity as a dashed line."""
    import numpy as np

    total = np.asarray(total, dtype=np.float64)
    if total.size == 0:
        return ""
    edges = np.linspace(0, total.size, num=min(width, total.size) + 1).astype(int)
    cols = [total[a:b].max() for a, b in zip(edges[:-1], edges[1:]) if b > a]
    top = max(max(cols), float(capacity)) or 1.0
    cap_row = min(height - 1, int(capacity / top * height))
    lines = []
    for level in range(height, 0, -1):
        lo = (level - 1) / height * top
        row = "".join("█" if c > lo + top / height / 2 else ("▄" if c > lo else " ")
                      for c in cols)
        if level - 1 == cap_row:
            row = "".join(ch if ch != " " else "-" for ch in row)
        label = format_bytes(level / height * top) if level in (height, 1) else ""
        lines.append(f"{label:>10} |{row}")
    lines.append(" " * 11 + "+" + "-" * len(cols))
    lines.append(" " * 12 + f"op 0 .. {total.size - 1}   (dashes: capacity "
                 f"{format_bytes(capacity)})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    try:
        from ..planner.cli import _optimizer
        from ..planner.errors import PlannerError
        from ..planner.models import DEFAULT_MODEL, load_workload
        from .advise import TECHNIQUES, advise
    except ImportError as e:
        print(f"pymemplan plan: needs PyTorch ({e}); pip install torch", file=sys.stderr)
        return 2
    for flag in ("batch", "seq_len", "target_batch"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            print(f"pymemplan plan: --{flag.replace('_', '-')} must be positive, got {v}",
                  file=sys.stderr)
            return 2
    from ..planner.cli import output_problem

    for path, flag in ((args.plot, "--plot"), (args.html, "--html")):
        problem = output_problem(path, flag)
        if problem:
            print(f"pymemplan plan: {problem}", file=sys.stderr)
            return 2
    techniques = [x.strip() for x in args.techniques.split(",") if x.strip()]
    if not techniques:
        print(f"pymemplan plan: --techniques names none; choose from {','.join(TECHNIQUES)}",
              file=sys.stderr)
        return 2
    policy = args.policy
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if policy is None and args.device == "cuda":
        from .advise import torch_policy_from_conf

        try:
            policy, left = torch_policy_from_conf(conf)
        except ValueError as e:
            print(f"pymemplan plan: {e}", file=sys.stderr)
            return 2
        if conf:
            err.print(f"reserved memory: PyTorch's allocator as PYTORCH_CUDA_ALLOC_CONF sets "
                      f"it ({policy})" + (f"; not modelled: {', '.join(left)}" if left else ""))
    model = args.model or DEFAULT_MODEL
    batch = args.batch if args.batch is not None or args.model else DEFAULT_BATCH
    w = None
    try:
        with err.status(f"building {model} on the meta device ...", spinner="dots") as status:
            try:
                w = load_workload(model, batch=batch, seq_len=args.seq_len)
            except ImportError as e:
                raise ValueError(f"the example {model!r} needs {e.name or e}: "
                                 f"pip install 'pymemplan[bench]' (torchvision, transformers)")
            per_batch = {}
            make_inputs = make_loss_fn = None
            if w.takes_batch and w.loss_fn is not None:
                # The factory's loss may close over targets of its batch size: rows at
                # other batch sizes take the inputs and loss it builds for theirs.
                def built(b):
                    if b not in per_batch:
                        wb = load_workload(model, batch=b, seq_len=args.seq_len)
                        per_batch[b] = (wb.inputs, wb.loss_fn)
                    return per_batch[b]

                def make_inputs(b):
                    return built(b)[0]

                def make_loss_fn(b):
                    return built(b)[1]
            a = advise(w.model, w.inputs, loss_fn=w.loss_fn, capacity=args.capacity,
                       make_inputs=make_inputs, make_loss_fn=make_loss_fn,
                       optimizer=_optimizer(args.optimizer), target_batch=args.target_batch,
                       world_size=args.world_size, device=args.device, policy=policy,
                       techniques=techniques, progress=lambda what: status.update(what + " ..."),
                       nonzero_density=args.nonzero_density,
                       **({"probe_kernels": False} if args.no_probe else {}))
    except (PlannerError, ValueError, OSError) as e:
        hint = ""
        if (isinstance(e, PlannerError) and w is not None and w.loss_fn is not None
                and w.description.endswith(".py:" + w.name) and not w.takes_batch):
            hint = (f"\n(the rows that change the batch size trace {w.name}'s loss on inputs "
                    f"of another size: give {w.name}() a batch= parameter, so that it builds "
                    f"inputs and loss for each, or leave those rows out: --techniques "
                    f"{','.join(x for x in TECHNIQUES if x not in ('batch', 'accumulation'))})")
        print(f"pymemplan plan: {e}{hint}", file=sys.stderr)
        return 2
    chosen = a.best or a.baseline
    if args.plot:
        a.plot(args.plot, chosen)
    if args.html:
        a.to_html(args.html)
    if args.json:
        print(a.to_json())
        return 0
    a.print()
    print(f"\nLive memory of {chosen.name} over one step:")
    print(text_timeline(chosen.trace.timeline["total"], a.capacity_bytes))
    for what, path in (("plot", args.plot), ("report", args.html)):
        if path:
            err.print(f"{what} written to {path}")
    return 0
