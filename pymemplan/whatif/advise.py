"""``pymemplan.advise``: every memory technique users reach for, quantified on their model.

Each row is a configuration of the same training step, *traced* (``pymemplan.trace``),
never estimated by a rule of thumb: mixed precision, the largest batch, gradient
accumulation, activation checkpointing, another optimizer, quantized frozen weights,
sharding across GPUs. For each: the predicted peak of live bytes, the peak the
allocator would reserve (CUDA; replayed through the allocator model), whether it fits
the capacity, the compute it costs relative to the unchanged step, and the code that
applies it. The last row is the cheapest combination that fits.

Compute cost (``relative_compute``): estimated seconds per *sample* on a nominal device,
relative to the unchanged step, from the traced ops themselves: FLOPs from shapes
(``torch.utils.flop_counter``'s formulas) at a rate that depends on the dtype the op
computes in, plus bytes written for memory-bound ops (``cost.DeviceSpeed``). On CUDA,
fp32 matmuls are counted at half the bf16/fp16 rate (TF32 tensor cores); on CPU every
dtype gets the same rate. Recomputation under checkpointing appears in the traced
backward, so it is counted without a separate formula.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..planner.errors import PlannerError
from ..traces.replay import torch_policy_from_conf  # noqa: F401  (also this module's API)
from ..units import format_bytes, parse_bytes

TECHNIQUES = ("precision", "batch", "accumulation", "checkpoint", "allocator", "optimizer",
              "weights", "sharding")

# Allocators the "allocator" rows replay the step through (CUDA): policy -> (label, code).
_ALLOCATORS = {
    "torch=expandable_segments:True": (
        "PyTorch's expandable segments",
        "# before the first CUDA allocation (or in the shell:\n"
        "# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py)\n"
        "import os\n"
        "os.environ[\"PYTORCH_CUDA_ALLOC_CONF\"] = \"expandable_segments:True\""),
    "pymemplan-vmm": (
        "pymemplan-vmm",
        "import pymemplan\n"
        "pymemplan.enable(\"pymemplan-vmm\")  # before the first CUDA allocation"),
}

# Optimizers compared by the "optimizer" rows: name -> (factory, code).
_OPTIMIZER_CODE = {
    "sgd-momentum": "torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)",
    "adam": "torch.optim.Adam(model.parameters(), lr=1e-3)",
    "adamw": "torch.optim.AdamW(model.parameters(), lr=1e-3)",
    "adafactor": "torch.optim.Adafactor(model.parameters(), lr=1e-2)",
    "adamw-8bit": "bitsandbytes.optim.AdamW8bit(model.parameters(), lr=1e-3)",
}


# The largest batch searched for (a batch that fits there is reported as the limit).
BATCH_SEARCH_LIMIT = 1 << 20

def _optimizer_factory(name: str):
    import torch

    if name == "sgd-momentum":
        return lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam
    if name == "adamw":
        return torch.optim.AdamW
    if name == "adafactor":
        return getattr(torch.optim, "Adafactor", None)
    if name == "adamw-8bit":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return None
        return bitsandbytes.optim.AdamW8bit
    raise AssertionError(name)


@dataclass(frozen=True)
class Config:
    """One configuration of the step. ``batch`` is the micro-batch when ``accumulation``
    > 1 (the traced step is then the last micro-step: gradients present, optimizer runs)."""

    batch: int
    autocast: str | None = None           # None, "bf16", "fp16"
    optimizer: str | None = None          # None: the user's optimizer
    accumulation: int = 1
    checkpoint: tuple = ()                # ((module, policy), ...) from a checkpoint plan
    weights: str | None = None            # None, "int8", "nf4", "prune-0.3", ...
    sharding: str | None = None           # None, "ddp", "zero1", "zero2", "zero3", "fsdp"
    # Another allocator (a replay policy): changes the reserved memory, not the step.
    allocator: str | None = None

    def changes(self, base: "Config") -> list[str]:
        out = []
        if self.autocast:
            out.append(f"autocast {self.autocast}")
        if self.accumulation > 1:
            out.append(f"micro-batch {self.batch} x {self.accumulation} accumulation steps")
        elif self.batch != base.batch:
            out.append(f"batch {self.batch}")
        if self.checkpoint:
            out.append(f"checkpoint {len(self.checkpoint)} module(s)")
        if self.optimizer:
            out.append(f"optimizer {self.optimizer}")
        if self.weights:
            out.append(f"weights {self.weights}")
        if self.sharding:
            out.append(self.sharding)
        if self.allocator:
            out.append(_ALLOCATORS.get(self.allocator, (self.allocator,))[0])
        return out


@dataclass
class Row:
    """One configuration with its predicted memory and cost (see :func:`advise`)."""

    technique: str
    name: str
    config: Config
    peak_bytes: int | None
    reserved_bytes: int | None
    fits: bool | None
    relative_compute: float | None
    code: str = ""
    notes: str = ""
    breakdown: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    trace: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        c = self.config
        return {"technique": self.technique, "name": self.name,
                "config": {"batch": c.batch, "autocast": c.autocast, "optimizer": c.optimizer,
                           "accumulation": c.accumulation,
                           "checkpoint": dict(c.checkpoint), "weights": c.weights,
                           "sharding": c.sharding, "allocator": c.allocator},
                "peak_bytes": self.peak_bytes, "reserved_bytes": self.reserved_bytes,
                "fits": self.fits, "relative_compute": self.relative_compute,
                "code": self.code, "notes": self.notes, "breakdown": self.breakdown,
                **self.extra}


class Advice:
    """The rows of :func:`advise`; ``best`` is the cheapest configuration that fits."""

    def __init__(self, rows: list[Row], *, capacity: int, device: str, policy: str | None,
                 model: str, baseline: Row, best: Row | None, seconds: float,
                 world_size: int, batch: int):
        self.rows = rows
        self.capacity_bytes = capacity
        self.device = device
        self.policy = policy
        self.model = model
        self.baseline = baseline
        self.best = best
        self.seconds = seconds
        self.world_size = world_size
        self.batch = batch

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def rows_for(self, technique: str) -> list[Row]:
        return [r for r in self.rows if r.technique == technique]

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row named {name!r}; rows: {', '.join(r.name for r in self.rows)}")

    @property
    def fit_metric(self) -> str:
        return "reserved" if self.device == "cuda" else "peak"

    def to_dict(self) -> dict:
        return {"model": self.model, "device": self.device, "capacity_bytes": self.capacity_bytes,
                "allocator_policy": self.policy, "batch": self.batch,
                "world_size": self.world_size, "fit_on": self.fit_metric,
                "seconds": self.seconds, "rows": [r.to_dict() for r in self.rows],
                "best": self.best.to_dict() if self.best is not None else None}

    def to_json(self, path=None) -> str:
        import json

        s = json.dumps(self.to_dict(), indent=2, default=float)
        if path is not None:
            from pathlib import Path

            Path(path).write_text(s)
        return s

    def table(self, width: int | None = None):
        from .report import advice_table

        return advice_table(self)

    def summary(self, width: int | None = None) -> str:
        from .report import summary_text

        return summary_text(self, width)

    def print(self) -> None:
        from .report import print_advice

        print_advice(self)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        best = self.best.name if self.best is not None else "nothing fits"
        return (f"<Advice {self.model} on {self.device}, capacity "
                f"{format_bytes(self.capacity_bytes)}: {len(self.rows)} rows, best: {best}>")

    def plot(self, path, row: Row | None = None):
        """The timeline of ``row`` (default: the best, else the baseline) as a PNG."""
        r = row or self.best or self.baseline
        title = f"{self.model}: {r.name} ({format_bytes(r.peak_bytes or 0)} peak)"
        return r.trace.plot(path, title=title)

    def to_html(self, path) -> str:
        """One self-contained page (timeline, breakdown, table, code); returns its path."""
        from .report import write_html

        return write_html(self, path)


# -----------------------------------------------------------------------------------------
# Inputs at another batch size
# -----------------------------------------------------------------------------------------

def _leaves(inputs):
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(inputs)


def detect_batch(inputs) -> int | None:
    """The batch size: dim 0 of the first tensor input with at least one dimension."""
    import torch

    for a in _leaves(inputs):
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return int(a.shape[0])
    return None


def inputs_at_batch(inputs, old: int, new: int):
    """``inputs`` with every tensor whose dim 0 is ``old`` resized to ``new``, on the meta
    device: tracing reads only shapes and dtypes."""
    import torch
    from torch.utils import _pytree as pytree

    def resize(t):
        if t.dim() >= 1 and t.shape[0] == old:
            return torch.empty((new, *t.shape[1:]), dtype=t.dtype, device="meta") \
                .requires_grad_(t.requires_grad)
        return t
    return pytree.tree_map_only(torch.Tensor, resize, inputs)


# -----------------------------------------------------------------------------------------
# The advisor
# -----------------------------------------------------------------------------------------

_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def checkpoint_key(plan) -> tuple:
    """A plan's (module, policy) pairs in model order ("h.2" before "h.10")."""
    import re

    def natural(path: str):
        return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", path)]
    return tuple(sorted(plan.policies.items(), key=lambda kv: natural(kv[0])))


