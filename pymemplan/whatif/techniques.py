"""The rows of :func:`pymemplan.advise`, one function per technique.

Each function takes the advisor (which traces and caches configurations) and returns
rows; every number in a row comes from a traced step.
"""

from __future__ import annotations

from dataclasses import replace

from ..planner.graph import ACTIVATION, CATEGORIES, GRADIENT, OPTIMIZER_STATE
from ..planner.errors import PlannerError
from ..units import format_bytes
from .advise import (BATCH_SEARCH_LIMIT, _ALLOCATORS, _OPTIMIZER_CODE, Config, Row,
                     _accumulation_config, _Advisor, _code_autocast, _optimizer_factory,
                     checkpoint_key, combined_code)


def _diff(a: dict, b: dict) -> str:
    """What changed at the peak, category by category, largest change first."""
    parts = []
    for c in sorted(CATEGORIES, key=lambda c: -abs(b.get(c, 0) - a.get(c, 0))):
        d = b.get(c, 0) - a.get(c, 0)
        if abs(d) >= max(1 << 20, 0.005 * max(sum(a.values()), 1)):
            parts.append(f"{c.replace('_', ' ')} {'+' if d > 0 else '-'}{format_bytes(abs(d))}")
    return ", ".join(parts) or "no category changes by more than 0.5%"


def _state_bytes(t) -> int:
    return sum(x.size for x in t.graph.tensors if x.category == OPTIMIZER_STATE)


def _grad_bytes(t) -> int:
    return sum(x.size for x in t.graph.tensors if x.category == GRADIENT)


def _cannot(technique: str, name: str, cfg: Config, err: Exception) -> Row:
    """A configuration that cannot run on this model: a row that says why, with no figures,
    rather than the end of the whole comparison."""
    return Row(technique, name, cfg, None, None, None, None, notes=f"cannot run on this model: {err}")


def precision(adv: _Advisor, target_batch) -> list:
    base = adv.trace(adv.base)
    rows = []
    for ac, label in (("bf16", "autocast bf16"), ("fp16", "autocast fp16 + GradScaler")):
        cfg = replace(adv.base, autocast=ac)
        t = adv.trace(cfg)
        saved = sum(x.size for x in t.graph.tensors if x.category == ACTIVATION)
        saved0 = sum(x.size for x in base.graph.tensors if x.category == ACTIVATION)
        notes = (f"at the peak: {_diff(base.breakdown(), t.breakdown())}. Activations saved "
                 f"for backward: {format_bytes(saved0)} -> {format_bytes(saved)}; fp32 "
                 f"parameters, gradients and optimizer state do not shrink")
        if ac == "fp16":
            notes += "; the grad scaler's scale and inf-check tensors are traced too"
        rows.append(adv.row("precision", label, cfg, _code_autocast(ac, adv.device), notes))
    return rows


def _none_fits(adv: _Advisor, what: str = "batch") -> str:
    if 1 not in adv.cannot_run:
        return "not even a batch of 1 fits" if what == "batch" else \
            "not even micro-batches of 1 fit"
    return (f"no {what} that the model can run fits: a batch of 1 cannot run "
            f"({adv.cannot_run[1].splitlines()[0][:160]})")


