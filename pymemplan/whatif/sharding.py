"""What if the step were sharded across GPUs: DDP, ZeRO-1/2/3 and FSDP, per rank.

``trace_sharded(model, inputs, strategy="fsdp", world_size=8)`` predicts one rank's
training step under a data-parallel strategy, by running torch.distributed's *own*
implementation of that strategy on fake tensors, over a fake process group (the "fake"
backend: collectives that move no data, on one process). What runs:

===========  ===========================================================================
strategy     torch code that runs (on fake tensors, under the planner's recorder)
===========  ===========================================================================
``ddp``      ``torch.nn.parallel.DistributedDataParallel`` with its C++ ``Reducer``:
             gradient buckets (25 MiB, the first rebuilt one 1 MiB, in gradient-ready
             order), the grad-to-bucket copies in backward, bucket all-reduces, the
             copies back, buffer broadcast before each forward.
``zero1``    DDP as above + ``torch.distributed.optim.ZeroRedundancyOptimizer``: each
             rank keeps the optimizer state of its own partition of the parameters and
             broadcasts the parameters it updated.
``zero2``    FSDP2 ``fully_shard(reshard_after_forward=False)`` on every block and the
             root: parameters all-gathered once and kept unsharded from forward through
             backward, gradients reduce-scattered to shards, optimizer state on shards
             (torch's own ZeRO-2 equivalent; unsharded parameters are freed after backward).
``zero3``    FSDP2 ``fully_shard(reshard_after_forward=True)`` on every block and the root:
             parameters all-gathered before each block's forward and again before its
             backward, freed after each.
``fsdp``     FSDP2 ``fully_shard`` with its defaults: as ``zero3``, except that the root
             module keeps its parameters unsharded after forward (FSDP2 sets the root's
             ``reshard_after_forward`` to False).
===========  ===========================================================================

The recorder (``planner/capture.py``) sees every ATen op these run, so FSDP's all-gather
and reduce-scatter buffers, its unsharded parameters (storages that FSDP resizes to 0
and back: ``UntypedStorage.resize_`` is followed, as torch's own ``MemTracker`` does),
DDP's buckets and every copy are in the graph exactly as torch makes and frees them.

Where torch's code cannot run on fake tensors, the smallest possible step is bridged, and
nothing else is modelled:

- DDP's constructor checks that parameter shapes agree across ranks by reading them with
  a tensor accessor (``_verify_param_shape_across_processes``): skipped (one rank, so
  shapes agree by construction).
- The fake backend's collectives return a ``Work`` whose future holds no value; the
  C++ ``Reducer`` reads the all-reduced bucket from it. Each collective's ``Work`` is
  replaced by a completed one holding its output tensors, as gloo's and NCCL's are.
- After the first step the ``Reducer`` rebuilds its buckets in gradient-ready order and
  broadcasts the new assignment in small int32 tensors it fills through accessors: those
  few index tensors are real (host memory, freed at once), everything else stays fake.
- A Python number passed to an op becomes, inside the C++ code, an 8-byte "wrapped
  number" tensor (DDP's ``1/world_size`` in ``mul_out``): on the CPU target it is
  measured with the op's other scratch by the kernel probe (``planner/probe.py``).

Ground truth: :func:`measure_sharded` runs the same strategy for real, one process per
rank on the gloo backend (CPU), and measures each rank's exact peak from the profiler's
allocation events (``pymemplan.traces.record``); ``tests/test_whatif_sharding.py`` and
``benchmarks/whatif_sharding.py`` compare the two.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import weakref
from typing import Any, Callable

from ..planner.errors import PlannerError

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")

DESCRIPTIONS = {
    "ddp": "DistributedDataParallel: full replica per rank, gradients all-reduced in buckets",
    "zero1": "DDP + ZeroRedundancyOptimizer: optimizer state sharded across ranks",
    "zero2": "FSDP2 fully_shard(reshard_after_forward=False): gradients and optimizer state "
             "sharded, parameters unsharded from forward to the end of backward",
    "zero3": "FSDP2 fully_shard(reshard_after_forward=True): parameters, gradients and "
             "optimizer state sharded; each block's parameters all-gathered when used",
    "fsdp": "FSDP2 fully_shard defaults: as zero3, but the root module's parameters stay "
            "unsharded between forward and backward",
}

# torch/nn/parallel/distributed.py: _DEFAULT_BUCKET_CAP_MB; the first rebuilt bucket is
# dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) when bucket_cap_mb is left at its default.
DEFAULT_BUCKET_CAP_MB = 25

_MARK = "pymemplan::measured_step"

# Options each strategy takes (all optional). Others are an error.
_DDP_OPTIONS = {"bucket_cap_mb", "gradient_as_bucket_view", "broadcast_buffers"}
_FSDP_OPTIONS = {"wrap", "reshard_after_forward"}
_OPTIONS = {
    "ddp": _DDP_OPTIONS,
    "zero1": _DDP_OPTIONS | {"parameters_as_bucket_view"},
    "zero2": {"wrap"},
    "zero3": {"wrap"},
    "fsdp": _FSDP_OPTIONS,
}


def _check_strategy(strategy, world_size, rank=0) -> None:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise PlannerError(f"unknown sharding strategy {strategy!r}; valid strategies: "
                           + ", ".join(f"{s!r} ({DESCRIPTIONS[s].split(':')[0]})"
                                       for s in STRATEGIES))
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise PlannerError(f"world_size must be a whole number of ranks (GPUs), at least 1; "
                           f"got {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise PlannerError(f"rank must be a whole number in [0, world_size={world_size}); "
                           f"got {rank!r}")


def _check_options(strategy: str, options: dict) -> None:
    unknown = set(options) - _OPTIONS[strategy]
    if unknown:
        raise PlannerError(f"option(s) {', '.join(sorted(unknown))} do not apply to strategy "
                           f"{strategy!r}; it takes: "
                           f"{', '.join(sorted(_OPTIONS[strategy])) or 'none'}")


# -----------------------------------------------------------------------------------------
# Applying a strategy: the same code wraps the fake copy (prediction) and the real model
# in each rank's process (measurement), so both run exactly the same torch code.
# -----------------------------------------------------------------------------------------

def shard_targets(model, wrap=None) -> list[str]:
    """Module paths that get their own ``fully_shard`` (the root is always sharded last).

    ``wrap``: None (default policy), a list of module paths, a tuple of module classes,
    or a callable ``(path, module) -> bool``. The default: every child of an
    ``nn.ModuleList`` (transformer blocks); in a model with no ModuleList, every child
    with parameters of an ``nn.Sequential`` (ResNet's bottlenecks, an MLP's layers).
    Nested candidates inside a chosen one are left to it.
    """
    from torch import nn

    if wrap is not None:
        if isinstance(wrap, (list, set)) and all(isinstance(w, str) for w in wrap):
            names = dict(model.named_modules())
            missing = [w for w in wrap if w not in names]
            if missing:
                raise PlannerError(f"wrap names module(s) the model does not have: {missing}")
            return [w for w in names if w in wrap and w]
        if isinstance(wrap, tuple) and all(isinstance(w, type) for w in wrap):
            return [n for n, m in model.named_modules() if n and isinstance(m, wrap)]
        if callable(wrap):
            return [n for n, m in model.named_modules() if n and wrap(n, m)]
        raise PlannerError("wrap must be a list of module paths, a tuple of module classes, "
                           "or a callable (path, module) -> bool")

    def collect(container_type) -> list[str]:
        out: list[str] = []

        def visit(prefix, m):
            for name, child in m.named_children():
                path = f"{prefix}.{name}" if prefix else name
                if isinstance(m, container_type) and any(
                        p.requires_grad for p in child.parameters()):
                    out.append(path)
                    continue
                visit(path, child)

        visit("", model)
        return out

    return collect(nn.ModuleList) or collect(nn.Sequential)


def _optimizer_spec(optimizer):
    """(class, kwargs) of an optimizer given as a class, a factory or an instance."""
    import torch

    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, {}
    if isinstance(optimizer, torch.optim.Optimizer):
        probe = optimizer
    elif callable(optimizer):
        probe = optimizer([torch.nn.Parameter(torch.zeros(1))])
        if not isinstance(probe, torch.optim.Optimizer):
            raise PlannerError(f"the optimizer factory returned {type(probe).__name__}, not a "
                               f"torch.optim.Optimizer")
    else:
        raise PlannerError(f"optimizer={optimizer!r} is not an optimizer: pass a "
                           f"torch.optim.Optimizer class, a callable params -> optimizer, "
                           f"an optimizer instance, or None")
    return type(probe), dict(probe.defaults)


def _build_optimizer(optimizer, params):
    import torch

    if optimizer is None:
        return None
    cls, kwargs = _optimizer_spec(optimizer)
    if isinstance(optimizer, type) or isinstance(optimizer, torch.optim.Optimizer):
        return cls(params, **kwargs)
    return optimizer(params)


def apply_strategy(model, strategy: str, optimizer, *, profile=None, mesh=None, **options):
    """Wrap ``model`` for ``strategy`` over the default process group (which must exist)
    and build its optimizer. Returns ``(module to call, optimizer or None)``; ``model``
    itself is changed in place for the FSDP strategies (as ``fully_shard`` does).
    ``mesh``: the FSDP strategies' device mesh (default: all ranks, on the device of the
    model's parameters)."""
    _check_options(strategy, options)
    if strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        kw = {k: options[k] for k in ("bucket_cap_mb", "gradient_as_bucket_view",
                                       "broadcast_buffers") if k in options}
        wrapped = DDP(model, **kw)
        if optimizer is None:
            return wrapped, None
        if strategy == "ddp":
            opt = _build_optimizer(optimizer, list(wrapped.parameters()))
            inner = opt
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            cls, kwargs = _optimizer_spec(optimizer)
            opt = ZeroRedundancyOptimizer(
                list(wrapped.parameters()), optimizer_class=cls,
                parameters_as_bucket_view=options.get("parameters_as_bucket_view", False),
                **kwargs)
            inner = opt.optim
        if profile is not None:
            from ..planner.profile import prepare_optimizer

            prepare_optimizer(inner, profile)
        return wrapped, opt
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device = next(iter(model.parameters())).device.type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if strategy == "zero2":
        reshard = False
    elif strategy == "zero3":
        reshard = True
    else:
        reshard = options.get("reshard_after_forward")
    modules = dict(model.named_modules())
    for path in shard_targets(model, options.get("wrap")):
        fully_shard(modules[path], mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = _build_optimizer(optimizer, list(model.parameters()))
    if opt is not None and profile is not None:
        from ..planner.profile import prepare_optimizer

        prepare_optimizer(opt, profile)
    return model, opt


def _loss_of(out, loss_fn):
    import torch

    if loss_fn is not None:
        return loss_fn(out)
    if isinstance(out, torch.Tensor):
        return out
    return out.loss


# -----------------------------------------------------------------------------------------
# Tracing: torch's code on fake tensors, over the "fake" process group
# -----------------------------------------------------------------------------------------

class _State:
    """What the dispatch mode needs to know, shared with the storage-resize hook."""

    def __init__(self, fake_mode):
        self.fake_mode = fake_mode
        self.rec = None                 # the recorder, once the traced step starts
        self.real_int = False           # DDP's bucket rebuild: int32 index tensors real
        self.label = ""                 # what the storages made now are (for the survey)
        # Every fake storage made before the traced step: key -> (weakref, label)
        self.survey: dict[int, tuple] = {}
        self.thread = threading.get_ident()
        self.collectives: list[tuple] = []   # (op, bytes, phase), during the traced step

    def note(self, out) -> None:
        import torch
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils import _pytree as pytree

        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and is_fake(o):
                s = o.untyped_storage()
                key = s._cdata
                old = self.survey.get(key)
                if old is None or old[0]() is not s:
                    self.survey[key] = (weakref.ref(s), self.label)


def _completed_work(tensors):
    """A collective's ``Work`` that is done and holds its output, as gloo's and NCCL's do
    (the fake backend's holds none, and DDP's Reducer reads it)."""
    import torch
    from torch._C._distributed_c10d import _create_work_from_future

    fut = torch.futures.Future()
    fut.set_result(tensors)
    return _create_work_from_future(fut).boxed()


def _collective_bytes(func, args, out) -> int:
    import torch
    from torch.utils import _pytree as pytree

    ts = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    name = func.overloadpacket.__name__
    if name in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
        ts = [t for t in pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
    elif name in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        ts = [t for t in pytree.tree_leaves(args[1]) if isinstance(t, torch.Tensor)]
    else:
        ts = [t for t in pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in ts)


def _mode(state: _State):
    import torch
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default
    empty = torch.ops.aten.empty.memory_format

    class _ShardMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # As torch's MemTracker: let DTensor desugar into ops on its local tensors,
            # which come back here; skip DTensor's own metadata propagation, which runs
            # under a fake mode of its own.
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            if active_fake_mode() is not state.fake_mode:
                return func(*args, **kwargs)
            if func is wait_tensor:  # its fake kernel makes a new tensor; eager returns its input
                return args[0]
            if state.real_int and (
                    (func is empty and kwargs.get("dtype") == torch.int32)
                    or (func is not empty and not any(
                        is_fake(a) for a in pytree.tree_leaves((args, kwargs))
                        if isinstance(a, torch.Tensor)))):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            rec = state.rec
            out = rec.dispatch(func, args, kwargs) if rec is not None else func(*args, **kwargs)
            if rec is None:
                state.note(out)
            if func.namespace == "c10d" and isinstance(out, tuple) and len(out) == 2 \
                    and isinstance(out[1], torch.ScriptObject):
                if rec is not None:
                    state.collectives.append((func.overloadpacket.__name__,
                                              _collective_bytes(func, args, out), rec.phase))
                return out[0], _completed_work(out[0])
            return out

    return _ShardMode()


def _recorder_class():
    from ..planner.capture import _Recorder
    from ..planner.graph import TEMPORARY, TensorInfo

    class _ShardRecorder(_Recorder):
        """The planner's recorder, plus storages resized in place (FSDP's unsharded
        parameters): a resize to 0 frees the storage's bytes, a resize up allocates."""

        def _on_free(self, key, tid):
            if self.tensors[tid].free_seq is not None:
                return  # already freed by a resize to 0
            super()._on_free(key, tid)

        def on_resize(self, storage, before: int, after: int) -> None:
            if self.closed:
                return
            key = storage._cdata
            tid = self.live.get(key)
            if tid is not None and before > 0:
                info = self.tensors[tid]
                info.freed_before = len(self.ops)
                info.free_seq = self._tick()
                del self.live[key]
            if after > 0:
                tid = len(self.tensors)
                index = len(self.ops)
                self.tensors.append(TensorInfo(
                    id=tid, nbytes=after, size=self.profile.device_bytes(after),
                    shape=(after,), dtype="uint8", category=TEMPORARY, alloc_op=index,
                    freed_before=None, last_use=index, op="UntypedStorage.resize_",
                    module=self.module_now(), phase=self.phase, name="resized storage",
                    alloc_seq=self._tick()))
                self.live[key] = tid
                self.finalizers.append(weakref.finalize(storage, self._on_free, key, tid))

    return _ShardRecorder


@contextlib.contextmanager
def _follow_resize(state: _State):
    """Follow ``UntypedStorage.resize_`` (not an op, so no dispatch mode sees it), as
    ``torch.distributed._tools.mem_tracker.MemTracker._track_resize`` does."""
    import torch

    orig = torch.UntypedStorage.resize_

    def resize_(st, size):
        before = st.nbytes()
        out = orig(st, size)
        if threading.get_ident() == state.thread:
            if state.rec is not None:
                state.rec.on_resize(st, before, st.nbytes())
            elif size > 0:
                key = st._cdata
                state.survey[key] = (weakref.ref(st), state.label)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = orig


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int):
    import torch.distributed as dist

    if not dist.is_available():
        raise PlannerError("this PyTorch build has no torch.distributed; sharding cannot be "
                           "traced")
    if dist.is_initialized():
        raise PlannerError(
            "trace_sharded sets up its own fake process group (no communication, one "
            "process) as the default group, but a default process group already exists in "
            "this process; call it before dist.init_process_group() or after "
            "dist.destroy_process_group()")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _ddp_on_fake_tensors():
    """DDP's constructor reads parameter shapes through a tensor accessor to check that
    ranks agree; on one process with a fake group they agree by construction."""
    import torch.nn.parallel.distributed as ddp_module

    orig = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = orig


def _fake_copy(model, fake_mode):
    """A copy of ``model`` whose parameters and buffers are fake CPU tensors with the same
    metadata (ties kept); the model's data is never read or copied."""
    import torch

    from ..planner.capture import _fake_like

    memo: dict = {}
    with fake_mode:
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(_fake_like(p, False),
                                                 requires_grad=p.requires_grad)
        for b in model.buffers():
            if id(b) not in memo:
                memo[id(b)] = _fake_like(b, False)
    return copy.deepcopy(model, memo)


class _StorageView:
    """Enough of a tensor for the recorder to register a bare storage."""

    def __init__(self, storage):
        import torch

        self._storage = storage
        self.shape = (storage.nbytes(),)
        self.dtype = torch.uint8

    def untyped_storage(self):
        return self._storage


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _backward(loss) -> None:
    """``loss.backward()`` calling the engine directly (as capture does), so Python code
    running in backward still sees the torch-function layer."""
    import torch
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward((loss,), (torch.ones_like(loss, memory_format=torch.preserve_format),),
                         False, False, (), allow_unreachable=True, accumulate_grad=True)


def _fsdp_params(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(group.fsdp_params)
    return out


def trace_sharded(model, inputs, *, strategy: str, world_size: int, rank: int = 0,
                  loss_fn=None, optimizer=None, device="cuda", autocast=None,
                  probe_kernels=None, progress=None, grad_scaler: bool = False,
                  **options):
    """Predict one rank's training step under a sharding ``strategy`` over ``world_size``
    ranks (see :data:`STRATEGIES` and the module's docstring for what each runs).

    Returns a :class:`pymemplan.planner.api.MemoryTrace`: ``.peak_bytes`` is the rank's
    peak of live tensor bytes, buckets, all-gathered parameters and reduce-scatter
    buffers included. The graph's ``meta["sharding"]`` records the strategy, and
    ``meta["collectives"]`` every collective of the step with its bytes.

    The arguments are :func:`pymemplan.trace`'s, plus ``strategy``, ``world_size``,
    ``rank`` and options: for ``ddp``/``zero1`` ``bucket_cap_mb``,
    ``gradient_as_bucket_view``, ``broadcast_buffers`` (and ``parameters_as_bucket_view``
    for zero1); for the FSDP strategies ``wrap`` (see :func:`shard_targets`), and for
    ``fsdp`` ``reshard_after_forward``. ``inputs`` are one rank's (its micro-batch).

    The model is never modified. No process group may exist in this process: the trace
    sets up its own fake one and tears it down.
    """
    import torch

    from ..planner.api import MemoryTrace, _probe_limit
    from ..planner.profile import get_profile

    _check_strategy(strategy, world_size, rank)
    _check_options(strategy, options)
    if grad_scaler:
        raise PlannerError("grad_scaler=True is not supported for sharded steps yet; FSDP "
                           "uses torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler")
    profile = get_profile(device)
    if not isinstance(model, torch.nn.Module):
        raise PlannerError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        raise PlannerError(f"inputs must be a tuple of positional arguments for the model's "
                           f"forward (or a single tensor), got {type(inputs).__name__}")
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise PlannerError(f"autocast={autocast!r}: use None, torch.bfloat16 or torch.float16")
    if probe_kernels is None:
        probe_kernels = profile.name == "cpu"
    if probe_kernels and profile.name != "cpu":
        raise PlannerError(f"probe_kernels=True needs the target device to run kernels on; "
                           f"it works for device='cpu' only, not {profile.name!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise PlannerError("the model has no parameters that require grad: nothing to shard")
    if strategy in ("zero1",) and optimizer is None:
        raise PlannerError("zero1 shards the optimizer's state: pass optimizer=...")
    g = _capture_sharded(model, inputs, strategy=strategy, world_size=world_size, rank=rank,
                         loss_fn=loss_fn, optimizer=optimizer, profile=profile,
                         autocast=autocast, progress=progress,
                         probe_limit=_probe_limit() if probe_kernels else 0, options=options)
    return MemoryTrace(g)


def _capture_sharded(model, inputs, *, strategy, world_size, rank, loss_fn, optimizer,
                     profile, autocast, progress, probe_limit, options):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import _pytree as pytree

    from ..planner.capture import (OUTSIDE, _check_loss, _describe_inputs, _fake_like,
                                   _function_mode, _to_loss, _untraceable)
    from ..planner.graph import (ACTIVATION, BACKWARD, BEFORE_STEP, BUFFER, FORWARD,
                                 GRADIENT, INPUT, OPTIMIZER, OPTIMIZER_STATE, PARAMETER,
                                 StepGraph)
    from ..planner.probe import ProbeSet
    from ..planner.profile import kernel_overrides, state_on_device

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = _State(fake_mode)
    mode = _mode(state)
    def amp():
        return (torch.autocast("cpu", dtype=autocast) if autocast is not None
                else contextlib.nullcontext())

    rec = None
    hooks = []
    wrapped = opt = fmodel = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fake_process_group(rank, world_size))
        mesh = None
        if strategy in ("zero2", "zero3", "fsdp"):
            from torch.distributed.device_mesh import init_device_mesh

            # Outside the fake mode: the mesh holds a small real tensor of rank ids.
            mesh = init_device_mesh("cpu", (world_size,))
        stack.enter_context(_follow_resize(state))
        stack.enter_context(_ddp_on_fake_tensors())
        with fake_mode, mode:
            state.label = "model"
            fmodel = _fake_copy(model, fake_mode)
            fmodel.train()
            fake_args = pytree.tree_map_only(
                torch.Tensor, lambda t: _fake_like(t, t.requires_grad), tuple(inputs))
            state.label = strategy
            try:
                wrapped, opt = apply_strategy(fmodel, strategy, optimizer, profile=profile,
                                              mesh=mesh, **options)
            except PlannerError:
                raise
            except Exception as e:
                raise PlannerError(f"cannot apply {strategy!r} to {type(model).__name__}: "
                                   f"{type(e).__name__}: {e}") from e

            def step():
                out = wrapped(*fake_args)
                loss = _loss_of(out, loss_fn)
                del out
                _backward(loss)
                del loss
                if opt is not None:
                    opt.step()

            # Warm-up: one step creates the optimizer's state, FSDP's lazy state and
            # DDP's gradient-ready order; DDP then rebuilds its buckets (once).
            state.label = "warm-up"
            try:
                with amp():
                    out = wrapped(*fake_args)
                    loss = _to_loss(out, loss_fn)
                del out
                _check_loss(loss)
                _backward(loss)
                del loss
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    wrapped.zero_grad(set_to_none=True)
            except PlannerError:
                raise
            except Exception as e:
                raise PlannerError(f"the warm-up step under {strategy!r} failed: "
                                   f"{type(e).__name__}: {e}") from e
            if strategy in ("ddp", "zero1"):
                state.label = "ddp bucket"
                state.real_int = True
                try:
                    wrapped.reducer._rebuild_buckets()
                finally:
                    state.real_int = False
            state.label = "persistent"
        gc.collect()

        # -- the traced step ---------------------------------------------------------------
        probes = ProbeSet(probe_limit) if probe_limit > 0 else None
        rec = _recorder_class()(profile, fake_mode, progress, probes)
        try:
            names: dict[int, str] = {}
            fsdp = _fsdp_params(fmodel) if strategy in ("zero2", "zero3", "fsdp") else []
            for name, p in fmodel.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), name)
            for fp in fsdp:
                names.setdefault(id(fp.sharded_param), fp._param_fqn)
            params = [p for p in fmodel.parameters()]
            for p in params:
                name = names.get(id(p), "?")
                rec.register(_local(p), PARAMETER, name)
                rec.param_module[id(p)] = name.rpartition(".")[0]
            for fp in fsdp:
                mod = fp._param_fqn.rpartition(".")[0]
                rec.param_module[id(fp.sharded_param)] = mod
                if hasattr(fp, "_unsharded_param"):
                    rec.param_module[id(fp._unsharded_param)] = mod
            for name, b in fmodel.named_buffers():
                rec.register(_local(b), BUFFER, name)
            for i, a in enumerate(pytree.tree_leaves(fake_args)):
                if isinstance(a, torch.Tensor):
                    rec.register(a, INPUT, f"inputs[{i}]")
            inner = getattr(opt, "optim", opt)
            if inner is not None:
                pnames = {id(p): names.get(id(p), "?") for p in params}
                for p, st in inner.state.items():
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            v = _local(v)
                            if state_on_device(inner, k, v, profile):
                                rec.register(v, OPTIMIZER_STATE,
                                             f"{pnames.get(id(p), '?')}.{k}")
                            else:
                                rec.register_host(v)
            # Everything else the strategy keeps between steps (DDP's buckets, ...).
            for key, (ref, label) in list(state.survey.items()):
                s = ref()
                if s is None or key in rec.live or s.nbytes() == 0:
                    continue
                cat = GRADIENT if label == "ddp bucket" else BUFFER
                rec.register(_StorageView(s), cat, f"{label} (kept between steps)")

            def enter(name):
                def hook(_module, _args):
                    rec.module_stack.append(name)
                return hook

            def leave(_module, _args, _output):
                rec.module_stack.pop()

            for mname, m in fmodel.named_modules():
                hooks.append(m.register_forward_pre_hook(enter(mname)))
                hooks.append(m.register_forward_hook(leave, always_call=True))

            state.rec = rec
            phase_starts = {}
            activations: set[int] = set()
            try:
                with fake_mode, mode, _function_mode(rec, kernel_overrides(profile)):
                    phase_starts[FORWARD] = len(rec.ops)
                    with amp():
                        out = wrapped(*fake_args)
                        loss = _to_loss(out, loss_fn)
                    del out
                    activations = {tid for tid in rec.live.values()
                                   if rec.tensors[tid].alloc_op != BEFORE_STEP}
                    rec.phase = BACKWARD
                    phase_starts[BACKWARD] = len(rec.ops)
                    _backward(loss)
                    del loss
                    if opt is not None:
                        rec.phase = OPTIMIZER
                        phase_starts[OPTIMIZER] = len(rec.ops)
                        opt.step()
            except PlannerError:
                raise
            except Exception as e:
                raise _untraceable(rec, e, model, tuple(inputs)) from e
            state.rec = None

            grads = set()
            for p in params:
                if p.grad is not None:
                    tid = rec.live.get(_local(p.grad).untyped_storage()._cdata)
                    if tid is not None:
                        grads.add(tid)
            unsharded = {}
            for fp in fsdp:
                for t in fp.all_gather_outputs:
                    unsharded[t.untyped_storage()._cdata] = fp._param_fqn
            rec.close()
            probe_stats = None
            if probes is not None:
                scratch, probe_stats = probes.measure(progress)
                for i, ws in scratch.items():
                    rec.ops[i].scratch = ws
            for tid in activations:
                rec.tensors[tid].category = ACTIVATION
            for tid in grads:
                rec.tensors[tid].category = GRADIENT
            # FSDP's unsharded parameters: each resize up of an all-gather output storage.
            # (Storage keys of the resized tensors are recovered from their names below.)
            for info in rec.tensors:
                if info.op == "UntypedStorage.resize_":
                    info.category = PARAMETER
                    info.name = "unsharded parameter (all-gathered)"
            meta = {"model": type(model).__name__, "train": True,
                    "optimizer": type(getattr(opt, "optim", opt)).__name__ if opt is not None
                    else None,
                    "autocast": str(autocast).replace("torch.", "") if autocast else None,
                    "inputs": _describe_inputs(tuple(inputs)),
                    "kernel_scratch_probe": probe_stats,
                    "torch_version": torch.__version__,
                    "sharding": {"strategy": strategy, "world_size": world_size, "rank": rank,
                                 "options": {k: (v if isinstance(v, (int, float, str, bool))
                                                 else repr(v)) for k, v in options.items()},
                                 "description": DESCRIPTIONS[strategy]},
                    "collectives": [{"op": op, "bytes": b, "phase": ph}
                                    for op, b, ph in state.collectives]}
            del unsharded
            return StepGraph(ops=rec.ops, tensors=rec.tensors, device=profile.name,
                             phase_starts=phase_starts, meta=meta)
        finally:
            state.rec = None
            if rec is not None:
                rec.close()
            for h in hooks:
                h.remove()
            # Drop the fake world (FSDP state, DDP's reducer and its hooks) before the
            # process group goes.
            wrapped = opt = fmodel = None
            gc.collect()


