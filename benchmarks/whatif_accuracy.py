"""How exact is ``pymemplan.advise``? Every row against a real CPU step in its configuration.

    python benchmarks/whatif_accuracy.py               # reduced sizes: 23 min on 2 busy cores
    python benchmarks/whatif_accuracy.py --markdown    # also print the tables of docs/whatif.md
    python benchmarks/whatif_accuracy.py --report --markdown   # tables of the last run
    python benchmarks/whatif_accuracy.py --models bert --update --sharding skip  # redo one
    python benchmarks/whatif_accuracy.py --scale full  # the planner_accuracy sizes (slow)
    python benchmarks/whatif_accuracy.py --models resnet50 --no-kitsune
    python benchmarks/whatif_accuracy.py 2>/dev/null    # tracebacks aside, stderr is noise

For GPT-2 small (12 layers), BERT-base and ResNet-50 (``pymemplan.planner.models``, real
random weights on the CPU), ``pymemplan.advise(..., device="cpu")`` (kernel probes on, the
CPU default) runs with AdamW as the user's optimizer, at a capacity halfway between the
step's peak and the least peak any checkpoint plan reaches (from a quick trace, rounded
down to a MiB; on no predicted boundary). The step as it is does not fit, so every
technique has work to do: the checkpoint rows carry a real plan, the accumulation rows a
real micro-batch, the largest batch is below the example's. Rows: precision (autocast
bf16; fp16 + GradScaler), largest batch (fp32, bf16), accumulation (fp32, bf16),
checkpointing (fp32, bf16), optimizers (sgd-momentum, adam, adamw, adafactor), weights
(int8, nf4, prune-0.3), best.

Each row that can run on a CPU is then run for real, in its configuration, and its exact
peak measured (``pymemplan.planner.measure.measure_step``: the profiler's allocation events
of a steady-state step, the optimizer's state created by a warm-up step first):

- autocast rows under ``torch.autocast("cpu", dtype)``; fp16 with ``torch.amp.GradScaler``;
- accumulation rows as their last micro-step (``grads_present=True``: gradients exist,
  backward adds into them, the optimizer steps), at the row's micro-batch;
- checkpoint rows with the row's plan applied (``apply_eager.apply``), then removed;
- optimizer rows with that optimizer;
- inputs at another batch are real random tensors of the shapes ``inputs_at_batch``
  gives (token ids uniform over the vocabulary, images standard normal).

Weight rows (int8 / nf4 / pruning) are estimates on the traced graph with no CPU
counterpart in torch: reported as not measurable, never dropped. The fp16 rows of a
convolutional model are not run by default (``--fp16-conv`` runs them): CPU fp16
convolution backward is a slow reference path, minutes per ResNet-50 step.

**Largest batch.** The true largest batch under the capacity comes from real steps:
a batch fits when its measured peak is at most the capacity. The search starts at the
prediction ``b`` (fit at ``b``, then at ``b + 1``) and walks/bisects from there, so the
answer is always proven by a measured fit at the answer and a measured non-fit one
above. (Memory grows with the batch; the search assumes it does not shrink.)

**torch-kitsune** (``pip install torch-kitsune``), when installed: its
``kitsune.predict.predict_memory(model, input_shape, batch_size, dtype, optimizer)``
total for each comparable row (``dtype`` bf16/fp16 for the autocast rows; it has no
notion of autocast, accumulation, checkpointing or Adafactor), and its largest batch
under the same capacity (its own total ≤ capacity). Which of its estimators ran (FX,
meta tensors, per-layer formulas) is recorded from its log.

**Sharding** (DDP / FSDP over 2 gloo ranks): measured by ``benchmarks/whatif_sharding.py``
(``run(models, strategies)``); when that file exists its results are merged under
``"sharding"``, otherwise the JSON says it was not run.

Writes ``benchmarks/results/whatif_accuracy.json``. Exit status 0 when every target is met:
every measurable predicted peak within 1% of the measured one, and every predicted
largest batch equal to the true one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "whatif_accuracy.json"
TARGET_ERROR = 0.01

# Sizes: "reduced" keeps each real CPU step to seconds on 2 cores.
SCALES = {
    "reduced": {"gpt2": dict(batch=4, seq_len=128), "bert": dict(batch=4, seq_len=128),
                "resnet50": dict(batch=4)},
    "full": {"gpt2": dict(batch=4, seq_len=512), "bert": dict(batch=4, seq_len=512),
             "resnet50": dict(batch=8)},
}
TECHNIQUES = ["precision", "batch", "accumulation", "checkpoint", "optimizer", "weights"]
FP16_CONV_SLOW = (
    "not run: CPU fp16 convolution backward takes a slow reference path (on the 2-core "
    "machine of the README: 9.2 s for one 64-channel 3x3 convolution at batch 4 x 56 x 56, "
    "against 0.58 s in fp32 and 1.3 s in bf16), so one real fp16 ResNet-50 step takes many "
    "minutes; pass --fp16-conv to run it")
MAX_SEARCH_STEPS = 8  # real steps per largest-batch search, at most


# -----------------------------------------------------------------------------------------
# Quiet: the CPU profiler (measure_step, the kernel probe) prints two lines per use on fd 2.
# -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_fd2(enabled: bool = True):
    """Send fd 2 to a temporary file; on an exception, print its last lines."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            log.seek(0)
            tail = [ln for ln in log.read().decode(errors="replace").splitlines()
                    if not ln.startswith("USDT:")][-20:]
            if tail:
                print("\n".join(tail), file=sys.stderr)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def say(*a) -> None:
    print(*a, flush=True)


