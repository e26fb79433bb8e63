"""Trace files: RMM CSV, our CSV (plain and gzipped), PyTorch snapshot pickles."""

from __future__ import annotations

import gzip
import pickle
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pymemplan.traces import (ALLOC, ALLOC_FAILURE, FREE, Trace, TraceError, builtin_traces,
                              read_rmm_csv, read_snapshot_pickle, read_trace, write_csv)
from pymemplan.traces._pairing import _pair_loop, _pair_vectorised

DATA = Path(__file__).parent / "data"
HEADER = "Thread,Time,Action,Pointer,Size,Stream"


# --- random valid traces ---------------------------------------------------------------

@st.composite
def traces(draw, max_events=60):
    """Valid traces with pointer reuse, failures, and frees given with or without size."""
    n = draw(st.integers(0, max_events))
    pool = draw(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=8, unique=True))
    live: dict[int, int] = {}
    rows, expected_sizes = [], []
    t = draw(st.floats(0, 1e9))
    for _ in range(n):
        t += draw(st.floats(0, 10))
        stream = draw(st.sampled_from([0, 1, 7, 2**62 + 5]))
        free_ptrs = [p for p in pool if p not in live]
        choice = draw(st.sampled_from(["alloc", "free", "fail"]))
        if choice == "free" and live:
            p = draw(st.sampled_from(sorted(live)))
            s = live.pop(p)
            rows.append((FREE, p, draw(st.sampled_from([s, 0])), stream, t))
            expected_sizes.append(s)
        elif choice == "fail":
            s = draw(st.integers(1, 2**50))
            rows.append((ALLOC_FAILURE, 0, s, stream, t))
            expected_sizes.append(s)
        elif free_ptrs:
            p = draw(st.sampled_from(free_ptrs))
            s = draw(st.integers(1, 2**50))
            live[p] = s
            rows.append((ALLOC, p, s, stream, t))
            expected_sizes.append(s)
    return Trace.from_events(rows, name="random"), np.array(expected_sizes, dtype=np.int64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.sampled_from(["t.csv", "t.csv.gz"]))
def test_write_read_round_trip(case, filename):
    trace, sizes = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / filename
        write_csv(trace, path)
        back = read_trace(path)
    np.testing.assert_array_equal(back.action, trace.action)
    np.testing.assert_array_equal(back.ptr, trace.ptr)
    np.testing.assert_array_equal(back.size, sizes)  # frees written with their alloc's size
    np.testing.assert_array_equal(back.stream, trace.stream)
    np.testing.assert_allclose(back.time, trace.time, rtol=0, atol=1e-6)
    back.validate()


@settings(max_examples=60, deadline=None)
@given(traces())
def test_vectorised_pairing_matches_the_loop(case):
    trace, _ = case
    fast = _pair_vectorised(trace.action, trace.ptr, trace.size)
    slow = _pair_loop(trace.action, trace.ptr, trace.size, str, False, True)
    assert fast is not None
    np.testing.assert_array_equal(fast.keep, slow.keep)
    np.testing.assert_array_equal(fast.size, slow.size)


def test_gzip_detected_by_content_not_name(tmp_path):
    trace = Trace.from_events([(ALLOC, 0x10, 8, 0, 0.0), (FREE, 0x10, 8, 0, 1.0)])
    write_csv(trace, tmp_path / "t.csv.gz")
    renamed = tmp_path / "t.csv"
    (tmp_path / "t.csv.gz").rename(renamed)
    assert gzip.decompress(renamed.read_bytes()).startswith(HEADER.encode())
    np.testing.assert_array_equal(read_trace(renamed).ptr, [0x10, 0x10])


def test_written_gzip_is_byte_identical_across_writes(tmp_path):
    trace = Trace.from_events([(ALLOC, 0x10, 8, 0, 0.0)])
    write_csv(trace, tmp_path / "a.csv.gz")
    write_csv(trace, tmp_path / "b.csv.gz")
    assert (tmp_path / "a.csv.gz").read_bytes() == (tmp_path / "b.csv.gz").read_bytes()