# -----------------------------------------------------------------------------------------
# Ground truth: the same strategy run for real, one process per rank, gloo on the CPU
# -----------------------------------------------------------------------------------------

def _load_workload(spec: dict):
    """(model, inputs, loss_fn) from ``{"builtin": name}`` (pymemplan.planner.models) or
    ``{"factory": "package.module:function"}``, with ``spec["kwargs"]`` passed on. A
    factory returns a Workload or ``(model, inputs[, loss_fn])``."""
    import importlib

    from ..planner.models import BUILTIN, Workload

    kwargs = dict(spec.get("kwargs", {}))
    if "builtin" in spec:
        out = BUILTIN[spec["builtin"]](**kwargs)
    else:
        module, _, fname = spec["factory"].partition(":")
        out = getattr(importlib.import_module(module), fname)(**kwargs)
    if isinstance(out, Workload):
        return out.model, out.inputs, out.loss_fn
    model, inputs, *rest = out
    return model, inputs, (rest[0] if rest else None)


def _allocation_window(prof, mark: str):
    """(total live bytes when ``mark`` began, peak of live bytes inside it, at its end),
    from the profiler's allocation events; totals count every block allocated while the
    profiler ran."""
    from torch._C._profiler import _EventType

    from ..traces.record import allocation_events, trace_from_events

    events = allocation_events(prof)
    trace_from_events(events, "cpu", name=mark)  # proves the events add up, or raises
    window = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack and window is None:
        node = stack.pop()
        if node.tag == _EventType.TorchOp and node.name == mark:
            window = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    if window is None:
        raise RuntimeError(f"the profiler has no {mark!r} range")
    cpu = sorted((e for e in events if e.device == "cpu"), key=lambda e: e.time_ns)
    before = [e for e in cpu if e.time_ns < window[0]]
    inside = [e for e in cpu if window[0] <= e.time_ns <= window[1]]
    start = before[-1].total_allocated if before else 0
    if inside:
        start = inside[0].total_allocated - inside[0].delta
    peak = max([start] + [e.total_allocated for e in inside])
    end = inside[-1].total_allocated if inside else start
    return start, peak, end, len(inside)