# -----------------------------------------------------------------------------------------
# Workloads and real inputs
# -----------------------------------------------------------------------------------------

def workload(name: str, size: dict):
    import torch

    from pymemplan.planner.models import BUILTIN

    torch.manual_seed(0)
    w = BUILTIN[name](device="cpu", **size)
    w.model.train()
    return w


def real_inputs(w, batch: int):
    """Real random inputs of ``batch`` samples, shaped as ``inputs_at_batch`` says."""
    import torch

    from pymemplan.whatif.advise import detect_batch, inputs_at_batch

    b0 = detect_batch(w.inputs)
    if batch == b0:
        return w.inputs
    vocab = getattr(getattr(w.model, "config", None), "vocab_size", None)
    g = torch.Generator().manual_seed(batch)
    out = []
    for m in inputs_at_batch(w.inputs, b0, batch):
        if m.dtype.is_floating_point:
            out.append(torch.randn(m.shape, dtype=m.dtype, generator=g))
        else:
            out.append(torch.randint(0, vocab or 2, m.shape, dtype=m.dtype, generator=g))
    return tuple(out)


def optimizer_factory(name: str | None):
    import torch

    from pymemplan.whatif.advise import _optimizer_factory

    return torch.optim.AdamW if name is None else _optimizer_factory(name)


# -----------------------------------------------------------------------------------------
# Measuring a configuration for real
# -----------------------------------------------------------------------------------------

_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def config_key(cfg) -> tuple:
    """Configs that run the same real step ("optimizer adamw" is the user's AdamW)."""
    return (cfg.batch, cfg.autocast, cfg.optimizer if cfg.optimizer != "adamw" else None,
            cfg.accumulation > 1, cfg.checkpoint)


def unmeasurable(cfg) -> str | None:
    if cfg.weights is not None:
        return (f"not measurable on CPU: weights {cfg.weights!r} is an estimate on the "
                f"traced graph (quantized / pruned storage has no CPU training step in torch)")
    if cfg.sharding is not None:
        return "sharding: measured by benchmarks/whatif_sharding.py (see 'sharding')"
    return None


