"""The torch.compile backend: the partition follows the plan, gradients do not change."""

from __future__ import annotations

import copy
import shutil

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pymemplan  # noqa: E402
from pymemplan.planner.checkpoint.milp import least_peak  # noqa: E402
from pymemplan.planner.errors import PlannerError  # noqa: E402
from pymemplan.planner.measure import measure_step  # noqa: E402
from test_checkpoint import Stack  # noqa: E402


def run(model, x, backend):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def eager_reference(model, x):
    eager = copy.deepcopy(model)
    for p in eager.parameters():
        p.grad = None
    loss = eager(x)
    loss.backward()
    return loss.detach(), [p.grad for p in eager.parameters()]


def test_compiled_partition_follows_the_plan():
    torch.manual_seed(0)
    model = Stack(widths=[256, 512, 384])
    x = torch.randn(512, 128)
    t = pymemplan.trace(model, (x,), device="cpu")
    plan = t.plan(int(t.peak_bytes * 0.8), model=model, inputs=(x,))
    assert plan.modules

    planned = pymemplan.compile_backend(plan=plan, compiler="aot_eager", adapt=False)
    unplanned = pymemplan.compile_backend(plan=t.plan(t.peak_bytes), compiler="aot_eager",
                                          adapt=False)
    assert not unplanned.plan.modules

    ref = copy.deepcopy(model)
    l1, g1 = run(model, x, planned)
    l0, g0 = run(ref, x, unplanned)
    le, ge = eager_reference(ref, x)
    assert torch.equal(l1, l0) and torch.allclose(l1, le)
    for a, b, e in zip(g1, g0, ge):
        assert torch.equal(a, b)
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-7)
    # The planned modules' forward ops were tagged, and the forward graph saves less.
    assert planned.tagged > 0 and unplanned.tagged == 0
    assert 0 < planned.saved_bytes < unplanned.saved_bytes
    assert planned.chosen is plan  # adapt=False: the plan as it is


class Deep(nn.Module):
    """An nn.Sequential MLP inside a module: the plan checkpoints runs of its children."""

    def __init__(self, layers=8, d=256):
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.GELU())])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.body(x)).pow(2).mean()


def test_sequential_segments_are_placed_in_the_compiled_graph():
    torch.manual_seed(0)
    model = Deep()
    x = torch.randn(512, 256)
    t = pymemplan.trace(model, (x,), device="cpu")
    p = t.checkpoint_problem(model, (x,), modules=["body?*:*"])
    lo, _ = least_peak(p)
    plan = t.plan(int(lo + 0.3 * (t.peak_bytes - lo)), model=model, inputs=(x,),
                  modules=["body?*:*"])
    assert plan.modules and all(m.startswith("body[") for m in plan.modules)
    be = pymemplan.compile_backend(plan=plan, compiler="aot_eager", adapt=False)
    none = pymemplan.compile_backend(plan=t.plan(t.peak_bytes), compiler="aot_eager",
                                     adapt=False)
    ref = copy.deepcopy(model)
    l1, g1 = run(model, x, be)
    l0, g0 = run(ref, x, none)
    assert be.tagged > 0 and torch.equal(l1, l0)
    assert all(torch.equal(a, b) for a, b in zip(g1, g0))
    assert be.saved_bytes < none.saved_bytes


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_inductor_backend_fits_the_budget_and_matches_eager():
    """Inductor (the default compiler): losses and gradients match eager; the backend
    re-chooses the plan for the compiled graph, and the measured compiled peak stays
    within the budget at no more recompute than the eager plan."""
    torch.manual_seed(0)
    model = Stack(widths=[256, 512, 384])
    x = torch.randn(512, 128)
    t = pymemplan.trace(model, (x,), device="cpu")
    p = t.checkpoint_problem(model, (x,))
    lo, _ = least_peak(p)
    budget = int(lo + 0.4 * (t.peak_bytes - lo))
    plan = t.plan(budget, model=model, inputs=(x,))
    be = pymemplan.compile_backend(plan=plan)
    assert be.compiler == "inductor" and be.adapt
    le, ge = eager_reference(model, x)
    lc, gc = run(model, x, be)  # compiles
    assert torch.allclose(lc, le, rtol=1e-4, atol=1e-6)
    for a, e in zip(gc, ge):
        assert torch.allclose(a, e, rtol=1e-4, atol=1e-5)
    assert be.chosen is not None and be.trials and be.tagged > 0
    assert be.chosen.recompute_seconds <= plan.recompute_seconds + 1e-12
    assert be.predicted_peak_bytes <= budget
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=be)  # the same backend: no recompilation
    peak = measure_step(compiled, (x,)).peak_bytes
    assert peak <= budget * 1.02
    # rechoose(): the same decision for the same plan, without compiling again.
    chosen, predicted = be.rechoose(plan)
    assert chosen.policies == be.chosen.policies and predicted == be.predicted_peak_bytes


def test_measured_unplanned_peak_calibrates_the_predictions():
    torch.manual_seed(0)
    model = Stack(widths=[256, 512, 384])
    x = torch.randn(512, 128)
    t = pymemplan.trace(model, (x,), device="cpu")
    plan = t.plan(int(t.peak_bytes * 0.9), model=model, inputs=(x,))
    measured = t.peak_bytes + (1 << 20)  # say the compiled step needs 1 MiB more
    be = pymemplan.compile_backend(plan=plan, compiler="aot_eager",
                                   unplanned_peak_bytes=measured)
    run(model, x, be)
    assert be.trials[0][2] == measured  # the unplanned prediction is the measurement
    assert be.calibration_bytes != 0 and be.predicted_peak_bytes <= plan.budget_bytes
    assert be.chosen.modules


def test_backend_needs_something_to_follow():
    with pytest.raises(PlannerError, match="needs a plan"):
        pymemplan.compile_backend(budget="1GiB")
    with pytest.raises(PlannerError, match="compiler="):
        pymemplan.compile_backend(plan=object(), compiler="tvm")
