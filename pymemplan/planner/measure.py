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


def state_bytes(model, inputs, opt) -> int:
    """Bytes of the distinct storages of parameters, buffers, tensor inputs and optimizer
    state on the model's device (shared storages counted once)."""
    import torch

    device = next(iter(model.parameters())).device
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [a for a in inputs if isinstance(a, torch.Tensor)]
    if opt is not None:
        tensors += [v for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
    seen = {}
    for t in tensors:
        if t.device == device:  # e.g. CUDA optimizers keep `step` counters on the CPU
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


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
                 grads_present: bool = False, grad_scaler: bool = False) -> Measurement:
    """Run one steady-state training step for real and measure its peak.

    With an optimizer, a first step creates its state; gradients are then set to None and
    the second step is measured, as :func:`pymemplan.trace` predicts it. The device is
    the one the model's parameters are on. ``autocast``, ``grads_present`` (a later
    micro-step of gradient accumulation: gradients exist and backward adds into them) and
    ``grad_scaler`` (``torch.amp.GradScaler``) as for :func:`pymemplan.trace`.
    """
    import torch

    from ..traces import record

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    opt = _build_optimizer(optimizer, model)
    device = next(iter(model.parameters())).device
    scaler = torch.amp.GradScaler(device.type) if grad_scaler else None
    step = step_fn(model, inputs, loss_fn, opt, autocast, scaler)
    if opt is not None:
        step()
        # GradScaler skips a step whose gradients overflowed (its first, at a scale of 65536,
        # often does): the optimizer then has no state yet, and the measured step would make it.
        for _ in range(32):
            if scaler is None or opt.state:
                break
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
    start = state_bytes(model, list(inputs) + grads, opt)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return Measurement(torch.cuda.max_memory_allocated(), start)
    with record(device="cpu") as rec:
        step()
    m = rec.trace.meta
    # The profiler's totals count from where recording started: add what was live then.
    return Measurement(start + m["peak_total_allocated"] - m["baseline_bytes"], start, rec.trace)