class Runner:
    """Runs configurations of one workload for real, each once (cached by config)."""

    def __init__(self, w, quiet: bool, skip: dict | None = None):
        self.w = w
        self.quiet = quiet
        self.skip = skip or {}  # autocast -> why it is not run
        self.cache: dict[tuple, dict] = {}
        self.steps = 0
        self.seconds = 0.0

    def measure(self, cfg) -> dict:
        key = config_key(cfg)
        if key in self.cache:
            return self.cache[key]
        if cfg.autocast in self.skip:
            return {"measured_peak_bytes": None, "why": self.skip[cfg.autocast]}
        import torch

        from pymemplan.planner.checkpoint.apply_eager import apply, remove
        from pymemplan.planner.measure import measure_step

        model = self.w.model
        opt = optimizer_factory(cfg.optimizer)(model.parameters())
        autocast = getattr(torch, _AUTOCAST[cfg.autocast]) if cfg.autocast else None
        inputs = real_inputs(self.w, cfg.batch)
        t0 = time.perf_counter()
        try:
            with quiet_fd2(self.quiet), settled_grad_scaler():
                if cfg.checkpoint:
                    apply(model, dict(cfg.checkpoint))
                try:
                    m = measure_step(model, inputs, loss_fn=self.w.loss_fn, optimizer=opt,
                                     autocast=autocast, grads_present=cfg.accumulation > 1,
                                     grad_scaler=cfg.autocast == "fp16")
                finally:
                    if cfg.checkpoint:
                        remove(model)
            out = {"measured_peak_bytes": m.peak_bytes}
            steps = _optimizer_steps(opt)
            if steps is not None and steps < 2:
                # GradScaler skipped a step (inf/NaN gradients): the measured step is not
                # the one predicted (which includes the optimizer step).
                out = {"measured_peak_bytes": None, "skipped_step_peak_bytes": m.peak_bytes,
                       "failure": f"the optimizer stepped {steps} time(s) of 2: GradScaler "
                                  f"found inf gradients and skipped optimizer.step(), so the "
                                  f"measured step is not the predicted one"}
        except Exception as e:  # noqa: BLE001 - reported in the results
            out = {"measured_peak_bytes": None, "failure": f"{type(e).__name__}: {e}"}
        finally:
            model.zero_grad(set_to_none=True)
            del opt
            gc.collect()
        dt = time.perf_counter() - t0
        self.steps += 1
        self.seconds += dt
        out["measure_seconds"] = round(dt, 2)
        self.cache[key] = out
        return out


@contextlib.contextmanager
def settled_grad_scaler(init_scale: float = 1.0):
    """``torch.amp.GradScaler`` starting at ``init_scale`` instead of 2**16 while
    ``measure_step`` builds one. With random weights the default scale overflows fp16
    gradients in the first steps, and a step with inf gradients skips ``optimizer.step()``:
    not the steady-state step that is predicted (the scaler settled, the optimizer
    stepping). The scale's value changes no allocation."""
    import torch

    base = torch.amp.GradScaler

    class Settled(base):
        def __init__(self, device="cuda", init_scale_=init_scale, **kw):
            kw.setdefault("init_scale", init_scale_)
            super().__init__(device, **kw)

    torch.amp.GradScaler = Settled
    try:
        yield
    finally:
        torch.amp.GradScaler = base


def _optimizer_steps(opt) -> int | None:
    """How many steps the optimizer took, from its per-parameter ``step`` counters."""
    import torch

    for st in opt.state.values():
        s = st.get("step")
        if s is not None:
            return int(s.item() if isinstance(s, torch.Tensor) else s)
    return 0 if not opt.state else None


# -----------------------------------------------------------------------------------------
# torch-kitsune
# -----------------------------------------------------------------------------------------

def kitsune_status() -> dict:
    try:
        import kitsune
        from kitsune.predict import predict_memory  # noqa: F401
    except ImportError as e:
        return {"installed": False, "why": f"{type(e).__name__}: {e}",
                "install": "pip install torch-kitsune"}
    return {"installed": True, "version": getattr(kitsune, "__version__", "?"),
            "api": "kitsune.predict.predict_memory(model, input_shape, batch_size, dtype, "
                   "optimizer, training=True).total_bytes"}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage().split("\n")[0][:160])


_KITSUNE_OPT = {None: "adamw", "adamw": "adamw", "adam": "adam", "sgd-momentum": "sgd_momentum",
                "adafactor": "adafactor"}


