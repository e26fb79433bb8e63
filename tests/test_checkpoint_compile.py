"""The torch.compile backend: the partition follows the plan, gradients do not change."""

from __future__ import annotations

import copy
import operator
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
    from pymemplan.planner.checkpoint.compile_backend import TorchBudgetPlan

    # Our tags, or PyTorch's partition under activation_memory_budget (no tags).
    assert be.chosen is not None and be.trials
    assert be.tagged > 0 or isinstance(be.chosen, TorchBudgetPlan)
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
    assert be.chosen.policies  # something is recomputed (by our tags, or PyTorch's knob)


def test_a_high_prediction_of_the_unplanned_step_does_not_lower_the_others():
    """Calibration only raises predictions: the unplanned step measured below its
    prediction leaves the other candidates' predictions as they are (what the walk
    over-predicts there, another partition may not have)."""
    model, x, t = _traced_stack()
    plan = t.plan(int(t.peak_bytes * 0.9), model=model, inputs=(x,))
    measured = t.peak_bytes - (1 << 20)
    be = pymemplan.compile_backend(plan=plan, compiler="aot_eager",
                                   unplanned_peak_bytes=measured)
    run(model, x, be)
    assert be.calibration_bytes == 0
    assert be.trials[0][2] == measured  # the unplanned prediction is still the measurement


def _graph_memory(fn, *shapes):
    """``fn`` traced on fake tensors of ``shapes`` (Inductor's prims registered), and its
    GraphMemory (no scratch probing)."""
    import torch._inductor.inductor_prims  # noqa: F401 - registers prims.inductor_random
    from torch.fx.experimental.proxy_tensor import make_fx

    from pymemplan.planner.checkpoint.compiled_memory import GraphMemory

    args = [torch.zeros(s, dtype=torch.int64) if s == (2,) else torch.randn(s) for s in shapes]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm, GraphMemory(gm, probe=False)


def test_random_values_a_recomputed_dropout_reads_twice_are_a_buffer():
    """Inductor realizes random values (the inductor_random lowering), so that each kernel
    reading them sees the same ones. A dropout the backward recomputes reads them in the
    recomputed forward and again in the dropout's backward, after a matmul: they are a
    buffer live across it, not values computed inline in each reader (BERT's
    recompute-all partition was predicted 53.6 MiB low for this: 9 MiB a layer)."""
    aten, prims = torch.ops.aten, torch.ops.prims

    def recomputed_dropout(seeds, x, w, g):
        r = prims.inductor_random.default(
            [64, 256], prims.inductor_lookup_seed.default(seeds, 0), "rand")
        h = aten.mm.default(aten.mul.Tensor(aten.gt.Scalar(r, 0.1), x), w)
        return aten.mul.Tensor(aten.gt.Scalar(r, 0.1), aten.mul.Tensor(h, g))

    gm, G = _graph_memory(recomputed_dropout, (2,), (64, 256), (256, 256), (64, 256))
    r = next(n for n in gm.graph.nodes if "inductor_random" in str(n.target))
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor
              and any(u.target is torch.ops.aten.mm.default for u in n.users))
    assert G.storage[r] is r and G.size[r] == 64 * 256 * 4
    step = {k: i for i, k in enumerate(G.order)}
    # live while the matmul runs: the random values, its input and its output
    at_mm = step[next(k for k in G.order if k.target is torch.ops.aten.mm.default)]
    assert G.curve()[at_mm] == G.size[r] + G.size[mm] + 64 * 256 * 4


