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
                           # and (CPU) what the steps before it left
    trace: object = None   # the recorded pymemplan.traces.Trace (CPU only)


def _build_optimizer(optimizer, model):
    import torch

    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer(model.parameters())


def _state_tensors(model, inputs, opt) -> list:
    """Parameters, buffers, tensors modules keep in plain attributes, tensor inputs and
    optimizer state on the model's device."""
    import torch

    from .module_state import HeldTensors

    device = next(iter(model.parameters())).device
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for _, t in HeldTensors(model).tensors()]
    tensors += [a for a in inputs if isinstance(a, torch.Tensor)]
    if opt is not None:
        tensors += [v for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
    # e.g. CUDA optimizers keep `step` counters on the CPU
    return [t for t in tensors if t.device == device]


def _blocks(t) -> list:
    """The storages holding a tensor's memory: a sparse tensor's indices' and values'; none
    for a ZeroTensor (forward-mode AD's zero tangents), for which eager allocates nothing."""
    import torch

    if t._is_zerotensor():
        return []
    if t.layout == torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:
        return [t.untyped_storage()]
    return [s for part in parts for s in _blocks(part)]


def _state_storages(model, inputs, opt) -> dict[int, int]:
    """The distinct blocks (data pointer -> bytes) of _state_tensors (shared storages counted
    once)."""
    return {s.data_ptr(): s.nbytes() for t in _state_tensors(model, inputs, opt)
            for s in _blocks(t) if s.nbytes() > 0}


def _reads(device):
    """A dispatch mode noting the distinct storages on `device` that ops read, each by its
    key: (bytes, a weak reference to it)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages: dict[int, tuple] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for a in tree_leaves((args, kwargs or {})):
                if isinstance(a, torch.Tensor) and a.device == device:
                    for s in _blocks(a):
                        if s._cdata not in self.storages and s.nbytes() > 0:
                            self.storages[s._cdata] = (s.nbytes(), weakref.ref(s))
            return func(*args, **(kwargs or {}))

        def alive(self) -> dict[int, int]:
            """Those still alive: data pointer -> bytes. (Weak references, as the CPU
            profiler reports no free of a block allocated while it was not running.)"""
            return {s.data_ptr(): s.nbytes()
                    for s in (ref() for _, ref in self.storages.values()) if s is not None}

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
    first step runs too, its gradients dropped). Every block alive when the measured step
    starts counts in its peak, as in :func:`pymemplan.trace`'s: parameters, buffers, inputs
    and state; what the steps before made and left alive, whoever holds it (the state of
    optimizers run from hooks, a tensor a module keeps from one step to the next); and, found
    by the first step, the tensors the step reads that were there before it (a target the
    loss closes over). A sparse tensor counts as its indices and values; a ZeroTensor
    (forward-mode AD) as nothing, as eager allocates nothing for it. The device is
    the one the model's parameters are on. ``autocast``, ``grads_present`` (a later
    micro-step of gradient accumulation: gradients exist and backward adds into them) and
    ``grad_scaler`` (``torch.amp.GradScaler``) as for :func:`pymemplan.trace`.
    ``steps_before``: unmeasured steps before the measured one (1: the second step is
    measured); more for optimizers whose step changes after a warm-up (RAdam's rectified
    update from its sixth step), as :func:`pymemplan.trace` predicts a step well into training.
    """
    import contextlib

    import torch

    from ..traces import record
    from ..traces.trace import ALLOC

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    opt = _build_optimizer(optimizer, model)
    device = next(iter(model.parameters())).device
    scaler = torch.amp.GradScaler(device.type) if grad_scaler else None
    step = step_fn(model, inputs, loss_fn, opt, autocast, scaler)
    # The steps before the measured one, unmeasured (with an optimizer the first makes the
    # state; without, it is a dry run whose gradients go below). On the CPU they are
    # recorded: what they make and leave alive is there when the measured step starts,
    # whoever holds it (the optimizer, a hook's own optimizers, a module keeping a tensor
    # from one step to the next). And the first finds the tensors the step reads that were
    # there before it (a target the loss closes over). Not in the measured step: a dispatch
    # mode can change which kernels run.
    def clear_grads():
        # Gradients left by an earlier step are not the step's: the model's, those of an
        # optimizer's parameters outside it (a loss module's), and the inputs' (a batch is
        # new at each step).
        model.zero_grad(set_to_none=True)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None

    clear_grads()
    cpu = device.type == "cpu"
    reads = _reads(device) if cpu else contextlib.nullcontext()
    with record(device="cpu") if cpu else contextlib.nullcontext() as warm:
        with reads:
            step()
        if opt is not None:
            # GradScaler skips a step whose gradients overflowed (its first, at a scale of
            # 65536, often does): the optimizer then has no state yet, and the measured step
            # would make it.
            for _ in range(32):
                if scaler is None or opt.state:
                    break
                step()
        for _ in range(steps_before - 1):
            clear_grads()
            step()
        clear_grads()
    grads = []
    if grads_present:
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                grads.append(p.grad)
    if scaler is not None:
        grads += [t for t in (scaler._scale, scaler._growth_tracker) if t is not None]
    known = _state_storages(model, list(inputs) + grads, opt)
    if not cpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return Measurement(torch.cuda.max_memory_allocated(), sum(known.values()))
    # Every block alive when the measured step starts, by data pointer, known before it
    # runs (a step that rebinds parameters, p.data = ..., frees the ones counted here): the
    # state; what the steps before made and left alive; and what the step reads that was
    # there before them and is still alive. cuda's counter has them all.
    tr = warm.trace
    alive: dict[int, int] = {}
    for action, ptr, size in zip(tr.action.tolist(), tr.ptr.tolist(), tr.size.tolist()):
        if action == ALLOC:
            alive[ptr] = size
        else:
            alive.pop(ptr, None)
    alive = {**reads.alive(), **alive, **known}
    with record(device="cpu") as rec:
        step()
    # Freed by this step and not counted above (made in an earlier recording: the profiler
    # reports no other frees of blocks from before it): live until then, and its free lowers
    # the running total below.
    start = sum(alive.values()) + sum(n for ptr, n in rec.trace.meta["dropped_free_blocks"]
                                      if ptr not in alive)
    m = rec.trace.meta
    # The profiler's totals count from where recording started: add what was live then.
    return Measurement(start + m["peak_total_allocated"] - m["baseline_bytes"], start, rec.trace)