def test_written_csv_is_what_rmm_replay_parses(tmp_path):
    """RMM's log_parser reads Pointer base 16 and Size, Stream, Thread as decimal."""
    trace = Trace.from_events([(ALLOC, 0x7F8A40000000, 1024, 94000000000000, 1.5),
                               (FREE, 0x7F8A40000000, 0, 94000000000000, 2.25),
                               (ALLOC_FAILURE, 0, 1 << 40, 0, 3.0)])
    write_csv(trace, tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text().splitlines() == [
        HEADER,
        "0,1.500000,allocate,0x7f8a40000000,1024,94000000000000",
        "0,2.250000,free,0x7f8a40000000,1024,94000000000000",
        "0,3.000000,allocate failure,0x0,1099511627776,0",
    ]
    write_csv(trace, tmp_path / "nofail.csv", failures=False)
    assert "failure" not in (tmp_path / "nofail.csv").read_text()


@pytest.mark.parametrize("rows, problem", [
    ([(FREE, 0x10, 8, 0, 0.0)], "event 0: free of pointer 0x10 that is not live"),
    ([(ALLOC, 0x10, 8, 0, 0.0), (ALLOC, 0x10, 8, 0, 0.0)], "event 1: pointer 0x10 allocated again"),
    ([(ALLOC, 0x10, 0, 0, 0.0)], "event 0: allocation of 0 bytes"),
    ([(ALLOC, -16, 8, 0, 0.0)], "event 0: negative pointer"),
    ([(ALLOC, 0x10, 8, -1, 0.0)], "event 0: negative stream"),
    ([(ALLOC, 0x10, 8, 0, float("nan"))], "event 0: time is nan"),
    ([(ALLOC, 0x10, 8, 0, 0.0), (FREE, 0x10, 9, 0, 0.0)], "event 1: free of pointer 0x10 with size 9"),
])
def test_write_rejects_invalid_traces(tmp_path, rows, problem):
    with pytest.raises(TraceError, match=problem):
        write_csv(Trace.from_events(rows, name="bad"), tmp_path / "t.csv")
    assert not (tmp_path / "t.csv").exists()


def test_large_file_reads_quickly(tmp_path):
    """200k events: a guard against per-row slowness (a million read in ~2 s here)."""
    import time
    n = 100_000
    ptr = np.repeat(np.arange(n, dtype=np.int64) * 256 + 0x7F0000000000, 2)
    action = np.tile([ALLOC, FREE], n)
    size = np.repeat(np.arange(1, n + 1, dtype=np.int64), 2)
    trace = Trace(action, ptr, size, np.zeros(2 * n), np.arange(2 * n) * 1e-6)
    write_csv(trace, tmp_path / "big.csv.gz")
    start = time.perf_counter()
    back = read_trace(tmp_path / "big.csv.gz")
    assert time.perf_counter() - start < 10
    np.testing.assert_array_equal(back.ptr, ptr)


# --- RMM's own log ---------------------------------------------------------------------

def test_rmm_sample_log():
    t = read_rmm_csv(DATA / "rmm_sample.csv")
    np.testing.assert_array_equal(t.action, [ALLOC, ALLOC, ALLOC, FREE, ALLOC_FAILURE, ALLOC, FREE, FREE])
    np.testing.assert_array_equal(t.ptr, [0x7F8A40000000, 0x7F8A40000400, 0x7F8A40001000,
                                          0x7F8A40000000, 0, 0x7F8A40000000, 0x7F8A40001000,
                                          0x7F8A40000400])
    np.testing.assert_array_equal(t.size, [1024, 2048, 4096, 1024, 1 << 40, 512, 4096, 2048])
    np.testing.assert_array_equal(t.stream, [0x7F8A38001020] * 2 + [0, 0x7F8A38001020, 0,
                                             0x7F8A38001020, 0, 0x7F8A38001020])
    # 23:59:59.999 then past midnight: the clock wraps, time keeps increasing.
    np.testing.assert_allclose(t.time, [86399.999, 86399.9995, 86400.0001, 86400.0002,
                                        86400.0003, 86400.0004, 86400.0005, 86400.0006])
    assert t.meta["format"] == "rmm-csv" and t.meta["threads"] == 2
    assert t.name == "rmm_sample"
    assert t.peak_live_bytes() == 1024 + 2048 + 4096
    assert read_trace(DATA / "rmm_sample.csv").ptr.tolist() == t.ptr.tolist()


def write(tmp_path, body: str, name="log.csv") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_rmm_variants_accepted(tmp_path):
    """CRLF, a BOM, blank lines, hex pointers without 0x, 'deallocate', decimal streams,
    seconds as time, and a zero-byte allocation at (nil) with its free."""
    body = ("\ufeff" + HEADER + "\r\n"
            "1,10.5,allocate,7f00,100,5\r\n"
            "\r\n"
            "1,10.75,allocate,(nil),0,5\r\n"
            "1,10.80,free,(nil),0,5\r\n"
            "1,11,deallocate,0x7f00,100,0x5\r\n")
    t = read_rmm_csv(write(tmp_path, body))
    np.testing.assert_array_equal(t.action, [ALLOC, FREE])
    np.testing.assert_array_equal(t.ptr, [0x7F00, 0x7F00])
    np.testing.assert_array_equal(t.stream, [5, 5])
    np.testing.assert_allclose(t.time, [10.5, 11.0])
    assert t.meta["zero_size_allocs"] == 1 and t.meta["time_format"] == "seconds"


def test_rmm_free_size_zero_takes_alloc_size(tmp_path):
    t = read_rmm_csv(write(tmp_path, f"{HEADER}\n1,1,allocate,0x10,64,0\n1,2,free,0x10,0,0\n"))
    np.testing.assert_array_equal(t.size, [64, 64])


def test_rmm_log_from_mid_run(tmp_path):
    path = write(tmp_path, f"{HEADER}\n1,1,free,0x10,64,0\n1,2,allocate,0x20,8,0\n")
    with pytest.raises(TraceError, match="line 2: free of pointer 0x10 that is not live"):
        read_rmm_csv(path)
    t = read_rmm_csv(path, drop_unknown_frees=True)
    assert t.action.tolist() == [ALLOC]
    assert t.meta["dropped_frees"] == 1 and t.meta["dropped_free_bytes"] == 64


OK_ROW = "1,00:00:01.000000,allocate,0x10,64,0"


@pytest.mark.parametrize("rows, line, problem", [
    (["1,00:00:01.000000,allocate,0x10,64"], 2, "5 columns, expected 6"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0x20,64,0,extra"], 3, "7 columns, expected 6"),
    (["1,00:00:01.000000,allocat,0x10,64,0"], 2, "unknown action 'allocat'"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0x20,12.5,0"], 3, "size '12.5' is not a decimal integer"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0x20,,0"], 3, "size '' is not a decimal integer"),
    (["1,00:00:01.000000,allocate,0x20,99999999999999999999,0"], 2, "size 99999999999999999999 does not fit in 64 bits"),
    (["1,00:00:01.000000,allocate,0xffffffffffffffff,1,0"], 2, "pointer 0xffffffffffffffff does not fit in 63 bits"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0x20,-5,0"], 3, "negative size -5"),
    ([OK_ROW, "1,00:00:01.000000,free,0x30,64,0"], 3, "free of pointer 0x30 that is not live"),
    ([OK_ROW, OK_ROW], 3, r"pointer 0x10 allocated again while still live \(allocated at line 2 "),
    ([OK_ROW, "1,00:00:01.000000,free,0x10,32,0"], 3,
     "free of pointer 0x10 with size 32, but it was allocated with size 64 at line 2"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0xzz,64,0"], 3, "pointer '0xzz' is not a hexadecimal address"),
    ([OK_ROW, "1,00:00:01.000000,allocate,-0x20,64,0"], 3, "pointer '-0x20' is not a hexadecimal"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0x20,64,stream7"], 3, "stream 'stream7' is neither"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0x20,64,7f"], 3, "stream '7f' is neither"),
    ([OK_ROW, "1,00:00:01.000000,allocate,0x20,64,0xffffffffffffffff"], 3,
     "stream 0xffffffffffffffff does not fit in 63 bits"),
    ([OK_ROW, "1,25:61:xx.000000,allocate,0x20,64,0"], 3, "time '25:61:xx.000000' is not HH:MM:SS"),
    (["1,1.5,allocate,0x10,64,0", "1,later,allocate,0x20,64,0"], 3, "time 'later' is not a number"),
    (["1,inf,allocate,0x10,64,0"], 2, "time 'inf' is not finite"),
    (["t1,1.5,allocate,0x10,64,0"], 2, "thread id 't1' is not a decimal integer"),
])
def test_rmm_malformed_rows_name_line_and_problem(tmp_path, rows, line, problem):
    path = write(tmp_path, "\n".join([HEADER, *rows]) + "\n")
    with pytest.raises(TraceError, match=f"log.csv: line {line}: {problem}"):
        read_rmm_csv(path)


def test_rmm_line_numbers_count_blank_lines(tmp_path):
    path = write(tmp_path, f"{HEADER}\n\n{OK_ROW}\n\n1,1,bogus,0x10,1,0\n")
    with pytest.raises(TraceError, match="line 5: unknown action 'bogus'"):
        read_rmm_csv(path)


@pytest.mark.parametrize("body, problem", [
    ("", "empty file"),
    ("\n\n", "empty file"),
    ("Time,Action,Pointer,Size\n", "line 1: expected the header"),
    ("Unnamed: 0,Thread,Time,Action,Pointer,Size,Stream\n", "line 1: expected the header"),
])
def test_rmm_bad_header(tmp_path, body, problem):
    with pytest.raises(TraceError, match=problem):
        read_rmm_csv(write(tmp_path, body))


def test_rmm_header_only_is_an_empty_trace(tmp_path):
    t = read_rmm_csv(write(tmp_path, HEADER + "\n"))
    assert len(t) == 0


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "log.csv"
    path.write_bytes(f"{HEADER}\n{OK_ROW}\n1,1,allocate,0x\xff\xfe,1,0\n".encode("latin-1"))
    with pytest.raises(TraceError, match="line 3: not UTF-8"):
        read_rmm_csv(path)


def test_corrupt_gzip(tmp_path):
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(f"{HEADER}\n{OK_ROW}\n".encode())[:-10])
    with pytest.raises(TraceError, match="t.csv.gz: corrupt or truncated gzip"):
        read_trace(path)


def test_unrecognised_and_missing_files(tmp_path):
    with pytest.raises(TraceError, match="unrecognised trace format"):
        read_trace(write(tmp_path, "hello,world\n1,2\n", "x.txt"))
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "absent.csv")
    with pytest.raises(TraceError, match="a CSV trace has no devices"):
        read_trace(DATA / "rmm_sample.csv", device=0)