def test_layer_norm_statistics_read_after_a_matmul_are_a_buffer():
    """var_mean is a reduction: each of its outputs is a buffer, which a layer norm
    recomputed in the backward keeps until its backward reads it, after a matmul (not
    recomputed there from the normalised input)."""
    aten = torch.ops.aten

    def recomputed_layer_norm(x, w, g):
        var, mean = aten.var_mean.correction(x, [1], correction=0, keepdim=True)
        rstd = aten.rsqrt.default(aten.add.Tensor(var, 1e-5))
        h = aten.mm.default(aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd), w)
        return aten.mul.Tensor(aten.mul.Tensor(h, g), rstd)

    gm, G = _graph_memory(recomputed_layer_norm, (64, 256), (256, 256), (64, 256))
    var = next(n for n in gm.graph.nodes if n.target is operator.getitem and n.args[1] == 0)
    mm = next(k for k in G.order if k.target is torch.ops.aten.mm.default)
    assert G.storage[var] is var and G.size[var] == 64 * 4
    assert G.alloc_at[var] < G.order.index(mm) < G.free_at[var]


def test_a_pooling_input_computed_from_several_buffers_is_a_buffer():
    """Max pooling reads each element several times, so its lowering asks for its input
    to be realized (realize_hint): a batch-norm + ReLU computed inline from the
    convolution and its statistics becomes a buffer, which the ReLU's backward reads
    later (resnet50's stem: 12 MiB its recompute-everything partitions lacked)."""
    aten, prims = torch.ops.aten, torch.ops.prims

    def stem(x, mean, rstd, w):
        y = aten.relu.default(aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd))
        p = prims._low_memory_max_pool_with_offsets.default(y, [3, 3], [2, 2], [1, 1],
                                                            [1, 1], False)
        v = aten.convolution.default(p[0], w, None, [1, 1], [0, 0], [1, 1], False,
                                     [0, 0], 1)
        return v, aten.le.Scalar(y, 0)

    gm, G = _graph_memory(stem, (2, 8, 32, 32), (1, 8, 1, 1), (1, 8, 1, 1), (8, 8, 1, 1))
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    assert G.storage[relu] is relu and G.free_at[relu] == len(G.order) - 1


def test_inductor_holds_a_freed_buffer_for_a_later_one_of_its_size():
    """Inductor's wrapper pools a freed buffer and hands its memory to a later
    allocation of the same dtype and size (memory_plan_reuse), holding it in between,
    if that keeps its estimate of the kernels in between within its estimate of the
    graph's peak; otherwise the buffer is released where it was freed."""
    aten = torch.ops.aten

    def chain(big):
        def f(x, w2, w3, w4, w5, w6):
            a = aten.exp.default(x)              # 64x256, freed after the next matmul
            m1 = aten.mm.default(a, w2)          # 64x128
            m2 = aten.mm.default(m1, w3)         # 64x64
            m3 = aten.mm.default(m2, w4)         # 64x128: m1's memory (the next kernel)
            c = aten.mm.default(m3, w5)          # 64x256: a's, three kernels later
            return aten.mm.default(c, w6) if big else c
        return f

    shapes = [(64, 256), (256, 128), (128, 64), (64, 128), (128, 256), (256, 2048)]
    gm, G = _graph_memory(chain(big=True), *shapes)
    names = {w.name: s.name for w, s in G.reused.items()}
    assert names == {"mm_2": "mm", "mm_3": "exp"}
    assert list(G.held) == [0, 0, 64 * 256 * 4, 64 * 256 * 4, 0, 0]
    # without the large output, holding it would raise the estimated peak: released
    gm, G = _graph_memory(chain(big=False), *shapes)
    assert {w.name: s.name for w, s in G.reused.items()} == {"mm_2": "mm"}
    assert not G.held.any()


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

        # Ours only (PyTorch's own partitions compete in the tests below).
        modules_only = pymemplan.compile_backend(plan=plan, unplanned_peak_bytes=base,
                                                 op_level=False, torch_budgets=())
        ops = pymemplan.compile_backend(plan=plan, unplanned_peak_bytes=base,
                                        torch_budgets=())
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