def kitsune_predict(w, batch: int, autocast: str | None, optimizer: str | None,
                    quiet: bool) -> dict:
    """kitsune's total for this configuration, and which of its estimators ran."""
    import torch
    from kitsune.predict import predict_memory

    dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[autocast]
    shape = tuple(w.inputs[0].shape[1:])
    log = logging.getLogger("kitsune")
    cap = _Capture()
    log.addHandler(cap)
    old = log.level
    log.setLevel(logging.DEBUG)
    t0 = time.perf_counter()
    try:
        with quiet_fd2(quiet), torch.random.fork_rng():
            r = predict_memory(w.model, shape, batch_size=batch, dtype=dtype,
                               optimizer=_KITSUNE_OPT[optimizer], training=True)
    except Exception as e:  # noqa: BLE001
        return {"predicted_peak_bytes": None, "error": f"{type(e).__name__}: {e}"}
    finally:
        log.removeHandler(cap)
        log.setLevel(old)
    out = {"predicted_peak_bytes": int(r.total_bytes),
           "parts": {"parameters": r.param_bytes, "gradients": r.gradient_bytes,
                     "optimizer": r.optimizer_bytes, "activations": r.activation_bytes,
                     "overhead_15pct": r.overhead_bytes},
           "estimators": [ln for ln in cap.lines if "estimat" in ln.lower()
                          or "fail" in ln.lower()],
           "seconds": round(time.perf_counter() - t0, 2)}
    if optimizer == "adafactor":
        out["note"] = "kitsune has no Adafactor: unknown optimizers count as Adam (2 states)"
    if autocast:
        out["note"] = (f"kitsune has no autocast: dtype={dtype} (activations at 2 bytes, "
                       f"parameters as they are)")
    return out