# --- PyTorch snapshot pickles ----------------------------------------------------------

BASE, BIG = 0x7F3A00200000, 0x7F3A02000000


def test_snapshot_sample():
    t = read_snapshot_pickle(DATA / "snapshot_sample.pickle", earlier="drop")
    assert t.meta["device"] == 0  # the device with the most events
    assert t.meta["devices"] == {0: 9, 1: 2}
    np.testing.assert_array_equal(
        t.action, [ALLOC, ALLOC, ALLOC, FREE, ALLOC, ALLOC, ALLOC_FAILURE, FREE])
    np.testing.assert_array_equal(
        t.ptr, [BASE, BASE + 0x1000, BASE + 0x3000, BASE, BASE, BIG, 0, BASE + 0x1000])
    np.testing.assert_array_equal(
        t.size, [4096, 8192, 1024, 4096, 2048, 10 << 20, 1 << 34, 8192])
    # The free of BASE counts when it completes (after the 1024 B alloc), not when
    # requested: live bytes peak at 13312 there before the free.
    np.testing.assert_array_equal(t.live_bytes()[:5], [4096, 12288, 13312, 9216, 11264])
    assert t.peak_live_bytes() == 8192 + 1024 + 2048 + (10 << 20)
    # The history began mid-run: the free of a block allocated before it is dropped.
    assert t.meta["dropped_frees"] == 1 and t.meta["dropped_free_bytes"] == 512
    assert t.stream[1] == 94_000_000_000_000
    assert t.time[0] == 0 and np.all(np.diff(t.time) > 0)
    t.validate()


