"""Would the same requests have fit under another allocator (pymemplan.traces.fit), and
`pymemplan explain` on a snapshot of an out-of-memory error."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymemplan import _core
from pymemplan.cli import main
from pymemplan.traces import ALLOC, ALLOC_FAILURE, FREE, Trace, TraceError, read_trace
from pymemplan.traces.fit import compare_fit, oom_snapshot, retry_failures, snapshot_fit

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def _trace(rows, name="t"):
    return Trace.from_events([(a, p, s, 0, float(i)) for i, (a, p, s) in enumerate(rows)], name=name)


def test_a_refused_request_is_asked_again_where_it_failed_and_freed_at_once():
    t = _trace([(ALLOC, 1, 100), (ALLOC_FAILURE, 0, 5 * MiB), (FREE, 1, 100),
                (ALLOC_FAILURE, 0, 7 * MiB)])
    r = retry_failures(t)
    assert r.action.tolist() == [ALLOC, ALLOC, FREE, FREE, ALLOC, FREE]
    assert r.size.tolist() == [100, 5 * MiB, 5 * MiB, 100, 7 * MiB, 7 * MiB]
    assert r.ptr[1] == r.ptr[2] != r.ptr[4] == r.ptr[5] and r.ptr[1] not in (0, 1)
    assert r.time.tolist() == [0, 1, 1, 2, 3, 3]
    r.validate()
    assert r.peak_live_bytes() == 7 * MiB
    assert retry_failures(_trace([(ALLOC, 1, 8)])).action.tolist() == [ALLOC]


@st.composite
def _programs(draw):
    rows, live, nxt = [], [], 1
    for _ in range(draw(st.integers(1, 60))):
        if live and draw(st.integers(0, 2)) == 0:
            p = live.pop(draw(st.integers(0, len(live) - 1)))
            rows.append((FREE, p, 0))
        elif draw(st.integers(0, 9)) == 0:
            rows.append((ALLOC_FAILURE, 0, draw(st.integers(1, 40)) * MiB))
        else:
            rows.append((ALLOC, nxt, draw(st.sampled_from([512, 4096, 300_000, MiB + 7, 3 * MiB, 25 * MiB]))))
            live.append(nxt)
            nxt += 1
    return _trace(rows)


@settings(max_examples=40, deadline=None)
@given(_programs(), st.integers(8, 200))
def test_each_verdict_is_what_a_replay_on_that_device_does(trace, capacity_mib):
    fit = compare_fit(trace, capacity=capacity_mib * MiB)
    asked = retry_failures(trace)
    assert fit.peak_live_bytes == asked.peak_live_bytes()
    assert fit.failed_requests == int((trace.action == ALLOC_FAILURE).sum())
    assert [r.policy for r in fit.rows][:2] == ["torch", "torch=expandable_segments:True"]
    for row in fit.rows:
        name, _, config = row.policy.partition("=")

        def ooms(cap):
            return _core.replay(asked.action, asked.ptr, asked.size, asked.stream, name, config,
                                cap, 2 * MiB)["ooms"]

        assert row.fits == (row.ooms == 0) and row.ooms == ooms(capacity_mib * MiB)
        # The smallest device found holds every request, one page less does not, and none
        # holds less than the live bytes.
        assert ooms(row.smallest_device_bytes) == 0
        assert row.smallest_device_bytes == 2 * MiB or ooms(row.smallest_device_bytes - 2 * MiB) > 0
        assert row.smallest_device_bytes >= fit.peak_live_bytes
        assert row.peak_reserved_bytes >= fit.peak_live_bytes


def test_bad_arguments_are_refused_with_what_was_wrong():
    t = _trace([(ALLOC, 1, MiB)])
    with pytest.raises(ValueError, match="policy 'bogus'.*valid policies"):
        compare_fit(t, policies=["bogus"])
    with pytest.raises(ValueError, match="capacity must be > 0"):
        compare_fit(t, capacity=0)
    with pytest.raises(ValueError, match="at most 33554432 pages"):
        compare_fit(t, capacity="100TiB")
    with pytest.raises(TraceError, match="not live"):
        compare_fit(_trace([(FREE, 1, 8)]))


def _run_to_oom(trace, capacity, keep, settings=None):
    """The snapshot PyTorch dumps where the model of its allocator fails `trace` on
    `capacity` (its last `keep` history entries), and the request that failed."""
    snap, at = oom_snapshot(trace, capacity, keep=keep)
    if settings is not None:
        snap["allocator_settings"] = settings
    return snap, int(trace.size[at])


def _between(trace):
    """A capacity on which PyTorch's allocator fails the trace and pymemplan-vmm runs it."""
    fit = compare_fit(trace, policies=["torch", "pymemplan-vmm"])
    torch, vmm = (r.smallest_device_bytes for r in fit.rows)
    assert vmm < torch, (vmm, torch)
    return torch - 2 * MiB


