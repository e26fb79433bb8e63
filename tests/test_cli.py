"""The `pymemplan replay` command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pymemplan.cli import main
from pymemplan.traces import Trace, builtin_traces, read_trace, write_csv
from pymemplan.traces.replay import replay

DATA = Path(__file__).parent / "data"
KEYS = {"trace", "policy", "events", "peak_live_bytes", "peak_allocated_bytes",
        "peak_reserved_bytes", "reserved_over_live", "device_allocs", "device_frees", "ooms",
        "ns_per_event", "steady_from_event", "steady_peak_live_bytes",
        "steady_peak_reserved_bytes", "steady_reserved_over_live", "steady_device_calls"}


def run_json(capsys, *argv):
    assert main(["replay", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_builtin_traces_with_every_default_policy(capsys):
    rows = run_json(capsys)
    assert len(rows) == 4 * len(builtin_traces())
    for r in rows:
        assert set(r) == KEYS
        assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"] >= r["peak_live_bytes"] > 0
        assert r["ooms"] == 0
    nocache = [r for r in rows if r["policy"] == "nocache"]
    assert all(r["device_allocs"] > 10 for r in nocache)


def test_replay_named_trace_policies_and_capacity(capsys, tmp_path):
    path = DATA / "mlp_adam.csv.gz"
    rows = run_json(capsys, str(path), "--policy", "torch", "--policy",
                    "torch=max_split_size_mb:64", "--capacity", "1GiB")
    assert [r["policy"] for r in rows] == ["torch", "torch=max_split_size_mb:64"]
    tr = read_trace(path)
    assert rows[0]["events"] == len(tr)
    assert rows[0]["peak_live_bytes"] == tr.peak_live_bytes()


def test_replay_counts_ooms_at_a_small_capacity(capsys):
    # 1 MiB device cannot hold a 2 MiB segment: every allocation fails, cleanly.
    rows = run_json(capsys, str(DATA / "mlp_adam.csv.gz"), "--policy", "torch",
                    "--capacity", "1MiB")
    assert rows[0]["ooms"] > 0 and rows[0]["peak_reserved_bytes"] == 0


def test_replay_table_shows_no_ratio_where_requests_were_refused(capsys):
    # At 1 MiB every request is refused: reserved/live read 0.000, as if nothing was wasted.
    argv = ["replay", str(DATA / "mlp_adam.csv.gz"), "--policy", "torch", "--policy"]
    assert main([*argv, "pymemplan", "--capacity", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "0.000" not in out and "OOM │" in out and "larger --capacity" in out
    assert main([*argv, "pymemplan"]) == 0
    out = capsys.readouterr().out
    assert "OOM │" not in out and "larger --capacity" not in out


def test_replay_table_output(capsys):
    assert main(["replay", str(DATA / "cnn_sgd.csv.gz"), "--policy", "pymemplan"]) == 0
    out = capsys.readouterr().out
    assert "cnn_sgd" in out and "pymemplan" in out and "reserved/live" in out


@pytest.mark.parametrize("argv,message", [
    (["--policy", "jemalloc"], "unknown allocator policy 'jemalloc'"),
    (["--policy", "torch=max_split_size_mb:abc"], "bad value 'abc'"),
    (["--capacity", "lots"], "not a size"),
    (["--capacity", "1e400"], "a size too large"),    # an OverflowError's traceback before
    (["--granularity", "1e30"], "a size too large"),  # a pybind11 TypeError's before
    (["no/such/file.csv"], "no/such/file.csv"),
])
def test_replay_bad_arguments_say_what_is_wrong(capsys, argv, message):
    assert main(["replay", *argv]) == 2
    assert message in capsys.readouterr().err


def test_replay_python_api_on_a_handmade_trace(tmp_path):
    MiB = 1 << 20
    # Free 10 MiB, then ask for 12 MiB: torch keeps the 10 MiB cached (peak 22 MiB), ours
    # gives it back first (peak 12 MiB).
    tr = Trace.from_events([(0, 1, 10 * MiB, 0, 0.0), (1, 1, 0, 0, 0.0), (0, 2, 12 * MiB, 0, 0.0)],
                           name="hand")
    write_csv(tr, tmp_path / "hand.csv")
    res = {r.policy: r for r in replay(read_trace(tmp_path / "hand.csv"), ["pymemplan", "torch"])}
    assert res["pymemplan"].peak_reserved_bytes == 12 * MiB
    assert res["torch"].peak_reserved_bytes == 22 * MiB
    assert res["pymemplan"].peak_live_bytes == 12 * MiB


def test_replay_counts_driver_calls_from_the_steady_state_on():
    from pymemplan import _core

    MiB = 1 << 20
    # Free 10 MiB, then ask for 12, then 30 (events 0-3). From event 2 on, torch makes two
    # segments (12, 30 MiB; the 10 MiB one stays cached); ours gives the cached 10 MiB back
    # before each new peak: two segments and one free.
    tr = Trace.from_events([(0, 1, 10 * MiB, 0, 0.0), (1, 1, 0, 0, 0.0), (0, 2, 12 * MiB, 0, 0.0),
                            (0, 3, 30 * MiB, 0, 0.0)], name="grow")
    for policy, allocs, frees in (("torch", 2, 0), ("pymemplan", 2, 1)):
        r = _core.replay(tr.action, tr.ptr, tr.size, tr.stream, policy, "", 1 << 30, 2 * MiB, 2)
        assert (r["steady_device_allocs"], r["steady_device_frees"]) == (allocs, frees), policy
        whole = _core.replay(tr.action, tr.ptr, tr.size, tr.stream, policy, "", 1 << 30, 2 * MiB, 0)
        assert whole["steady_device_allocs"] == whole["device_allocs"] == allocs + 1
    # Without a steady state, nothing is counted.
    assert _core.replay(tr.action, tr.ptr, tr.size, tr.stream)["steady_device_allocs"] == -1
    # replay() counts from the first request a plan served, the same events for every policy.
    rec = read_trace(DATA / "gpt2_6l_s512.csv.gz")
    for r in replay(rec, ["pymemplan-planned", "torch"]):
        s = _core.replay(rec.action, rec.ptr, rec.size, rec.stream, r.policy, "", 80 << 30,
                         2 * MiB, r.steady_from_event)
        assert r.steady_from_event > 0
        assert r.steady_device_calls == s["steady_device_allocs"] + s["steady_device_frees"]
        assert r.steady_device_calls <= r.device_allocs + r.device_frees


def test_replay_on_a_lagging_device_counts_the_unmaps_that_wait():
    import numpy as np
    from pymemplan import _core

    MiB = 1 << 20
    # Free 8 pages, then ask for 9 that fit only above them: at its peak, vmm moves the 8
    # freed pages. On a device `lag` events behind, the work queued before the free is done
    # only `lag` events after it: earlier, unmapping waits (and the host with it) for the
    # event recorded after the free, not for the stream's whole queue.
    def trace(gap):
        ev = [(0, 1, 16 * MiB), (0, 2, 4 * MiB), (1, 1, 0)] + [(2, 9, 1)] * gap + [(0, 3, 18 * MiB)]
        cols = list(zip(*ev))
        return (np.array(cols[0], np.uint8), np.array(cols[1], np.int64),
                np.array(cols[2], np.int64), np.zeros(len(ev), np.int64))
    for gap, lag, waits, waited in ((0, 0, 0, 0), (0, 8, 1, 7), (8, 8, 0, 0), (4, 8, 1, 3)):
        r = _core.replay(*trace(gap), "pymemplan-vmm", "", 1 << 30, 2 * MiB, -1, lag)
        assert (r["unmap_waits"], r["ticks_waited"]) == (waits, waited), (gap, lag)
        assert r["peak_reserved_bytes"] == 22 * MiB  # the pages moved either way


def test_console_script_and_module_entry_points():
    r = subprocess.run([sys.executable, "-m", "pymemplan", "replay", "--json",
                        str(DATA / "cnn_sgd.csv.gz"), "--policy", "nocache"],
                       capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)[0]["policy"] == "nocache"
    script = shutil.which("pymemplan")
    assert script is not None, "the install did not put a `pymemplan` console script on PATH"
    r = subprocess.run([script, "replay", "--json", str(DATA / "cnn_sgd.csv.gz"), "--policy",
                        "torch"], capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)[0]["policy"] == "torch"


def test_replay_offline_row_says_what_knowing_the_trace_would_hold(capsys):
    rows = run_json(capsys, str(DATA / "gpt2_6l_s512.csv.gz"), "--policy", "torch",
                    "--policy", "pymemplan-vmm", "--offline")
    torch_row, vmm, offline = rows
    assert offline["policy"] == "offline (knows the trace)"
    assert set(offline) == KEYS | {"arena_bytes"}
    page = 2 << 20
    live = offline["peak_live_bytes"]
    # Whole pages, never below the live bytes in pages; here below both online policies.
    assert offline["peak_reserved_bytes"] % page == 0
    assert offline["peak_reserved_bytes"] >= -(-live // page) * page
    assert offline["peak_reserved_bytes"] < vmm["peak_reserved_bytes"] < torch_row["peak_reserved_bytes"]
    assert offline["arena_bytes"] >= live and offline["device_allocs"] is None
    assert main(["replay", str(DATA / "cnn_sgd.csv.gz"), "--policy", "torch", "--offline"]) == 0
    out = capsys.readouterr().out
    assert "offline (knows the trace)" in out and "–" in out


def test_replay_restarted_row_replays_with_the_first_replays_plans(capsys):
    """gpt2_6l_s512 (tests/data): restarted with what its first replay exported, pymemplan-
    planned holds less at its peak. Its 4,505 requests are fewer than a prologue takes, so the
    prologue lays out the whole run and no plan needs to arm; with `prologue:0`, the plans
    alone serve from event 3,106 instead of 5,906."""
    trace = str(DATA / "gpt2_6l_s512.csv.gz")
    first, restarted = run_json(capsys, trace, "--policy", "pymemplan-planned", "--restarted")
    assert first["policy"] == "pymemplan-planned"
    assert restarted["policy"] == "pymemplan-planned, restarted"
    assert set(restarted) == KEYS
    assert restarted["peak_live_bytes"] == first["peak_live_bytes"]
    assert restarted["peak_reserved_bytes"] < first["peak_reserved_bytes"]
    assert restarted["steady_from_event"] is None
    first, plans_only = run_json(capsys, trace, "--policy", "pymemplan-planned=prologue:0", "--restarted")
    assert restarted["peak_reserved_bytes"] < plans_only["peak_reserved_bytes"] < first["peak_reserved_bytes"]
    assert plans_only["steady_from_event"] < first["steady_from_event"]


def test_replay_restarted_row_keeps_the_policys_config(capsys):
    """The restarted row replays the pymemplan-planned policy given, with its config (it
    replayed the default config whatever was given)."""
    trace = str(DATA / "gpt2_6l_s512.csv.gz")
    spec = "pymemplan-planned=vmm:False"
    first, restarted = run_json(capsys, trace, "--policy", spec, "--restarted")
    assert restarted["policy"] == f"{spec}, restarted"
    [default_restarted] = run_json(capsys, trace, "--policy", "pymemplan-planned",
                                   "--restarted")[1:]
    assert restarted["peak_reserved_bytes"] != default_restarted["peak_reserved_bytes"]


def test_replay_saves_plans_and_starts_from_a_plans_file(capsys, tmp_path):
    """--save-plans writes what the replay ended with; --plans starts from a file: together,
    the --restarted row, so plans made offline from a recorded run can start a job."""
    trace = str(DATA / "gpt2_6l_s512.csv.gz")
    plans = tmp_path / "plans.txt"
    first, restarted = run_json(capsys, trace, "--policy", "pymemplan-planned", "--restarted",
                                "--save-plans", str(plans))
    assert plans.read_text().startswith("pymemplan-plans 4")
    [loaded] = run_json(capsys, trace, "--policy", "pymemplan-planned", "--plans", str(plans))
    assert loaded["policy"] == "pymemplan-planned"
    assert loaded["peak_reserved_bytes"] < first["peak_reserved_bytes"]  # laid out in advance
    for key in ("peak_reserved_bytes", "steady_from_event", "steady_peak_reserved_bytes"):
        assert loaded[key] == restarted[key], key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.txt"]


@pytest.mark.parametrize("argv, message", [
    (["--plans", "PLANS"], "--plans is for pymemplan-planned: add --policy pymemplan-planned"),
    (["--policy", "pymemplan-planned", "--plans", "BAD"],
     "import_plans: it does not start with 'pymemplan-plans'"),
    (["--policy", "pymemplan-planned", "--plans", "MISSING"], "No such file"),
    (["--policy", "pymemplan-planned", "--plans", "BINARY"], "binary.txt: not a plans file"),
    (["--save-plans", "OUT"], "--save-plans needs a pymemplan-planned replay"),
    (["SECOND", "--policy", "pymemplan-planned", "--save-plans", "OUT"],
     "--save-plans writes the plans of one trace; 2 were given"),
])
def test_replay_plans_options_say_what_is_wrong(capsys, tmp_path, argv, message):
    (tmp_path / "bad.txt").write_text("junk")
    (tmp_path / "binary.txt").write_bytes(b"\x8d\x00\xff pymemplan")
    (tmp_path / "plans.txt").write_text("pymemplan-plans 1\npeak 0\n0\n")
    names = {"PLANS": tmp_path / "plans.txt", "BAD": tmp_path / "bad.txt",
             "BINARY": tmp_path / "binary.txt",
             "MISSING": tmp_path / "missing.txt", "OUT": tmp_path / "out.txt",
             "SECOND": DATA / "gpt2_6l_s512.csv.gz"}
    argv = [str(names.get(a, a)) for a in argv]
    assert main(["replay", str(DATA / "gpt2_6l_s512.csv.gz"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.txt").exists()