def test_snapshot_blocks_made_before_the_history_are_placed_at_its_start():
    t = read_snapshot_pickle(DATA / "snapshot_sample.pickle")
    # The 512 B block whose free opens the history was made before it: allocated first.
    np.testing.assert_array_equal(
        t.action, [ALLOC, FREE, ALLOC, ALLOC, ALLOC, FREE, ALLOC, ALLOC, ALLOC_FAILURE, FREE])
    assert (t.ptr[0], t.size[0], t.time[0]) == (BASE - 0x200000, 512, 0)
    assert t.meta["earlier_blocks"] == 1 and t.meta["earlier_bytes"] == 512
    assert t.meta["dropped_frees"] == 0
    t.validate()


def _run_and_record(ops, keep):
    """Runs `ops` (("a", addr, size) / ("f", addr)) and returns a snapshot whose history is
    the last `keep` actions, with the blocks alive at the end in its segments, and the live
    bytes after each action of the run."""
    live, history, lives = {}, [], []
    for k, op in enumerate(ops):
        if op[0] == "a":
            live[op[1]] = op[2]
            history.append({"action": "alloc", "addr": op[1], "size": op[2], "stream": 0,
                            "time_us": k})
        else:
            history.append({"action": "free_requested", "addr": op[1], "size": live[op[1]],
                            "stream": 0, "time_us": k})
            history.append({"action": "free_completed", "addr": op[1], "size": live.pop(op[1]),
                            "stream": 0, "time_us": k})
        lives.append(sum(live.values()))
    blocks = [{"address": a, "size": -(-n // 512) * 512, "requested_size": n,
               "state": "active_allocated"} for a, n in sorted(live.items())]
    segment = {"device": 0, "address": 0, "total_size": 1 << 40, "stream": 0, "blocks": blocks}
    return {"segments": [segment], "device_traces": [history[len(history) - keep:]]}, lives


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_history_that_begins_mid_run_holds_the_live_bytes_of_the_run(data):
    """Placing the blocks made before the history gives, after every kept event, the live
    bytes the run had then: its figures start from what the program held, not from zero."""
    ops, live = [], set()
    for _ in range(data.draw(st.integers(1, 40))):
        if live and data.draw(st.booleans()):
            a = data.draw(st.sampled_from(sorted(live)))
            ops.append(("f", a))
            live.discard(a)
        else:
            a = data.draw(st.integers(1, 24).map(lambda x: x << 20).filter(lambda x: x not in live))
            ops.append(("a", a, data.draw(st.integers(1, 5000))))
            live.add(a)
    actions = sum(1 if op[0] == "a" else 2 for op in ops)  # a free is requested, then completed
    snap, lives = _run_and_record(ops, data.draw(st.integers(0, actions)))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "snap.pickle"
        path.write_bytes(pickle.dumps(snap))
        t = read_snapshot_pickle(path)
    t.validate()
    kept = [int(e["time_us"]) for e in snap["device_traces"][0] if e["action"] != "free_requested"]
    earlier = t.meta["earlier_blocks"]
    assert len(t) == earlier + len(kept)
    # The blocks placed first hold what the run held before the first kept event.
    first = kept[0] if kept else len(ops)
    before = lives[first - 1] if first > 0 else 0
    got = t.live_bytes()
    assert t.meta["earlier_bytes"] == before and (not earlier or got[earlier - 1] == before)
    np.testing.assert_array_equal(got[earlier:], [lives[k] for k in kept])


@pytest.mark.parametrize("device", [1, "cuda:1", "1"])
def test_snapshot_device_choice(device):
    t = read_trace(DATA / "snapshot_sample.pickle", device=device)
    assert t.meta["device"] == 1
    np.testing.assert_array_equal(t.action, [ALLOC, FREE])
    np.testing.assert_array_equal(t.ptr, [0x7F3B00000000] * 2)


def test_snapshot_absent_device_lists_devices():
    with pytest.raises(TraceError, match=r"no device 'cuda:3'.*0 \(9 events\), 1 \(2 events\)"):
        read_snapshot_pickle(DATA / "snapshot_sample.pickle", device="cuda:3")
    with pytest.raises(TraceError, match="device must be an index or 'cuda:N'"):
        read_snapshot_pickle(DATA / "snapshot_sample.pickle", device="cpu")


def test_snapshot_gzipped_and_protocol_5(tmp_path):
    snap = pickle.loads((DATA / "snapshot_sample.pickle").read_bytes())
    path = tmp_path / "snap.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps(snap, protocol=5)))
    t = read_trace(path)
    assert t.meta["format"] == "torch-snapshot" and len(t) == 10


def snapshot_file(tmp_path, events, extra_devices=()) -> Path:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events, *extra_devices]}))
    return path