class _Advisor:
    def __init__(self, model, inputs, *, capacity: int, optimizer, loss_fn, device: str,
                 policy: str | None, make_inputs, world_size: int, trace_kwargs: dict,
                 progress: Callable | None, make_loss_fn: Callable | None = None):
        self.model = model
        self.inputs = inputs if isinstance(inputs, tuple) else (
            tuple(inputs) if isinstance(inputs, list) else (inputs,))
        self.capacity = capacity
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.policy = policy
        self.make_inputs = make_inputs
        self.make_loss_fn = make_loss_fn
        self.world_size = world_size
        self.trace_kwargs = trace_kwargs
        self.progress = progress
        self.chosen: tuple = TECHNIQUES
        self.batch0 = detect_batch(self.inputs)
        self._traces: dict[Config, Any] = {}
        self._measured: dict[Config, tuple] = {}
        # Batches below the inputs' own that the model cannot run (BatchNorm in training
        # refuses a batch of 1): why, by batch. The searches never answer one of them.
        self.cannot_run: dict[int, str] = {}

    # -- tracing -------------------------------------------------------------------------
    def _say(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what)

    def inputs_for(self, batch: int):
        if self.make_inputs is not None:
            out = self.make_inputs(batch)
            return out if isinstance(out, tuple) else (out,)
        if batch == self.batch0 or (self.batch0 is None and batch == 0):
            return self.inputs  # 0: the base configuration of inputs without a batch
        if self.batch0 is None:
            raise PlannerError(
                "cannot change the batch size: no input tensor has a batch dimension; pass "
                "make_inputs=lambda batch: (...) that builds the inputs for a batch size")
        return inputs_at_batch(self.inputs, self.batch0, batch)

    def _explain_resized(self, e: PlannerError, batch: int) -> None:
        """Adds to ``e``'s message (its first line kept as it is) that the step failed at a
        batch made by resizing dim 0 of the inputs, and which inputs were not resized: the
        usual cause is an input whose batch is not its dim 0 (a sequence-first tensor)."""
        import torch

        if self.make_inputs is not None or batch == self.batch0 or self.batch0 is None \
                or getattr(e, "_resized_noted", False):
            return
        kept = [f"input {i}: {tuple(a.shape)}" for i, a in enumerate(_leaves(self.inputs))
                if isinstance(a, torch.Tensor) and (a.dim() == 0 or a.shape[0] != self.batch0)]
        note = (f"\n(traced at batch {batch}: advise() made the inputs by resizing dim 0 of "
                f"each input tensor whose dim 0 is {self.batch0}, the batch it read from the "
                f"first input"
                + (f"; left as they were: {', '.join(kept)}" if kept else "")
                + ". If the batch is not dim 0 of every input, pass make_inputs=lambda batch: "
                  "(...) that builds the inputs for a batch size, or leave out the rows that "
                  "change it: techniques without 'batch' and 'accumulation')")
        e.args = (f"{e.args[0] if e.args else e}{note}", *e.args[1:])
        e._resized_noted = True

    def loss_for(self, batch: int):
        return self.loss_fn if self.make_loss_fn is None else self.make_loss_fn(batch)

    def optimizer_for(self, cfg: Config):
        if cfg.optimizer is None:
            return self.optimizer
        return _optimizer_factory(cfg.optimizer)

    def trace(self, cfg: Config):
        """The traced step of ``cfg`` (cached)."""
        if cfg.allocator is not None:  # the same step: only what is reserved differs
            return self.trace(replace(cfg, allocator=None))
        if cfg in self._traces:
            return self._traces[cfg]
        import torch

        from ..planner.api import trace as trace_step

        self._say(f"tracing {', '.join(cfg.changes(self.base)) or 'the step as it is'}"
                  f" (batch {cfg.batch})")
        autocast = getattr(torch, _AUTOCAST[cfg.autocast]) if cfg.autocast else None
        kwargs = dict(self.trace_kwargs)
        if cfg.autocast == "fp16":
            kwargs["grad_scaler"] = True
        if cfg.sharding is not None:
            from .sharding import trace_sharded

            t = trace_sharded(self.model, self.inputs_for(cfg.batch), strategy=cfg.sharding,
                              world_size=self.world_size, loss_fn=self.loss_for(cfg.batch),
                              optimizer=self.optimizer_for(cfg), device=self.device,
                              autocast=autocast, **kwargs)
        else:
            import contextlib

            from ..planner.checkpoint.apply_eager import apply, remove
            from .weights import prepared

            with contextlib.ExitStack() as stack:
                if cfg.weights is not None:
                    stack.enter_context(prepared(self.model, cfg.weights))
                if cfg.checkpoint:
                    apply(self.model, dict(cfg.checkpoint))
                    stack.callback(remove, self.model)
                try:
                    t = trace_step(self.model, self.inputs_for(cfg.batch),
                                   loss_fn=self.loss_for(cfg.batch),
                                   optimizer=self.optimizer_for(cfg), device=self.device,
                                   autocast=autocast, grads_present=cfg.accumulation > 1,
                                   **kwargs)
                except PlannerError as e:
                    self._explain_resized(e, cfg.batch)
                    raise
        if cfg.weights is not None:
            from .weights import rewrite

            t = rewrite(t, self.model, cfg.weights)
        self._traces[cfg] = t
        return t

    def measure(self, cfg: Config) -> tuple[int, int | None, bool]:
        """(peak of live bytes, peak reserved or None on CPU, fits)."""
        if cfg not in self._measured:
            t = self.trace(cfg)
            peak = t.peak_bytes  # checkpoint's saved RNG states included (CPU target)
            reserved = None
            if self.device == "cuda":
                cap = max(4 * peak, 1 << 30)
                reserved = t.reserved_peak(cfg.allocator or self.policy, capacity=cap)
            self._measured[cfg] = (peak, reserved, (reserved if reserved is not None
                                                    else peak) <= self.capacity)
        return self._measured[cfg]

    def fits(self, cfg: Config) -> bool:
        return self.measure(cfg)[2]

    def seconds_per_sample(self, cfg: Config) -> float:
        """Estimated compute time per sample (see the module's docstring)."""
        t = self.trace(cfg)
        phases = step_seconds(t)
        fwd_bwd = phases.get("forward", 0.0) + phases.get("backward", 0.0)
        opt = phases.get("optimizer", 0.0)
        samples = (cfg.batch or 1) * cfg.accumulation  # batch 0: inputs without one, per step
        # The optimizer step runs once per accumulated batch.
        return (cfg.accumulation * fwd_bwd + opt) / samples

    def relative_compute(self, cfg: Config) -> float:
        base = self.seconds_per_sample(self.base)
        return self.seconds_per_sample(cfg) / base if base else 1.0

    def row(self, technique: str, name: str, cfg: Config, code: str, notes: str = "",
            **extra) -> Row:
        peak, reserved, fits = self.measure(cfg)
        t = self.trace(cfg)
        return Row(technique, name, cfg, peak, reserved, fits, self.relative_compute(cfg),
                   code=code, notes=notes, breakdown=t.breakdown(), extra=extra, trace=t)

    # -- searches ------------------------------------------------------------------------
    def largest_batch(self, cfg: Config, limit: int = BATCH_SEARCH_LIMIT, metric=None) -> int:
        """The largest batch at which ``cfg`` fits (0: not even 1).

        Activation memory is affine in the batch for most models: interpolate the fit
        metric between the nearest traced batch sizes, trace there, and keep a bracket
        (largest that fits, smallest that does not) until they are adjacent, so the
        answer is confirmed by traces at the answer and at answer + 1, whatever the shape
        of the curve. ``metric(batch)``: what must stay within the capacity (default: the
        reserved peak on CUDA, the live peak on CPU).

        Reserved memory does not always grow with the batch: the allocator's segment sizes
        make it rise and fall (a small CNN reserved 26 MiB at batches 5-8 and 22 MiB at
        9-13). The live peak does grow, and what is reserved holds it, so on CUDA the
        bracket is found on the live peak first: no batch above its answer can fit. Below
        it, batches are tried downwards (16 at most, then the bracket again below them)."""
        def measured(b: int, reserved_too: bool) -> int:
            try:
                if reserved_too:
                    peak, reserved, _ = self.measure(replace(cfg, batch=b))
                else:
                    peak, reserved = self.trace(replace(cfg, batch=b)).peak_bytes, None
            except PlannerError as e:
                if b >= (self.batch0 or 0):
                    raise
                # Taken as fitting, so that the search goes on to the batches above it
                # (memory grows with the batch); the answer is never such a batch.
                self.cannot_run[b] = str(e)
                return 0
            return reserved if reserved is not None else peak

        if metric is not None:
            given = metric

            def metric(b: int) -> int:
                # As measured(): a batch below the inputs' own that the model cannot run
                # (BatchNorm at 1) is stepped over, whatever the metric traces.
                try:
                    return given(b)
                except PlannerError as e:
                    if b >= (self.batch0 or 0):
                        raise
                    self.cannot_run[b] = str(e)
                    return 0
        if metric is not None or self.device != "cuda":
            return self._bracket(cfg, metric or (lambda b: measured(b, True)), limit)
        top = self._bracket(cfg, lambda b: measured(b, False), limit)
        for b in range(top, max(top - 16, 0), -1):
            if b not in self.cannot_run and measured(b, True) <= self.capacity:
                return b
        if top <= 16:
            return 0
        return self._bracket(replace(cfg, batch=min(cfg.batch, top - 16)),
                             lambda b: measured(b, True), top - 16)

    def _bracket(self, cfg: Config, metric, limit: int) -> int:
        seen: dict[int, int] = {}
        lo, hi = 0, None
        b = max(1, cfg.batch)
        width = None
        for _ in range(64):
            seen[b] = metric(b)
            if seen[b] <= self.capacity:
                lo = max(lo, b)
            else:
                hi = b if hi is None else min(hi, b)
            if hi is not None and hi - lo <= 1:
                return 0 if lo in self.cannot_run else lo
            if lo >= limit:
                return lo
            b = self._next_batch(seen, lo, hi, limit)
            if hi is not None:
                # Safeguard: where the curve is not affine (a checkpoint plan changing
                # with the batch), interpolation can creep one batch at a time; when a
                # step did not halve the bracket, bisect instead.
                if width is not None and hi - lo > width // 2 and hi - lo > 2:
                    b = (lo + hi) // 2
                width = hi - lo
        return lo

    def _next_batch(self, seen: dict, lo: int, hi: int | None, limit: int) -> int:
        pts = sorted(seen.items())
        below = [p for p in pts if p[0] <= lo] or pts[:1]
        above = [p for p in pts if hi is not None and p[0] >= hi]
        if above:
            (b1, m1), (b2, m2) = below[-1], above[0]
        elif len(pts) >= 2:
            (b1, m1), (b2, m2) = pts[-2], pts[-1]
        else:
            (b1, m1), (b2, m2) = pts[0], pts[0]
        guess = None
        if b2 != b1 and m2 != m1:
            slope = (m2 - m1) / (b2 - b1)
            if slope > 0:
                guess = int(math.floor(b1 + (self.capacity - m1) / slope))
        if guess is None:  # one point, or memory flat in the batch: double / halve
            guess = lo * 2 if hi is None else (lo + hi) // 2
        if hi is None:
            guess = min(max(guess, lo + 1), limit, max(2 * lo, lo + 1) * 8)
        else:
            guess = min(max(guess, lo + 1), hi - 1)
        if guess in seen:  # the interpolation repeats itself: bisect
            guess = (lo + hi) // 2 if hi is not None else lo * 2
            if guess in seen or guess <= lo:
                guess = lo + 1
        return max(1, guess)

    def checkpoint_plan(self, cfg: Config):
        """A checkpoint plan for ``cfg`` that fits the capacity, or the error saying why
        none does. For CUDA the plan's budget (live bytes) is lowered until the traced
        reserved peak of the checkpointed step fits."""
        from ..planner.checkpoint.plan import BudgetTooSmallError

        t = self.trace(cfg)
        inputs = self.inputs_for(cfg.batch)
        budget = self.capacity
        peak, reserved, _ = self.measure(cfg)
        if reserved is not None:
            budget = self.capacity - max(0, reserved - peak)
        plan = None
        for attempt in range(6):
            if budget <= 0:
                break
            try:
                # verify=False: the loop below traces the checkpointed step itself (its
                # reserved peak too) and lowers the budget until it fits.
                plan = t.plan(budget, model=self.model, inputs=inputs, verify=False)
            except BudgetTooSmallError as e:
                return None, e
            ck = replace(cfg, checkpoint=checkpoint_key(plan))
            if not plan.policies or self.fits(ck):
                return plan, None
            p2, r2, _ = self.measure(ck)
            # Fragmentation grows with what is freed and re-allocated: step further each try.
            over = (r2 if r2 is not None else p2) - self.capacity
            budget -= int(over * (1 + attempt / 2)) + (1 << 20)
        return plan, PlannerError(
            f"the checkpoint plan for {format_bytes(self.capacity)} does not fit once the "
            f"allocator's fragmentation is counted")

    def checkpointed(self, cfg: Config) -> tuple[Config | None, int]:
        """``cfg`` with the checkpoint plan that fits the capacity (None if none does), and
        its fit metric: the checkpointed step's, or the least achievable peak."""
        plan, err = self.checkpoint_plan(cfg)
        if plan is not None:
            ck = replace(cfg, checkpoint=checkpoint_key(plan))
            peak, reserved, _ = self.measure(ck)
            return (ck if err is None else None), reserved if reserved is not None else peak
        least = getattr(err, "least_peak_bytes", None)
        return None, max(least or 0, self.capacity + 1)

    @property
    def base(self) -> Config:
        return Config(batch=self.batch0 or 0)


