"""The torch.compile backend: the partition follows the plan, gradients do not change."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import pymemplan  # noqa: E402
from pymemplan.planner.errors import PlannerError  # noqa: E402
from test_checkpoint import Stack  # noqa: E402


def run(model, x, backend):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_compiled_partition_follows_the_plan():
    torch.manual_seed(0)
    model = Stack(widths=[256, 512, 384])
    x = torch.randn(512, 128)
    t = pymemplan.trace(model, (x,), device="cpu")
    plan = t.plan(int(t.peak_bytes * 0.8), model=model, inputs=(x,))
    assert plan.modules

    planned = pymemplan.compile_backend(plan=plan)
    unplanned = pymemplan.compile_backend(plan=t.plan(t.peak_bytes))  # fits: no checkpoint
    assert not unplanned.plan.modules

    ref = copy.deepcopy(model)
    l1, g1 = run(model, x, planned)
    l0, g0 = run(ref, x, unplanned)
    eager = copy.deepcopy(ref)
    for p in eager.parameters():
        p.grad = None
    le = eager(x)
    le.backward()
    assert torch.equal(l1, l0) and torch.allclose(l1, le.detach())
    for a, b, e in zip(g1, g0, eager.parameters()):
        assert torch.equal(a, b)
        assert torch.allclose(a, e.grad, rtol=1e-5, atol=1e-7)
    # The planned modules' forward ops were tagged, and the forward graph saves less.
    assert planned.tagged > 0 and unplanned.tagged == 0
    assert 0 < planned.saved_bytes < unplanned.saved_bytes


def test_backend_needs_something_to_follow():
    with pytest.raises(PlannerError, match="needs a plan"):
        pymemplan.compile_backend(budget="1GiB")
