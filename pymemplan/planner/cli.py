"""``pymemplan trace``: predict a training step's memory from the command line."""

from __future__ import annotations

import argparse
import sys

OPTIMIZERS = {"none": None, "adam": "Adam", "adamw": "AdamW", "sgd": "SGD",
              "sgd-momentum": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}
AUTOCAST = {"none": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
            "float16": "float16"}


def add_parser(sub) -> None:
    from .models import BUILTIN, DEFAULT_MODEL

    p = sub.add_parser(
        "trace", help="predict the memory of one training step, without a GPU",
        description="Trace one training step (forward, backward, optionally the optimizer "
                    "step) on fake tensors and predict its memory on the target device: "
                    "peak, what fills it, and when. With no MODEL, traces the built-in "
                    f"{DEFAULT_MODEL}.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, metavar="MODEL",
                   help=f"a built-in example ({', '.join(BUILTIN)}) or path/to/file.py:factory "
                        f"returning (model, inputs) or (model, inputs, loss_fn)")
    p.add_argument("--batch", type=int, help="batch size (default: the model's example)")
    p.add_argument("--seq-len", type=int, help="sequence length, for language models")
    p.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS),
                   help="optimizer whose steady-state step is traced (default adam; none: "
                        "forward + backward only)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="device whose memory is predicted (default cuda; no GPU needed)")
    p.add_argument("--autocast", default="none", choices=list(AUTOCAST),
                   help="trace under autocast to this dtype")
    p.add_argument("--no-probe", action="store_true",
                   help="with --device cpu: do not run kernels to measure their scratch "
                        "memory (nothing real is allocated; oneDNN scratch is then missed)")
    add_density_option(p)
    p.add_argument("--top", type=int, default=10, help="rows in the module and tensor tables")
    p.add_argument("--plot", metavar="PNG", help="write a plot of live memory over the step")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--budget", metavar="SIZE",
                   help="also plan activation checkpointing to fit SIZE (e.g. 6GiB): the "
                        "modules to recompute, the predicted peak and recompute cost "
                        "(under 'checkpoint_plan' with --json)")
    p.add_argument("--reserved", action="store_true",
                   help="also predict the memory each allocator reserves over a run of 3 steps "
                        "(PyTorch's, with expandable segments, pymemplan's): what decides an "
                        "OOM (under 'reserved' with --json)")
    p.add_argument("--run-seq-lens", type=_lengths, metavar="N,N,...",
                   help="with --reserved: the run's steps at these sequence lengths, in this "
                        "order (e.g. 256,512,128,512), as a loader that buckets by length makes "
                        "them")
    p.set_defaults(func=run)


RESERVED_POLICIES = ("torch", "torch=expandable_segments:True", "pymemplan-vmm",
                     "pymemplan-planned")


