"""Checkpointing to a memory budget: pymemplan's plan against the alternatives, on real
CPU training steps.

    python benchmarks/checkpoint_pareto.py                    # reduced sizes, all four models
    python benchmarks/checkpoint_pareto.py --models mlp,gpt2 --no-compile
    python benchmarks/checkpoint_pareto.py --scale full       # the larger sizes below
    python benchmarks/checkpoint_pareto.py --report results/checkpoint_pareto.json

**Budgets.** For each model (real weights, on the CPU, one forward + backward step, no
optimizer) the step is traced (``pymemplan.trace(device="cpu")``) and:

- ``fixed`` is the *least achievable peak*: the peak that remains when every candidate
  unit the planner knows (every module with a forward of its own, every run of
  consecutive children of an ``nn.Sequential``, each in ``full`` or ``save-compute``
  form) is chosen to minimise memory (``milp.least_peak``). It is the part of the peak
  no module-level checkpointing can remove: parameters, gradients, inputs, backward
  temporaries, and the activations that must stay (unit boundaries, what the loss
  keeps). ``fixed_nonactivation_bytes`` in the JSON is the narrower reading, the
  non-activation part at that peak (parameters, buffers, gradients, inputs, temporaries);
  with it, the 30% budget of resnet50 would be below the least peak of any module-level
  plan.
- ``activation`` is the unplanned (predicted) peak minus ``fixed``;
- the budgets are ``fixed + f * activation`` for ``f`` in 0.3, 0.5 and 0.7.

**Methods**, each measured on a real CPU step (peak of live tensor bytes from the
profiler's memory events, ``pymemplan.planner.measure.measure_step``):

- eager:
  - ``pymemplan``: ``t.plan(budget)`` applied with ``plan.apply(model)``;
  - ``checkpoint_sequential``: ``torch.utils.checkpoint.checkpoint_sequential`` (non-
    reentrant) over the model's repeated blocks, with the smallest segment count whose
    *measured* peak meets the budget (every count is tried in order: the peak is not
    monotonic in it). The blocks: GPT-2 ``transformer.h``, BERT ``bert.encoder.layer``,
    resnet50 the 16 bottlenecks of ``layer1``..``layer4`` in order, the MLP (itself an
    ``nn.Sequential``) its 49 children. The model's own loop over the blocks is kept:
    the first block's call runs ``checkpoint_sequential`` over all of them, with the
    arguments the model passed it, and the others pass their input through;
  - Rockmate: ``import rockmate`` is attempted (``--rockmate-path`` for a separate
    install); why it does not run is recorded.
- compiled (Inductor, on the CPU):
  - ``pymemplan``: ``torch.compile(model, backend=pymemplan.compile_backend(plan=plan,
    unplanned_peak_bytes=...))``: the plan for the same budget, which the backend
    re-chooses for the compiled graph (module-level plans against op-level ones, see
    ``pymemplan/planner/checkpoint/op_level.py``, and against PyTorch's own partitions
    under ``activation_memory_budget`` 0.9, 0.75, 0.5, 0.3, 0.1 and 0, each taken only
    when predicted to fit and cheapest), its predictions calibrated by the measured
    peak of the compiled step without a budget (the baseline, measured anyway);
  - ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``: bisection
    over the float (``--bisect-steps``) for the largest value whose measured peak meets
    the budget; when the unbudgeted compiled step already meets it, 1.0.

**Compiled budgets.** The compiled step saves less for backward than the eager one, so
an eager-derived budget may already be met by the unplanned compiled step. The compiled
methods are also compared at budgets defined the same way relative to the compiled
step: ``fixed_c + f * (compiled unplanned peak - fixed_c)``, with ``fixed_c`` the least
achievable compiled peak as our backend predicts it: the least predicted compiled peak
over the candidate partitions it can make at their most memory-saving settings (the
unplanned one, PyTorch's partitions under each ``activation_memory_budget`` value, the
module-level least-peak plan, the op-level plan that recomputes all it may, and
op-level MILP plans asked for less), each partitioned for real and predicted like any
candidate, calibrated by the measured unplanned compiled step
(``CompileBackend.least_compiled_peak``). They are ``compiled_points`` in the JSON, each
with its ``budget_basis``, and marked ``c`` (``0.3c``) in the tables.

**Step time** is relative to the unplanned step in the same run: eager methods against
the eager step, compiled ones against the compiled step without a budget. Each round
runs baseline, variant 1, baseline, variant 2, ..., baseline; a variant's ratio is its
time over the mean of the two baseline steps around it, and the median over the
rounds is reported (``--rounds``, at least; short steps get more rounds, up to 15, until
the timing has lasted 30 s). Variants that are the same configuration (the same plan,
segment count or compiled artifact) are timed once. The time is the process's CPU
time (all threads), because on a shared machine wall time swings with other jobs' load;
the same ratio in wall time is in the JSON (``wall_time_ratio``). OpenMP threads wait passively
(``OMP_WAIT_POLICY=PASSIVE`` unless set): spinning threads stall, and burn CPU time,
whenever another job takes a core.

**Solve time**: for pymemplan, the solver's time (``plan.solve_seconds``; tracing and
building the problem are reported apart) and, compiled, the backend's re-choice inside
the partitioner; for the baselines, the time of their search (the measured steps or
compilations it took).

The solver target (exact or a proved gap under 1% in under 10 s) is checked on the
full-size GPT-2 small of ``pymemplan trace`` (batch 8 x 1024, Adam, CUDA profile).

Writes ``results/checkpoint_pareto.json`` and ``results/checkpoint_pareto.png`` (measured
peak vs step time, one panel per model) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

# OpenMP threads that wait by spinning burn CPU and stall whenever another job on the
# machine takes a core; passive waiting keeps step times steady on a shared machine.
# Set before torch loads OpenMP; an explicit setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

SIZES = {  # (reduced, full)
    "mlp": (dict(batch=512, width=512), dict(batch=2048, width=1024)),
    "resnet50": (dict(batch=4), dict(batch=16)),
    "bert": (dict(batch=2, seq_len=256), dict(batch=4, seq_len=512)),
    "gpt2": (dict(batch=2, seq_len=256), dict(batch=4, seq_len=512)),
}
FRACTIONS = (0.3, 0.5, 0.7)
MIB = 2 ** 20

ROCKMATE_NOTE = (
    "pip install rockmate (2.0.0, an sdist) installs, with its dependencies rkgb 2.0.0, "
    "pulp 2.7.0 and configmypy, but `import rockmate` fails: the rkgb 2.0.0 sdist on PyPI "
    "ships only rkgb/__init__.py and rkgb/rkgb.py while rkgb/__init__.py imports "
    "rkgb.core (ModuleNotFoundError: No module named 'rkgb.core'). The only other "
    "release, rockmate 1.0.1 (with rkgb 1.0.1), imports gurobipy, a commercial MILP "
    "solver, at import time (ModuleNotFoundError: No module named 'gurobipy').")


# ---------------------------------------------------------------------------------------
# Steps, peaks, times
# ---------------------------------------------------------------------------------------

def step(model, inputs, loss_fn):
    out = model(*inputs)
    loss = loss_fn(out)
    del out
    loss.backward()
    model.zero_grad(set_to_none=True)


def measured_peak(model, inputs, loss_fn) -> int:
    from pymemplan.planner.measure import measure_step

    return measure_step(model, inputs, loss_fn=loss_fn).peak_bytes


def _median(xs):
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else 0.5 * (xs[k - 1] + xs[k])


def interleaved_times(configs: dict, inputs, loss_fn, rounds: int, min_seconds: float = 30.0,
                      max_rounds: int = 15) -> dict:
    """``configs``: name -> (callable model, enter, exit); the first is the baseline.
    Each round runs baseline, variant 1, baseline, variant 2, ..., baseline, so every
    variant sits between two baseline steps taken moments apart. A step's time is the
    CPU time of this process (all threads: ``time.process_time``), which other jobs on
    a shared machine disturb far less than wall time; wall time is kept too. Returns
    name -> {"cpu_seconds", "wall_seconds", "ratio": median over rounds of the
    variant's CPU time over the mean of its two neighbouring baselines',
    "wall_ratio": the same in wall time}. At least ``rounds`` rounds, more (up to
    ``max_rounds``) while the timing has lasted under ``min_seconds``: short steps are
    noisier."""
    names = list(configs)
    base, variants = names[0], names[1:]
    cpu = {n: [] for n in names}
    wall = {n: [] for n in names}
    ratios = {n: [] for n in variants}
    wall_ratios = {n: [] for n in variants}

    def run(name):
        m, enter, leave = configs[name]
        enter()
        try:
            c0, t0 = time.process_time(), time.perf_counter()
            step(m, inputs, loss_fn)
            c, t = time.process_time() - c0, time.perf_counter() - t0
        finally:
            leave()
        cpu[name].append(c)
        wall[name].append(t)
        return c, t

    t_start = time.perf_counter()
    done = 0
    while done < rounds or (done < max_rounds
                            and time.perf_counter() - t_start < min_seconds):
        done += 1
        before = run(base)
        for v in variants:
            tv = run(v)
            after = run(base)
            ratios[v].append(tv[0] / (0.5 * (before[0] + after[0])))
            wall_ratios[v].append(tv[1] / (0.5 * (before[1] + after[1])))
            before = after
    out = {base: {"cpu_seconds": cpu[base], "wall_seconds": wall[base]}}
    for v in variants:
        out[v] = {"cpu_seconds": cpu[v], "wall_seconds": wall[v],
                  "ratio": _median(ratios[v]), "wall_ratio": _median(wall_ratios[v])}
    return out


def nothing():
    return None


def point_name(f) -> str:
    """A budget point's key: the fraction ``f`` (eager-derived budget), or
    ``("compiled", f)`` (the budget relative to the compiled unplanned step)."""
    return f"{f[1]:g}c" if isinstance(f, tuple) else f"{f:g}"


def plan_key(pl) -> tuple:
    """What makes two compiled plans the same: an op-level plan's recomputed nodes, a
    torch-budget partition's value, or a module-level plan's units."""
    key = getattr(pl, "key", None)
    return ("ops",) + key if key is not None else tuple(sorted(pl.policies.items()))


def compiled_kind(pl) -> str:
    """"module-level", "op-level" or "torch-budget:<value>" (a partition PyTorch's
    partitioner made under that activation_memory_budget, which our backend chose)."""
    from pymemplan.planner.checkpoint.compile_backend import plan_kind

    return plan_kind(pl)


class Variants:
    """What to time: the baseline and each distinct variant once. ``add`` files a
    (method, fraction) point under ``key``; points with equal keys (the same plan, the
    same segment count, the same compiled artifact) share one timed variant, and a key
    equal to the baseline's is the baseline itself (ratio 1)."""

    def __init__(self, baseline, key="baseline"):
        self.configs = {"baseline": baseline}
        self.names = {key: "baseline"}
        self.points: dict[str, list] = {"baseline": []}

    def add(self, method, f, key, config):
        name = self.names.get(key)
        if name is None:
            name = self.names[key] = f"{method}@{point_name(f)}"
            self.configs[name] = config
            self.points[name] = []
        self.points[name].append((method, f))

    def time(self, inputs, loss_fn, rounds, points) -> dict:
        times = interleaved_times(self.configs, inputs, loss_fn, rounds)
        for name, pts in self.points.items():
            d = times[name]
            for method, f in pts:
                points[f]["methods"][method].update(
                    step_time_ratio=d.get("ratio", 1.0),
                    wall_time_ratio=d.get("wall_ratio", 1.0), timed_as=name)
        return times


