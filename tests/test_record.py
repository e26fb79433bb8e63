"""Recording real eager PyTorch runs on CPU through the profiler's allocator events."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pymemplan.traces import (ALLOC, FREE, RecordingError, TraceError, read_trace, record,
                              record_step, write_csv)
from pymemplan.traces.record import (AllocationEvent, RecordingWarning, allocation_events,
                                     trace_from_events)

FLOAT = 4  # bytes per float32


def allocator_totals(prof, device="cpu") -> list[tuple[int, int]]:
    """(signed bytes, allocator total) per event, read from the profiler independently of
    pymemplan: the profiler's flat list of memory records, in time order."""
    from torch._C._profiler import _EventType
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == device:
            out.append((node.start_time_ns, node.extra_fields.alloc_size,
                        node.extra_fields.total_allocated))
        stack.extend(node.children)
    out.sort(key=lambda r: r[0])
    return [(d, total) for _, d, total in out]


def test_known_allocations_recorded_exactly():
    def fn():
        a = torch.empty(1000)   # 4000 B
        b = torch.empty(2000)   # 8000 B
        del a
        c = torch.empty(500)    # 2000 B
        return b, c             # held until recording stops
    t = record_step(fn)
    np.testing.assert_array_equal(t.action, [ALLOC, ALLOC, FREE, ALLOC])
    np.testing.assert_array_equal(t.size, [4000, 8000, 4000, 2000])
    assert t.ptr[2] == t.ptr[0]
    assert t.peak_live_bytes() == 12000
    assert t.meta["device"] == "cpu" and t.meta["dropped_frees"] == 0
    assert t.name == "fn"


def make_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    return model, x, y


def test_model_step_matches_the_allocator():
    model, x, y = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record() as rec:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        del loss
    t = rec.trace
    t.validate()  # every free matches a live alloc; no pointer allocated twice while live
    assert t.meta["dropped_frees"] == 0

    # Every free carries the size of the allocation it frees.
    sizes = {}
    for a, p, s in zip(t.action.tolist(), t.ptr.tolist(), t.size.tolist()):
        if a == ALLOC:
            sizes[p] = s
        else:
            assert sizes.pop(p) == s

    # The trace's peak is the allocator's own peak over the step.
    raw = allocator_totals(rec.profile)
    assert len(raw) == len(t)
    baseline = raw[0][1] - raw[0][0]
    assert t.peak_live_bytes() == max(total for _, total in raw) - baseline
    np.testing.assert_array_equal(t.live_bytes(), [total - baseline for _, total in raw])
    # torch's accounting: after the step only the gradients remain (SGD keeps no state).
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert t.live_bytes()[-1] == param_bytes
    assert t.time[0] == 0 and np.all(np.diff(t.time) >= 0)


def test_frees_of_blocks_allocated_before_recording_are_dropped():
    with record():
        kept = torch.empty(1000)  # the allocator now knows this block's size
    with record() as rec:
        del kept                  # freed while recording: its allocation was not seen
        new = torch.empty(10)
    t = rec.trace
    np.testing.assert_array_equal(t.action, [ALLOC])
    np.testing.assert_array_equal(t.size, [10 * FLOAT])
    assert t.meta["dropped_frees"] == 1 and t.meta["dropped_free_bytes"] == 1000 * FLOAT
    del new


def test_adam_steps_round_trip_through_csv(tmp_path):
    model, x, y = make_mlp()
    opt = torch.optim.Adam(model.parameters())

    def steps():
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    t = record_step(steps)
    # The second step's zero_grad frees grads the first step allocated: nothing dropped.
    assert t.meta["dropped_frees"] == 0
    # Left live: grads, Adam's exp_avg and exp_avg_sq, and one float step count per param.
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert t.live_bytes()[-1] == 3 * param_bytes + len(params) * FLOAT
    write_csv(t, tmp_path / "adam.csv.gz")
    back = read_trace(tmp_path / "adam.csv.gz")
    np.testing.assert_array_equal(back.ptr, t.ptr)
    np.testing.assert_array_equal(back.size, t.size)
    assert back.peak_live_bytes() == t.peak_live_bytes()


def test_nothing_built_when_the_block_raises():
    rec = record()
    with pytest.raises(ZeroDivisionError):
        with rec:
            torch.empty(10)
            1 / 0
    assert rec.trace is None


def test_refuses_to_nest_profilers():
    with record() as outer:
        with pytest.raises(RecordingError, match="profiler is already running"):
            with record():
                pass
        kept = torch.empty(8)
    assert outer.trace.size.tolist() == [8 * FLOAT]
    del kept


def test_allocation_events_come_in_time_order():
    with record() as rec:
        a = [torch.empty(i + 1) for i in range(20)]
        del a
    evs = allocation_events(rec.profile)
    assert [e.time_ns for e in evs] == sorted(e.time_ns for e in evs)
    assert [e.delta for e in evs[:20]] == [(i + 1) * FLOAT for i in range(20)]


# --- the completeness check, on synthetic allocator reports -----------------------------

def ev(t, ptr, delta, total, device="cpu"):
    return AllocationEvent(t, ptr, delta, total, device)


