"""The `pymemplan` command."""

from __future__ import annotations

import argparse
import json
import sys

from .units import format_bytes


def _replay(args: argparse.Namespace) -> int:
    from . import _core
    from .traces import TraceError, builtin_traces, read_trace
    from .traces.replay import DEFAULT_POLICIES, replay

    paths = args.traces or builtin_traces()
    policies = args.policy or list(DEFAULT_POLICIES)
    results = []
    try:
        for path in paths:
            results.extend(replay(read_trace(path), policies, capacity=args.capacity,
                                  granularity=args.granularity))
    except (TraceError, _core.AllocatorError, ValueError, OSError) as e:
        print(f"pymemplan replay: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump([r.to_dict() for r in results], sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Allocation trace replay (simulated device, capacity {args.capacity})")
    for col in ("trace", "policy", "events", "peak live", "peak allocated", "peak reserved",
                "reserved/live", "device allocs", "device frees", "OOMs", "ns/event"):
        table.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for r in results:
        table.add_row(r.trace, r.policy, f"{r.events:,}", format_bytes(r.peak_live_bytes),
                      format_bytes(r.peak_allocated_bytes), format_bytes(r.peak_reserved_bytes),
                      f"{r.reserved_over_live:.3f}", f"{r.device_allocs:,}",
                      f"{r.device_frees:,}", str(r.ooms), f"{r.ns_per_event:.0f}")
    # Piped output has no terminal width to fit; keep rows on one line.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pymemplan", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser(
        "replay", help="replay allocation traces through allocator policies",
        description="Replay allocation traces (RMM CSV, pymemplan CSV[.gz], PyTorch snapshot "
                    "pickle) through allocator policies on a simulated device. With no TRACE, "
                    "replays the traces shipped with pymemplan.")
    rp.add_argument("traces", nargs="*", metavar="TRACE")
    rp.add_argument("--policy", action="append", metavar="NAME[=CONFIG]",
                    help="pymemplan, torch or nocache, optionally with a config string in the "
                         "style of PYTORCH_CUDA_ALLOC_CONF, e.g. "
                         "'torch=max_split_size_mb:256'; repeat to compare "
                         "(default: pymemplan, torch, nocache)")
    rp.add_argument("--capacity", default="80GiB", help="device memory (default 80GiB)")
    rp.add_argument("--granularity", default="2MiB",
                    help="device allocation granularity (default 2MiB)")
    rp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rp.set_defaults(func=_replay)
    from .planner.cli import add_parser as _add_trace_parser  # torch is imported only to trace

    _add_trace_parser(sub)
    from .whatif.cli import add_parser as _add_plan_parser

    _add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