# ---------------------------------------------------------------------------------------
# checkpoint_sequential over a model's repeated blocks
# ---------------------------------------------------------------------------------------

def block_list(name, model):
    """The model's repeated blocks, in the order its forward runs them, and where."""
    if name == "gpt2":
        blocks = list(model.transformer.h)
        return blocks, f"transformer.h ({len(blocks)} GPT2Block)"
    if name == "bert":
        blocks = list(model.bert.encoder.layer)
        return blocks, f"bert.encoder.layer ({len(blocks)} BertLayer)"
    if name == "resnet50":
        blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                  for b in layer]
        return blocks, f"layer1..layer4 ({len(blocks)} Bottleneck)"
    if name == "mlp":
        return list(model), f"the nn.Sequential's {len(model)} children"
    raise ValueError(name)


class SequentialCheckpoint:
    """``checkpoint_sequential(blocks, segments)`` inside the model's own loop: the first
    block's call runs all blocks (with the extra arguments the model passed it); the
    other blocks pass their input through. ``enter``/``exit`` install and remove it."""

    def __init__(self, blocks, segments: int):
        self.blocks = blocks
        self.segments = segments

    def enter(self):
        from torch.utils.checkpoint import checkpoint_sequential

        blocks, segments = self.blocks, self.segments

        def run_block(block, args, kwargs, x):
            return type(block).forward(block, x, *args, **kwargs)

        def first(x, *args, **kwargs):
            fns = [functools.partial(run_block, b, args, kwargs) for b in blocks]
            return checkpoint_sequential(fns, segments, x, use_reentrant=False)

        def passthrough(x, *args, **kwargs):
            return x

        object.__setattr__(blocks[0], "forward", first)
        for b in blocks[1:]:
            object.__setattr__(b, "forward", passthrough)

    def exit(self):
        for b in self.blocks:
            b.__dict__.pop("forward", None)