def _torch_budget_setup():
    """An MLP of Linear/GELU layers, its input, its trace, the measured peak of its
    unmodified step (min-cut partition, no tags, aot_eager), and the eager plan for the
    least eager peak."""
    from pymemplan.planner.checkpoint.compile_backend import TorchBudgetPlan

    torch.manual_seed(0)
    model = Deep()
    x = torch.randn(512, 256)
    t = pymemplan.trace(model, (x,), device="cpu")
    none = pymemplan.compile_backend(plan=TorchBudgetPlan(1.0), adapt=False,
                                     compiler="aot_eager")
    m = copy.deepcopy(model)
    run(m, x, none)
    m.zero_grad(set_to_none=True)
    base = measure_step(torch.compile(m, backend=none), (x,)).peak_bytes
    lo, _ = least_peak(t.checkpoint_problem(model, (x,)))
    return model, x, t, base, t.plan(lo, model=model, inputs=(x,))


def test_torch_budget_partition_is_chosen_when_it_fits_and_is_cheaper():
    """PyTorch's own partitions under activation_memory_budget are candidates of the
    backend, partitioned, predicted and priced like ours. At a budget that PyTorch's
    0.9 partition is predicted to meet, it is chosen (named "torch-budget:0.9"): the
    cheapest of the candidates predicted to fit, where the backend without PyTorch's
    partitions pays more recompute. Followed, the step's losses and gradients equal the
    unmodified compiled model's, and its measured peak meets the budget."""
    import dataclasses

    from pymemplan.planner.checkpoint.compile_backend import (COST_TIE, TorchBudgetPlan,
                                                              plan_kind)

    model, x, t, base, least_plan = _torch_budget_setup()
    be = pymemplan.compile_backend(plan=least_plan, compiler="aot_eager",
                                   unplanned_peak_bytes=base, op_level=False)
    run(copy.deepcopy(model), x, be)
    preds = {pl.amb: pk for pl, pk in be._portfolio}
    assert 0.9 in preds and preds[0.9] < base
    budget = int(preds[0.9] + 0.01 * base)
    plan = dataclasses.replace(least_plan, budget_bytes=budget)
    chosen, predicted = be.rechoose(plan)
    assert isinstance(chosen, TorchBudgetPlan) and predicted <= budget
    assert plan_kind(chosen) == "torch-budget:0.9"
    assert chosen.policies == {"*": "torch-budget:0.9"}
    # The cheapest (within the cost model's tie) of the candidates predicted to fit;
    # PyTorch's partitions are made once per joint graph (in the first choice's trials).
    fitting = [frac for _, frac, pk in be.rechoose_trials if pk <= budget] + [
        pl.recompute_cost["fraction_of_forward"] for pl, pk in be._portfolio if pk <= budget]
    assert be.recompute_fraction <= min(fitting) + COST_TIE
    # Without PyTorch's partitions: a module-level plan, at more recompute.
    own = pymemplan.compile_backend(plan=plan, compiler="aot_eager",
                                    unplanned_peak_bytes=base, op_level=False,
                                    torch_budgets=())
    run(copy.deepcopy(model), x, own)
    assert not isinstance(own.chosen, TorchBudgetPlan) and own.chosen.modules
    assert own.recompute_fraction > be.recompute_fraction + COST_TIE
    # Followed as it is: the same numbers as the unmodified compiled model, the
    # measured peak within the budget.
    again = pymemplan.compile_backend(plan=chosen, adapt=False, compiler="aot_eager")
    ref = copy.deepcopy(model)
    la, ga = run(ref, x, again)
    l0, g0 = run(copy.deepcopy(model), x, "aot_eager")
    assert torch.equal(la, l0) and all(torch.equal(a, b) for a, b in zip(ga, g0))
    assert again.tagged == 0 and again.saved_bytes > 0
    ref.zero_grad(set_to_none=True)
    peak = measure_step(torch.compile(ref, backend=again), (x,)).peak_bytes
    assert peak <= budget * 1.02


