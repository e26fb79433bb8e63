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
    explained = []
    try:
        plans = _read_plans_option(args.plans)
        if plans is not None and not any(p.split("=")[0] == "pymemplan-planned" for p in policies):
            raise ValueError("--plans is for pymemplan-planned: add --policy pymemplan-planned")
        if args.save_plans is not None and len(paths) != 1:
            raise ValueError(f"--save-plans writes the plans of one trace; {len(paths)} were "
                             "given (name one TRACE)")
        placed = []
        for path in paths:
            trace = read_trace(path)
            if trace.meta.get("earlier_blocks"):
                placed.append(f"{trace.name}: {trace.meta['earlier_blocks']:,} block(s) "
                              f"({format_bytes(trace.meta['earlier_bytes'])}) made before the "
                              f"snapshot's history began are allocated at its start, in address "
                              f"order: the program held them")
            replayed = replay(trace, policies, capacity=args.capacity,
                              granularity=args.granularity, plans=plans)
            rows = [r.to_dict() for r in replayed]
            if args.explain:
                from .traces.explain import explain_peak

                for spec, row in zip(policies, rows):
                    if spec.split("=")[0] == "gmlake":
                        continue  # its snapshots cannot be split (explain_peak says why)
                    seed = plans if spec.split("=")[0] == "pymemplan-planned" else None
                    why = explain_peak(trace, spec, capacity=args.capacity,
                                       granularity=args.granularity, plans=seed)
                    row["explain"] = why.to_dict()
                    explained.append(why)
            results.extend(rows)
            if args.save_plans is not None:
                _save_plans_option(args.save_plans, replayed)
            if args.restarted:
                planned = [p for p in policies if p.split("=")[0] == "pymemplan-planned"]
                for spec in planned or ["pymemplan-planned"]:
                    results.append(_restarted_row(trace, spec, args.capacity, args.granularity,
                                                  plans))
            if args.offline:
                results.append(_offline_row(trace, args.granularity))
    except (TraceError, _core.AllocatorError, ValueError, OSError) as e:
        print(f"pymemplan replay: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Allocation trace replay (simulated device, capacity {args.capacity})")
    for col in ("trace", "policy", "events", "peak live", "peak allocated", "peak reserved",
                "reserved/live", "device allocs", "device frees", "OOMs", "ns/event"):
        table.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    def show(value, fmt):
        return "–" if value is None else fmt(value)

    refused = False
    for r in results:
        # Where requests were refused, the live bytes were never all held: a ratio to them
        # (0.25 on a device a quarter of the trace's size) would read as a saving.
        ratio = f"{r['reserved_over_live']:.3f}"
        if r["ooms"]:
            ratio, refused = "OOM", True
        table.add_row(r["trace"], r["policy"], f"{r['events']:,}",
                      format_bytes(r["peak_live_bytes"]),
                      show(r["peak_allocated_bytes"], format_bytes),
                      format_bytes(r["peak_reserved_bytes"]), ratio,
                      show(r["device_allocs"], "{:,}".format),
                      show(r["device_frees"], "{:,}".format), show(r["ooms"], str),
                      show(r["ns_per_event"], "{:.0f}".format))
    # Piped output has no terminal width to fit; keep rows on one line.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    for line in placed:
        print(line)
    for why in explained:
        print()
        print("\n".join(why.lines()))
    if refused:
        print(f"OOM: the policy refused requests at {args.capacity}; peak reserved is what it "
              "held, and peak live counts the refused requests too. Replay with a larger "
              "--capacity to compare it.")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from .traces import TraceError, explain_snapshot

    try:
        # The path, not the loaded dict: messages about the snapshot then name the file.
        why = explain_snapshot(args.snapshot, device=args.device, top=args.top,
                               compare=args.compare, capacity=args.capacity,
                               policies=args.policy)
    except (TraceError, ValueError, OSError) as e:
        print(f"pymemplan explain: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(why.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    print("\n".join(why.lines()))
    if args.compare and why.fit is None and why.fit_error is None:
        print()
        print("No allocation history in the snapshot: record it with "
              "torch.cuda.memory._record_memory_history(max_entries=100000) before the run "
              "(under pymemplan, pymemplan.record_memory_history(max_entries=100000)), and this "
              "command also replays its requests under other allocators, to tell which would "
              "have fit.")
    return 0


def _read_plans_option(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--plans {path}: not a plans file (written by --save-plans or "
                         f"pymemplan.save_plans()): it is not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None


def _save_plans_option(path: str, replayed) -> None:
    """Writes the plans pymemplan-planned ended its replay with (as save_plans would)."""
    from .allocator._plans import write_atomic

    planned = [r for r in replayed if r.plans is not None]  # only pymemplan-planned has plans
    if not planned:
        raise ValueError("--save-plans needs a pymemplan-planned replay: add "
                         "--policy pymemplan-planned")
    write_atomic(path, planned[0].plans)


OFFLINE = "offline (knows the trace)"
RESTARTED = "pymemplan-planned, restarted"


def _restarted_row(trace, spec, capacity, granularity, plans=None) -> dict:
    """A row for the pymemplan-planned policy ``spec`` (its config included) replaying the
    trace again with the plans its first replay (from ``plans``, as --plans gives) ended
    with, as a restarted job would (pymemplan.save_plans / load_plans)."""
    from .traces.replay import replay

    first = replay(trace, [spec], capacity=capacity, granularity=granularity, plans=plans)[0]
    again = replay(trace, [spec], capacity=capacity, granularity=granularity,
                   plans=first.plans)[0]
    name = RESTARTED if spec == "pymemplan-planned" else f"{spec}, restarted"
    return {**again.to_dict(), "policy": name}


def _offline_row(trace, granularity) -> dict:
    """A row for what an allocator that knew the whole trace would reserve."""
    from .traces import offline_layout

    layout = offline_layout(trace, granularity)
    live = trace.peak_live_bytes()
    return {"trace": trace.name, "policy": OFFLINE, "events": len(trace),
            "peak_live_bytes": live, "peak_allocated_bytes": None,
            "peak_reserved_bytes": layout.peak_reserved_bytes,
            "reserved_over_live": layout.peak_reserved_bytes / live if live else 0.0,
            "device_allocs": None, "device_frees": None, "ooms": None, "ns_per_event": None,
            "steady_from_event": None, "steady_peak_live_bytes": None,
            "steady_peak_reserved_bytes": None, "steady_reserved_over_live": None,
            "steady_device_calls": None, "arena_bytes": layout.arena_bytes}


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
                    help="pymemplan, pymemplan-vmm, pymemplan-planned, torch or nocache, optionally "
                         "with a config string in the "
                         "style of PYTORCH_CUDA_ALLOC_CONF, e.g. "
                         "'torch=max_split_size_mb:256'; repeat to compare "
                         "(default: pymemplan, pymemplan-vmm, torch, nocache)")
    rp.add_argument("--capacity", default="80GiB", help="device memory (default 80GiB)")
    rp.add_argument("--granularity", default="2MiB",
                    help="device allocation granularity (default 2MiB)")
    rp.add_argument("--offline", action="store_true",
                    help="add a row per trace: the most pages (of --granularity) an allocator "
                         "that knew the whole trace in advance would hold (every block placed "
                         "offline), to tell how much of the waste an allocator could avoid")
    rp.add_argument("--restarted", action="store_true",
                    help="add a row per trace and pymemplan-planned policy (with its "
                         "config, and --plans): replaying it again with the plans its first "
                         "replay ended with, as a job restarted with pymemplan.load_plans "
                         "would")
    rp.add_argument("--plans", metavar="FILE",
                    help="pymemplan-planned starts with the plans in FILE (written by "
                         "pymemplan.save_plans, enable(plans=...) or --save-plans), as a job "
                         "started with them would")
    rp.add_argument("--save-plans", metavar="FILE",
                    help="write the plans pymemplan-planned ended its replay of TRACE with, "
                         "for a job to start with (enable(plans=FILE), PYMEMPLAN_PLANS=FILE)")
    rp.add_argument("--explain", action="store_true",
                    help="say, per trace and policy, what reserved memory holds at its peak: "
                         "live, rounding, pending frees, cached, and fragments (free space in "
                         "segments or pages that blocks in use keep), with the segments or "
                         "pages that hold the most and the blocks that keep them")
    rp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rp.set_defaults(func=_replay)
    ep = sub.add_parser(
        "explain", help="what a memory snapshot's reserved memory holds",
        description="What reserved memory holds in a memory snapshot (a pickle written by "
                    "torch.cuda.memory._dump_snapshot, at an out-of-memory error say, or by "
                    "pymemplan.save_snapshot): live, rounding, pending frees, cached, and "
                    "fragments, with the segments or pages that hold the most fragments and "
                    "where the blocks that keep them were allocated. Where the snapshot has "
                    "allocation history, its requests (those that failed asked again) are "
                    "replayed under PyTorch's allocator as the run had it and under the "
                    "others, on the device's memory: which would have fit, and the smallest "
                    "device each needs.")
    ep.add_argument("snapshot", metavar="SNAPSHOT")
    ep.add_argument("--device", type=int, default=0, help="device index (default 0)")
    ep.add_argument("--top", type=int, default=5,
                    help="segments or pages to list, the most fragments first (default 5)")
    ep.add_argument("--capacity", default=None,
                    help="the device's memory for the program, to tell which allocators would "
                         "have fit its requests (default: what PyTorch had at the history's "
                         "last out-of-memory error, reserved plus free)")
    ep.add_argument("--policy", action="append", default=None,
                    help="an allocator to replay the history under (repeat; default: PyTorch's "
                         "as the run had it, with expandable segments, pymemplan, "
                         "pymemplan-vmm, pymemplan-planned)")
    ep.add_argument("--no-compare", dest="compare", action="store_false",
                    help="only split the snapshot's memory; do not replay its history")
    ep.add_argument("--json", action="store_true", help="print JSON instead of text")
    ep.set_defaults(func=_explain)
    from .planner.cli import add_parser as _add_trace_parser  # torch is imported only to trace

    _add_trace_parser(sub)
    from .whatif.cli import add_parser as _add_plan_parser

    _add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