def step_seconds(t) -> dict[str, float]:
    """Estimated seconds of each phase of a traced step on a nominal device."""
    from ..planner.checkpoint.cost import DeviceSpeed

    speed = DeviceSpeed()
    half = ("bfloat16", "float16")
    out: dict[str, float] = {}
    for op in t.graph.ops:
        if op.flops:
            rate = speed.flops_per_s
            if t.device == "cuda" and op.dtype not in half:
                rate /= 2  # fp32 matmuls on TF32 tensor cores
            s = op.flops / rate
        else:
            s = 2.0 * op.written / speed.bytes_per_s
        out[op.phase] = out.get(op.phase, 0.0) + s
    return out


# -----------------------------------------------------------------------------------------
# Code snippets
# -----------------------------------------------------------------------------------------

def _code_autocast(dtype: str, device: str = "cuda") -> str:
    # The device the advice is for: torch.autocast('cuda') on a CPU step disables itself.
    if dtype == "fp16":
        return (f"scaler = torch.amp.GradScaler({device!r})\n"
                f"with torch.autocast({device!r}, dtype=torch.float16):\n"
                "    loss = loss_fn(model(*inputs))\n"
                "scaler.scale(loss).backward()\n"
                "scaler.step(optimizer); scaler.update(); optimizer.zero_grad(set_to_none=True)")
    return (f"with torch.autocast({device!r}, dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(*inputs))\n"
            "loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)")