def test_missing_event_is_detected():
    events = [ev(1, 0x10, 100, 100), ev(2, 0x20, 50, 150),
              # an allocation of 30 B happened here but was not recorded
              ev(4, 0x10, -100, 80)]
    with pytest.raises(RecordingError, match=r"event 2 of 3 .* sum to 50 bytes but the allocator reports 80"):
        trace_from_events(events)
    assert issubclass(RecordingError, TraceError)


def test_ties_settled_by_the_totals():
    # Same timestamp, reported in the wrong order: the totals say which came first.
    events = [ev(1, 0x10, 100, 100), ev(2, 0x10, -100, 50), ev(2, 0x20, 50, 150)]
    t = trace_from_events(events)
    np.testing.assert_array_equal(t.ptr, [0x10, 0x20, 0x10])
    np.testing.assert_array_equal(t.action, [ALLOC, ALLOC, FREE])


def test_nonzero_baseline_and_dropped_frees():
    events = [ev(1, 0x99, -64, 1000 - 64), ev(2, 0x10, 32, 1000 - 32), ev(3, 0x10, -32, 1000 - 64)]
    t = trace_from_events(events)
    assert t.meta["baseline_bytes"] == 1000
    assert t.meta["dropped_frees"] == 1 and t.meta["dropped_free_bytes"] == 64
    np.testing.assert_array_equal(t.action, [ALLOC, FREE])


def test_a_pointer_handed_out_again_was_freed_where_the_profiler_does_not_see():
    # DDP's gloo workers free gradients the calling thread allocated: the allocator reports
    # nothing for them (nor changes its total), and hands the pointer out again.
    events = [ev(1, 0x10, 8, 8), ev(2, 0x20, 4, 12), ev(3, 0x10, 16, 28), ev(4, 0x10, -16, 12)]
    with pytest.warns(RecordingWarning, match=r"1 block\(s\) \(8 bytes\) were freed where the"):
        t = trace_from_events(events)
    np.testing.assert_array_equal(t.action, [ALLOC, ALLOC, FREE, ALLOC, FREE])
    np.testing.assert_array_equal(t.ptr, [0x10, 0x20, 0x10, 0x10, 0x10])
    np.testing.assert_array_equal(t.size, [8, 4, 8, 16, 16])
    assert t.meta["unseen_frees"] == 1 and t.meta["unseen_free_bytes"] == 8
    assert t.peak_live_bytes() == 20  # 0x20 and the second 0x10: the first was gone
    assert trace_from_events(events[:2]).meta["unseen_frees"] == 0


def test_device_choice():
    cpu = [ev(1, 0x10, 4, 4)]
    gpu0 = [ev(2, 0x7F00, 512, 512, "cuda:0")]
    gpu1 = [ev(3, 0x7E00, 512, 512, "cuda:1")]
    assert trace_from_events(cpu + gpu0).meta["device"] == "cuda:0"  # the accelerator
    assert trace_from_events(cpu + gpu0, device="cpu").ptr.tolist() == [0x10]
    assert trace_from_events(cpu + gpu0, device=torch.device("cuda", 0)).ptr.tolist() == [0x7F00]
    with pytest.raises(RecordingError, match=r"several devices: cpu \(1 events\), cuda:0 .*cuda:1"):
        trace_from_events(cpu + gpu0 + gpu1)


def test_empty_recording():
    with record() as rec:
        pass
    assert len(rec.trace) == 0


def test_a_distributed_data_parallel_step_records_whole(tmp_path):
    # gloo's worker threads free tensors this thread allocated, which the profiler never sees
    # freed; recording must still give a complete trace (a free per allocation, in order).
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.ReLU(),
                                                      nn.Linear(512, 256)), bucket_cap_mb=1)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        with record() as rec:
            for _ in range(3):
                model(torch.randn(32, 256)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()
    t = rec.trace
    live: dict[int, int] = {}
    for a, p, s in zip(t.action.tolist(), t.ptr.tolist(), t.size.tolist()):
        if a == ALLOC:
            assert p not in live
            live[p] = s
        else:
            assert live.pop(p) == s
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert t.peak_live_bytes() >= grads  # the gradients (and DDP's buckets) were recorded


@pytest.mark.parametrize("user_level", [None, "5"])
def test_the_profilers_own_log_lines_stay_off_stderr_unless_the_user_asks(user_level):
    # Kineto prints two lines at every profiler start and stop (and an error where no GPU
    # is found); the kernel probe starts one profiler per op signature. A user's own
    # KINETO_LOG_LEVEL is kept.
    import os
    import subprocess
    import sys

    code = ("import torch, pymemplan\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"
            "t = pymemplan.trace(m, (torch.randn(4, 8),), loss_fn=lambda o: o.sum(),\n"
            "                    device='cpu')\n"
            "import os; print(t.peak_bytes > 0, os.environ['KINETO_LOG_LEVEL'])\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    if user_level is not None:
        env["KINETO_LOG_LEVEL"] = user_level
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", user_level or "6"]
    if user_level is None:
        assert "profiler_start" not in run.stderr and "ERROR" not in run.stderr, run.stderr[:500]
