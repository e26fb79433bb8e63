"""The CPU-side helpers of benchmarks/gpu_check.py (the GPU run itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from pymemplan.traces import ALLOC, FREE, Trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_check import RUN, allocation_match, gpu_tests_command  # noqa: E402


def step(sizes):
    ev = []
    for i, s in enumerate(sizes):
        ev += [(ALLOC, i + 1, s, 0, 0.0), (FREE, i + 1, s, 0, 0.0)]
    return Trace.from_events(ev)


def test_the_same_sequence_matches_whole():
    sizes = [1000 * (i % 7 + 1) for i in range(50)]
    m = allocation_match(step(sizes), step(sizes))
    assert m["ratio"] == 1.0 and m["in_runs"] == 1.0 and m["longest_run"] == 50
    assert m["recorded_allocations"] == m["predicted_allocations"] == 50


def test_extra_requests_break_runs_and_sizes_compare_rounded():
    sizes = [4096 * (i + 1) for i in range(40)]
    # The recorded step has a small workspace every 5 requests; sizes that round to the same
    # 512 bytes are the same request.
    recorded = []
    for i, s in enumerate(sizes):
        recorded.append(s + 100)
        if i % 5 == 4:
            recorded.append(512)
    m = allocation_match(step([s + 50 for s in sizes]), step(recorded))
    assert m["recorded_allocations"] == 48
    assert m["longest_run"] == 5 < RUN
    assert m["in_runs"] == 0.0  # no run long enough for a plan to follow
    assert 0.8 < m["ratio"] < 1.0
    assert allocation_match(step([512] * 10), step([10 ** 6] * 10))["ratio"] == 0.0


def test_the_gpu_tests_run_where_pytest_xdist_is_missing():
    """The GPU machine may lack pytest-xdist, which the project's addopts ask for: the
    command gpu_check runs must collect the GPU tests without it, where plain pytest cannot."""
    import subprocess

    cmd = gpu_tests_command()
    without_xdist = ["-p", "no:xdist", "--collect-only"]
    r = subprocess.run(cmd[:3] + without_xdist + cmd[3:], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "test_gpu.py" in r.stdout
    plain = subprocess.run([sys.executable, "-m", "pytest", *without_xdist, "-m", "gpu", "-q",
                            cmd[-1]], capture_output=True, text=True, timeout=300)
    assert plain.returncode != 0 and "unrecognized arguments: -n" in plain.stderr


def test_the_oom_stage_reads_a_snapshot_as_pytorch_dumps_it(tmp_path):
    """gpu_check's OOM stage, on a snapshot of the model of PyTorch's allocator instead of
    the GPU's: the capacity it reads is the device's, and the recorded allocator fails."""
    import pickle

    from gpu_check import OOM_BYTES_PER_SAMPLE, oom_batch, oom_summary

    from pymemplan.traces import read_trace
    from pymemplan.traces.fit import oom_snapshot

    assert oom_batch(80 << 30) * OOM_BYTES_PER_SAMPLE > 1.2 * (80 << 30)
    trace = read_trace(Path(__file__).parent / "data" / "gru_seq2seq_small.csv.gz")
    snap, _ = oom_snapshot(trace, 24 << 20, keep=500)
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snap))
    out = oom_summary(str(path), 24 << 20)
    assert out["capacity_bytes"] == 24 << 20 and out["failed_requests"] == 1
    assert out["rows"][0]["policy"] == "torch" and out["rows"][0]["fits"] is False
    assert out["reserved_bytes"] <= out["capacity_bytes"] and out["advice"]