def batch(adv: _Advisor, target_batch) -> list:
    rows = []
    variants = [(None, False), ("bf16", False)]
    if "checkpoint" in adv.chosen:
        variants.append(("bf16", True))
    for ac, ckpt in variants:
        cfg = replace(adv.base, autocast=ac)
        label = "largest batch" + (f" (autocast {ac}" if ac else "") + \
            (" + checkpointing)" if ckpt else (")" if ac else ""))
        if ckpt:
            b = adv.largest_batch(cfg, metric=lambda n: adv.checkpointed(
                replace(cfg, batch=n))[1])
        else:
            b = adv.largest_batch(cfg)
        if b == 0:
            r = adv.row("batch", label, replace(cfg, batch=1 if 1 not in adv.cannot_run
                                                else adv.base.batch), "",
                        notes=_none_fits(adv), largest_batch=0)
            r.fits = False
            rows.append(r)
            continue
        c = replace(cfg, batch=b)
        if ckpt:
            c = adv.checkpointed(c)[0]
        else:
            p1, r1, _ = adv.measure(replace(cfg, batch=b + 1))
            above = r1 if r1 is not None else p1
        code = combined_code(c, adv.base, adv.capacity, adv.world_size, adv.model, adv.device)
        if b >= BATCH_SEARCH_LIMIT:
            # The search stops there: memory that barely grows with the batch (a factory
            # that builds the same inputs whatever batch= says?) fits any batch.
            notes = (f"the search's limit: batch {b:,} still fits, and memory barely grows "
                     "with the batch (do the inputs follow batch=?)")
        else:
            notes = (f"batch {b + 1} does not fit, even checkpointed" if ckpt else
                     f"batch {b + 1} needs {format_bytes(above)}")
        rows.append(adv.row("batch", label, c, code, largest_batch=b, notes=notes))
    return rows