def alloc(addr, size, **kw):
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": 0, **kw}


@pytest.mark.parametrize("events, problem", [
    ([alloc(16, 8), {"action": "alloc_typo", "addr": 16, "size": 8}], "event 1: unknown action 'alloc_typo'"),
    ([{"action": "alloc", "size": 8}], "event 0: 'alloc' entry has no 'addr'"),
    ([alloc(16, "8")], "event 0: 'size' is '8', expected an integer"),
    ([alloc(16, 8.0)], "event 0: 'size' is 8.0, expected an integer"),
    ([alloc(16, -8)], "event 0: negative size -8"),
    ([alloc(16, 8), alloc(32, 8), alloc(16, 8)], r"event 2: pointer 0x10 allocated again while still live \(allocated at event 0 "),
    ([alloc(16, 8), {"action": "free_completed", "addr": 16, "size": 4}], "event 1: free of pointer 0x10 with size 4"),
    ([alloc(16, 8, time_us="now")], "event 0: 'time_us' is 'now'"),
    (["alloc"], "event 0: expected a dict, got str"),
    ([{"action": ["alloc"], "addr": 16, "size": 8}], "event 0: 'action' must be a string"),
])
def test_snapshot_malformed_events_name_index_and_problem(tmp_path, events, problem):
    with pytest.raises(TraceError, match=f"snap.pickle: device 0, event {problem}".replace(
            "event event", "event")):
        read_snapshot_pickle(snapshot_file(tmp_path, events))