def _code_accumulation(micro: int, steps: int, autocast: str | None = None,
                       device: str = "cuda") -> str:
    """The accumulation loop, each micro-step under ``autocast`` when the configuration has
    it (the micro-steps are what autocast must cover, not one more step after the loop)."""
    forward = f"loss = loss_fn(model(*inputs)) / {steps}"
    if autocast:
        forward = (f"with torch.autocast({device!r}, dtype=torch.{_AUTOCAST[autocast]}):\n"
                   f"        {forward}")
    scaled = autocast == "fp16"
    return ((f"scaler = torch.amp.GradScaler({device!r})\n" if scaled else "")
            + f"loader = DataLoader(dataset, batch_size={micro})  # {steps} per optimizer step\n"
            f"for i, inputs in enumerate(loader):\n"
            f"    {forward}\n"
            + ("    scaler.scale(loss).backward()\n" if scaled else "    loss.backward()\n")
            + f"    if (i + 1) % {steps} == 0:\n"
            + ("        scaler.step(optimizer); scaler.update()\n"
               "        optimizer.zero_grad(set_to_none=True)" if scaled else
               "        optimizer.step(); optimizer.zero_grad(set_to_none=True)"))


def _code_checkpoint(cfg: Config) -> str:
    """The row's own checkpoint plan, applied as traced: the modules and policies the row's
    figures come from (planning again from the code would need this row's batch, device
    and, on CUDA, the budget lowered for the allocator's fragmentation)."""
    lines = ["from pymemplan.planner.checkpoint import apply",
             "apply(model, {  # the checkpoint plan traced for this row, in place "
             "(the same module's remove(model) undoes it)"]
    lines += [f"    {m!r}: {p!r}," for m, p in cfg.checkpoint]
    lines.append("})")
    return "\n".join(lines)


