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


def _traced_stack():
    """A three-layer MLP, its input and its CPU trace."""
    torch.manual_seed(0)
    model = Stack(widths=[256, 512, 384])
    x = torch.randn(512, 128)
    return model, x, pymemplan.trace(model, (x,), device="cpu")


def test_compiled_partition_follows_the_plan():
    model, x, t = _traced_stack()
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
    model, x, t = _traced_stack()
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
    model, x, t = _traced_stack()
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


class ConvNet(nn.Module):
    """Convolution, BatchNorm, ReLU (and dropout) blocks: in a compiled step the cheap
    way to save memory is per op (keep each convolution's output, recompute the
    normalisation and activation after it), not per module."""

    def __init__(self, c=32, n=6, p_drop=0.0):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.ModuleList([
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                          nn.ReLU(), *([nn.Dropout(p_drop)] if p_drop and k % 2 else []))
            for k in range(n)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.body:
            x = b(x)
        return self.head(x.mean((2, 3))).pow(2).mean()


def _step(model, x, backend=None):
    """One step (compiled with ``backend`` if given): loss, grads, buffers after it."""
    m = torch.compile(model, backend=backend) if backend is not None else model
    loss = m(x)
    loss.backward()
    return (loss.detach(), [p.grad.clone() for p in model.parameters()],
            [b.clone() for b in model.buffers()])


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_op_level_units_beat_module_units_on_conv_bn_relu():
    """On a conv/BatchNorm/ReLU/dropout net, the backend's op-level units meet the budget
    at less predicted recompute than the best module-level plan; losses, gradients and
    BatchNorm running statistics (updated once) equal those of the unmodified compiled
    model, and eager's up to Inductor's rounding; dropout is never recomputed; the
    chosen op-level plan can be followed again on a fresh compile."""
    import torch._inductor.config as inductor_config

    from pymemplan.planner.checkpoint.op_level import OpPlan

    torch.manual_seed(0)
    model = ConvNet(n=12, p_drop=0.1)
    x = torch.randn(8, 3, 32, 32)
    t = pymemplan.trace(model, (x,), device="cpu")
    lo, _ = least_peak(t.checkpoint_problem(model, (x,)))
    # Eager's random numbers in the compiled graphs too, so dropout masks match eager.
    with inductor_config.patch(fallback_random=True):
        torch._dynamo.reset()
        base = measure_step(torch.compile(copy.deepcopy(model)), (x,)).peak_bytes
        budget = int(lo + 0.5 * (base - lo))
        plan = t.plan(budget, model=model, inputs=(x,))

        def compiled(backend, seed=1):
            torch._dynamo.reset()
            m = copy.deepcopy(model)
            torch.manual_seed(seed)
            return m, _step(m, x, backend)

        modules_only = pymemplan.compile_backend(plan=plan, unplanned_peak_bytes=base,
                                                 op_level=False)
        ops = pymemplan.compile_backend(plan=plan, unplanned_peak_bytes=base)
        _, (lu, gu, bu) = compiled("inductor")  # the unmodified model, compiled
        _, (lm, gm, bm) = compiled(modules_only)
        m_ops, (lo_, go, bo) = compiled(ops)  # last: measured below without recompiling
        ref = copy.deepcopy(model)
        torch.manual_seed(1)
        le, ge, be = _step(ref, x)

        # The op-level plan was chosen, and it is cheaper than any module-level one.
        assert isinstance(ops.chosen, OpPlan) and ops.tagged > 0
        assert not isinstance(modules_only.chosen, OpPlan)
        assert ops.predicted_peak_bytes <= budget
        assert modules_only.predicted_peak_bytes <= budget
        assert ops.recompute_fraction < modules_only.recompute_fraction
        # Dropout draws its mask once, in the forward pass.
        nodes = dict(zip(ops.op_problem.names, ops.op_problem.nodes))
        random = [nm for nm, nd in nodes.items()
                  if isinstance(nd.target, torch._ops.OpOverload)
                  and torch.Tag.nondeterministic_seeded in nd.target.tags]
        assert random and all(ops.chosen.tags[nm] == "save" for nm in random)
        # The same numbers as the unmodified compiled model: loss, gradients, and the
        # running statistics, updated once.
        assert torch.equal(lo_, lu)
        assert all(torch.equal(a, u) for a, u in zip(go, gu))
        assert all(torch.equal(a, u) for a, u in zip(bo, bu))
        assert all(int(b) == 1 for n, b in m_ops.named_buffers() if "num_batches" in n)
        assert torch.allclose(lm, lu, rtol=1e-5) and all(
            torch.allclose(a, u, rtol=1e-4, atol=1e-7) for a, u in zip(gm, gu))
        # And as eager, up to Inductor's own rounding (which 12 BatchNorms amplify).
        assert torch.allclose(lo_, le, rtol=1e-4)
        for a, e in zip(go, ge):
            assert (a - e).abs().max() <= 0.05 * e.abs().max()
        for a, e in zip(bo, be):
            assert torch.allclose(a.float(), e.float(), rtol=1e-3, atol=1e-5)
        # The measured compiled peak meets the budget.
        m_ops.zero_grad(set_to_none=True)
        graphs = ops._graphs
        peak = measure_step(torch.compile(m_ops, backend=ops), (x,)).peak_bytes
        assert ops._graphs == graphs  # the step measured is the one compiled above
        assert peak <= budget * 1.02
        # Followed as it is on a fresh compile of the same model (as the benchmark does).
        again = pymemplan.compile_backend(plan=ops.chosen, adapt=False)
        _, (la, ga, _) = compiled(again)
        assert again.tagged == ops.tagged
        assert torch.equal(la, lu) and all(torch.equal(a, u) for a, u in zip(ga, gu))


def test_op_level_plan_refuses_a_graph_it_was_not_made_for():
    from pymemplan.planner.checkpoint.op_level import tag_ops

    g = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU())).graph
    with pytest.raises(PlannerError, match="does not match this graph"):
        tag_ops(g, {"no_such_node": "recompute"})