def test_torch_budget_partitions_that_recompute_mutated_inputs_are_dropped():
    """Under aot_eager, BatchNorm updates its running statistics in place, and PyTorch's
    budgeted partitions recompute the ops that read them (autograd's version check then
    fails in backward). Such partitions are no candidates: the step runs, and its
    numbers equal the unmodified compiled model's."""
    torch.manual_seed(0)
    model = ConvNet(n=4)
    x = torch.randn(4, 3, 16, 16)
    t = pymemplan.trace(model, (x,), device="cpu")
    lo, _ = least_peak(t.checkpoint_problem(model, (x,)))
    be = pymemplan.compile_backend(plan=t.plan(lo, model=model, inputs=(x,)),
                                   compiler="aot_eager")
    lb, gb = run(copy.deepcopy(model), x, be)
    l0, g0 = run(copy.deepcopy(model), x, "aot_eager")
    assert be._portfolio == [] and "mutated-input" in be.torch_budget_error
    assert torch.equal(lb, l0) and all(torch.equal(a, b) for a, b in zip(gb, g0))


def test_least_compiled_peak_spans_all_candidates():
    """least_compiled_peak(): the least predicted compiled peak over the candidate
    partitions the backend knows (PyTorch's included), below the unplanned step's; at a
    budget between it and the unplanned peak the backend finds a plan predicted to fit,
    and its measured peak meets the budget."""
    import dataclasses

    from pymemplan.planner.checkpoint.compile_backend import plan_kind

    model, x, t, base, least_plan = _torch_budget_setup()
    be = pymemplan.compile_backend(plan=least_plan, compiler="aot_eager",
                                   unplanned_peak_bytes=base)
    run(copy.deepcopy(model), x, be)
    least = be.least_compiled_peak()
    assert be.least_compiled_peak() == least  # made once
    # The least over partitions made for real: PyTorch's, ours (module-level and
    # op-level, recompute-all among them), the unplanned one.
    kinds = {"unplanned" if pl is None else plan_kind(pl) for pl, _ in be._least_all}
    assert {"unplanned", "module-level", "op-level"} <= kinds
    assert any(k.startswith("torch-budget:") for k in kinds)
    assert least == min(pk for _, pk in be._least_all) < base
    assert be.least_peak_source in kinds
    budget = int(least + 0.3 * (base - least))
    chosen, predicted = be.rechoose(dataclasses.replace(least_plan, budget_bytes=budget))
    assert predicted <= budget
    follow = pymemplan.compile_backend(plan=chosen, adapt=False, compiler="aot_eager")
    m = copy.deepcopy(model)
    run(m, x, follow)
    m.zero_grad(set_to_none=True)
    assert measure_step(torch.compile(m, backend=follow), (x,)).peak_bytes <= budget * 1.02


def test_least_compiled_peak_below_the_resolution_is_the_unplanned_peak(monkeypatch):
    """A least compiled peak predicted less than LEAST_RESOLUTION below the unplanned
    one is not resolved by the predictions: the unplanned peak is the least, and no
    least-peak candidate joins the choice (GPT-2: a plan recomputing every op was
    otherwise taken for a predicted 52 KB)."""
    import importlib

    cb = importlib.import_module("pymemplan.planner.checkpoint.compile_backend")

    model, x, t, base, least_plan = _torch_budget_setup()
    be = pymemplan.compile_backend(plan=least_plan, compiler="aot_eager",
                                   unplanned_peak_bytes=base)
    run(copy.deepcopy(model), x, be)
    monkeypatch.setattr(cb, "LEAST_RESOLUTION", 0.99)  # nothing saves that much
    assert be.least_compiled_peak() == be._pred_none == base
    assert be._least == [] and be.least_peak_source == "unplanned"
    assert be.least_compiled_peak() == base  # made once