def test_snapshot_oom_and_ignored_actions(tmp_path):
    events = [
        {"action": "segment_alloc", "addr": 4096, "size": 2 << 20, "stream": 0, "time_us": 1},
        alloc(4096, 100, time_us=2),
        {"action": "oom", "size": 1 << 40, "device_free": 5, "stream": 0, "time_us": 3},
        {"action": "annotate", "addr": 4096, "size": 0, "user_metadata": "x", "time_us": 4},
        {"action": "free_requested", "addr": 4096, "size": 100, "stream": 0, "time_us": 5},
        {"action": "segment_unmap", "addr": 4096, "size": 2 << 20, "stream": 0, "time_us": 6},
    ]
    t = read_snapshot_pickle(snapshot_file(tmp_path, events))
    np.testing.assert_array_equal(t.action, [ALLOC, ALLOC_FAILURE])
    np.testing.assert_array_equal(t.size, [100, 1 << 40])
    np.testing.assert_allclose(t.time, [0, 1e-6])
    t.validate()  # the block stays live: its free was only requested


@pytest.mark.parametrize("payload, problem", [
    (pickle.dumps([1, 2]), "not a PyTorch memory snapshot"),
    (pickle.dumps({"segments": []}), "no 'device_traces'"),
    (pickle.dumps({"device_traces": {}}), "must be a list"),
    (pickle.dumps({"device_traces": []}), "allocation history was not recorded"),
    (pickle.dumps(Fraction(1, 2)), "asks for fractions.Fraction"),
    (pickle.dumps({"device_traces": [[]]})[:-5], "cannot unpickle"),
])
def test_snapshot_bad_files(tmp_path, payload, problem):
    path = tmp_path / "snap.pickle"
    path.write_bytes(payload)
    with pytest.raises(TraceError, match=problem):
        read_trace(path)


