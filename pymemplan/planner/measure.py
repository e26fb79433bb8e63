"""Ground truth: the measured peak of a real eager training step, to check predictions.

Unlike :func:`pymemplan.trace`, this *runs* the step: it updates the model's parameters
and needs the memory. On the CPU the peak comes from the profiler's allocation events
(:class:`pymemplan.traces.record`, checked against the allocator's running total); on a
GPU from ``torch.cuda.max_memory_allocated()``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Measurement:
    peak_bytes: int        # peak of live tensor bytes during the step
    start_bytes: int       # live when the step started: parameters, buffers, inputs, state
    trace: object = None   # the recorded pymemplan.traces.Trace (CPU only)


def _build_optimizer(optimizer, model):
    import torch

    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer(model.parameters())


def _state_tensors(model, inputs, opt) -> list:
    """Parameters, buffers, tensor inputs and optimizer state on the model's device."""
    import torch

    device = next(iter(model.parameters())).device
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [a for a in inputs if isinstance(a, torch.Tensor)]
    if opt is not None:
        tensors += [v for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
    # e.g. CUDA optimizers keep `step` counters on the CPU
    return [t for t in tensors if t.device == device]


def _state_storages(model, inputs, opt) -> dict[int, int]:
    """The distinct storages (key -> bytes) of _state_tensors (shared storages counted once)."""
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in _state_tensors(model, inputs, opt)}


def _reads(device, known: set[int]):
    """A dispatch mode noting the distinct storages on `device` that ops read, other than
    those in `known`: key -> (bytes, data pointer)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages: dict[int, tuple[int, int]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for a in tree_leaves((args, kwargs or {})):
                if isinstance(a, torch.Tensor) and a.device == device:
                    s = a.untyped_storage()
                    if s._cdata not in known and s.nbytes() > 0:
                        self.storages.setdefault(s._cdata, (s.nbytes(), s.data_ptr()))
            return func(*args, **(kwargs or {}))

    return Reads()


def step_fn(model, inputs, loss_fn, opt, autocast=None, scaler=None):
    """The training step :func:`pymemplan.trace` predicts, as plain eager code."""
    import contextlib

    import torch

    device = next(iter(model.parameters())).device.type

    def step():
        amp = (torch.autocast(device, dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        with amp:
            out = model(*inputs)
            if loss_fn is not None:
                loss = loss_fn(out)
            else:
                loss = out if isinstance(out, torch.Tensor) else out.loss
            del out
        if scaler is not None:
            loss = scaler.scale(loss)
        loss.backward()
        del loss
        if opt is not None:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    return step


def measure_step(model, inputs, *, loss_fn=None, optimizer=None, autocast=None,
                 grads_present: bool = False, grad_scaler: bool = False,
                 steps_before: int = 1) -> Measurement:
    """Run one steady-state training step for real and measure its peak.

    With an optimizer, a first step creates its state; gradients are then set to None and
    the second step is measured, as :func:`pymemplan.trace` predicts it (without one, a
    first step runs too, its gradients dropped). The first step also finds the tensors the
    step reads that exist before it and are neither parameters, buffers, inputs nor state (a
    target the loss closes over): live through the step, they count in the peak, as in
    :func:`pymemplan.trace`'s. The device is
    the one the model's parameters are on. ``autocast``, ``grads_present`` (a later
    micro-step of gradient accumulation: gradients exist and backward adds into them) and
    ``grad_scaler`` (``torch.amp.GradScaler``) as for :func:`pymemplan.trace`.
    ``steps_before``: unmeasured steps before the measured one (1: the second step is
    measured); more for optimizers whose step changes after a warm-up (RAdam's rectified
    update from its sixth step), as :func:`pymemplan.trace` predicts a step well into training.
    """
    import torch

    from ..traces import record

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    opt = _build_optimizer(optimizer, model)
    device = next(iter(model.parameters())).device
    scaler = torch.amp.GradScaler(device.type) if grad_scaler else None
    step = step_fn(model, inputs, loss_fn, opt, autocast, scaler)
    # A first step, unmeasured (with an optimizer it makes the state; without, it is a dry
    # run whose gradients go below). On the CPU it finds the tensors the step reads that
    # were there before it: read, and at no pointer the step allocated. Not in the measured
    # step: a dispatch mode can change which kernels run.
    older: dict[int, int] = {}
    older_ptrs: set[int] = set()
    model.zero_grad(set_to_none=True)  # gradients left by an earlier step are not the step's
    if device.type == "cpu":
        reads = _reads(device, set(_state_storages(model, inputs, opt)))
        with record(device="cpu") as dry, reads:
            step()
        made = set(dry.trace.ptr.tolist())
        older = {k: n for k, (n, ptr) in reads.storages.items() if ptr not in made}
        older_ptrs = {ptr for n, ptr in reads.storages.values() if ptr not in made}
    else:
        step()
    if opt is not None:
        # GradScaler skips a step whose gradients overflowed (its first, at a scale of 65536,
        # often does): the optimizer then has no state yet, and the measured step would make it.
        for _ in range(32):
            if scaler is None or opt.state:
                break
            step()
    for _ in range(steps_before - 1):
        model.zero_grad(set_to_none=True)
        step()
    model.zero_grad(set_to_none=True)
    grads = []
    if grads_present:
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                grads.append(p.grad)
    if scaler is not None:
        grads += [t for t in (scaler._scale, scaler._growth_tracker) if t is not None]
    known = _state_storages(model, list(inputs) + grads, opt)
    start = sum(known.values())
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return Measurement(torch.cuda.max_memory_allocated(), start)
    # Read by the step, made before it, and not counted above (a target the loss closes
    # over): live through the step. cuda's counter has them already.
    start += sum(n for key, n in older.items() if key not in known)
    with record(device="cpu") as rec:
        step()
    # Made before the step, neither state nor read, and freed by it: a tensor a module keeps
    # from one step to the next (self.cache = h.detach()), replaced here. Live until then,
    # and its free lowers the running total below.
    counted = older_ptrs | {t.untyped_storage().data_ptr()
                            for t in _state_tensors(model, list(inputs) + grads, opt)}
    start += sum(n for ptr, n in rec.trace.meta["dropped_free_blocks"] if ptr not in counted)
    m = rec.trace.meta
    # The profiler's totals count from where recording started: add what was live then.
    return Measurement(start + m["peak_total_allocated"] - m["baseline_bytes"], start, rec.trace)