def combined_code(cfg: Config, base: Config, capacity: int, world_size: int, model=None,
                  device: str = "cuda") -> str:
    parts = []
    if cfg.allocator:
        parts.append(_ALLOCATORS[cfg.allocator][1])
    if cfg.sharding:
        from .sharding import code_snippet

        parts.append(code_snippet(cfg.sharding, world_size, model, device=device))
    if cfg.optimizer:
        parts.append(f"optimizer = {_OPTIMIZER_CODE[cfg.optimizer]}")
    if cfg.weights:
        from .weights import code_snippet as weights_code

        parts.append(weights_code(cfg.weights))
    if cfg.checkpoint:
        parts.append(_code_checkpoint(cfg))
    if cfg.accumulation > 1:
        parts.append(_code_accumulation(cfg.batch, cfg.accumulation, cfg.autocast, device))
    else:
        if cfg.batch != base.batch:
            parts.append(f"loader = DataLoader(dataset, batch_size={cfg.batch})")
        if cfg.autocast:
            parts.append(_code_autocast(cfg.autocast, device))
    return "\n".join(parts) if parts else "# nothing to change"


# -----------------------------------------------------------------------------------------
# advise
# -----------------------------------------------------------------------------------------

def advise(model, inputs, *, capacity="80GiB", optimizer=None, target_batch: int | None = None,
           world_size: int = 1, device: str = "cuda", loss_fn=None, policy: str | None = None,
           techniques=None, make_inputs: Callable | None = None,
           make_loss_fn: Callable | None = None,
           progress: Callable | None = None, **trace_kwargs) -> Advice:
    """Quantify, on this model, every memory technique: each row is a traced configuration.

    - ``capacity``: the GPU's memory ("80GiB", "24GB" or bytes). On CUDA a configuration
      fits when the memory the allocator would *reserve* (``policy``: "torch" for
      PyTorch's native allocator, "torch=expandable_segments:True", or one of
      pymemplan's; by default PyTorch's as ``PYTORCH_CUDA_ALLOC_CONF`` sets it, see
      :func:`torch_policy_from_conf`) is at most the capacity; on CPU, when its peak of
      live bytes is.
    - ``optimizer``: as for :func:`pymemplan.trace` (default ``torch.optim.AdamW``).
    - ``target_batch``: the effective batch to reach by gradient accumulation (default:
      the batch of ``inputs``).
    - ``world_size``: GPUs to shard over (DDP, ZeRO-1/2/3, FSDP rows) when above 1.
    - ``techniques``: a subset of ``TECHNIQUES`` (default all).
    - ``make_inputs``: ``batch -> inputs``, when the batch size is not dim 0 of the inputs.
    - ``make_loss_fn``: ``batch -> loss_fn``, when the loss depends on the batch size (a
      closure over targets of that size); without it ``loss_fn`` serves every batch.
    - other keyword arguments go to :func:`pymemplan.trace` (``autocast`` excepted).
    """
    import torch

    t0 = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise PlannerError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        cap = parse_bytes(capacity)
    except (TypeError, ValueError, OverflowError) as e:
        raise PlannerError(f"capacity={capacity!r} is not a size: {e}") from None
    if cap <= 0:
        raise PlannerError(f"capacity must be positive, got {capacity!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise PlannerError(f"world_size must be a whole number of GPUs, at least 1; got "
                           f"{world_size!r}")
    chosen = (TECHNIQUES if techniques is None else
              (techniques,) if isinstance(techniques, str) else tuple(techniques))
    unknown = [x for x in chosen if x not in TECHNIQUES]
    if unknown:
        raise PlannerError(f"unknown technique(s) {', '.join(map(repr, unknown))}; choose "
                           f"from {', '.join(TECHNIQUES)}")
    if device not in ("cuda", "cpu"):
        raise PlannerError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if "autocast" in trace_kwargs:
        raise PlannerError("advise() compares autocast itself (the precision rows); trace "
                           "the step without passing autocast=")
    _check_trace_kwargs(trace_kwargs)
    if target_batch is not None and (not isinstance(target_batch, int)
                                     or isinstance(target_batch, bool) or target_batch < 1):
        raise PlannerError(f"target_batch must be a positive integer, got {target_batch!r}")
    if optimizer is None:
        optimizer = torch.optim.AdamW
    if device == "cpu":
        policy = None
    elif policy is None:
        import os

        try:
            policy, _ = torch_policy_from_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        except ValueError as e:
            raise PlannerError(str(e)) from None
    adv = _Advisor(model, inputs, capacity=cap, optimizer=optimizer, loss_fn=loss_fn,
                   device=device, policy=policy, make_inputs=make_inputs,
                   world_size=world_size, trace_kwargs=trace_kwargs, progress=progress,
                   make_loss_fn=make_loss_fn)
    if adv.batch0 == 0:
        raise PlannerError("the inputs' batch is empty (dim 0 of the first input tensor is 0): "
                           "pass inputs of at least one sample")
    if adv.batch0 is None:
        chosen = tuple(x for x in chosen if x not in ("batch", "accumulation"))
    adv.chosen = chosen
    _check_parameters_fit(model, cap, world_size)

    base = adv.base
    rows = [adv.row("baseline", "as it is", base, "# nothing to change")]
    from .techniques import ALL

    for name in TECHNIQUES:
        if name in chosen:
            rows.extend(ALL[name](adv, target_batch))
    best = _best(adv, rows, target_batch, chosen)
    if best is not None:
        rows.append(best)
    return Advice(rows, capacity=cap, device=device, policy=policy,
                  model=type(model).__name__, baseline=rows[0], best=best,
                  seconds=time.perf_counter() - t0, world_size=world_size,
                  batch=adv.batch0 or 0)


