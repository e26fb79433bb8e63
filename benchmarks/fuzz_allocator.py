"""Long fuzz run of the allocator core: random alloc/free/record_stream/event/empty_cache
operations, every result checked against the allocator's invariants (no overlap, alignment,
stream safety, stats == recount from the snapshot, limit respected, zero after draining).

    python benchmarks/fuzz_allocator.py [--ops 10000000] [--seed 1]

Writes benchmarks/results/fuzz_allocator.json. Exits non-zero on the first violation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pymemplan import _core

MiB = 1 << 20
GiB = 1 << 30
CONFIGS = [
    # (policy, config, capacity, limit, streams, manual events[, periodic])
    ("pymemplan", "", 4 * GiB, 0, 3, True),
    ("pymemplan", "max_split_size_mb:64", 16 * GiB, 3 * GiB, 4, True),
    ("pymemplan", "release_before_grow:False", 4 * GiB, 0, 2, False),
    ("pymemplan-vmm", "", 4 * GiB, 0, 3, True),
    ("pymemplan-vmm", "vmm_segment_mb:64", 16 * GiB, 3 * GiB, 4, True),
    ("torch", "", 4 * GiB, 0, 3, True),
    ("torch", "max_split_size_mb:64,roundup_power2_divisions:4", 16 * GiB, 3 * GiB, 4, True),
    ("nocache", "", 4 * GiB, 0, 3, True),
    ("pymemplan-planned", "", 4 * GiB, 0, 3, True),
    # Periodic: a repeated iteration program (with divergences and alternating shapes), so that
    # plans are made and serve requests (plan_hits), not only the fallback pool.
    ("pymemplan-planned", "", 4 * GiB, 0, 3, True, True),
    ("pymemplan-planned", "min_period:8,match_window:8,max_plans:2", 16 * GiB, 3 * GiB, 4, False, True),
    ("pymemplan-planned", "vmm:False", 4 * GiB, 0, 2, True, True),
    ("pymemplan-planned", "", 16 * GiB, 96 * MiB, 3, True, True),  # under memory pressure
    # Last, so that the configurations above keep their seeds (--seed + index).
    ("torch", "expandable_segments:True", 4 * GiB, 0, 3, True),
    ("torch", "expandable_segments:True", 16 * GiB, 96 * MiB, 3, True),  # under memory pressure
    # The model of GMLake, stitching every large request (as shipped, only those of 512 MiB).
    ("gmlake", "frag_limit_mb:0", 4 * GiB, 0, 3, True),
    ("gmlake", "frag_limit_mb:0", 16 * GiB, 96 * MiB, 3, True),  # under memory pressure
]


HANDOVER = "restarted, prologue handed over"
AFTER_TRIAL = "restarted after a shorter run"
RESTARTS = ("restarted", "restarted, plans only", HANDOVER, AFTER_TRIAL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=10_000_000, help="operations per configuration")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fuzz_allocator.json"))
    args = ap.parse_args()
    runs = []
    for i, (policy, config, capacity, limit, streams, manual, *rest) in enumerate(CONFIGS):
        periodic = bool(rest and rest[0])
        t0 = time.perf_counter()
        report = _core.fuzz(args.ops, seed=args.seed + i, policy=policy, config=config,
                            capacity=capacity, limit=limit, streams=streams,
                            manual_events=manual, full_check_every=1000, periodic=periodic)
        seconds = time.perf_counter() - t0
        run = {"policy": policy, "config": config, "capacity": capacity, "limit": limit,
               "streams": streams, "manual_events": manual, "periodic": periodic,
               "seed": args.seed + i, "seconds": round(seconds, 2), **report}
        if periodic and policy == "pymemplan-planned" and report["plan_hits"] == 0:
            raise SystemExit(f"{policy} {config}: no request was served from a plan")
        plans = run.pop("plans")
        if periodic and policy == "pymemplan-planned":
            # The same programs again, half as long, restarted with what this run exported
            # (save_plans / load_plans): its prologue, laid out in advance (the whole restarted
            # run, which is shorter than a prologue); with prologue:0, the plans alone, whose
            # offsets were packed in another run; and a prologue of at least 2,000 requests,
            # recorded by a short run of its own, which ends with the next pass a plan serves
            # whole, where that plan takes over (the programs' noise makes plans again under
            # other signatures, so a long run seldom still has the plan its prologue names).
            def again(extra, text, ops=args.ops // 2):
                return _core.fuzz(ops, seed=args.seed + i, policy=policy,
                                  config=",".join(c for c in (config, extra) if c),
                                  capacity=capacity, limit=limit, streams=streams,
                                  manual_events=manual, full_check_every=1000, periodic=True,
                                  plans=text)

            keep = ("ops", "mallocs", "plans_imported", "plan_hits", "prologue_hits",
                    "prologue_handover", "prologue_ahead", "ooms")
            for key, extra in (("restarted", ""), ("restarted, plans only", "prologue:0")):
                report_again = again(extra, plans)
                run[key] = {k: report_again[k] for k in keep}
            short = "prologue:2000"
            recorded = again(short, "", min(args.ops // 2, 6250))
            report_again = again(short, recorded["plans"])
            run[HANDOVER] = {k: report_again[k] for k in keep}
            run[HANDOVER]["ops"] += recorded["ops"]  # the run that recorded it counts too
            # What a run a third as long (a trial, stopped within a pass and before its
            # prologue's end) exported: the rest of the pass it stopped in is laid out too.
            trial = again("", "", args.ops // 6)
            report_again = again("", trial["plans"])
            run[AFTER_TRIAL] = {k: report_again[k] for k in keep}
            run[AFTER_TRIAL]["ops"] += trial["ops"]
        runs.append(run)
        hits = (f"  {report['plan_hits']:>9,} plan hits ({report['plan_tail_layouts']} from a page's tail)"
                if policy == "pymemplan-planned" else "")
        print(f"{policy:17s} {config:48s} {'periodic ' if periodic else '':9s}"
              f"{report['ops']:>11,} ops  {report['ooms']:>8,} OOMs  "
              f"{report['full_checks']:>6,} full checks{hits}  {seconds:6.1f} s  ok", flush=True)
        for key in RESTARTS:
            if key in run:
                r = run[key]
                print(f"{'':17s} {key + ' (its export)':48s} {'':9s}{r['ops']:>11,} ops  "
                      f"{r['ooms']:>8,} OOMs  {r['plans_imported']} plans imported  "
                      f"{r['plan_hits']:>9,} plan hits  {r['prologue_hits']:>9,} from the prologue"
                      + (f"  ({r['prologue_ahead']:,} laid out ahead)" if r["prologue_ahead"] else "")
                      + ("  (its plan took over)" if r["prologue_handover"] else "") + "  ok",
                      flush=True)
    total = sum(r["ops"] + sum(r.get(key, {}).get("ops", 0) for key in RESTARTS) for r in runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"total_ops": total, "violations": 0, "runs": runs}, indent=2) + "\n")
    print(f"{total:,} operations, no invariant violated -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