@pytest.mark.parametrize("keep", [None, 300])
def test_an_oom_snapshot_tells_which_allocator_would_have_fit(tmp_path, capsys, keep):
    trace = read_trace(DATA / "gru_seq2seq_small.csv.gz")
    capacity = _between(trace)
    snap, failed = _run_to_oom(trace, capacity, keep)
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snap))
    fit = snapshot_fit(path)
    # The capacity is what the program had: reserved at the error plus what was free.
    assert fit.capacity_bytes == capacity and "out-of-memory error" in fit.capacity_source
    assert fit.failed_requests == 1
    by = {r.policy: r for r in fit.rows}
    assert not by["torch"].fits and by["pymemplan-vmm"].fits
    # The requests are those of the run up to the error, the failed one included, whatever
    # part of them the history kept: the blocks made before it are placed first.
    assert fit.peak_live_bytes >= failed
    if keep is not None:
        assert read_trace(path).meta["earlier_blocks"] > 0
        assert main(["replay", str(path), "--policy", "torch"]) == 0
        assert "made before the snapshot's history began" in capsys.readouterr().out
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "fits" in out and "reserved +" in out
    assert main(["explain", str(path), "--json", "--policy", "pymemplan-vmm",
                 "--capacity", f"{capacity + 64 * MiB}"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in got["fit"]["rows"]] == ["pymemplan-vmm"]
    assert got["fit"]["capacity_bytes"] == capacity + 64 * MiB and got["fit"]["rows"][0]["fits"]


def test_the_recorded_settings_pick_the_model_of_pytorchs_allocator(tmp_path):
    trace = read_trace(DATA / "gru_seq2seq_small.csv.gz")
    capacity = _between(trace)
    snap, _ = _run_to_oom(trace, capacity, None, settings={
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,garbage_collection_threshold:0.8"})
    fit = snapshot_fit(snap)
    assert fit.rows[0].policy == "torch=expandable_segments:True"
    assert [r.policy for r in fit.rows].count("torch=expandable_segments:True") == 1
    assert any("garbage_collection_threshold:0.8" in n for n in fit.notes)
    del snap["allocator_settings"]
    assert any("defaults are assumed" in n for n in snapshot_fit(snap).notes)


def test_a_snapshot_without_history_says_how_to_record_it(tmp_path, capsys):
    snap, _ = _run_to_oom(read_trace(DATA / "gru_seq2seq_small.csv.gz"), 8 * MiB, None)
    snap["device_traces"] = [[]]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    with pytest.raises(TraceError, match="_record_memory_history"):
        snapshot_fit(path)
    assert main(["explain", str(path)]) == 0
    assert "_record_memory_history(max_entries" in capsys.readouterr().out
    assert main(["explain", str(path), "--no-compare"]) == 0
    assert "_record_memory_history" not in capsys.readouterr().out


def test_the_advice_is_a_setting_that_makes_the_run_fit(tmp_path):
    from pymemplan.allocator._config import parse_config

    trace = read_trace(DATA / "gru_seq2seq_small.csv.gz")
    capacity = _between(trace)
    snap, _ = _run_to_oom(trace, capacity, None)
    fit = snapshot_fit(snap, policies=["torch", "pymemplan-vmm", "pymemplan=release_before_grow:False"])
    assert fit.rows[1].fits and "pymemplan.enable(\"pymemplan-vmm\")" in fit.advice
    env = fit.advice.split('PYMEMPLAN_ALLOC_CONF="')[1].split('"')[0]
    assert parse_config(env) == ("pymemplan-vmm", {})
    assert "What to do: call pymemplan.enable" in str(fit)
    # PyTorch's own setting comes first where it fits.
    exp = snapshot_fit(snap, capacity=capacity + 256 * MiB)
    assert exp.rows[1].policy == "torch=expandable_segments:True" and exp.rows[1].fits
    assert exp.advice.startswith("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    # Below the live bytes nothing fits: the advice says what would.
    none = snapshot_fit(snap, capacity=fit.peak_live_bytes // 2)
    assert not any(r.fits for r in none.rows)
    assert "no allocator fits" in none.advice and "pymemplan plan" in none.advice
    least = min(r.smallest_device_bytes for r in none.rows)
    assert f"the least any needs is {_core.format_bytes(least)}" in none.advice
    # No failed request, no advice: nothing failed.
    assert compare_fit(trace, capacity=capacity).advice is None



def _layout_of(alloc, ptr_of):
    """The model's own layout now, as replay's `layout` takes it."""
    return [(g["total_size"], g["segment_type"] == "small", g["stream"],
             [(b["address"] - g["address"], b["size"], b["requested_size"], ptr_of[b["address"]])
              for b in g["blocks"] if b["state"] == "active_allocated"])
            for g in alloc.snapshot()["segments"]]


@settings(max_examples=40, deadline=None)
@given(_programs(), st.floats(0.0, 1.0), st.sampled_from([None, 0.9, 0.7]))
def test_a_replay_from_the_models_own_layout_goes_on_as_the_whole_run(trace, where, tight):
    """Started from the layout PyTorch's allocator had at any event, with the blocks alive
    then, the model serves the rest of the trace exactly as it did in the whole run: the
    same requests refused, the same highest reserved from there on."""
    keep = trace.action != ALLOC_FAILURE
    action, ptr, size, stream = (np.ascontiguousarray(c[keep]) for c in
                                 (trace.action, trace.ptr, trace.size, trace.stream))
    n = len(action)
    spare = _core.replay(action, ptr, size, stream, "torch", "", 1 << 36, 2 * MiB)
    cap = (1 << 36) if tight is None else max(2 * MiB, int(spare["peak_reserved_bytes"] * tight))
    k = int(where * n)
    alloc = _core.Allocator(_core.SimulatedDevice(cap), "torch", "")
    addr, refused = {}, 0
    for a, p, s in zip(action[:k].tolist(), ptr[:k].tolist(), size[:k].tolist()):
        if a == ALLOC:
            try:
                addr[p] = alloc.malloc(s)
            except _core.OutOfMemoryError:
                addr[p], refused = None, refused + 1
        else:
            at = addr.pop(p)
            if at is not None:
                alloc.free(at)
    layout = _layout_of(alloc, {at: p for p, at in addr.items() if at is not None})
    # The rest, less the frees of blocks that were refused (they were never made).
    gone = {p for p, at in addr.items() if at is None}
    rest = np.array([not (a == FREE and p in gone) for a, p in
                     zip(action[k:].tolist(), ptr[k:].tolist())], dtype=bool)
    cols = (np.ascontiguousarray(c[k:][rest]) for c in (action, ptr, size, stream))
    started = _core.replay(*cols, "torch", "", cap, 2 * MiB, layout=layout)
    whole = _core.replay(action, ptr, size, stream, "torch", "", cap, 2 * MiB,
                         steady_from=max(k - 1, 0))
    assert whole["ooms"] == refused + started["ooms"]
    if k > 0:
        assert started["peak_reserved_bytes"] == whole["steady_peak_reserved_bytes"]


def test_a_layout_is_refused_with_what_was_wrong():
    t = _trace([(FREE, 7, 512)])
    with pytest.raises(_core.AllocatorError, match="only the model of PyTorch's allocator"):
        _core.replay(t.action, t.ptr, t.size, t.stream, "pymemplan-vmm", "", 1 << 30, 2 * MiB,
                     layout=[(2 * MiB, True, 0, [(0, 512, 512, 7)])])
    for bad in ([(0, 1024, 512, 7), (512, 512, 512, 8)],  # overlapping
                [(2 * MiB, 512, 512, 7)],                  # outside the segment
                [(0, 1000, 512, 7)],                       # not a multiple of 512
                [(0, 512, 600, 7)]):                       # smaller than its request
        with pytest.raises(_core.AllocatorError, match="adopt_segment: block"):
            _core.replay(t.action, t.ptr, t.size, t.stream, "torch", "", 1 << 30, 2 * MiB,
                         layout=[(2 * MiB, True, 0, bad)])
    # A segment the device has no room for: its blocks count as refused, their frees skipped.
    r = _core.replay(t.action, t.ptr, t.size, t.stream, "torch", "", 2 * MiB, 2 * MiB,
                     layout=[(20 * MiB, False, 0, [(0, 2 * MiB, 2 * MiB, 7)])])
    assert r["ooms"] == 1


@pytest.mark.parametrize("keep", [40, 300, 3000])
def test_the_recorded_allocator_starts_from_the_layout_the_snapshot_had(keep):
    """From a history cut anywhere, the model of PyTorch's allocator, started from the layout
    the run had where the history begins, fails as the run did; placing the blocks made
    before it together, as the other allocators do, it may not."""
    trace = read_trace(DATA / "gru_seq2seq_small.csv.gz")
    capacity = _between(trace)
    snap, _ = _run_to_oom(trace, capacity, keep)
    fit = snapshot_fit(snap)
    assert fit.rows[0].policy == "torch" and not fit.rows[0].fits
    assert any("starts from the layout the run had" in n for n in fit.notes)


def test_only_the_recorded_allocators_row_is_called_the_recorded_allocator(tmp_path, capsys):
    """A run under PyTorch's allocator, its 100 MiB request failed; replayed under the policies
    asked for, on 1 GiB. The recorded allocator is PyTorch's whichever row comes first."""
    from test_explain import BASE, _snapshot_with_history

    snap = _snapshot_with_history(
        [{"action": "alloc", "addr": BASE, "size": 5 * MiB, "stream": 0, "time_us": 1},
         {"action": "oom", "device_free": 10 * MiB, "size": 100 * MiB, "stream": 0, "time_us": 2}])
    fit = snapshot_fit(snap, capacity="1GiB", policies=["pymemplan-vmm", "pymemplan"])
    assert all(r.fits for r in fit.rows)
    assert not any("recorded allocator" in n for n in fit.notes), fit.notes
    assert 'pymemplan.enable("pymemplan-vmm")' in fit.advice
    fit = snapshot_fit(snap, capacity="1GiB", policies=["pymemplan-vmm", "torch"])
    assert [n for n in fit.notes if "recorded allocator" in n][0].startswith(
        "The model of the recorded allocator (torch) serves every request on this device")
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["explain", str(path), "--capacity", "1GiB", "--policy", "pymemplan-vmm",
                 "--policy", "pymemplan"]) == 0
    out = capsys.readouterr().out
    assert "recorded allocator" not in out and 'pymemplan.enable("pymemplan-vmm")' in out, out
