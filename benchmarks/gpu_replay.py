"""What the policies' driver calls cost on a real GPU: allocation traces replayed through the
plugin (libpymemplan_alloc.so, the library PyTorch allocates through), on the CUDA driver.

    python benchmarks/gpu_replay.py            # needs a CUDA GPU and pymemplan installed
    python benchmarks/gpu_replay.py --quick    # one small trace (what the tests run)

The replay benchmarks count driver calls (pages mapped and unmapped, cudaMalloc and cudaFree)
on a simulated device; what one costs on a GPU they cannot say. Here each trace is replayed
twice per policy, in a process of its own: through the plugin over the CUDA driver (every
request a ctypes call into the plugin's C API, as PyTorch's pluggable allocator makes one), and
through the same policy over the simulated device (`_core.replay`), in the same process. The
peak reserved and the driver calls are set beside the simulated ones: the two take the same
decisions wherever the driver hands out addresses in the simulated device's order, and may
differ a little where it does not (best fit breaks ties between free blocks by address; the
fake driver's mmap hands segments out downwards, the simulated device upwards: on the 16 GB
loop classic `pymemplan` holds 17,820 MiB over it against 17,650). The wall time over the
simulated one, per driver call, bounds what a call costs on the GPU from above (it also holds
the ctypes calls, one per request, which the simulated replay does not make); the difference of
that between `pymemplan-vmm` and classic `pymemplan` (the same requests, many more driver
calls), per call, is the estimate (`trace_us_per_device_call`).
No kernels run: the traces' requests come one after another, so every driver call is on the
critical path, as it is for a training step that waits on the allocator.

The traces: random training loop 9 over 40 steps (batch sizes drawn from three, 16 GB live;
plans of several sizes take turns) and loop 4 (13 GB, the next batch made before the last is
released, whose layout `pymemplan-vmm` moves at each step), from benchmarks/alloc_random.py;
traces of one stream (the replay makes every request on the default stream). Writes
benchmarks/results/gpu_replay.json; benchmarks/gpu_check.py runs it on a GPU.

With PYMEMPLAN_LIBCUDA naming another driver library (the fake one of the tests), the same
runs go over it: `--quick` checks the CUDA path against the simulated device on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "gpu_replay.json"
# The model of GMLake (stitching every large request) too: the same comparison on the GPU.
POLICIES = ("pymemplan", "pymemplan-vmm", "pymemplan-planned", "gmlake=frag_limit_mb:0")
TRACES = {"random_training_9_x40": (9, 40), "random_training_4_x40": (4, 40)}
QUICK = {"random_training_2": (2, None)}

# One policy over one trace, in a process of its own (the plugin keeps one allocator per
# device for the life of the process).
WORKER = textwrap.dedent("""
    import ctypes, json, sys, time
    import numpy as np
    from pymemplan import _core
    from pymemplan.allocator._library import load
    spec, path = sys.argv[1], sys.argv[2]
    policy, _, config = spec.partition("=")
    t = np.load(path)
    action, ptr, size, stream = (t[k] for k in ("action", "ptr", "size", "stream"))
    if len(set(stream.tolist())) > 1:
        raise SystemExit(f"{path}: requests on several streams; this replay makes them all on one")
    lib = load()
    assert lib.pymemplan_configure(policy.encode(), config.encode()) == 0, lib.pymemplan_last_error()

    def stats():
        buf = ctypes.create_string_buffer(1 << 16)
        n = lib.pymemplan_stats_json(0, buf, len(buf))
        assert 0 <= n < len(buf), n
        return json.loads(buf.value.decode())

    capacity = int(sys.argv[3])
    stats()  # the device's allocator and the driver's context made before the clock starts
    # try_alloc: NULL and the plugin's message on failure, where alloc (PyTorch's entry)
    # throws to its caller
    live, a, f = {}, lib.pymemplan_try_alloc, lib.pymemplan_free
    half = len(action) // 2
    t0 = time.perf_counter()
    for i, (act, p, n) in enumerate(zip(action.tolist(), ptr.tolist(), size.tolist())):
        if i == half:
            mid = stats()
        if act == 0:
            q = a(n, 0, None)
            if not q:
                error = lib.pymemplan_last_error().decode()
                raise SystemExit(f"request {i} of {n} bytes failed: {error}")
            live[p] = q
        else:
            f(live.pop(p), n, 0, None)
    wall = time.perf_counter() - t0
    end = stats()
    for p, q in live.items():
        f(q, 0, 0, None)
    lib.pymemplan_empty_cache(0)
    t0 = time.perf_counter()
    sim = _core.replay(action, ptr, size, stream, policy, config, capacity, 2 << 20, half)
    sim_wall = time.perf_counter() - t0
    calls = lambda s: int(s["num_device_alloc"]) + int(s["num_device_free"])
    print(json.dumps({
        "events": len(action),
        "wall_s": wall,
        "simulated_wall_s": sim_wall,
        "peak_reserved_bytes": int(end["reserved_bytes.all.peak"]),
        "simulated_peak_reserved_bytes": int(sim["peak_reserved_bytes"]),
        "device_calls": calls(end),
        "simulated_device_calls": int(sim["device_allocs"]) + int(sim["device_frees"]),
        "second_half_device_calls": calls(end) - calls(mid),
        "simulated_second_half_device_calls":
            int(sim["steady_device_allocs"]) + int(sim["steady_device_frees"]),
    }))