def _rank_main(rank, world_size, port, spec, strategy, optimizer, warmup, threads, options,
               out_dir):
    import json
    import os
    import traceback

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    result = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile, record_function

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            # All threads: gloo's worker threads drop the last reference to some tensors
            # (a collective's Work holds its inputs and outputs), and those frees count.
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                         record_shapes=False, with_stack=False,
                         experimental_config=_ExperimentalConfig(profile_all_threads=True)
                         ) as prof:
                torch.manual_seed(0)
                model, inputs, loss_fn = _load_workload(spec)
                if isinstance(inputs, torch.Tensor):
                    inputs = (inputs,)
                model.train()
                wrapped, opt = apply_strategy(model, strategy, optimizer, **options)

                def step():
                    out = wrapped(*inputs)
                    loss = _loss_of(out, loss_fn)
                    del out
                    loss.backward()
                    del loss
                    if opt is not None:
                        opt.step()

                for _ in range(warmup):
                    step()
                    (opt or wrapped).zero_grad(set_to_none=True)
                gc.collect()
                dist.barrier()
                with record_function(_MARK):
                    step()
            start, peak, end, n = _allocation_window(prof, _MARK)
            result.update(peak_bytes=peak, start_bytes=start, end_bytes=end, events=n)
        finally:
            dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_sharded(workload: dict, strategy: str, world_size: int = 2, *, optimizer=None,
                    warmup: int = 2, timeout: float = 600, threads: int | None = None,
                    **options) -> list[dict]:
    """Run ``strategy`` for real on ``world_size`` CPU processes (gloo backend, started
    with torch.multiprocessing's spawn) and measure each rank's step.

    Each rank builds the workload (see :func:`_load_workload`; it must be importable in a
    fresh process, hence a spec rather than a model), wraps it with
    :func:`apply_strategy` (the code :func:`trace_sharded` runs on fake tensors), runs
    ``warmup`` steps (optimizer state, FSDP's lazy init, DDP's bucket rebuild), then one
    step under the profiler. The whole life of the process after the process group is up
    runs under the profiler, so its allocation totals are the rank's live tensor bytes.

    Returns one dict per rank: ``peak_bytes`` (the exact peak of live bytes in the
    step), ``start_bytes``/``end_bytes`` (live when it began/ended), ``events``. Raises
    RuntimeError with every rank's traceback if a rank fails, or on ``timeout`` seconds.
    """
    import json
    import os
    import tempfile
    import time

    import torch
    import torch.multiprocessing as mp

    _check_strategy(strategy, world_size)
    _check_options(strategy, options)
    threads = threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="pymemplan-ranks-") as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(world_size, _free_port(), workload, strategy, optimizer, warmup,
                              threads, options, out_dir),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"measuring {strategy} on {world_size} gloo ranks took more than "
                        f"{timeout:.0f} s; ranks were stopped")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.json")
            if not os.path.exists(path):
                results.append({"rank": r, "error": "no result (the process died)"})
                continue
            with open(path) as f:
                results.append(json.load(f))
    errors = [f"rank {r['rank']}:\n{r['error']}" for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"measuring {strategy} on {world_size} gloo ranks failed:\n"
                           + "\n".join(errors))
    return results