def test_compiled_peak_prediction_matches_the_measured_inductor_step():
    """The backend predicts each candidate's compiled peak by walking its partitioned
    forward and backward graphs (compiled_memory.py). On an Inductor-compiled Linear/GELU
    MLP the raw prediction (no calibration) of the unplanned partition and of PyTorch's
    partition that saves half the activations is within 1% of the peak measured on the
    real step. The partition that saves none is predicted high, never low: Inductor
    starts that backward with the kernels that read the output gradient and frees it,
    where the graph order keeps it; with its reordering replayed (reorder=True) the
    prediction is within 1% too."""
    from pymemplan.planner.checkpoint.compile_backend import TorchBudgetPlan
    from pymemplan.planner.checkpoint.compiled_memory import predict_step
    from pymemplan.planner.models import BUILTIN

    torch.manual_seed(0)
    w = BUILTIN["mlp"](batch=256, width=256, layers=8, device="cpu")
    model, inputs, loss_fn = w.model, w.inputs, w.loss_fn
    t = pymemplan.trace(model, inputs, loss_fn=loss_fn, device="cpu")
    torch._dynamo.reset()
    be = pymemplan.compile_backend(plan=t.plan(t.peak_bytes, model=model, inputs=inputs),
                                   op_level=False, torch_budgets=())
    measure_step(torch.compile(copy.deepcopy(model), backend=be), inputs, loss_fn=loss_fn)
    assert be.predictor == "graphs" and be.graph_prediction_error is None
    predicted = {1.0: be.trials[0][2]}  # the unplanned partition's prediction
    measured, reordered = {}, {}
    for amb in (1.0, 0.5, 0.0):
        if amb != 1.0:
            pk, fw, bw = be._predict(be._ctx, TorchBudgetPlan(amb), keep=True)
            predicted[amb] = int(pk)
            reordered[amb] = predict_step(fw, bw, be._ctx["frame"], reorder=True)["peak"]
        follow = pymemplan.compile_backend(plan=TorchBudgetPlan(amb), adapt=False)
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(model), backend=follow)
        measured[amb] = measure_step(compiled, inputs, loss_fn=loss_fn).peak_bytes
    for amb in (1.0, 0.5):
        assert abs(predicted[amb] - measured[amb]) <= 0.01 * measured[amb], (
            amb, predicted[amb], measured[amb])
    assert measured[0.0] <= predicted[0.0] <= 1.15 * measured[0.0]
    assert abs(reordered[0.0] - measured[0.0]) <= 0.01 * measured[0.0]
    assert measured[0.5] < measured[1.0] and predicted[0.5] < predicted[1.0]


class _Loop(nn.Module):
    """One block applied four times with a residual (weights shared across depth)."""

    def __init__(self, d=64):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for _ in range(4):
            x = x + self.block(x)
        return self.head(x).pow(2).mean()


def test_aot_eager_frees_saved_tensors_after_their_last_use_as_predicted():
    # The aot_eager graphs were called unboxed: the argument list held every saved tensor
    # to the end of backward, 5 MiB above the walk's prediction of 29 MiB, which frees
    # each after its last reader as Inductor's code does.
    torch.manual_seed(0)
    model, x = _Loop(), torch.randn(32, 128, 64)
    unplanned = pymemplan.compile_backend(plan=pymemplan.trace(model, (x,), device="cpu").plan(
        10**12), compiler="aot_eager", adapt=False)
    full = measure_step(torch.compile(copy.deepcopy(model), backend=unplanned), (x,)).peak_bytes
    torch._dynamo.reset()
    budget = int(0.75 * full)
    be = pymemplan.compile_backend(budget, model=model, inputs=(x,), device="cpu",
                                   compiler="aot_eager", unplanned_peak_bytes=full)
    peak = measure_step(torch.compile(copy.deepcopy(model), backend=be), (x,)).peak_bytes
    assert be.predicted_peak_bytes <= budget
    assert peak == be.predicted_peak_bytes