def _check_trace_kwargs(trace_kwargs: dict) -> None:
    """Keywords for :func:`pymemplan.trace` that advise() passes on: unknown ones (a typo)
    and those advise() sets itself for each row are refused before anything is traced."""
    import inspect

    from ..planner.api import trace

    own = {"model", "inputs", "loss_fn", "optimizer", "device", "autocast", "grads_present",
           "grad_scaler"}
    passed_on = [k for k in inspect.signature(trace).parameters if k not in own]
    for k in trace_kwargs:
        if k in own:
            raise PlannerError(f"advise() sets {k}= itself for each configuration it traces; "
                               f"call it without {k}=")
        if k not in passed_on:
            raise PlannerError(f"advise() got an unexpected keyword argument {k!r}; besides its "
                               f"own it takes pymemplan.trace's {', '.join(passed_on)}")


def _check_parameters_fit(model, capacity: int, world_size: int) -> None:
    """Parameters alone above the capacity: no single-GPU technique but smaller weights
    can help; unless sharding over ``world_size`` could, say which configuration might."""
    seen = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    if total <= capacity or total <= capacity * world_size:
        return
    ranks = math.ceil(total / capacity)
    # Sharded training holds parameters, gradients and Adam's two states: 4x the weights.
    ranks_train = math.ceil(4 * total / capacity)
    raise PlannerError(
        f"the parameters alone take {format_bytes(total)}, more than the capacity of "
        f"{format_bytes(capacity)}" + (f" x {world_size} GPUs" if world_size > 1 else "")
        + f": no single-GPU technique can fit this model. The smallest configurations that "
        f"could: FSDP / ZeRO-3 over at least {ranks} GPUs for the parameters alone, about "
        f"{ranks_train} with gradients and Adam state (pass world_size={ranks_train}), or "
        f"frozen int8 / 4-bit weights for fine-tuning with adapters.")