""")


def trace_file(name: str, seed: int, steps: int | None, folder: Path) -> Path:
    import numpy as np

    sys.path.insert(0, str(HERE))
    from synthetic_traces import random_training

    t = random_training(seed, steps=steps)
    path = folder / f"{name}.npz"
    np.savez(path, action=t.action, ptr=t.ptr, size=t.size, stream=t.stream)
    return path


def run(traces: dict, capacity: int, timeout: float) -> list[dict]:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (seed, steps) in traces.items():
            path = trace_file(name, seed, steps, Path(tmp))
            for policy in POLICIES:
                r = subprocess.run(
                    [sys.executable, "-c", WORKER, policy, str(path), str(capacity)],
                    capture_output=True, text=True, timeout=timeout)
                if r.returncode != 0:
                    rows.append({"trace": name, "policy": policy,
                                 "error": (r.stdout + r.stderr)[-2000:]})
                    print(f"{name:24s} {policy:18s} FAILED\n{r.stderr[-2000:]}", flush=True)
                    continue
                row = {"trace": name, "policy": policy,
                       **json.loads(r.stdout.strip().splitlines()[-1])}
                extra = row["wall_s"] - row["simulated_wall_s"]
                calls = row["device_calls"]
                row["us_per_device_call"] = 1e6 * extra / calls if calls else None
                row["same_as_simulated"] = (
                    row["peak_reserved_bytes"] == row["simulated_peak_reserved_bytes"]
                    and row["device_calls"] == row["simulated_device_calls"])
                row["peak_over_simulated"] = (row["peak_reserved_bytes"]
                                              / row["simulated_peak_reserved_bytes"])
                rows.append(row)
                per = row["us_per_device_call"]
                print(f"{name:24s} {policy:18s} {row['events']:7,} events  {row['wall_s']:7.3f} s "
                      f"(simulated {row['simulated_wall_s']:6.3f})  "
                      f"{row['device_calls']:7,} driver calls "
                      f"({row['second_half_device_calls']:,} in the second half)  "
                      f"{'-' if per is None else f'{per:.1f}'} us/call  "
                      + ("same as simulated" if row["same_as_simulated"] else
                         f"simulated: peak x{1 / row['peak_over_simulated']:.4f}, "
                         f"{row['simulated_device_calls']:,} driver calls"),
                      flush=True)
            # The cost of a driver call, from two policies on the same trace: the ctypes calls
            # (one per request) are the same in both, the driver calls are not.
            done = {r["policy"]: r for r in rows if r["trace"] == name and "error" not in r}
            few, many = done.get("pymemplan"), done.get("pymemplan-vmm")
            if few and many and many["device_calls"] > few["device_calls"]:
                extra = ((many["wall_s"] - many["simulated_wall_s"])
                         - (few["wall_s"] - few["simulated_wall_s"]))
                us = 1e6 * extra / (many["device_calls"] - few["device_calls"])
                for r in done.values():
                    r["trace_us_per_device_call"] = us
                print(f"{name:24s} about {us:.1f} us per driver call "
                      "(pymemplan-vmm against pymemplan)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small trace")
    ap.add_argument("--capacity", type=int, default=80 << 30,
                    help="the simulated device's bytes (the GPU's, for decisions near it to match)")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = run(QUICK if args.quick else TRACES, args.capacity, timeout=240)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/gpu_replay.py" + (" --quick" if args.quick else ""),
        "driver": os.environ.get("PYMEMPLAN_LIBCUDA", "libcuda.so.1"),
        "seconds": time.perf_counter() - t0,
        "runs": rows}, indent=2) + "\n")
    print(f"-> {args.out}")
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