def test_shared_weights_gradient_kernels_are_predicted_where_inductor_runs_them():
    # A block applied four times. Inductor fuses each use's bias-gradient reduction into
    # the sum over the uses, one kernel late in backward that holds every use's output
    # gradient until then (vertical fusion has no distance limit); and of add(mm, mm) it
    # folds the second matmul into addmm, not the first. The walk predicted the
    # checkpointed block 26.19 MiB against 29.32 measured (a plan over its budget), and
    # PyTorch's half-budget partition 34.19 against 29.26.
    from pymemplan.planner.checkpoint.compile_backend import TorchBudgetPlan

    torch.manual_seed(0)
    model, x = _Loop(), torch.randn(32, 128, 64)
    t = pymemplan.trace(model, (x,), device="cpu")
    module_plan = t.plan(int(0.5 * t.peak_bytes), model=model, inputs=(x,))
    assert [d.module for d in module_plan.recomputed] == ["block"]
    be = pymemplan.compile_backend(plan=module_plan, op_level=False, torch_budgets=())
    run(copy.deepcopy(model), x, be)
    for plan in (module_plan, TorchBudgetPlan(0.5)):
        predicted = be._predict(be._ctx, plan, keep=True)[0]
        torch._dynamo.reset()
        follow = pymemplan.compile_backend(plan=plan, adapt=False)
        measured = measure_step(torch.compile(copy.deepcopy(model), backend=follow),
                                (x,)).peak_bytes
        assert abs(predicted - measured) <= 0.01 * measured, (plan, predicted, measured)


class _SlicedCache(nn.Module):
    """Returns, besides the loss, a slice of an activation the loss does not read (as a
    sliding-window key/value cache is): an output that is not contiguous."""

    def __init__(self, d=64):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = torch.relu(self.up(x))  # saved for backward: the slice frees nothing
        return self.down(h).pow(2).mean(), h[:, -8:]


def test_a_strided_output_gradient_is_a_buffer_of_its_strides():
    # Autograd gives the unread output zeros, contiguous; AOTAutograd copies them into a
    # buffer of the strides the backward was traced with, whose storage spans the whole
    # activation the output slices (4 MiB for a 256 KiB slice here), live until the
    # backward reads it. The walk took that gradient for one the loss window holds, of
    # the slice's storage: Mistral's six cache slices made it 255 KiB low (aot_eager).
    torch.manual_seed(0)
    model, x = _SlicedCache(), torch.randn(32, 128, 64)
    t = pymemplan.trace(model, (x,), loss_fn=lambda out: out[0], device="cpu")
    for compiler in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        be = pymemplan.compile_backend(plan=t.plan(10 * t.peak_bytes, model=model,
                                                   inputs=(x,)),
                                       compiler=compiler, op_level=False, torch_budgets=())
        peak = measure_step(torch.compile(copy.deepcopy(model), backend=be), (x,),
                            loss_fn=lambda out: out[0]).peak_bytes
        assert be.graph_prediction_error is None
        if compiler == "aot_eager":  # 4 MiB low before
            assert abs(be.predicted_peak_bytes - peak) <= 1024, (peak, be.predicted_peak_bytes)
        else:  # high: Inductor folds the slice's scatter into the matmul's buffer
            assert be.predicted_peak_bytes >= peak, (peak, be.predicted_peak_bytes)


def test_a_chosen_partition_predicted_over_the_budget_is_said():
    # No candidate is predicted to fit: the backend follows the one predicted lowest, as
    # before, but says so (squeezenet's was predicted over its budget and measured 2%
    # over it, silently).
    import dataclasses
    import warnings

    model, x, t = _traced_stack()
    lo, _ = least_peak(t.checkpoint_problem(model, (x,)))
    least = t.plan(lo, model=model, inputs=(x,))
    be = pymemplan.compile_backend(plan=dataclasses.replace(least, budget_bytes=1024),
                                   compiler="aot_eager")
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="no candidate partition is predicted to fit"):
        torch.compile(copy.deepcopy(model), backend=be)(x).backward()
    assert be.predicted_peak_bytes > 1024
    # one that fits: nothing said
    be = pymemplan.compile_backend(plan=t.plan(t.peak_bytes, model=model, inputs=(x,)),
                                   compiler="aot_eager")
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.compile(copy.deepcopy(model), backend=be)(x).backward()