def _best(adv: _Advisor, rows: list[Row], target_batch, chosen) -> Row | None:
    """The cheapest configuration that fits (by estimated compute, then fewest changes).

    The unchanged step wins when it fits: changing nothing is free. Otherwise the
    candidates are the rows that keep the training the same (precision, accumulation to
    the same effective batch, checkpointing, sharding) and their combinations with
    checkpointing, and with another allocator (CUDA: it costs no compute, and may be what
    makes a cheaper configuration fit); rows that change the training itself (another
    optimizer, frozen or pruned weights) or its batch are the last resort."""
    base = adv.base
    if rows[0].fits:
        return replace(rows[0], technique="best", name="as it is: it fits")
    keeps_training = ("precision", "accumulation", "checkpoint", "allocator", "sharding")
    target = target_batch or adv.batch0

    def keeps(r: Row) -> bool:
        # Accumulation keeps the training only when it reaches the target exactly: 4 x 140
        # for a target of 509 (a prime) is another batch.
        return r.technique in keeps_training and not (
            r.technique == "accumulation" and target
            and r.config.batch * r.config.accumulation != target)

    same = [r.config for r in rows if r.fits and keeps(r)]
    # Rows that change the effective batch (accumulation that cannot reach the target
    # exactly), with the optimizer and weights rows: the last resort.
    other_batch = [r.config for r in rows if r.fits and r.technique == "accumulation"
                   and not keeps(r)]
    if "allocator" in chosen and adv.device == "cuda":
        for r in rows:
            if r.fits or not keeps(r) or r.config.allocator is not None:
                continue
            for policy in _ALLOCATORS:  # PyTorch's own setting first
                cfg = replace(r.config, allocator=policy)
                if policy != adv.policy and adv.fits(cfg):
                    same.append(cfg)
                    break
    if not same and "checkpoint" in chosen and "accumulation" in chosen and adv.batch0:
        # Micro-batches and checkpointing together: plan the micro-step that keeps the
        # batch largest.
        for ac in ([None, "bf16"] if "precision" in chosen else [None]):
            for micro in sorted({d for d in range(1, target + 1) if target % d == 0},
                                reverse=True)[:4]:
                cfg = replace(base, autocast=ac, batch=micro, accumulation=target // micro)
                if cfg.accumulation == 1:
                    continue
                try:
                    plan, err = adv.checkpoint_plan(cfg)
                except PlannerError as e:
                    if micro >= adv.batch0:
                        raise
                    adv.cannot_run[micro] = str(e)  # BatchNorm at 1: not a candidate
                    continue
                if plan is not None and err is None:
                    same.append(replace(cfg, checkpoint=checkpoint_key(plan)))
                    break
    if not same and "sharding" in chosen and adv.world_size > 1 and "precision" in chosen:
        from .sharding import STRATEGIES

        for strategy in STRATEGIES:
            cfg = replace(base, autocast="bf16", sharding=strategy)
            if adv.fits(cfg):
                same.append(cfg)
    found = same or other_batch + [r.config for r in rows if r.fits and r.technique in
                                   ("optimizer", "weights")]
    if not found:
        return None
    c = min(found, key=lambda c: (round(adv.relative_compute(c), 3), len(c.changes(base))))
    code = combined_code(c, base, adv.capacity, adv.world_size, adv.model, adv.device)
    changed = ("" if same else
               f" ({c.batch * c.accumulation} samples a step, not {target})"
               if c in other_batch else "")
    notes = "the cheapest configuration found that fits" + (
        "" if same else f"; it changes the training itself{changed}: nothing that keeps it "
                        f"fits")
    return adv.row("best", ", ".join(c.changes(base)), c, code, notes=notes)


def _accumulation_config(adv: _Advisor, cfg: Config, target: int) -> Config | None:
    """Micro-batch and steps reaching ``target`` samples per optimizer step: the largest
    micro-batch that fits with gradients already present, preferring divisors of
    ``target`` so every micro-batch is the same size."""
    largest = adv.largest_batch(replace(cfg, accumulation=2))
    if largest <= 0:
        return None
    largest = min(largest, target)
    micro = next((d for d in range(largest, 0, -1) if target % d == 0), largest)
    if micro < largest and micro * 2 < largest:
        micro = largest  # a divisor far below what fits wastes too much speed
    steps = math.ceil(target / micro)
    if steps == 1:
        c = replace(cfg, batch=micro)
        return c if adv.fits(c) else None
    c = replace(cfg, batch=micro, accumulation=steps)
    return c if adv.fits(c) else None
