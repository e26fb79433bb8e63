"""What reserved memory holds at its peak (pymemplan.traces.explain_peak, replay --explain)."""

import json
import pickle
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pymemplan import _core
from pymemplan.cli import main
from pymemplan.traces import (ALLOC, FREE, Trace, TraceError, explain_peak, explain_snapshot,
                               replay, write_csv)

MiB = 1 << 20
POLICIES = ["torch", "torch=expandable_segments:True", "pymemplan", "pymemplan-vmm",
            "pymemplan-planned", "nocache"]


def _trace(ops, name="t"):
    """ops: ("a", id, size) or ("f", id)."""
    sizes, events = {}, []
    for op in ops:
        if op[0] == "a":
            sizes[op[1]] = op[2]
            events.append((ALLOC, op[1], op[2], 0, 0.0))
        else:
            events.append((FREE, op[1], sizes[op[1]], 0, 0.0))
    return Trace.from_events(events, name=name)


def _live_after(trace, event):
    live = 0
    for a, s in zip(trace.action[:event + 1].tolist(), trace.size[:event + 1].tolist()):
        live += s if a == ALLOC else -s
    return live


def test_holes_in_a_torch_segment_are_fragments_kept_by_the_blocks_between_them():
    """Eight 2.5 MiB blocks fill one of torch's 20 MiB segments; every other one is freed, and
    a 5 MiB request fits none of the four 2.5 MiB holes: a second segment. At that peak (40 MiB
    for 15 live), the first segment's holes are kept by the four blocks left in it."""
    ops = [("a", i, 5 * MiB // 2) for i in range(8)]
    ops += [("f", i) for i in range(1, 8, 2)]
    ops += [("a", 100, 5 * MiB), ("f", 100)] + [("f", i) for i in range(0, 8, 2)]
    why = explain_peak(_trace(ops), "torch")
    assert why.event == 12 and why.reserved_bytes == 40 * MiB
    assert why.live_bytes == 15 * MiB and why.rounding_bytes == 0
    assert why.cached_bytes == 0 and why.pending_bytes == 0
    assert why.fragment_bytes == 25 * MiB and why.unit == "segment" and why.partly_used == 2
    # The four blocks left in the first segment live for most of the trace; the 5 MiB one, one
    # event: only the first segment's holes are kept step after step.
    assert why.long_lived_fragment_bytes == 10 * MiB
    second, first = why.holders
    assert (second.free_bytes, second.largest_free_bytes) == (15 * MiB, 15 * MiB)
    assert [(b.size, b.made_at, b.freed_at) for b in second.blocks] == [(5 * MiB, 12, 13)]
    assert (first.free_bytes, first.largest_free_bytes) == (10 * MiB, 5 * MiB // 2)
    assert sorted((b.made_at, b.freed_at) for b in first.blocks) == [(0, 14), (2, 15), (4, 16),
                                                                      (6, 17)]
    assert all(b.size == 5 * MiB // 2 for b in first.blocks)


def test_a_wholly_free_segment_is_cached_and_a_small_block_pins_its_page():
    """torch: a 4 MiB block takes a 20 MiB segment and is freed; a 1 MiB request then makes a
    2 MiB small segment. At that peak (22 MiB), the large segment is cached (empty_cache would
    give it back) and the small one holds 1 MiB of fragments."""
    why = explain_peak(_trace([("a", 1, 4 * MiB), ("f", 1), ("a", 2, MiB)]), "torch")
    assert why.reserved_bytes == 22 * MiB and why.event == 2
    assert (why.live_bytes, why.cached_bytes, why.fragment_bytes) == (MiB, 20 * MiB, MiB)
    assert [h.bytes for h in why.holders] == [2 * MiB]


def test_with_virtual_memory_a_partly_used_page_is_what_holds_fragments():
    """pymemplan-vmm maps whole 2 MiB pages: a 1 MiB block and a 3 MiB one share the second
    page; the first page is the first block's alone. Once the 3 MiB block is freed its pages
    stay mapped, unused: cached, and the first page is half free."""
    why = explain_peak(_trace([("a", 1, MiB), ("a", 2, 3 * MiB), ("f", 2), ("f", 1)]),
                       "pymemplan-vmm")
    assert why.unit == "page" and why.event == 1 and why.reserved_bytes == 4 * MiB
    assert why.live_bytes == 4 * MiB and why.fragment_bytes == 0 and why.partly_used == 0
    why = explain_peak(_trace([("a", 1, MiB), ("a", 2, 3 * MiB), ("f", 2), ("a", 3, MiB // 2)]),
                       "pymemplan-vmm")
    assert why.event == 1  # the first event at the peak: later ones hold no more
    assert why.fragment_bytes == 0


def test_a_partly_used_page_is_listed_with_the_block_that_keeps_it():
    """A 3 MiB block maps two pages and leaves 1 MiB of the second free: the peak is there, at
    the first event; a 512 KiB block made next fits in that free MiB and raises nothing."""
    why = explain_peak(_trace([("a", 1, 3 * MiB), ("a", 2, 512 << 10), ("f", 2)]),
                       "pymemplan-vmm", top=3)
    assert why.event == 0 and why.reserved_bytes == 4 * MiB and why.live_bytes == 3 * MiB
    assert why.fragment_bytes == MiB and why.partly_used == 1
    assert why.long_lived_fragment_bytes == MiB  # its block is never freed
    (page,) = why.holders
    assert page.bytes == 2 * MiB and page.free_bytes == page.largest_free_bytes == MiB
    assert [(b.size, b.made_at, b.freed_at) for b in page.blocks] == [(3 * MiB, 0, None)]
    text = str(why)
    assert text == "\n".join(why.lines())
    assert "fragments 1.00 MiB (25.0%) in 1 partly used pages" in text, text
    assert "3.00 MiB made at event 0, alive to the end" in text, text


@st.composite
def _programs(draw):
    ops, live, next_id = [], [], 0
    for _ in range(draw(st.integers(1, 60))):
        if live and draw(st.booleans()):
            ops.append(("f", live.pop(draw(st.integers(0, len(live) - 1)))))
        else:
            size = draw(st.sampled_from([512, 3000, 200_000, MiB, 3 * MiB // 2, 5 * MiB, 23 * MiB]))
            ops.append(("a", next_id, size))
            live.append(next_id)
            next_id += 1
    return ops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_programs(), st.sampled_from(POLICIES))
def test_the_parts_add_up_to_the_peak_the_replay_engine_reports(ops, policy):
    trace = _trace(ops)
    why = explain_peak(trace, policy)
    (result,) = replay(trace, [policy])
    assert why.reserved_bytes == result.peak_reserved_bytes
    parts = (why.live_bytes, why.rounding_bytes, why.pending_bytes, why.cached_bytes,
             why.fragment_bytes)
    assert min(parts) >= 0, why
    assert sum(parts) == why.reserved_bytes
    assert why.live_bytes == _live_after(trace, why.event)
    assert why.holders == sorted(why.holders, key=lambda h: -h.free_bytes)
    assert sum(h.free_bytes for h in why.holders) <= why.fragment_bytes
    assert 0 <= why.long_lived_fragment_bytes <= why.fragment_bytes
    for h in why.holders:
        assert 0 < h.largest_free_bytes <= h.free_bytes < h.bytes
        for b in h.blocks:
            assert b.made_at <= why.event and (b.freed_at is None or b.freed_at > why.event)


def test_plans_start_pymemplan_planned_as_in_a_replay():
    ops = []
    for step in range(6):
        ops += [("a", 100 * step + i, (i + 1) * MiB // 3) for i in range(12)]
        ops += [("f", 100 * step + i) for i in range(11, -1, -1)]
    trace = _trace(ops)
    (first,) = replay(trace, ["pymemplan-planned"])
    assert "plan " in first.plans
    why = explain_peak(trace, "pymemplan-planned", plans=first.plans)
    (again,) = replay(trace, ["pymemplan-planned"], plans=first.plans)
    assert why.reserved_bytes == again.peak_reserved_bytes


def test_bad_input_is_refused_with_what_was_wrong():
    trace = _trace([("a", 1, MiB), ("f", 1)])
    with pytest.raises(_core.AllocatorError, match="unknown allocator policy .best.: valid policies are"):
        explain_peak(trace, "best")
    with pytest.raises(ValueError, match="top must be >= 0"):
        explain_peak(trace, "torch", top=-1)
    with pytest.raises(ValueError, match="plans are for pymemplan-planned"):
        explain_peak(trace, "torch", plans="pymemplan-plans 4\n")
    with pytest.raises(ValueError, match="its snapshots do not say which pages its stitched"):
        explain_peak(trace, "gmlake=frag_limit_mb:0")
    bad = Trace.from_events([(FREE, 7, MiB, 0, 0.0)], name="bad")
    with pytest.raises(TraceError):
        explain_peak(bad, "torch")


def test_replay_explain_prints_and_writes_json(tmp_path, capsys):
    path = tmp_path / "frag.csv"
    ops = [("a", i, 5 * MiB // 2) for i in range(8)] + [("f", i) for i in range(1, 8, 2)]
    write_csv(_trace(ops + [("a", 100, 5 * MiB)], name="frag"), path)
    assert main(["replay", str(path), "--policy", "torch", "--policy", "pymemplan-vmm",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "frag / torch: reserved peaks at 40.00 MiB" in out, out
    assert "fragments 25.00 MiB (62.5%) in 2 partly used segments" in out, out
    assert "frag / pymemplan-vmm" in out
    assert main(["replay", str(path), "--policy", "torch", "--explain", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["explain"]["fragment_bytes"] == 25 * MiB
    assert row["explain"]["holders"][0]["blocks"][0]["made_at"] == 12
    # GMLake's model is replayed as asked, and left unexplained (its memory cannot be split).
    assert main(["replay", str(path), "--policy", "gmlake", "--policy", "torch", "--explain",
                 "--json"]) == 0
    gm, torch_row = json.loads(capsys.readouterr().out)
    assert "explain" not in gm and torch_row["explain"]["fragment_bytes"] == 25 * MiB


def _torch_snapshot():
    """A snapshot in the shape torch.cuda.memory._snapshot() returns, with stacks: one 20 MiB
    segment holding a 6 MiB block (made in the user's code, under torch.nn.functional), a
    2 MiB one freed but waiting for its stream, and free space; one wholly free 2 MiB segment;
    one segment on device 1."""
    def block(address, size, state, requested=0, frames=()):
        return {"address": address, "size": size, "requested_size": requested, "state": state,
                "frames": list(frames)}
    frames = [{"filename": "??", "line": 0, "name": "unwind::unwind"},  # C++ first (stacks="all")
              {"filename": "/opt/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 1000,
               "name": "c10::cuda::CUDACachingAllocator::Native::malloc"},
              {"filename": "/env/lib/python3.11/site-packages/torch/nn/functional.py",
               "line": 2256, "name": "linear"},
              {"filename": "/home/me/train.py", "line": 42, "name": "forward"},
              {"filename": "/home/me/train.py", "line": 90, "name": "<module>"}]
    big = {"device": 0, "address": 0x100000000, "total_size": 20 * MiB, "segment_type": "large",
           "is_expandable": False, "frames": [],
           "blocks": [block(0x100000000, 6 * MiB, "active_allocated", 6 * MiB - 1000, frames),
                      block(0x100600000, 2 * MiB, "active_pending_free"),
                      block(0x100800000, 12 * MiB, "inactive")]}
    idle = {"device": 0, "address": 0x200000000, "total_size": 2 * MiB, "segment_type": "small",
            "is_expandable": False, "frames": [],
            "blocks": [block(0x200000000, 2 * MiB, "inactive")]}
    other = {"device": 1, "address": 0x300000000, "total_size": 2 * MiB, "segment_type": "small",
             "is_expandable": False, "frames": [],
             "blocks": [block(0x300000000, 2 * MiB, "active_allocated", 2 * MiB)]}
    return {"segments": [big, idle, other], "device_traces": [[], []]}


def test_a_torch_snapshot_is_split_and_names_where_the_pinning_block_was_made(tmp_path, capsys):
    why = explain_snapshot(_torch_snapshot())
    assert why.reserved_bytes == 22 * MiB and why.live_bytes == 6 * MiB - 1000
    assert (why.rounding_bytes, why.pending_bytes, why.cached_bytes) == (1000, 2 * MiB, 2 * MiB)
    assert why.fragment_bytes == 12 * MiB and why.partly_used == 1 and why.unit == "segment"
    (seg,) = why.holders
    assert (seg.free_bytes, seg.largest_free_bytes) == (12 * MiB, 12 * MiB)
    assert [(b.size, b.site) for b in seg.blocks] == [(6 * MiB - 1000, "/home/me/train.py:42 (forward)")]
    assert explain_snapshot(_torch_snapshot(), device=1).fragment_bytes == 0

    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(_torch_snapshot()))
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "device 0: 22.00 MiB reserved" in out and "cached 2.00 MiB (9.1%)" in out, out
    assert "allocated at /home/me/train.py:42 (forward)" in out, out
    assert main(["explain", str(path), "--device", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["live_bytes"] == 2 * MiB


def test_explain_refuses_what_is_not_a_snapshot(tmp_path, capsys):
    with pytest.raises(ValueError, match="no segment on device 3 .it has segments on devices .0, 1.."):
        explain_snapshot(_torch_snapshot(), device=3)
    with pytest.raises(ValueError, match="expected a dict with a 'segments' list"):
        explain_snapshot({"device_traces": []})
    path = tmp_path / "x.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[]]}))
    with pytest.raises(TraceError, match="not a memory snapshot .no 'segments' list."):
        explain_snapshot(path)
    (tmp_path / "text.pickle").write_text("hello")
    assert main(["explain", str(tmp_path / "text.pickle")]) == 2
    assert "cannot unpickle a memory snapshot" in capsys.readouterr().err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_programs(), st.sampled_from(POLICIES))
def test_a_snapshot_of_the_core_is_split_as_its_stats_count(ops, policy):
    """explain_snapshot on pymemplan's own snapshot (the plugin writes the same; GMLake's model
    is left out, as by explain_peak): reserved
    and live as the allocator's stats count them, every part >= 0, at any moment."""
    trace = _trace(ops)
    name, _, config = policy.partition("=")
    alloc = _core.Allocator(_core.SimulatedDevice(1 << 36), name, config)
    addresses = {}
    for a, p, s in zip(trace.action.tolist(), trace.ptr.tolist(), trace.size.tolist()):
        if a == ALLOC:
            addresses[p] = alloc.malloc(s)
        else:
            alloc.free(addresses.pop(p))
    stats = alloc.stats()
    snap = alloc.snapshot()
    if not snap["segments"]:
        return
    why = explain_snapshot(snap)
    assert why.reserved_bytes == stats["reserved_bytes.all.current"]
    assert why.live_bytes == stats["requested_bytes.all.current"]
    assert why.live_bytes + why.rounding_bytes == stats["allocated_bytes.all.current"]
    parts = (why.live_bytes, why.rounding_bytes, why.pending_bytes, why.cached_bytes,
             why.fragment_bytes)
    assert min(parts) >= 0 and sum(parts) == why.reserved_bytes, why


def test_a_block_site_is_the_users_code_where_the_stack_has_it():
    from pymemplan.traces.explain import _site

    cpp = {"filename": "/opt/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 7, "name": "malloc"}
    torch_py = {"filename": "/env/site-packages/torch/nn/modules/linear.py", "line": 125,
                "name": "forward"}
    user = {"filename": "C:\\work\\train.py", "line": 3, "name": "step"}
    assert _site([cpp, torch_py, user]) == "C:\\work\\train.py:3 (step)"
    assert _site([cpp, torch_py]) == "/env/site-packages/torch/nn/modules/linear.py:125 (forward)"
    assert _site([cpp]) == "/opt/pytorch/c10/cuda/CUDACachingAllocator.cpp:7 (malloc)"
    assert _site([]) is None and _site(None) is None


BASE = 0x7F0000000000


def _entry(action, addr, size, t, **kw):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": [],
            **kw}


def _snapshot_with_history(history):
    """PyTorch's snapshot of one 20 MiB segment holding a 5 MiB block, with `history` on
    device 0 as torch.cuda.memory._record_memory_history records it."""
    seg = {"device": 0, "address": BASE, "total_size": 20 * MiB, "stream": 0,
           "segment_type": "large", "is_expandable": False, "frames": [],
           "blocks": [{"address": BASE, "size": 5 * MiB, "requested_size": 5 * MiB,
                       "state": "active_allocated", "frames": []},
                      {"address": BASE + 5 * MiB, "size": 15 * MiB, "requested_size": 0,
                       "state": "inactive", "frames": []}]}
    return {"segments": [seg], "device_traces": [history],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


def test_user_defined_annotations_in_the_history_are_skipped(tmp_path, capsys):
    """_record_memory_history(..., global_record_annotations=True) writes an entry of action
    "user_defined" per record_function start and end (some PyTorch 2.x releases): markers,
    which change no memory."""
    from pymemplan.traces import read_snapshot_pickle

    history = [_entry("user_defined", 0, 0, 1, user_metadata="## forward ## START"),
               _entry("segment_alloc", BASE, 20 * MiB, 2), _entry("alloc", BASE, 5 * MiB, 3),
               _entry("user_defined", 0, 0, 4, user_metadata="## forward ## END")]
    path = tmp_path / "annotated.pickle"
    path.write_bytes(pickle.dumps(_snapshot_with_history(history)))
    trace = read_snapshot_pickle(path)
    assert trace.action.tolist() == [ALLOC] and trace.size.tolist() == [5 * MiB]
    assert main(["explain", str(path), "--policy", "torch", "--policy", "pymemplan-vmm"]) == 0
    out = capsys.readouterr().out
    assert "annotated.pickle: the same 1 events, under each allocator:" in out, out
    assert "pymemplan-vmm  peak reserved" in out, out


@pytest.mark.parametrize("history, problem", [
    # An action PyTorch may add later: what it does to memory is not known, so it is not skipped.
    ([_entry("alloc", BASE, 5 * MiB, 1), _entry("segment_defragment", BASE, 0, 2)],
     "device 0, event 1: unknown action 'segment_defragment'"),
    ([_entry("alloc", BASE, 5 * MiB, 1), _entry("alloc", BASE, MiB, 2)],
     "device 0, event 1: pointer 0x7f0000000000 allocated again while still live"),
])
def test_a_history_that_cannot_be_replayed_still_gives_the_split_and_says_why(
        tmp_path, capsys, history, problem):
    snap = _snapshot_with_history(history)
    path = tmp_path / "bad_history.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "device 0: 20.00 MiB reserved" in out, out
    assert "live 5.00 MiB (25.0%)" in out and "cached 0 B" in out, out
    assert f"the history cannot be replayed: {path}: {problem}" in out, out
    assert "--no-compare" in out and "report" in out, out
    assert "No allocation history in the snapshot" not in out, out
    assert main(["explain", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["fit"] is None and problem in got["fit_error"]
    assert got["live_bytes"] == 5 * MiB and got["fragment_bytes"] == 15 * MiB
    # From Python (pymemplan.explain_memory() in an OOM handler calls this): no raise.
    why = explain_snapshot(snap, compare=True)
    assert why.fit is None and why.fit_error.startswith(f"snapshot: {problem}")
    assert why.live_bytes == 5 * MiB and "the history cannot be replayed" in str(why)
    assert explain_snapshot(snap).fit_error is None  # compare=False: nothing replayed
    # The replay itself still refuses such a history: skipping it could give a wrong replay.
    assert main(["replay", str(path)]) == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("snap, problem", [
    ({"segments": [{"device": 0, "address": 1, "total_size": 512}]},
     "segment 0 has no 'blocks' (expected a list of its blocks)"),
    ({"segments": [{"address": 1, "total_size": 512, "blocks": [{"address": 1, "size": 512}]}]},
     "segment 0, block 0 has no 'state' (expected a string such as 'active_allocated')"),
    ({"segments": ["x"]}, "segment 0 is a str, expected a dict"),
    ({"segments": [{"address": 1, "total_size": "512", "blocks": []}]},
     "segment 0: 'total_size' is '512', expected an integer >= 0"),
    ({"segments": [{"address": 0, "total_size": 4 * MiB, "mapped_size": 2 * MiB,
                    "page_size": 2 * MiB, "page_mapped": [True],
                    "blocks": [{"address": 0, "size": 4 * MiB, "state": "active_allocated"}]}]},
     "segment 0, block 0 (at 0x0, 4.00 MiB) lies outside the segment's 1 page(s) of 2.00 MiB "
     "from 0x0"),
    ({"segments": [], "device_traces": []}, "it has no segment at all: nothing was allocated"),
])
def test_a_malformed_snapshot_is_refused_with_what_is_wrong(tmp_path, capsys, snap, problem):
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pymemplan explain: ") and problem in err, err
    assert "Traceback" not in err
    with pytest.raises(ValueError, match=re.escape(problem)):
        explain_snapshot(snap)


def test_a_pickle_of_memory_snapshot_the_list_of_segments_is_read(tmp_path, capsys):
    """torch.cuda.memory_snapshot() returns the segments alone, as a list (PyTorch's
    _memory_viz reads a pickle of it too)."""
    path = tmp_path / "segments.pickle"
    path.write_bytes(pickle.dumps(_torch_snapshot()["segments"]))
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "device 0: 22.00 MiB reserved" in out and "No allocation history" in out, out
    assert explain_snapshot(_torch_snapshot()["segments"], device=1).live_bytes == 2 * MiB
    assert explain_snapshot(path).reserved_bytes == 22 * MiB