def accumulation(adv: _Advisor, target_batch) -> list:
    target = target_batch or adv.batch0
    rows = []
    for ac in (None, "bf16"):
        cfg = replace(adv.base, autocast=ac)
        c = _accumulation_config(adv, cfg, target)
        label = f"accumulate to {target}" + (f" (autocast {ac})" if ac else "")
        if c is None:
            micro = 1 if 1 not in adv.cannot_run else adv.base.batch
            r = adv.row("accumulation", label,
                        replace(cfg, batch=micro, accumulation=max(target // micro, 2)),
                        "", notes=_none_fits(adv, "micro-batches"))
            r.fits = False
        else:
            t = adv.trace(c)
            code = combined_code(c, adv.base, adv.capacity, adv.world_size, adv.model, adv.device)
            samples = c.batch * c.accumulation
            # No divisor of the target fits well (a prime target): the step takes more.
            over = (f" ({samples} samples a step: no micro-batch that fits divides {target}; "
                    f"micro-batches of 1 x {target} would be exact)"
                    if samples != target else "")
            notes = (f"micro-batch {c.batch} x {c.accumulation} steps{over}; the accumulated "
                     f"gradients ({format_bytes(_grad_bytes(t))}) stay allocated through "
                     f"every micro-step") if c.accumulation > 1 else \
                f"the whole batch of {target} fits: no accumulation needed"
            r = adv.row("accumulation", label, c, code, notes=notes,
                        micro_batch=c.batch, steps=c.accumulation,
                        accumulated_gradient_bytes=_grad_bytes(t))
        rows.append(r)
    return rows


def checkpoint(adv: _Advisor, target_batch) -> list:
    rows = []
    for ac in (None, "bf16"):
        cfg = replace(adv.base, autocast=ac)
        label = "checkpointing" + (f" (autocast {ac})" if ac else "")
        plan, err = adv.checkpoint_plan(cfg)
        if plan is None:
            r = adv.row("checkpoint", label, cfg, "", notes=str(err))
            r.fits = False
            r.extra["least_peak_bytes"] = getattr(err, "least_peak_bytes", None)
            rows.append(r)
            continue
        c = replace(cfg, checkpoint=checkpoint_key(plan))
        code = combined_code(c, adv.base, adv.capacity, adv.world_size, adv.model, adv.device)
        notes = (f"{len(plan.policies)} module(s) checkpointed, est. recompute "
                 f"{plan.recompute_cost['fraction_of_forward']:.1%} of the forward "
                 f"({plan.solver}, {'optimal' if plan.optimal else 'not proved optimal'})")
        if not plan.policies:
            notes = "fits without checkpointing"
        r = adv.row("checkpoint", label, c, code, notes=notes,
                    recompute_fraction_of_forward=plan.recompute_cost["fraction_of_forward"])
        if err is not None:
            r.fits = False
            r.notes += f"; {err}"
        rows.append(r)
    return rows


def allocator(adv: _Advisor, target_batch) -> list:
    """The same step under another allocator (CUDA: the fit is on reserved memory). Only
    the memory reserved beyond the live bytes changes, and with it the largest batch."""
    if adv.device != "cuda":
        return []
    peak0, reserved0, _ = adv.measure(adv.base)
    largest0 = adv.largest_batch(adv.base) if "batch" in adv.chosen else None
    rows = []
    for policy, (label, code) in _ALLOCATORS.items():
        if policy == adv.policy:
            continue
        cfg = replace(adv.base, allocator=policy)
        peak, reserved, _ = adv.measure(cfg)
        notes = (f"reserved beyond the live peak: {format_bytes(reserved0 - peak0)} with "
                 f"{adv.policy} -> {format_bytes(reserved - peak)}")
        extra = {}
        if largest0 is not None:
            extra["largest_batch"] = adv.largest_batch(cfg)
            notes += f"; largest batch {extra['largest_batch']} ({largest0} with {adv.policy})"
        rows.append(adv.row("allocator", label, cfg, code, notes, **extra))
    return rows


def optimizer(adv: _Advisor, target_batch) -> list:
    rows = []
    for name in ("sgd-momentum", "adam", "adamw", "adafactor", "adamw-8bit"):
        if _optimizer_factory(name) is None:
            continue  # not provided by the installed packages
        cfg = replace(adv.base, optimizer=name)
        try:
            t = adv.trace(cfg)
        except PlannerError as e:
            # Adafactor refuses complex parameters, for one.
            rows.append(_cannot("optimizer", f"optimizer {name}", cfg, e))
            continue
        rows.append(adv.row("optimizer", f"optimizer {name}", cfg,
                            f"optimizer = {_OPTIMIZER_CODE[name]}",
                            notes=f"optimizer state {format_bytes(_state_bytes(t))}; "
                                  f"changes the training itself",
                            state_bytes=_state_bytes(t)))
    return rows


def weights(adv: _Advisor, target_batch) -> list:
    from .weights import code_snippet, describe

    rows = []
    for spec in ("int8", "nf4", "prune-0.3"):
        cfg = replace(adv.base, weights=spec)
        try:
            rows.append(adv.row("weights", describe(spec), cfg, code_snippet(spec),
                                notes=_weights_note(spec)))
        except PlannerError as e:
            r = adv.row("weights", describe(spec), adv.base, "", notes=str(e))
            r.fits = None
            rows.append(r)
    return rows


def _weights_note(spec: str) -> str:
    if spec.startswith("prune"):
        return ("estimate on the traced graph: the pruned layers' weights, their gradients "
                "and optimizer state, and the tensors their ops make shrink by the pruned "
                "fraction. Unstructured sparsity saves nothing in dense storage (a "
                "torch.nn.utils.prune mask even adds a copy); only removing channels does")
    return ("Linear weights frozen and stored quantized (fine-tuning with adapters, whose "
            "own small parameters are not counted); each matmul dequantizes its weight to "
            "the compute dtype while it runs")


def sharding(adv: _Advisor, target_batch) -> list:
    if adv.world_size <= 1:
        return []
    from .sharding import STRATEGIES, code_snippet, communication_bytes

    rows = []
    for strategy in STRATEGIES:
        cfg = replace(adv.base, sharding=strategy)
        try:
            comm = communication_bytes(adv.model, strategy, adv.world_size)
            adv.trace(cfg)
        except PlannerError as e:
            # ZeRO-1 refuses parameters of mixed dtypes (complex beside real), for one.
            rows.append(_cannot("sharding", f"{strategy} x {adv.world_size}", cfg, e))
            continue
        rows.append(adv.row("sharding", f"{strategy} x {adv.world_size}", cfg,
                            code_snippet(strategy, adv.world_size, adv.model,
                                         device=adv.device),
                            notes=f"per rank; sends {format_bytes(sum(comm.values()))} per "
                                  f"step per rank", communication_bytes=comm))
    return rows


ALL = {"precision": precision, "batch": batch, "accumulation": accumulation,
       "checkpoint": checkpoint, "allocator": allocator, "optimizer": optimizer,
       "weights": weights, "sharding": sharding}

__all__ = ["ALL", "Config"]