# ---------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------

def inductor_with_budget(amb: float):
    """An Inductor backend that partitions under ``activation_memory_budget=amb`` (a
    distinct backend object per value, so Dynamo keeps one compiled entry each)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=amb):
            return compile_fx(gm, example_inputs)
    backend.__name__ = f"inductor_amb_{amb:g}"
    return backend


def setup_compile():
    import torch
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, key):
            setattr(dynamo_config, key, 256)
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = 4096
    # Cached artifacts would not know which budget or plan made them.
    functorch_config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False


def compile_and_measure(model, backend, inputs, loss_fn):
    """torch.compile with ``backend``; the first step compiles (timed), then the peak."""
    import torch

    cm = torch.compile(model, backend=backend)
    t0 = time.perf_counter()
    step(cm, inputs, loss_fn)
    compile_s = time.perf_counter() - t0
    return cm, compile_s, measured_peak(cm, inputs, loss_fn)


# ---------------------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------------------

def run_model(name, scale, args, log):
    import numpy as np
    import torch

    import pymemplan
    from pymemplan.planner.checkpoint.milp import least_peak
    from pymemplan.planner.graph import ACTIVATION
    from pymemplan.planner.models import BUILTIN

    torch.manual_seed(0)
    size = SIZES[name][scale == "full"]
    w = BUILTIN[name](device="cpu", **size)
    model, inputs, loss_fn = w.model, w.inputs, w.loss_fn
    model.train()

    t0 = time.perf_counter()
    t = pymemplan.trace(model, inputs, loss_fn=loss_fn, device="cpu")
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = t.checkpoint_problem(model, inputs)
    problem_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    least, x_least = least_peak(p)
    least_s = time.perf_counter() - t0
    tl = p.simulate(x_least)
    i = tl.peak_index
    nonact = sum(int(a[i]) for c, a in tl.by_category.items() if c != ACTIVATION)
    unplanned = t.peak_bytes
    fixed, activation = least, unplanned - least
    budgets = {f: int(fixed + f * activation) for f in args.fractions}
    out = {"model": name, "sizes": size, "description": w.description,
           "ops": t.graph.num_ops, "candidates": p.n,
           "predicted_unplanned_peak_bytes": unplanned, "fixed_bytes": fixed,
           "fixed_definition": "least achievable peak (milp.least_peak over all candidates)",
           "fixed_nonactivation_bytes": nonact, "activation_bytes": activation,
           "trace_seconds": trace_s, "problem_seconds": problem_s,
           "least_peak_seconds": least_s,
           "budgets": {str(f): b for f, b in budgets.items()}}
    log(f"\n== {name} {size}: {p.n} candidates, unplanned {unplanned / MIB:.1f} MiB, "
        f"fixed (least achievable) {fixed / MIB:.1f} MiB, budgets "
        + ", ".join(f"{f:g}: {b / MIB:.1f}" for f, b in budgets.items()) + " MiB")

    base_peak = measured_peak(model, inputs, loss_fn)
    out["eager_unplanned_measured_peak_bytes"] = base_peak
    points = {f: {"fraction": f, "budget_bytes": b, "methods": {}} for f, b in budgets.items()}

    def record(f, method, peak, **extra):
        b = budgets[f]
        points[f]["methods"][method] = dict(
            measured_peak_bytes=int(peak) if peak is not None else None,
            met=bool(peak is not None and peak <= b),
            over_budget=(peak / b - 1) if peak is not None else None, **extra)

    # -- eager: our plans ---------------------------------------------------------------
    plans = {}
    eager = Variants((model, nothing, nothing), key=("pymemplan", ()))
    for f, b in budgets.items():
        plan = t.plan(b, model=model, inputs=inputs)
        plans[f] = plan
        plan.apply(model)
        try:
            peak = measured_peak(model, inputs, loss_fn)
        finally:
            plan.remove(model)
        record(f, "pymemplan", peak, predicted_peak_bytes=plan.predicted_peak_bytes,
               solver=plan.solver, optimal=plan.optimal, gap=plan.gap,
               solve_seconds=plan.solve_seconds,
               predicted_recompute_fraction=plan.recompute_cost["fraction_of_forward"],
               units=plan.policies)
        eager.add("pymemplan", f, ("pymemplan", tuple(sorted(plan.policies.items()))),
                  (model, functools.partial(plan.apply, model),
                   functools.partial(plan.remove, model)))
        log(f"  pymemplan eager  f={f:g}: measured {peak / MIB:.1f} MiB "
            f"(predicted {plan.predicted_peak_bytes / MIB:.1f}), {plan.solver} "
            f"{'optimal' if plan.optimal else plan.gap} in {plan.solve_seconds:.2f} s, "
            f"{len(plan.recomputed)} units")

    # -- eager: checkpoint_sequential ---------------------------------------------------
    blocks, where = block_list(name, model)
    out["checkpoint_sequential_blocks"] = where
    seq_peaks: dict[int, int] = {}
    seq_seconds = 0.0

    def seq_peak(s):
        nonlocal seq_seconds
        if s not in seq_peaks:
            t0 = time.perf_counter()
            sc = SequentialCheckpoint(blocks, s)
            sc.enter()
            try:
                seq_peaks[s] = measured_peak(model, inputs, loss_fn)
            finally:
                sc.exit()
            seq_seconds += time.perf_counter() - t0
        return seq_peaks[s]

    for f in sorted(budgets, reverse=True):  # loosest first: the scan carries over
        b = budgets[f]
        t0 = time.perf_counter()
        chosen = None
        for s in range(2, len(blocks) + 1):
            if seq_peak(s) <= b:
                chosen = s
                break
        if chosen is None:  # none meets it: report the lowest peak it reaches
            chosen = min(seq_peaks, key=seq_peaks.get)
        record(f, "checkpoint_sequential", seq_peaks[chosen], segments=chosen,
               search_seconds=time.perf_counter() - t0,
               measured_segment_counts=len(seq_peaks))
        sc = SequentialCheckpoint(blocks, chosen)
        eager.add("checkpoint_sequential", f, ("checkpoint_sequential", chosen),
                  (model, sc.enter, sc.exit))
        log(f"  checkpoint_sequential f={f:g}: {chosen} segments, measured "
            f"{seq_peaks[chosen] / MIB:.1f} MiB")
    out["checkpoint_sequential_peaks"] = {str(s): v for s, v in sorted(seq_peaks.items())}
    out["checkpoint_sequential_search_seconds"] = seq_seconds

    # -- eager: Rockmate ------------------------------------------------------------------
    rockmate = rockmate_attempt(model, inputs, budgets)
    out["rockmate"] = rockmate
    for f in budgets:
        points[f]["methods"]["rockmate"] = {"measured_peak_bytes": None, "met": False,
                                            "status": rockmate["status"]}

    # -- eager timing ---------------------------------------------------------------------
    step(model, inputs, loss_fn)  # warm
    times = eager.time(inputs, loss_fn, args.rounds, points)
    out["eager_timing"] = times
    base_t = _median(times["baseline"]["cpu_seconds"])
    log(f"  eager step {base_t:.3f} s CPU; " + ", ".join(
        f"{k} x{d['ratio']:.3f}" for k, d in times.items() if k != "baseline"))

    # -- compiled -------------------------------------------------------------------------
    if args.compile:
        out["compiled_points"] = []
        out["compiled"] = run_compiled(model, inputs, loss_fn, budgets, plans, points, args,
                                       record, log, t, fixed, out["compiled_points"])

    out["points"] = [points[f] for f in sorted(points)]
    return out


def run_compiled(model, inputs, loss_fn, budgets, plans, points, args, record, log, t,
                 fixed, compiled_points):
    """Ours and torch.compile's budget, at the eager-derived budgets (``points``) and at
    budgets defined the same way relative to the compiled step (``compiled_points``,
    filled here): ``fixed_c + f * (compiled unplanned peak - fixed_c)``, where
    ``fixed_c`` is the least achievable compiled peak as the eager ``fixed`` is the least
    achievable eager one: the least compiled peak our backend predicts for any of its
    candidate partitions (``CompileBackend.least_compiled_peak``)."""
    import dataclasses

    import pymemplan
    from pymemplan.planner.checkpoint.plan import BudgetTooSmallError

    setup_compile()
    info = {"compiler": "inductor"}
    cm, cs, base_peak = compile_and_measure(model, inductor_with_budget(1.0), inputs, loss_fn)
    configs = Variants((cm, nothing, nothing), key=id(cm))
    base_cm = cm
    info.update(baseline_measured_peak_bytes=base_peak, baseline_compile_seconds=cs)
    log(f"  compiled baseline: {cs:.0f} s to compile, measured {base_peak / MIB:.1f} MiB")

    evals: dict[float, tuple] = {1.0: (base_cm, base_peak, 0.0)}

    def evaluate(amb):
        if amb not in evals:
            cm, cs, peak = compile_and_measure(model, inductor_with_budget(amb), inputs,
                                               loss_fn)
            evals[amb] = (cm, peak, cs)
            log(f"    activation_memory_budget={amb:g}: measured {peak / MIB:.1f} MiB "
                f"({cs:.0f} s to compile)")
        return evals[amb][1]

    # Ours first compiles for the loosest eager budget; its op-level model of the joint
    # graph gives the least compiled peak, which defines the compiled budgets.
    loosest = max(budgets, key=budgets.get)
    t0 = time.perf_counter()
    first = pymemplan.compile_backend(plan=plans[loosest], unplanned_peak_bytes=base_peak)
    first_cm, first_cs, first_peak = compile_and_measure(model, first, inputs, loss_fn)
    first_choose_s = first.choose_seconds
    info["calibration_bytes"] = first.calibration_bytes
    t0 = time.perf_counter()
    fixed_c = first.least_compiled_peak()
    info.update(least_compiled_seconds=time.perf_counter() - t0,
                least_compiled_source=first.least_peak_source,
                portfolio_seconds=getattr(first, "portfolio_seconds", None),
                least_candidates=[
                    ["unplanned" if pl is None else
                     f"{compiled_kind(pl)} ({getattr(pl, 'solver', '')})", pk]
                    for pl, pk in first._least_all])
    log(f"  least compiled peak {fixed_c / MIB:.1f} MiB ({first.least_peak_source}, "
        f"{info['least_compiled_seconds']:.0f} s)")
    activation_c = base_peak - fixed_c
    budgets_c = {f: int(fixed_c + f * activation_c) for f in budgets}
    info.update(fixed_compiled_bytes=fixed_c, activation_compiled_bytes=activation_c,
                fixed_compiled_definition=(
                    "least achievable compiled peak: the least predicted compiled peak "
                    "(calibrated by the measured unplanned compiled step) over the "
                    "backend's candidate partitions at their most memory-saving "
                    "settings: unplanned, PyTorch's under each activation_memory_budget "
                    "value, module-level least-peak, op-level recompute-all, op-level "
                    "MILP below those (CompileBackend.least_compiled_peak)"),
                budgets_compiled={str(f): b for f, b in budgets_c.items()})
    log("  compiled budgets (relative to the compiled step): " + ", ".join(
        f"{f:g}: {b / MIB:.1f}" for f, b in budgets_c.items()) + " MiB")
    cpoints = {("compiled", f): {"fraction": f, "budget_bytes": b,
                                 "budget_basis": "compiled: fixed_c + f * (compiled "
                                                 "unplanned peak - fixed_c)",
                                 "methods": {}}
               for f, b in budgets_c.items()}
    all_budgets = dict(budgets)
    all_budgets.update({k: p["budget_bytes"] for k, p in cpoints.items()})
    all_points = dict(points)
    all_points.update(cpoints)

    def record_any(key, method, peak, **extra):
        if not isinstance(key, tuple):
            return record(key, method, peak, **extra)
        b = all_budgets[key]
        cpoints[key]["methods"][method] = dict(
            measured_peak_bytes=int(peak) if peak is not None else None,
            met=bool(peak is not None and peak <= b),
            over_budget=(peak / b - 1) if peak is not None else None, **extra)

    def eager_plan(key):
        """The eager plan the backend starts from: for a compiled budget below what any
        eager plan reaches, the least-peak one, with the compiled budget as its target."""
        if not isinstance(key, tuple):
            return plans[key]
        b = all_budgets[key]
        try:
            return t.plan(b, model=model, inputs=inputs)
        except BudgetTooSmallError as e:
            least = t.plan(e.least_peak_bytes, model=model, inputs=inputs)
            return dataclasses.replace(least, budget_bytes=b)

    order = sorted(all_budgets, key=lambda k: -all_budgets[k])  # loosest first

    # Ours: the plan for the budget, re-chosen for the compiled graph by the backend. The
    # joint graph is the same for every budget: the first backend compiles it and
    # re-chooses for the other budgets on it (CompileBackend.rechoose); a choice already
    # compiled (no checkpointing at all: the baseline) is not compiled again.
    compiled_plans = {(): (base_cm, 0.0, base_peak)}
    for key in order:
        t0 = time.perf_counter()
        start = eager_plan(key)
        if key == loosest:
            # The baseline's measured peak calibrated the backend's predictions.
            chosen, predicted = first.chosen or start, first.predicted_peak_bytes
            choose_s, trials = first_choose_s, len(first.trials)
            fraction = first.recompute_fraction
            # No checkpointing at all compiles to the baseline's graph: time that one.
            cm, cs, peak = compiled_plans.setdefault(plan_key(chosen),
                                                     (first_cm, first_cs, first_peak))
        else:
            chosen, predicted = first.rechoose(start)
            choose_s, trials = time.perf_counter() - t0, None
            fraction = first.recompute_fraction
            if plan_key(chosen) not in compiled_plans:
                be = pymemplan.compile_backend(plan=chosen, adapt=False)
                compiled_plans[plan_key(chosen)] = compile_and_measure(model, be, inputs,
                                                                       loss_fn)
            cm, cs, peak = compiled_plans[plan_key(chosen)]
        record_any(key, "pymemplan-compiled", peak, compile_seconds=cs,
                   solve_seconds=getattr(start, "solve_seconds", 0.0) + choose_s,
                   predicted_peak_bytes=predicted,
                   predicted_recompute_fraction=fraction,
                   plan_kind=compiled_kind(chosen),
                   units=chosen.policies, trials=trials)
        configs.add("pymemplan-compiled", key, id(cm), (cm, nothing, nothing))
        log(f"  pymemplan compiled {point_name(key)}: measured {peak / MIB:.1f} MiB "
            f"(budget {all_budgets[key] / MIB:.1f}, predicted "
            f"{predicted / MIB if predicted else float('nan'):.1f}), "
            f"{compiled_kind(chosen)} "
            f"plan, {len(chosen.policies)} units, {cs:.0f} s to compile")

    # torch.compile's activation_memory_budget, bisected per budget.
    for key in order:
        b = all_budgets[key]
        t0 = time.perf_counter()
        n0 = len(evals)
        if evaluate(1.0) > b:
            lo, hi = 0.0, 1.0
            for _ in range(args.bisect_steps):
                mid = round((lo + hi) / 2, 6)
                if evaluate(mid) <= b:
                    lo = mid
                else:
                    hi = mid
        meeting = [a for a, (_, pk, _) in evals.items() if pk <= b]
        amb = max(meeting) if meeting else min(evals, key=lambda a: evals[a][1])
        record_any(key, "torch.compile-budget", evals[amb][1], activation_memory_budget=amb,
                   search_seconds=time.perf_counter() - t0, compilations=len(evals) - n0,
                   tried={str(a): v[1] for a, v in sorted(evals.items())})
        configs.add("torch.compile-budget", key, id(evals[amb][0]),
                    (evals[amb][0], nothing, nothing))
        log(f"  torch.compile budget {point_name(key)}: activation_memory_budget={amb:g}, "
            f"measured {evals[amb][1] / MIB:.1f} MiB")
    info["activation_memory_budget_tried"] = {str(a): v[1] for a, v in sorted(evals.items())}

    import torch

    before = dict(torch._dynamo.utils.counters["stats"])
    times = configs.time(inputs, loss_fn, args.rounds, all_points)
    after = dict(torch._dynamo.utils.counters["stats"])
    info["recompiled_while_timing"] = after.get("unique_graphs", 0) - before.get("unique_graphs", 0)
    base_t = _median(times["baseline"]["cpu_seconds"])
    info["timing"] = times
    log(f"  compiled step {base_t:.3f} s CPU; " + ", ".join(
        f"{k} x{d['ratio']:.3f}" for k, d in times.items() if k != "baseline"))
    compiled_points.extend(cpoints[k] for k in sorted(cpoints))
    return info


def rockmate_attempt(model, inputs, budgets) -> dict:
    """Rockmate where it imports; otherwise why not."""
    try:
        import rockmate  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return {"status": "unavailable", "error": f"{type(e).__name__}: {e}",
                "why": ROCKMATE_NOTE}
    try:
        from rockmate import Rockmate

        Rockmate(model, inputs, budget=min(budgets.values()))
    except Exception as e:
        return {"status": "failed", "error": f"{type(e).__name__}: {e}", "why": ROCKMATE_NOTE}
    return {"status": "imports and builds, but measuring it is not implemented"}


# ---------------------------------------------------------------------------------------
# The full-size solver check
# ---------------------------------------------------------------------------------------

def solver_check(fractions, log) -> dict:
    import torch

    import pymemplan
    from pymemplan.planner.checkpoint.milp import least_peak
    from pymemplan.planner.models import BUILTIN

    w = BUILTIN["gpt2"]()  # meta device, batch 8 x 1024
    t0 = time.perf_counter()
    t = pymemplan.trace(w.model, w.inputs, loss_fn=w.loss_fn, optimizer=torch.optim.Adam,
                        device="cuda")
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = t.checkpoint_problem(w.model, w.inputs)
    problem_s = time.perf_counter() - t0
    least, _ = least_peak(p)
    out = {"workload": w.description + ", batch 8, Adam, CUDA profile",
           "candidates": p.n, "ops": t.graph.num_ops, "trace_seconds": trace_s,
           "problem_seconds": problem_s, "unplanned_peak_bytes": t.peak_bytes,
           "least_peak_bytes": least, "points": []}
    for f in fractions:
        b = int(least + f * (t.peak_bytes - least))
        pl = t.plan(b, model=w.model, inputs=w.inputs)
        out["points"].append({"fraction": f, "budget_bytes": b, "solver": pl.solver,
                              "optimal": pl.optimal, "gap": pl.gap,
                              "solve_seconds": pl.solve_seconds,
                              "predicted_peak_bytes": pl.predicted_peak_bytes,
                              "recompute_fraction": pl.recompute_cost["fraction_of_forward"]})
        log(f"  full GPT-2 f={f:g}: {pl.solver}, optimal={pl.optimal}, gap={pl.gap}, "
            f"{pl.solve_seconds:.2f} s")
    return out


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

METHODS = ("pymemplan", "checkpoint_sequential", "rockmate", "pymemplan-compiled",
           "torch.compile-budget")


def table(results) -> str:
    rows = ["| model | f | budget (MiB) | method | measured peak (MiB) | met | step time vs "
            "unplanned | solve / search (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for pt in r["points"] + r.get("compiled_points", []):
            fr = f"{pt['fraction']:g}" + ("c" if pt.get("budget_basis") else "")
            for m in METHODS:
                d = pt["methods"].get(m)
                if d is None:
                    continue
                if d.get("measured_peak_bytes") is None:
                    rows.append(f"| {r['model']} | {fr} | "
                                f"{pt['budget_bytes'] / MIB:.1f} | {m} | — | — | — | "
                                f"{d.get('status', '')} |")
                    continue
                ratio = d.get("step_time_ratio")
                solve = d.get("solve_seconds", d.get("search_seconds"))
                extra = ""
                if m == "checkpoint_sequential":
                    extra = f" ({d['segments']} segments)"
                elif m == "torch.compile-budget":
                    extra = f" (budget={d['activation_memory_budget']:g})"
                elif m == "pymemplan-compiled" and d.get("plan_kind"):
                    extra = f" ({d['plan_kind']})"
                rows.append(
                    f"| {r['model']} | {fr} | {pt['budget_bytes'] / MIB:.1f} | "
                    f"{m}{extra} | {d['measured_peak_bytes'] / MIB:.1f} | "
                    f"{'yes' if d['met'] else 'NO'} | "
                    + (f"{ratio:.3f}" if ratio is not None else "—")
                    + f" | {solve:.2f} |")
    return "\n".join(rows)


def summary_table(results) -> str:
    """One row per model and budget: each method's measured peak (MiB), whether it met
    the budget (✗ if not), and its step time relative to the unplanned step (eager
    methods against the eager step, compiled ones against the compiled one)."""

    def cell(d, prefix=""):
        if d is None or d.get("measured_peak_bytes") is None:
            return "—"
        ratio = d.get("step_time_ratio")
        mark = "" if d["met"] else " ✗"
        time_s = f"{ratio:.2f}" if ratio is not None else "—"
        return f"{prefix}{d['measured_peak_bytes'] / MIB:.0f}{mark} / {time_s}"

    rows = ["| model | f | budget MiB | pymemplan eager | checkpoint_sequential | "
            "pymemplan compiled | torch.compile budget | solve s (eager, compiled) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for pt in r["points"]:
            m = pt["methods"]
            ours, seq = m.get("pymemplan"), m.get("checkpoint_sequential")
            oc, tc = m.get("pymemplan-compiled"), m.get("torch.compile-budget")
            seq_prefix = f"{seq['segments']} seg: " if seq else ""
            tc_prefix = f"{tc['activation_memory_budget']:g}: " if tc else ""
            solve = f"{ours['solve_seconds']:.2f}"
            if oc:
                solve += f", {oc['solve_seconds']:.1f}"
            rows.append(f"| {r['model']} | {pt['fraction']:g} | {pt['budget_bytes'] / MIB:.0f} "
                        f"| {cell(ours)} | {cell(seq, seq_prefix)} | {cell(oc, kind(oc))} "
                        f"| {cell(tc, tc_prefix)} | {solve} |")
    rows += ["", "Compiled budgets, relative to the compiled unplanned step "
             "(fixed_c + f × compiled activation):", "",
             "| model | f | compiled budget MiB | compiled unplanned MiB | pymemplan compiled "
             "| torch.compile budget | solve s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        base = (r.get("compiled") or {}).get("baseline_measured_peak_bytes")
        for pt in r.get("compiled_points", []):
            m = pt["methods"]
            oc, tc = m.get("pymemplan-compiled"), m.get("torch.compile-budget")
            tc_prefix = f"{tc['activation_memory_budget']:g}: " if tc else ""
            rows.append(f"| {r['model']} | {pt['fraction']:g} | {pt['budget_bytes'] / MIB:.0f} "
                        f"| {base / MIB:.0f} | {cell(oc, kind(oc))} | {cell(tc, tc_prefix)} "
                        f"| {oc['solve_seconds']:.1f} |" if oc else "")
    return "\n".join(rows)


def kind(d) -> str:
    """"ops: " for an op-level compiled plan, "torch 0.75: " for a partition PyTorch's
    partitioner made under activation_memory_budget=0.75 that our backend chose, ""
    for a module-level plan."""
    k = (d or {}).get("plan_kind") or ""
    if k == "op-level":
        return "ops: "
    if k.startswith("torch-budget:"):
        return f"torch {k.split(':', 1)[1]}: "
    return ""


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"pymemplan": ("o", "tab:blue"), "checkpoint_sequential": ("s", "tab:orange"),
             "pymemplan-compiled": ("^", "tab:green"), "torch.compile-budget": ("x", "tab:red")}
    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        for m, (marker, color) in style.items():
            xs, ys, met = [], [], []
            for pt in r["points"] + r.get("compiled_points", []):
                d = pt["methods"].get(m)
                if d and d.get("measured_peak_bytes") and d.get("step_time_ratio"):
                    xs.append(d["measured_peak_bytes"] / MIB)
                    ys.append(d["step_time_ratio"])
                    met.append(d["met"])
            if not xs:
                continue
            ax.plot(xs, ys, linestyle=":", color=color, alpha=0.5)
            for x, y, ok in zip(xs, ys, met):
                ax.scatter([x], [y], marker=marker, s=45, color=color,
                           facecolors=color if ok or marker == "x" else "none")
            ax.scatter([], [], marker=marker, color=color, label=m)
        for pt in r["points"]:
            ax.axvline(pt["budget_bytes"] / MIB, color="grey", linestyle="--", linewidth=0.8)
        for pt in r.get("compiled_points", []):
            ax.axvline(pt["budget_bytes"] / MIB, color="tab:green", linestyle=":", linewidth=0.8)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_title(f"{r['model']} {r['sizes']}", fontsize=9)
        ax.set_xlabel("measured peak (MiB)\nbudgets: dashed eager, dotted compiled", fontsize=8)
        ax.set_ylabel("step time / unplanned")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,gpt2,bert,resnet50")
    ap.add_argument("--scale", choices=("reduced", "full"), default="reduced")
    ap.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--bisect-steps", type=int, default=2,
                    help="bisection steps over activation_memory_budget per budget (2: a "
                         "resolution of 1/4; each step is one compilation)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="eager methods only")
    ap.add_argument("--no-solver-check", dest="solver_check", action="store_false")
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_pareto.json"))
    ap.add_argument("--rockmate-path", metavar="DIR",
                    help="a directory Rockmate was installed into (pip install --target DIR "
                         "rockmate), tried before the environment's own packages")
    ap.add_argument("--report", metavar="JSON",
                    help="run nothing: print the tables and redraw the plot of a results file")
    args = ap.parse_args()
    args.fractions = tuple(float(f) for f in args.fractions.split(","))
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        plot(doc["results"], Path(args.report).with_suffix(".png"))
        print(table(doc["results"]))
        print()
        print(summary_table(doc["results"]))
        return
    if args.rockmate_path:
        sys.path.insert(0, args.rockmate_path)
    import torch

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    doc = {"scale": args.scale, "torch": torch.__version__, "machine": platform.machine(),
           "cpu_threads": torch.get_num_threads(), "python": platform.python_version(),
           "fractions": args.fractions, "rounds": args.rounds,
           "bisect_steps": args.bisect_steps, "rockmate_note": ROCKMATE_NOTE}
    if args.solver_check:
        log("== solver check: full-size GPT-2 small")
        doc["solver_full_gpt2"] = solver_check(args.fractions, log)
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        t0 = time.perf_counter()
        r = run_model(name, args.scale, args, log)
        r["benchmark_seconds"] = time.perf_counter() - t0
        log(f"  ({r['benchmark_seconds']:.0f} s)")
        results.append(r)
        doc["results"] = results
        doc["total_seconds"] = time.perf_counter() - t_start
        out.write_text(json.dumps(doc, indent=1, default=float))  # after each model
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print()
    print(summary_table(results))
    print(f"\nwrote {out} and {out.with_suffix('.png')} in {doc['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