def _lengths(text: str) -> list[int]:
    """Sequence lengths such as 256,512,128."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of lengths such as 256,512,128")
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be positive")
    return values


def _density(text: str) -> float:
    """A share such as 0.125 or 1/8."""
    import argparse

    try:
        num, _, den = text.partition("/")
        value = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number such as 0.125 or 1/8")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]: it is the share of a "
                                         f"mask's elements that are true")
    return value


def add_density_option(p) -> None:
    p.add_argument("--nonzero-density", type=_density, metavar="D",
                   help="size the outputs of torch.nonzero, torch.where(mask) and boolean-mask "
                        "indexing as if this share (e.g. 1/8) of each mask were true; for a "
                        "mixture-of-experts router over E experts, 1/E (default: such ops are "
                        "an error)")


def _optimizer(name: str):
    import torch

    cls_name = OPTIMIZERS[name]
    if cls_name is None:
        return None
    cls = getattr(torch.optim, cls_name)
    if name == "sgd-momentum":
        return lambda params: cls(params, lr=0.01, momentum=0.9)
    if name == "sgd":
        return lambda params: cls(params, lr=0.01)
    return cls


def output_problem(path: str | None, flag: str) -> str | None:
    """Why a file cannot be written at ``path`` (checked before the work, which can take
    minutes), or None."""
    import os

    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag} {path}: the folder {folder} does not exist"
    if os.path.isdir(path):
        return f"{flag} {path}: is a folder, give a file name"
    if not os.access(folder, os.W_OK):
        return f"{flag} {path}: the folder {folder} is not writable"
    return None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    try:
        import torch

        from .api import trace
        from .capture import PlannerError
        from .models import load_workload
    except ImportError as e:  # torch is an optional dependency of pymemplan
        print(f"pymemplan trace: needs PyTorch ({e}); pip install torch", file=sys.stderr)
        return 2
    for flag in ("batch", "seq_len"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            print(f"pymemplan trace: --{flag.replace('_', '-')} must be positive, got {v}",
                  file=sys.stderr)
            return 2
    if args.top < 0:
        print(f"pymemplan trace: --top must be 0 or more, got {args.top}", file=sys.stderr)
        return 2
    if args.run_seq_lens and not args.reserved:
        print("pymemplan trace: --run-seq-lens describes the run of --reserved; add --reserved",
              file=sys.stderr)
        return 2
    if args.reserved and args.device != "cuda":
        print("pymemplan trace: --reserved predicts what CUDA's caching allocators reserve; "
              "use it with --device cuda (the default)", file=sys.stderr)
        return 2
    problem = output_problem(args.plot, "--plot")
    if problem:
        print(f"pymemplan trace: {problem}", file=sys.stderr)
        return 2
    autocast = AUTOCAST[args.autocast]
    try:
        with err.status(f"building {args.model} on the meta device ...", spinner="dots") as status:
            try:
                w = load_workload(args.model, batch=args.batch, seq_len=args.seq_len)
            except ImportError as e:
                raise ValueError(f"the example {args.model!r} needs {e.name or e}: "
                                 f"pip install 'pymemplan[bench]' (torchvision, transformers)")

            def progress(phase, n):
                status.update(f"tracing {w.name}: {phase} pass, {n:,} ops ...")

            def trace_at(seq_len, progress=None):
                """The step traced with the command's options, at another sequence length."""
                built = w if seq_len is None else load_workload(args.model, batch=args.batch,
                                                                seq_len=seq_len)
                return trace(built.model, built.inputs, loss_fn=built.loss_fn,
                             optimizer=_optimizer(args.optimizer), device=args.device,
                             autocast=getattr(torch, autocast) if autocast else None,
                             probe_kernels=False if args.no_probe else None, progress=progress,
                             nonzero_density=args.nonzero_density)

            status.update(f"tracing {w.name} ...")
            t = trace_at(None, progress)
    except (PlannerError, ValueError, OSError) as e:
        print(f"pymemplan trace: {e}", file=sys.stderr)
        return 2
    t.graph.meta["workload"] = w.description
    plan, plan_error, rc = None, None, 0
    if args.budget is not None:
        from .checkpoint import BudgetTooSmallError

        try:
            with err.status(f"planning checkpointing for {args.budget} ...", spinner="dots"):
                plan = t.plan(args.budget, model=w.model, inputs=w.inputs)
        except BudgetTooSmallError as e:
            plan_error = {"error": str(e), "least_peak_bytes": e.least_peak_bytes}
            rc = 1
        except PlannerError as e:
            print(f"pymemplan trace: --budget: {e}", file=sys.stderr)
            return 2
    reserved = None
    if args.reserved:
        try:
            with err.status("replaying the predicted run through the allocators ...", spinner="dots"):
                reserved = _reserved(args, t, trace_at)
        except (PlannerError, ValueError, OSError) as e:
            print(f"pymemplan trace: --reserved: {e}", file=sys.stderr)
            return 2
    if args.plot:
        t.plot(args.plot)
    if args.json:
        if args.budget is None and reserved is None:
            print(t.to_json(top=args.top, timeline=False))
        else:
            import json

            d = t.to_dict(top=args.top, timeline=False)
            if args.budget is not None:
                d["checkpoint_plan"] = plan.to_dict() if plan is not None else plan_error
            if reserved is not None:
                d["reserved"] = reserved
            print(json.dumps(d, indent=1))
    else:
        t.print(top=args.top)
        if plan is not None:
            print()
            print(plan.summary())
        if reserved is not None:
            print()
            _print_reserved(reserved)
        if args.plot:
            err.print(f"plot written to {args.plot}")
    if plan_error is not None:
        print(f"pymemplan trace: --budget: {plan_error['error']}", file=sys.stderr)
    return rc


def _reserved(args, t, trace_at) -> dict:
    """Peak reserved bytes of each allocator over the predicted run: 3 steps of `t`, or one
    step per length of --run-seq-lens (each length traced once), and the offline bound."""
    from ..traces import offline_layout, replay
    from .api import run_trace

    if args.run_seq_lens:
        traced = {n: trace_at(n) for n in dict.fromkeys(args.run_seq_lens)}
        steps = [traced[n] for n in args.run_seq_lens]
    else:
        steps = [t] * 3
    run = run_trace(steps)
    live = run.peak_live_bytes()
    capacity = max(4 * live, 1 << 30)  # a device big enough for any policy's layout
    results = replay(run, RESERVED_POLICIES, capacity=capacity, granularity="2MiB")
    return {"steps": args.run_seq_lens or 3, "peak_live_bytes": live,
            "policies": {r.policy: r.peak_reserved_bytes for r in results},
            "offline_bytes": offline_layout(run, "2MiB").peak_reserved_bytes}


def _print_reserved(reserved: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..units import format_bytes

    steps = reserved["steps"]
    run = (f"{len(steps)} steps at sequence lengths {', '.join(map(str, steps))}"
           if isinstance(steps, list) else f"{steps} steps")
    live = reserved["peak_live_bytes"]
    table = Table(title=f"Reserved memory over a run of {run} (live peak {format_bytes(live)})")
    table.add_column("allocator")
    table.add_column("peak reserved", justify="right")
    table.add_column("over live", justify="right")
    names = {"torch": "PyTorch", "torch=expandable_segments:True": "PyTorch, expandable_segments",
             "pymemplan-vmm": "pymemplan-vmm", "pymemplan-planned": "pymemplan-planned"}
    rows = [(names[p], b) for p, b in reserved["policies"].items()]
    rows.append(("least possible with 2 MiB pages (offline)", reserved["offline_bytes"]))
    for name, b in rows:
        table.add_row(name, format_bytes(b), f"{b / live:.3f}")
    Console().print(table)
