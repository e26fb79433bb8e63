"""`pymemplan trace --budget`: the checkpoint plan from the command line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from pymemplan.cli import main  # noqa: E402

FACTORY = (
    "import torch\n"
    "def build(batch=256):\n"
    "    layers = [m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]\n"
    "    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 1))\n"
    "    return model, (torch.randn(batch, 256),), lambda out: out.pow(2).mean()\n")


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    f = tmp_path_factory.mktemp("cli") / "deep.py"
    f.write_text(FACTORY)
    return f"{f}:build"


def trace_json(capsys, argv):
    rc = main(["trace", *argv, "--device", "cpu", "--no-probe", "--optimizer", "none", "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_budget_plan_in_json(factory, capsys):
    rc, d, _ = trace_json(capsys, [factory])
    assert rc == 0 and "checkpoint_plan" not in d
    budget = int(d["peak_bytes"] * 0.8)
    rc, d, _ = trace_json(capsys, [factory, "--budget", str(budget)])
    assert rc == 0
    plan = d["checkpoint_plan"]
    assert plan["budget_bytes"] == budget
    assert plan["predicted_peak_bytes"] <= budget < plan["unplanned_peak_bytes"]
    assert plan["recomputed"] and plan["solver"] in ("chain-dp", "milp", "greedy")
    assert plan["cost_model"] == "flops+bytes"  # planned with the model: FLOPs counted


def test_budget_plan_summary_in_tables(factory, capsys):
    rc = main(["trace", factory, "--device", "cpu", "--no-probe", "--optimizer", "none",
               "--budget", "8MiB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "checkpoint plan for a budget of 8.00 MiB" in out
    assert "predicted peak" in out and "checkpointed" in out


def test_budget_too_small_says_what_is_achievable(factory, capsys):
    rc, d, err = trace_json(capsys, [factory, "--budget", "1KiB"])
    assert rc == 1
    assert d["checkpoint_plan"]["least_peak_bytes"] > 1024
    assert "least achievable peak" in d["checkpoint_plan"]["error"]
    assert "least achievable peak" in err


def test_budget_not_a_size(factory, capsys):
    assert main(["trace", factory, "--device", "cpu", "--budget", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err