def kitsune_largest_batch(w, capacity: int, autocast: str | None, quiet: bool,
                          limit: int = 4096) -> dict:
    """The largest batch whose kitsune total is at most ``capacity``: its totals are
    affine in the batch, so extrapolate from batches 1 and 2, then confirm at the answer
    and one above with kitsune itself."""
    calls = {}

    def total(b):
        if b not in calls:
            calls[b] = kitsune_predict(w, b, autocast, None, quiet)["predicted_peak_bytes"]
        return calls[b]

    t1, t2 = total(1), total(2)
    if t1 is None or t2 is None:
        return {"largest_batch": None, "error": "kitsune failed", "totals": calls}
    if t1 > capacity:
        b = 0
    elif t2 <= t1:
        b = limit
    else:
        b = min(limit, 1 + int((capacity - t1) // (t2 - t1)))
    for _ in range(6):  # confirm, nudging if kitsune is not exactly affine
        if b >= 1 and total(b) > capacity:
            b -= 1
        elif b < limit and total(b + 1) <= capacity:
            b += 1
        else:
            break
    return {"largest_batch": b, "capped_at_limit": b >= limit,
            "totals": {str(k): v for k, v in sorted(calls.items())}}


# -----------------------------------------------------------------------------------------
# The true largest batch
# -----------------------------------------------------------------------------------------

def true_largest_batch(runner: Runner, cfg, predicted: int, capacity: int) -> dict:
    """Real steps from the prediction outwards: a measured fit at the answer and a
    measured non-fit one above. ``cfg`` is the row's configuration (batch replaced)."""
    peaks: dict[int, int | None] = {}

    def fits(b: int) -> bool | None:
        if b not in peaks:
            say(f"    real step at batch {b} ...")
            peaks[b] = runner.measure(replace(cfg, batch=b))["measured_peak_bytes"]
        return None if peaks[b] is None else peaks[b] <= capacity

    lo, hi = 0, None  # the largest measured fit (0: none yet), the smallest non-fit
    b, step = max(1, predicted), 1
    for _ in range(MAX_SEARCH_STEPS):
        f = fits(b)
        if f is None:
            return {"true_largest_batch": None, "error": "a real step failed",
                    "measured_peaks": {str(k): v for k, v in sorted(peaks.items())}}
        if f:
            lo = b
        else:
            hi = b
        if hi is not None and hi == lo + 1:
            break
        if hi is None:      # only fits so far: walk up, +1, +2, +4 ...
            b, step = lo + step, 2 * step
        elif lo == 0:       # no fit yet: walk down, -1, -2, -4 ...
            b, step = max(1, hi - step), 2 * step
        else:               # bracketed: bisect
            b = (lo + hi) // 2
    proven = hi is not None and hi == lo + 1
    return {"true_largest_batch": lo if proven else None,
            "proven": proven,
            "measured_peaks": {str(k): v for k, v in sorted(peaks.items())},
            "real_steps": len(peaks)}


# -----------------------------------------------------------------------------------------
# One model
# -----------------------------------------------------------------------------------------

def _row_result(row, runner: Runner, kit: dict | None) -> dict:
    cfg = row.config
    r = {"technique": row.technique,
         "row": f"best: {row.name}" if row.technique == "best" else row.name,
         "config": row.to_dict()["config"], "predicted_peak_bytes": row.peak_bytes,
         "fits": row.fits}
    why = unmeasurable(cfg)
    if row.peak_bytes is None:
        why = why or f"no prediction: {row.notes}"
    if why:
        r.update(measured_peak_bytes=None, measurable=False, why=why)
    else:
        say(f"  {row.name} (batch {cfg.batch}"
            f"{f' x {cfg.accumulation}' if cfg.accumulation > 1 else ''}) ...")
        m = runner.measure(cfg)
        r.update(m, measurable=m.get("measured_peak_bytes") is not None)
        if r["measurable"]:
            d = row.peak_bytes - m["measured_peak_bytes"]
            r["error_bytes"] = d
            r["error"] = d / m["measured_peak_bytes"]
            say(f"    predicted {row.peak_bytes:,}  measured {m['measured_peak_bytes']:,}  "
                f"error {d:+,} B ({100 * r['error']:+.4f}%)")
        elif m.get("failure"):
            say(f"    not compared: {m['failure']}")
    if kit is not None:
        r["kitsune"] = kit
        if kit.get("predicted_peak_bytes") and r.get("measured_peak_bytes"):
            k = kit["predicted_peak_bytes"]
            r["kitsune"]["error"] = (k - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
    return r


_KITSUNE_CACHE: dict = {}


def _kitsune_for(w, row, quiet) -> dict | None:
    c = row.config
    if c.checkpoint or c.weights or c.sharding:
        return {"predicted_peak_bytes": None, "why": "kitsune has no equivalent"}
    key = (id(w), c.batch, c.autocast, _KITSUNE_OPT[c.optimizer])
    if key not in _KITSUNE_CACHE:
        _KITSUNE_CACHE[key] = kitsune_predict(w, c.batch, c.autocast, c.optimizer, quiet)
    k = dict(_KITSUNE_CACHE[key])
    if c.accumulation > 1:
        k["note"] = ("kitsune has no accumulation: predicted for the micro-batch (its "
                     "gradients are always counted)")
    return k


def _least_checkpointed_peak(trace, w) -> int:
    from pymemplan.planner.checkpoint.plan import BudgetTooSmallError

    try:
        plan = trace.plan(1, model=w.model, inputs=w.inputs)
    except BudgetTooSmallError as e:
        return e.least_peak_bytes
    return plan.predicted_peak_bytes


def run_model(name: str, size: dict, *, use_kitsune: bool, quiet: bool,
              fp16_conv: bool) -> dict:
    import torch

    import pymemplan
    from pymemplan.units import format_bytes

    say(f"\n== {name} {size}")
    t_model = time.perf_counter()
    w = workload(name, size)
    skip = {}
    if not fp16_conv and any(isinstance(m, torch.nn.Conv2d) for m in w.model.modules()):
        skip["fp16"] = FP16_CONV_SLOW
    runner = Runner(w, quiet, skip)

    # The capacity: halfway between the step's peak and the least peak any checkpoint plan
    # reaches, from a quick trace (no kernel probe), rounded down to a MiB. The step as it
    # is does not fit; checkpointing, bf16, accumulation and a smaller batch do.
    common = dict(loss_fn=w.loss_fn, optimizer=torch.optim.AdamW, device="cpu")
    mib = 1 << 20
    with quiet_fd2(quiet):
        t = pymemplan.trace(w.model, w.inputs, probe_kernels=False, **common)
        least = _least_checkpointed_peak(t, w)
    capacity = (least + (t.peak_bytes - least) // 2) // mib * mib
    say(f"  peak {format_bytes(t.peak_bytes)}, least with checkpointing "
        f"{format_bytes(least)} (no probe): capacity {format_bytes(capacity)}")
    t0 = time.perf_counter()
    with quiet_fd2(quiet):
        advice = pymemplan.advise(w.model, w.inputs, capacity=capacity, techniques=TECHNIQUES,
                                  **common)
    t_advise = time.perf_counter() - t0
    say(f"  advise: {len(advice)} rows in {t_advise:.1f} s; best: "
        f"{advice.best.name if advice.best is not None else 'nothing fits'}")

    rows = [_row_result(row, runner, _kitsune_for(w, row, quiet) if use_kitsune else None)
            for row in advice.rows]
    largest = []
    for row in advice.rows_for("batch"):
        pred = row.extra.get("largest_batch", 0)
        say(f"  true largest batch for {row.name} (predicted {pred}) under "
            f"{format_bytes(capacity)}:")
        truth = true_largest_batch(runner, row.config, pred, capacity)
        entry = {"row": row.name, "autocast": row.config.autocast, "capacity_bytes": capacity,
                 "predicted_largest_batch": pred, **truth}
        entry["equal"] = truth.get("true_largest_batch") == pred
        if use_kitsune:
            entry["kitsune"] = kitsune_largest_batch(w, capacity, row.config.autocast, quiet)
        say(f"    predicted {pred}, true {truth.get('true_largest_batch')} "
            f"({truth.get('real_steps')} real steps)"
            + (f"; kitsune {entry['kitsune']['largest_batch']}" if use_kitsune else ""))
        largest.append(entry)

    return {"model": name, "size": size, "description": w.description,
            "capacity_bytes": capacity, "advise_seconds": round(t_advise, 1),
            "best": advice.best.name if advice.best is not None else None,
            "rows": rows, "largest_batch": largest,
            "real_steps": runner.steps, "real_step_seconds": round(runner.seconds, 1),
            "seconds": round(time.perf_counter() - t_model, 1)}


# -----------------------------------------------------------------------------------------
# Sharding (another benchmark)
# -----------------------------------------------------------------------------------------

def sharding_results(models: list[str], strategies=("ddp", "fsdp"), mode: str = "run") -> dict:
    """``benchmarks/whatif_sharding.py``'s ``run(models, strategies)`` (``mode="run"``), or
    the rows of its last results file (``mode="reuse"``)."""
    path = HERE / "whatif_sharding.py"
    if mode == "skip":
        return {"run": False, "why": "--sharding skip"}
    if mode == "reuse":
        saved = HERE / "results" / "whatif_sharding.json"
        if not saved.exists():
            return {"run": False, "why": f"--sharding reuse: no {saved.relative_to(HERE.parent)}"}
        doc = json.loads(saved.read_text())
        rows = [r for r in doc.get("rows", []) if r.get("model") in models]
        return {"run": True, "source": str(saved.relative_to(HERE.parent)),
                "command": doc.get("command"), "result": rows}
    if not path.exists():
        return {"run": False,
                "why": "benchmarks/whatif_sharding.py does not exist: the 2-rank gloo "
                       "DDP/FSDP measurements (pymemplan/whatif/sharding.py measure_sharded) "
                       "live there; this benchmark calls its run(models, strategies) and "
                       "merges the result here once it does"}
    import importlib.util

    spec = importlib.util.spec_from_file_location("whatif_sharding", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        rows = mod.run(list(models), list(strategies))
    except Exception as e:  # noqa: BLE001
        return {"run": False, "why": f"whatif_sharding.run failed: {type(e).__name__}: {e}"}
    return {"run": True, "source": "benchmarks/whatif_sharding.py run()",
            "strategies": list(strategies), "result": rows}


def _sharding_rows(sh: dict) -> list[dict]:
    """Rows with predicted and measured peaks, whatever the nesting of the result."""
    out = []

    def walk(x):
        if isinstance(x, dict):
            p = x.get("predicted_peak_bytes", x.get("predicted"))
            m = x.get("measured_peak_bytes", x.get("measured"))
            if isinstance(p, int) and isinstance(m, int) and m > 0:
                out.append({**{k: v for k, v in x.items() if not isinstance(v, (dict, list))},
                            "error": (p - m) / m})
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    if sh.get("run"):
        walk(sh.get("result"))
    return out


# -----------------------------------------------------------------------------------------
# Report
# -----------------------------------------------------------------------------------------

def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.4f}%"


def markdown(result: dict) -> str:
    from pymemplan.units import format_bytes

    def fb(x):
        return "-" if x is None else format_bytes(x)

    kit = result["kitsune"].get("installed")
    head = ("| model (capacity) | row | batch | predicted | measured | error |"
            + (" kitsune | kitsune error |" if kit else ""))
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in result["models"]:
        for r in m["rows"]:
            c = r["config"]
            batch = f"{c['batch']}" + (f" x {c['accumulation']}" if c["accumulation"] > 1 else "")
            if r["measurable"]:
                meas, err = fb(r["measured_peak_bytes"]), \
                    f"{r['error_bytes']:+,} B ({_pct(r['error'])})"
            elif c.get("weights"):
                meas, err = "not measurable on CPU", "-"
            elif r.get("failure"):
                meas, err = f"failed: {r['failure'][:50]}", "-"
            else:
                meas, err = "not run" + (" (CPU fp16 conv: slow)" if c.get("autocast") ==
                                          "fp16" else ""), "-"
            line = (f"| {m['model']} ({fb(m['capacity_bytes'])}) | {r['row']} | {batch} | "
                    f"{fb(r['predicted_peak_bytes'])} | {meas} | {err} |")
            if kit:
                k = r.get("kitsune") or {}
                line += f" {fb(k.get('predicted_peak_bytes'))} | {_pct(k.get('error'))} |"
            out.append(line)
    out.append("")
    head = ("| model | row | capacity | predicted largest batch | true largest batch | "
            "measured at true / true + 1 | real steps |" + (" kitsune |" if kit else ""))
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    for m in result["models"]:
        for e in m["largest_batch"]:
            t = e.get("true_largest_batch")
            pk = e.get("measured_peaks", {})
            at = " / ".join(fb(pk.get(str(b))) for b in ((t, t + 1) if t is not None else ()))
            line = (f"| {m['model']} | {e['row']} | {fb(e['capacity_bytes'])} | "
                    f"{e['predicted_largest_batch']} | {t if t is not None else '?'} | {at} | "
                    f"{e.get('real_steps', '-')} |")
            if kit:
                k = e.get("kitsune", {}).get("largest_batch")
                line += f" {k if k is not None else '-'} |"
            out.append(line)
    sh = _sharding_rows(result["sharding"])
    if sh:
        out += ["", "| sharding row | predicted | measured | error |", "|---|---|---|---|"]
        for r in sh:
            name = " ".join(str(r[k]) for k in ("model", "strategy", "rank") if k in r)
            out.append(f"| {name} | {fb(r.get('predicted_peak_bytes', r.get('predicted')))} | "
                       f"{fb(r.get('measured_peak_bytes', r.get('measured')))} | "
                       f"{_pct(r['error'])} |")
    return "\n".join(out)


def summarize(result: dict) -> dict:
    measured = [(m["model"], r) for m in result["models"] for r in m["rows"] if r["measurable"]]
    worst = max(measured, key=lambda x: abs(x[1]["error"]), default=(None, None))
    misses = [f"{name}: {r['row']} ({_pct(r['error'])})" for name, r in measured
              if abs(r["error"]) > TARGET_ERROR]
    sh = _sharding_rows(result["sharding"])
    misses += [f"sharding {r.get('model', '')} {r.get('strategy', '')} ({_pct(r['error'])})"
               for r in sh if abs(r["error"]) > TARGET_ERROR]
    lb = [(m["model"], e) for m in result["models"] for e in m["largest_batch"]]
    lb_miss = [f"{name}: {e['row']} predicted {e['predicted_largest_batch']}, true "
               f"{e.get('true_largest_batch')}" for name, e in lb if not e["equal"]]
    failed = [f"{m['model']}: {r['row']}: {r['failure']}" for m in result["models"]
              for r in m["rows"] if r.get("failure")]
    not_measurable = sorted({f"{m['model']}: {r['row']}" for m in result["models"]
                             for r in m["rows"] if not r["measurable"]})
    return {
        "peaks_measured": len(measured) + len(sh),
        "max_abs_error": abs(worst[1]["error"]) if worst[1] else None,
        "worst": f"{worst[0]}: {worst[1]['row']}" if worst[1] else None,
        "peaks_within_1pct": not misses and not failed,
        "peak_misses": misses, "failed_steps": failed,
        "largest_batch_equal": bool(lb) and not lb_miss, "largest_batch_misses": lb_miss,
        "not_measurable_rows": not_measurable,
        "sharding_merged": bool(result["sharding"].get("run")),
        "targets_met": not misses and not failed and bool(lb) and not lb_miss,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), default="reduced")
    ap.add_argument("--models", nargs="*", default=["gpt2", "bert", "resnet50"],
                    choices=["gpt2", "bert", "resnet50"])
    ap.add_argument("--markdown", action="store_true", help="print the tables of docs/whatif.md")
    ap.add_argument("--no-kitsune", action="store_true", help="skip torch-kitsune")
    ap.add_argument("--sharding", choices=["run", "reuse", "skip"], default="run",
                    help="2-rank gloo DDP and FSDP rows: run benchmarks/whatif_sharding.py "
                         "(default), reuse its results/whatif_sharding.json, or skip")
    ap.add_argument("--fp16-conv", action="store_true",
                    help="also run the fp16 rows of convolutional models for real (slow)")
    ap.add_argument("--verbose", action="store_true",
                    help="let the profiler print its per-use lines on stderr")
    ap.add_argument("--update", action="store_true",
                    help="rerun only --models and merge them into the existing --out file "
                         "(other models kept; with --sharding skip, its sharding rows too)")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--report", action="store_true",
                    help="run nothing: print the summary (and --markdown) of the --out file")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    if args.report:
        result = json.loads(args.out.read_text())
        return _print_report(result, args.out, args.markdown, wrote=False)
    import faulthandler

    import torch

    faulthandler.enable()
    t0 = time.perf_counter()
    kit = {"installed": False, "why": "--no-kitsune"} if args.no_kitsune else kitsune_status()
    say(f"torch-kitsune: {kit}")
    models = [run_model(m, SCALES[args.scale][m], use_kitsune=kit["installed"],
                        quiet=not args.verbose, fp16_conv=args.fp16_conv) for m in args.models]
    sharding = sharding_results(args.models, mode=args.sharding)
    command = "python benchmarks/whatif_accuracy.py " + " ".join(argv or sys.argv[1:])
    commands = [command]
    if args.update and args.out.exists():
        old = json.loads(args.out.read_text())
        rerun = {m["model"] for m in models}
        models = [m for m in old.get("models", []) if m["model"] not in rerun] + models
        order = ["gpt2", "bert", "resnet50"]
        models.sort(key=lambda m: order.index(m["model"]))
        if args.sharding == "skip" and old.get("sharding"):
            sharding = old["sharding"]
        commands = old.get("commands", [old.get("command")]) + [command]
    result = {"benchmark": "whatif_accuracy", "scale": args.scale, "commands": commands,
              "torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "processor": platform.processor(),
              "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
              "target_error": TARGET_ERROR, "kitsune": kit, "models": models,
              "sharding": sharding}
    result["summary"] = summarize(result)
    result["seconds"] = round(time.perf_counter() - t0, 1)  # this invocation
    result["seconds_per_model"] = {m["model"]: m["seconds"] for m in models}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return _print_report(result, args.out, args.markdown, wrote=True)


def _print_report(result: dict, out: Path, with_markdown: bool, wrote: bool) -> int:
    s = result["summary"]
    say(f"\n{'wrote' if wrote else 'read'} {out} ({result['seconds']:.0f} s; per model: "
        f"{result.get('seconds_per_model')})")
    say(f"peaks: {s['peaks_measured']} measured, max |error| {_pct(s['max_abs_error'])} "
        f"({s['worst']}); within 1%: {s['peaks_within_1pct']}"
        + (f"; misses: {s['peak_misses']}" if s["peak_misses"] else "")
        + (f"; failed: {s['failed_steps']}" if s["failed_steps"] else ""))
    say(f"largest batch equal on every model: {s['largest_batch_equal']}"
        + (f"; misses: {s['largest_batch_misses']}" if s["largest_batch_misses"] else ""))
    say(f"not measured: {', '.join(s['not_measurable_rows'])}")
    sh = result["sharding"]
    say(f"sharding: {'merged from ' + sh.get('source', '?') if s['sharding_merged'] else sh['why']}")
    if with_markdown:
        say("\n" + markdown(result))
    sys.stdout.flush()
    return 0 if s["targets_met"] else 1


if __name__ == "__main__":
    rc = main()
    # After long runs (real GPT-2 / ResNet-50 steps, hundreds of kernel probes) the
    # interpreter has been seen to crash in native teardown, after everything was written
    # (SIGSEGV / SIGBUS, no Python frame). Exit without teardown so the status is ours.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