# --- shipped traces --------------------------------------------------------------------

def test_builtin_traces_ship_and_read():
    paths = builtin_traces()
    assert [p.name for p in paths] == ["cnn_sgd.csv.gz", "mlp_adam.csv.gz", "transformer_varlen.csv.gz"]
    for path in paths:
        assert path.stat().st_size < 200_000
        assert (DATA / path.name).exists()
        t = read_trace(path).validate()
        assert len(t) > 100 and t.peak_live_bytes() > 0
        assert t.meta["format"] == "rmm-csv"


# --- fuzzing: bad input raises TraceError, never another exception --------------------

FIELD_TEXT = st.one_of(
    st.sampled_from(["", "0", "-1", "0x", "0x10", "(nil)", "allocate", "free", "1.5", "nan",
                     "12:00:00.000000", "99:99:99.999999", "1e400", "1_0", " 7", "\x00", "é"]),
    st.text(alphabet="0123456789abcdefx:.-+ ,()", max_size=12))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(FIELD_TEXT, min_size=0, max_size=8), max_size=6))
def test_fuzzed_csv_rows_raise_only_trace_errors(rows):
    body = "\n".join([HEADER, OK_ROW, *(",".join(r) for r in rows)]) + "\n"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.csv"
        path.write_text(body, encoding="utf-8")
        try:
            read_trace(path).validate()
        except TraceError as e:
            assert "fuzz.csv" in str(e)


SNAP_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**70), st.floats(allow_nan=True),
                       st.text(max_size=4), st.lists(st.integers(), max_size=2))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.fixed_dictionaries({"action": st.sampled_from(["alloc", "free_completed", "free_requested",
                                                      "oom", "segment_alloc", "bogus"]),
                           "addr": SNAP_VALUE, "size": SNAP_VALUE},
                          optional={"stream": SNAP_VALUE, "time_us": SNAP_VALUE}),
    SNAP_VALUE), max_size=8))
def test_fuzzed_snapshot_events_raise_only_trace_errors(events):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.pickle"
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
        try:
            read_trace(path).validate()
        except TraceError as e:
            assert "fuzz.pickle" in str(e)


def test_head_is_the_run_stopped_early():
    from pymemplan.traces import Trace
    from pymemplan.traces.trace import TraceError

    trace = Trace.from_events([(0, 1, 512, 0, 0.0), (0, 2, 1024, 7, 0.5), (1, 1, 512, 0, 1.0)],
                              name="t", meta={"source": "x"})
    head = trace.head(2)
    assert len(head) == 2 and head.live_bytes().tolist() == [512, 1536]  # block 2 still alive
    assert head.stream.tolist() == [0, 7] and head.meta == {"source": "x"} and "first 2" in head.name
    assert len(trace.head(0)) == 0 and len(trace.head(3)) == 3
    with pytest.raises(TraceError, match=r"head\(4\) of a trace of 3 events \(expected 0 to 3\)"):
        trace.head(4)
