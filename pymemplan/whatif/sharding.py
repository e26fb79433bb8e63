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

The one thing modelled rather than run is the communication backend's own buffers, which
the fake backend does not take: for the CPU target (gloo) an all-gather stages its output
in a temporary of the output's size and a reduce-scatter all-reduces a clone of its
input (``_gloo_scratch``, from ProcessGroupGloo.cpp and measured); for CUDA (NCCL) there
are none. They count as scratch of the collective's op.

Ground truth: :func:`measure_sharded` runs the same strategy for real, one process per
rank on the gloo backend (CPU), and measures each rank's exact peak from the profiler's
allocation events (``pymemplan.traces.record``); ``tests/test_whatif_sharding.py`` and
``benchmarks/whatif_sharding.py`` compare the two (exact, to the byte, for GPT-2 small,
BERT-base, ResNet-50 and an MLP under all five strategies on this machine).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import weakref
from typing import Any

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
    """(class, kwargs) of an optimizer given as a class, a factory or an instance: the
    hyperparameters are its ``defaults`` that its constructor takes (an instance's
    per-group settings are not kept)."""
    import inspect

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
    cls = type(probe)
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return cls, dict(probe.defaults)
    return cls, {k: v for k, v in probe.defaults.items() if k in params and k != "params"}


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
            if inner is not opt:
                # ZeroRedundancyOptimizer copies its own groups' settings onto the local
                # optimizer's at every step: give them the local optimizer's.
                opt._sync_param_groups(inner.param_groups, opt.param_groups)
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
        # The recorder of the optimizer's first step (in the warm-up): it records, but what
        # the warm-up makes is surveyed and its collectives are not the traced step's.
        self.first_rec = None
        self.backend = "nccl"           # whose buffers a collective takes: "gloo" or "nccl"
        self.nonzero_density = None     # trace_sharded(nonzero_density=): see _at_density

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


def _collective_bytes(func, args) -> int:
    """The bytes a collective is over: the all-reduced or broadcast tensors, an
    all-gather's output, a reduce-scatter's input (the c10d ops' argument order)."""
    import torch
    from torch.utils import _pytree as pytree

    name = func.overloadpacket.__name__
    reduce_scatter = name in ("_reduce_scatter_base_", "reduce_scatter_",
                              "reduce_scatter_tensor_coalesced_")
    ts = [t for t in pytree.tree_leaves(args[1] if reduce_scatter else args[0])
          if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in ts)


_AVG = 1  # c10d ReduceOp.AVG's code (ReduceOp ScriptObjects give it as .op())


def _gloo_scratch(func, args) -> int:
    """Bytes gloo allocates on the calling thread inside a CPU collective and frees as it
    completes (ProcessGroupGloo.cpp), which the fake backend does not:
    ``_allgather_base_`` gathers into temporaries of the output's size (measured: two in
    turn); ``_reduce_scatter_base_`` all-reduces a clone of its input, and with
    ``ReduceOp.AVG`` divides by the world size through a float64 scalar and one element
    of the input's dtype. NCCL (the CUDA target) takes no such buffers."""
    name = func.overloadpacket.__name__
    if name == "_allgather_base_":
        out = args[0]
        return out.numel() * out.element_size()
    if name == "_reduce_scatter_base_":
        inp = args[1]
        extra = 0
        try:
            if args[3].op() == _AVG:
                extra = 8 + inp.element_size()
        except Exception:  # not a ReduceOp object: no division
            pass
        return inp.numel() * inp.element_size() + extra
    return 0


def _mode(state: _State):
    import torch
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..planner.capture import run_op

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
            if rec is not None:
                out = rec.dispatch(func, args, kwargs)
            else:  # the warm-up step: no recorder, the same kernels
                out = run_op(func, args, kwargs, state.nonzero_density)
            if rec is None or rec is state.first_rec:
                state.note(out)
            if func.namespace == "c10d" and isinstance(out, tuple) and len(out) == 2 \
                    and isinstance(out[1], torch.ScriptObject):
                if rec is not None and rec is not state.first_rec:
                    state.collectives.append((func.overloadpacket.__name__,
                                              _collective_bytes(func, args), rec.phase))
                    if state.backend == "gloo":
                        rec.ops[-1].scratch += _gloo_scratch(func, args)
                return out[0], _completed_work(out[0])
            return out

    return _ShardMode()


def _copies_of_reals(profile, fake_mode, model, fmodel, inputs, fake_args):
    """A recorder holding only the fake world's stand-ins for the user's real parameters,
    buffers and inputs (matched by name and position), for the function mode."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree

    from ..planner.capture import _Recorder

    copies = _Recorder(profile, fake_mode, None)
    copies.phase = "warm-up"  # records nothing: no module attribution of autograd nodes
    fake = dict(fmodel.named_parameters(remove_duplicate=False))
    fake.update(fmodel.named_buffers(remove_duplicate=False))
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        f = fake.get(name)
        # A shard (FSDP's DTensor) does not stand for the whole tensor's bytes: such a real
        # tensor, if read, is copied whole when first read (copy_leaves), as any real leaf.
        if f is not None and not isinstance(f, DTensor) and f.shape == t.shape:
            copies.add_copy(t, f)
    for a, f in zip(pytree.tree_leaves(tuple(inputs)), pytree.tree_leaves(fake_args)):
        if isinstance(a, torch.Tensor):
            copies.add_copy(a, f)
    copies.copy_leaves = True
    return copies


def _recorder_class():
    from ..planner.capture import _Recorder
    from ..planner.graph import BEFORE_STEP, TEMPORARY, TensorInfo

    class _ShardRecorder(_Recorder):
        """The planner's recorder, plus storages resized in place (FSDP's unsharded
        parameters): a resize to 0 frees the storage's bytes, a resize up allocates.
        Tensors made while ``label`` is set (inside FSDP's collectives) are named by it."""

        label = ""
        merge_in_place_sums = False  # see _Recorder.merge_in_place_sums

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.resized: dict[int, int] = {}   # tensor id -> key of the resized storage

        def _new(self, t, category, op_index, op="", name="", module="", phase=""):
            if not name and self.label and op_index != BEFORE_STEP:
                name = self.label
            return super()._new(t, category, op_index, op=op, name=name, module=module,
                                phase=phase)

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
                    module=self.module_now(), phase=self.phase,
                    name=self.label or "resized storage",
                    alloc_seq=self._tick()))
                self.live[key] = tid
                self.resized[tid] = key
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


_FSDP_LABELS = {"foreach_all_gather": "FSDP all-gather buffer",
                "foreach_all_gather_copy_out": "unsharded parameter (all-gathered)",
                "foreach_reduce": "FSDP reduce-scatter buffer"}


@contextlib.contextmanager
def _fsdp_labels(state: _State):
    """Name what FSDP's collective functions allocate (reports only; nothing else
    changes): they are called by name from ``_fsdp_param_group``."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    originals = {name: getattr(pg, name) for name in _FSDP_LABELS if hasattr(pg, name)}

    def labelled(fn, label):
        def wrapper(*args, **kwargs):
            rec = state.rec
            if rec is None:
                return fn(*args, **kwargs)
            previous, rec.label = rec.label, label
            try:
                return fn(*args, **kwargs)
            finally:
                rec.label = previous
        return wrapper

    for name, fn in originals.items():
        setattr(pg, name, labelled(fn, _FSDP_LABELS[name]))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(pg, name, fn)


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

    def _is_zerotensor(self):  # a storage holds its bytes
        return False


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


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
                  train: bool = True, grads_present: bool = False,
                  nonzero_density: float | None = None, **options):
    """Predict one rank's training step under a sharding ``strategy`` over ``world_size``
    ranks (see :data:`STRATEGIES` and the module's docstring for what each runs).

    Returns a :class:`pymemplan.planner.api.MemoryTrace`: ``.peak_bytes`` is the rank's
    peak of live tensor bytes, buckets, all-gathered parameters and reduce-scatter
    buffers included. The graph's ``meta["sharding"]`` records the strategy, and
    ``meta["collectives"]`` every collective of the step with its bytes.

    The arguments are :func:`pymemplan.trace`'s (``loss_fn``, ``optimizer``, ``device``,
    ``autocast``, ``probe_kernels``, ``progress``, ``grad_scaler``, ``nonzero_density``;
    ``train`` must stay True and ``grads_present`` False), plus:

    - ``strategy``: one of :data:`STRATEGIES`; ``world_size``: ranks (GPUs), at least 1;
      ``rank``: the rank traced (ranks differ where shards are uneven, and under zero1);
    - options: for ``ddp``/``zero1`` ``bucket_cap_mb``, ``gradient_as_bucket_view``,
      ``broadcast_buffers`` (and ``parameters_as_bucket_view`` for zero1); for the FSDP
      strategies ``wrap`` (see :func:`shard_targets`), and for ``fsdp``
      ``reshard_after_forward``. Anything else is a PlannerError.

    ``inputs`` are one rank's micro-batch. The step is the steady state, as for
    :func:`pymemplan.trace`: one warm-up step has run (optimizer state, FSDP's lazy
    init) and DDP has rebuilt its buckets; gradients start as None. For the CPU target
    the communication backend is gloo, for CUDA NCCL (see ``_gloo_scratch``).

    The model is never modified. No process group may exist in this process: the trace
    sets up its own fake one and tears it down.
    """
    import torch

    from ..planner.api import MemoryTrace, _probe_limit, check_density, check_trace_args
    from ..planner.profile import get_profile

    _check_strategy(strategy, world_size, rank)
    _check_options(strategy, options)
    if not train:
        raise PlannerError("a sharded step is a training step: train=False is not supported")
    if grads_present:
        raise PlannerError("grads_present=True (a gradient-accumulation micro-step) is not "
                           "traced for sharded strategies: DDP would need no_sync() and FSDP "
                           "set_requires_gradient_sync(False) for the micro-steps before it")
    profile = get_profile(device)
    inputs, probe_kernels = check_trace_args(model, inputs, profile, autocast=autocast,
                                             loss_fn=loss_fn, probe_kernels=probe_kernels)
    check_density(nonzero_density)
    if not any(p.requires_grad for p in model.parameters()):
        raise PlannerError("the model has no parameters that require grad: nothing to shard")
    if strategy in ("zero1",) and optimizer is None:
        raise PlannerError("zero1 shards the optimizer's state: pass optimizer=...")
    from ..planner.library_shims import eager_paths
    from ..planner.module_state import function_caches_kept

    with eager_paths(), function_caches_kept():
        g = _capture_sharded(model, inputs, strategy=strategy, world_size=world_size,
                             rank=rank, loss_fn=loss_fn, optimizer=optimizer, profile=profile,
                             autocast=autocast, progress=progress,
                             probe_limit=_probe_limit() if probe_kernels else 0,
                             grad_scaler=grad_scaler, options=options,
                             nonzero_density=nonzero_density)
    return MemoryTrace(g)


def _capture_sharded(model, inputs, *, strategy, world_size, rank, loss_fn, optimizer,
                     profile, autocast, progress, probe_limit, grad_scaler, options,
                     nonzero_density=None):
    """trace_sharded's work: set up the fake world, warm up, record one step."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import _pytree as pytree

    from ..planner.capture import (_backward, _check_loss, _describe_inputs, _fake_like,
                                   _first_step_events, _function_mode, _to_loss, _untraceable,
                                   backward_phase, begin_first_step, finish_recording,
                                   real_storages, rng_states_recorded,
                                   conversions_in_forward)
    from ..planner.library_shims import note_real_inputs
    from ..planner.graph import (BEFORE_STEP, BUFFER, FORWARD, GRADIENT, INPUT, OPTIMIZER,
                                 OPTIMIZER_STATE, PARAMETER, StepGraph)
    from ..planner.autocast import for_target as autocast_for_target
    from ..planner.probe import ProbeSet
    from ..planner.profile import kernel_overrides, state_on_device

    scaler_class = None
    if grad_scaler:
        from ..planner import capture

        scaler_class = getattr(capture, "_ScalerState", None)
        if scaler_class is None:
            raise PlannerError("grad_scaler=True needs the planner's GradScaler support "
                               "(pymemplan.planner.capture._ScalerState)")

    def amp():
        return (torch.autocast("cpu", dtype=autocast) if autocast is not None
                else contextlib.nullcontext())

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = _State(fake_mode)
    state.nonzero_density = nonzero_density
    # Whose staging buffers collectives take: gloo's on the CPU target, NCCL's (none) on CUDA.
    state.backend = "gloo" if profile.name == "cpu" else "nccl"
    mode = _mode(state)
    world: dict[str, Any] = {}   # the fake copy, its wrapper and optimizer: dropped at the end
    hooks: list = []
    rec = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fake_process_group(rank, world_size))
        mesh = None
        if strategy in ("zero2", "zero3", "fsdp"):
            from torch.distributed.device_mesh import init_device_mesh

            # Outside the fake mode: the mesh keeps a small real tensor of rank ids.
            mesh = init_device_mesh("cpu", (world_size,))
        stack.enter_context(_follow_resize(state))
        stack.enter_context(_ddp_on_fake_tensors())
        stack.enter_context(_fsdp_labels(state))
        stack.callback(world.clear)

        # -- the fake world, and one warm-up step -------------------------------------------
        with fake_mode, mode:
            state.label = "model"
            try:
                fmodel = world["model"] = _fake_copy(model, fake_mode)
            except Exception as e:
                raise PlannerError(
                    f"cannot copy {type(model).__name__}'s structure to trace it "
                    f"(copy.deepcopy, with fake parameters: {type(e).__name__}: {e}); pass "
                    f"the plain model, not one already wrapped by DDP or FSDP") from e
            fmodel.train()
            fake_args = pytree.tree_map_only(
                torch.Tensor, lambda t: _fake_like(t, t.requires_grad), tuple(inputs))
            note_real_inputs(pytree.tree_leaves(fake_args), pytree.tree_leaves(tuple(inputs)))
            state.label = strategy
            try:
                wrapped, opt = apply_strategy(fmodel, strategy, optimizer, profile=profile,
                                              mesh=mesh, **options)
            except PlannerError:
                raise
            except Exception as e:
                raise PlannerError(f"cannot apply {strategy!r} to {type(model).__name__}: "
                                   f"{type(e).__name__}: {e}") from e
            world.update(wrapped=wrapped, opt=opt)
            # Code outside the model (a loss over a list of the parameters) reads the fake
            # world's tensors for the user's real ones, as in pymemplan.trace: a real tensor
            # read in the step would be a leaf of the graph, and backward would leave a fake
            # gradient in it. Put back at the end, whatever happens.
            copies = _copies_of_reals(profile, fake_mode, model, fmodel, inputs, fake_args)
            stack.callback(copies.restore_reals)
            scaler = world["scaler"] = scaler_class() if scaler_class else None
            inner = getattr(opt, "optim", opt)   # ZeroRedundancyOptimizer's local optimizer
            params = list(fmodel.parameters())

            def step():
                with amp():
                    out = wrapped(*fake_args)
                    loss = _to_loss(out, loss_fn)
                del out
                _check_loss(loss)
                if scaler is not None:
                    loss = scaler.scale_loss(loss)
                return loss

            def optimizer_step():
                if scaler is not None:
                    scaler.unscale([_local(p.grad) for p in params if p.grad is not None])
                opt.step()
                if scaler is not None:
                    scaler.update()

            # The warm-up step creates the optimizer's state, FSDP's lazy state and DDP's
            # gradient-ready order; the traced step is then the steady state.
            state.label = "warm-up"
            first = None
            try:
                warm_copies = _function_mode(copies, {})
                warm_copies.__enter__()
                loss = step()
                _backward(loss)
                del loss
                if opt is not None and strategy not in ("ddp", "zero1"):
                    optimizer_step()
                elif opt is not None:
                    # The optimizer's first step, recorded: where it makes its state. Only
                    # on plain tensors: under FSDP (DTensor parameters) the recorded first
                    # step holds full-size temporaries that later steps do not, not yet
                    # understood, so the state is made before the run there.
                    first = state.first_rec = _recorder_class()(profile, fake_mode, None)
                    first.known_real = real_storages(pytree.tree_leaves(tuple(inputs)))
                    first.nonzero_density = nonzero_density
                    begin_first_step(first, inner, params, local=_local)
                    state.rec = first
                    try:
                        optimizer_step()
                    finally:
                        state.rec = None
                        first.close()
                (opt if opt is not None else wrapped).zero_grad(set_to_none=True)
            except PlannerError:
                raise
            except Exception as e:
                raise PlannerError(f"the warm-up step under {strategy!r} failed: "
                                   f"{type(e).__name__}: {e}") from e
            finally:
                warm_copies.__exit__(None, None, None)
            if strategy in ("ddp", "zero1"):
                # DDP rebuilds its buckets in gradient-ready order once, at the start of the
                # second forward; do it now, with its few int32 index tensors real.
                state.label = "ddp bucket"
                state.real_int = True
                try:
                    wrapped.reducer._rebuild_buckets()
                except Exception as e:
                    raise PlannerError(
                        f"DDP could not rebuild its gradient buckets after the first step "
                        f"({type(e).__name__}: {e}); a model with parameters that get no "
                        f"gradient needs find_unused_parameters=True, which is not traced") from e
                finally:
                    state.real_int = False
            state.label = "persistent"
        gc.collect()

        # -- what exists when the step starts ---------------------------------------------
        probes = ProbeSet(probe_limit) if probe_limit > 0 else None
        rec = _recorder_class()(profile, fake_mode, progress, probes)
        # A loss_fn over the real inputs reads tensors registered already (their copies).
        rec.known_real = real_storages(pytree.tree_leaves(tuple(inputs)))
        rec.share_copies(copies)
        rec.nonzero_density = nonzero_density
        stack.callback(rec.close)
        fsdp = _fsdp_params(fmodel) if strategy in ("zero2", "zero3", "fsdp") else []
        names: dict[int, str] = {}
        for name, p in fmodel.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        for p in params:
            name = names.get(id(p), "?")
            rec.register(_local(p), PARAMETER, name)
            rec.param_module[id(p)] = name.rpartition(".")[0]
        for fp in fsdp:   # autograd sees the unsharded parameters
            if hasattr(fp, "_unsharded_param"):
                rec.param_module[id(fp._unsharded_param)] = fp._param_fqn.rpartition(".")[0]
        for name, b in fmodel.named_buffers():
            rec.register(_local(b), BUFFER, name)
        for i, a in enumerate(pytree.tree_leaves(fake_args)):
            if isinstance(a, torch.Tensor):
                rec.register(a, INPUT, f"inputs[{i}]")
        if inner is not None:
            for p, st in inner.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        v = _local(v)
                        if state_on_device(inner, k, v, profile):
                            rec.register(v, OPTIMIZER_STATE, f"{names.get(id(p), '?')}.{k}")
                        else:
                            rec.register_host(v)
        if scaler is not None:
            rec.register(scaler.scale, OPTIMIZER_STATE, "grad_scaler.scale")
            rec.register(scaler.growth_tracker, OPTIMIZER_STATE, "grad_scaler.growth_tracker")
        if mesh is not None and profile.name == "cpu":
            # The device mesh's tensor of rank ids is host memory: the CPU target's.
            rec.register(_StorageView(mesh.mesh.untyped_storage()), BUFFER,
                         "device mesh (rank ids)")
        # Everything else the strategy keeps between steps: DDP's buckets, ...
        for key, (ref, label) in list(state.survey.items()):
            kept = ref()
            if kept is not None and key not in rec.live and key not in rec.host \
                    and kept.nbytes() > 0:
                category = GRADIENT if label == "ddp bucket" else BUFFER
                rec.register(_StorageView(kept), category, f"{label} (kept between steps)")
            kept = None   # no reference of ours may outlive the storage's own

        def enter(name):
            def hook(_module, _args):
                rec.enter_module(name)
            return hook

        def leave(_module, _args, _output):
            rec.leave_module()

        for mname, m in fmodel.named_modules():
            hooks.append(m.register_forward_pre_hook(enter(mname)))
            hooks.append(m.register_forward_hook(leave, always_call=True))
        stack.callback(lambda: [h.remove() for h in hooks])

        # -- the traced step ---------------------------------------------------------------
        phase_starts: dict[str, int] = {}
        state.rec = rec
        try:
            with fake_mode, mode, _function_mode(rec, kernel_overrides(profile)), \
                    rng_states_recorded(rec, profile), conversions_in_forward(fmodel), \
                    autocast_for_target(profile, autocast):
                phase_starts[FORWARD] = len(rec.ops)
                loss = step()
                activations = backward_phase(rec, loss, phase_starts)
                del loss
                if opt is not None:
                    rec.phase = OPTIMIZER
                    phase_starts[OPTIMIZER] = len(rec.ops)
                    optimizer_step()
                    step_span = (phase_starts[OPTIMIZER], len(rec.ops))
        except PlannerError:
            raise
        except Exception as e:
            raise _untraceable(rec, e, model, tuple(inputs)) from e
        finally:
            state.rec = None

        grads = set()
        for p in params:
            if p.grad is not None:
                tid = rec.live.get(_local(p.grad).untyped_storage()._cdata)
                if tid is not None:
                    grads.add(tid)
        unsharded: dict[int, tuple] = {}   # storage key -> (fqn, shape, dtype)
        for fp in fsdp:
            dtype = str(fp.param_dtype or fp.orig_dtype).replace("torch.", "")
            for t in fp.all_gather_outputs:
                unsharded[t.untyped_storage()._cdata] = (fp._param_fqn, tuple(fp._orig_size),
                                                         dtype)
        probe_stats = finish_recording(rec, probes, progress, activations, grads)
        # FSDP's unsharded parameters: each resize up of an all-gather output's storage.
        for tid, key in rec.resized.items():
            info = rec.tensors[tid]
            info.category = PARAMETER
            if key in unsharded:
                fqn, info.shape, info.dtype = unsharded[key]
                info.name = f"{fqn} (unsharded, all-gathered)"
            else:
                info.name = "unsharded parameter (all-gathered)"
        meta = {"model": type(model).__name__, "train": True,
                "optimizer": type(inner).__name__ if inner is not None else None,
                "foreach": inner.param_groups[0].get("foreach") if inner is not None else None,
                "autocast": str(autocast).replace("torch.", "") if autocast else None,
                "grad_scaler": bool(grad_scaler),
                "nonzero_density": nonzero_density,
                "inputs": _describe_inputs(tuple(inputs)),
                "kernel_scratch_probe": probe_stats,
                "module_calls": {k: v for k, v in rec.module_calls.items() if v > 1},
                "torch_version": torch.__version__,
                "sharding": {"strategy": strategy, "world_size": world_size, "rank": rank,
                             "backend": state.backend,
                             "options": {k: (v if isinstance(v, (int, float, str, bool))
                                             else repr(v)) for k, v in options.items()},
                             "description": DESCRIPTIONS[strategy]},
                "collectives": [{"op": op, "bytes": b, "phase": ph}
                                for op, b, ph in state.collectives]}
        first_step = (_first_step_events(first, rec, inner, profile, step_span, local=_local)
                      if first is not None and inner is not None else None)
        graph = StepGraph(ops=rec.ops, tensors=rec.tensors, device=profile.name,
                          phase_starts=phase_starts, meta=meta, first_optimizer_step=first_step,
                          op_calls=rec.op_calls, op_reads=rec.op_reads)
        # Drop the fake world (FSDP's state, DDP's reducer and its hooks) before the process
        # group goes.
        del fmodel, wrapped, opt, inner, params, scaler, step, optimizer_step
        world.clear()
        gc.collect()
    return graph


# -----------------------------------------------------------------------------------------
# Communication per step, and the code to apply a strategy
# -----------------------------------------------------------------------------------------

_COLLECTIVE_KIND = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
                    "_allgather_base_": "all_gather", "allgather_": "all_gather",
                    "allgather_into_tensor_coalesced_": "all_gather",
                    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
                    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
                    "broadcast_": "broadcast"}


def _sent(kind: str, nbytes: float, world_size: int) -> float:
    """Bytes one rank sends for a collective over ``nbytes`` (the all-reduced buffer, the
    gathered output, the reduce-scattered input, the broadcast buffer), with ring
    algorithms (NCCL's default for large messages; gloo's all-reduce is a ring too)."""
    w = world_size
    if w <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (w - 1) / w * nbytes


def communication_bytes(model, strategy: str, world_size: int, *, trace=None,
                        broadcast_buffers: bool = True, wrap=None) -> dict:
    """Bytes each rank sends per training step under ``strategy``, by collective:
    ``{"all_reduce", "all_gather", "reduce_scatter", "broadcast"}`` (ring algorithms).

    With ``trace`` (a :func:`trace_sharded` result), from the collectives the traced step
    issued, with their exact sizes (FSDP's padding included). Without, from the model's
    parameter and buffer sizes and what each strategy issues per step:

    - ddp: all-reduce of every gradient; broadcast of the buffers before each forward
      (``broadcast_buffers``, DDP's default);
    - zero1: as ddp, plus each rank broadcasts the parameters it updated;
    - zero2: all-gather of the parameters once (kept until backward ends), reduce-scatter
      of the gradients;
    - zero3: all-gather twice (before forward and again before backward), reduce-scatter;
    - fsdp: as zero3, but the root module's own parameters are gathered once.
    """
    _check_strategy(strategy, world_size)
    out = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "broadcast": 0.0}
    if trace is not None:
        shard = trace.graph.meta.get("sharding") or {}
        if shard.get("strategy") != strategy or shard.get("world_size") != world_size:
            raise PlannerError(f"the trace is of {shard.get('strategy')!r} over "
                               f"{shard.get('world_size')} ranks, not {strategy!r} over "
                               f"{world_size}")
        for c in trace.graph.meta.get("collectives", []):
            kind = _COLLECTIVE_KIND.get(c["op"])
            if kind is not None:
                out[kind] += _sent(kind, c["bytes"], world_size)
        return {k: int(round(v)) for k, v in out.items()}

    def nbytes(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    params = [p for p in model.parameters() if p.requires_grad]
    p_bytes = nbytes(params)
    b_bytes = nbytes(list(model.buffers()))
    if strategy in ("ddp", "zero1"):
        out["all_reduce"] = _sent("all_reduce", p_bytes, world_size)
        if broadcast_buffers:
            out["broadcast"] = _sent("broadcast", b_bytes, world_size)
        if strategy == "zero1":
            out["broadcast"] += _sent("broadcast", p_bytes, world_size)
    else:
        out["reduce_scatter"] = _sent("reduce_scatter", p_bytes, world_size)
        if strategy == "zero2":
            gathers = p_bytes
        else:
            gathers = 2 * p_bytes
            if strategy == "fsdp":
                modules = dict(model.named_modules())
                wrapped = set()
                for path in shard_targets(model, wrap):
                    wrapped |= {id(p) for p in modules[path].parameters()}
                root = [p for p in params if id(p) not in wrapped]
                gathers -= nbytes(root)
        out["all_gather"] = _sent("all_gather", gathers, world_size)
    return {k: int(round(v)) for k, v in out.items()}


def _targets_code(model, wrap=None) -> list[str]:
    """The ``for`` line over the modules :func:`shard_targets` picks."""
    if model is None:
        return ["for block in model.blocks:        # each transformer block / residual stage"]
    targets = shard_targets(model, wrap)
    if not targets:
        return ["for block in []:                  # no blocks found: the root only"]
    parents: dict[str, list[str]] = {}
    for t in targets:
        parent, _, leaf = t.rpartition(".")
        parents.setdefault(parent, []).append(leaf)
    modules = dict(model.named_modules())
    items = []
    for parent, leaves in parents.items():
        ref = f"model.{parent}" if parent else "model"
        if len(leaves) == len(list((modules[parent] if parent else model).children())):
            items.append(f"*{ref}")
        else:
            items += [f"{ref}[{leaf}]" if leaf.isdigit() else f"{ref}.{leaf}" for leaf in leaves]
    if len(items) == 1 and items[0].startswith("*"):
        return [f"for block in {items[0][1:]}:"]
    return [f"for block in [{', '.join(items)}]:"]


def code_snippet(strategy: str, world_size: int, model=None, *, device: str = "cuda") -> str:
    """The code that applies ``strategy`` over ``world_size`` GPUs: the ``torchrun``
    command and the wrapping, as :func:`trace_sharded` traced it. With ``model``, the
    modules that get their own ``fully_shard`` are named (see :func:`shard_targets`)."""
    _check_strategy(strategy, world_size)
    backend = "nccl" if device == "cuda" else "gloo"
    nodes = "" if world_size <= 8 else (f"   # over several nodes: --nnodes=N "
                                        f"--nproc_per_node={world_size}/N --rdzv-endpoint=HOST")
    lines = [f"# torchrun --nproc_per_node={world_size} train.py{nodes}",
             "# (one process per GPU; each feeds its own micro-batch, e.g. through "
             "torch.utils.data.DistributedSampler)",
             "import os, torch, torch.distributed as dist",
             f'dist.init_process_group("{backend}")']
    if device == "cuda":
        lines.append('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))')
    to_dev = ".cuda()" if device == "cuda" else ""
    if strategy in ("ddp", "zero1"):
        lines += ["from torch.nn.parallel import DistributedDataParallel as DDP",
                  f"model = DDP(model{to_dev})   # gradients all-reduced in 25 MiB buckets"]
        if strategy == "ddp":
            lines.append("optimizer = torch.optim.AdamW(model.parameters())   # as before")
        else:
            lines += ["from torch.distributed.optim import ZeroRedundancyOptimizer",
                      "optimizer = ZeroRedundancyOptimizer(model.parameters(),",
                      "                                    optimizer_class=torch.optim.AdamW)"
                      "   # + its usual arguments"]
        return "\n".join(lines)
    reshard = {"zero2": "False", "zero3": "True", "fsdp": None}[strategy]
    arg = f", reshard_after_forward={reshard}" if reshard else ""
    lines += ["from torch.distributed.fsdp import fully_shard"]
    if to_dev:
        lines.append(f"model = model{to_dev}   # or build it on the meta device and "
                     f"materialize after sharding")
    lines += _targets_code(model)
    lines += [f"    fully_shard(block{arg})", f"fully_shard(model{arg})",
              "optimizer = torch.optim.AdamW(model.parameters())   # over the sharded parameters"]
    return "\n".join(lines)


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
    """(live bytes when ``mark`` began, peak of live bytes inside it, live at its end,
    number of events inside), from the profiler's allocation events. Bytes count from
    the allocator's total when the profiler started."""
    from torch._C._profiler import _EventType

    from ..traces.record import allocation_events, trace_from_events

    events = allocation_events(prof)
    trace = trace_from_events(events, "cpu", name=mark)  # proves the events add up, or raises
    baseline = trace.meta["baseline_bytes"]
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
    start = before[-1].total_allocated if before else baseline
    if inside:
        start = inside[0].total_allocated - inside[0].delta
    peak = max([start] + [e.total_allocated for e in inside])
    end = inside[-1].total_allocated if inside else start
    return start - baseline, peak - baseline, end - baseline, len(inside)


def _one_worker_gloo() -> None:
    """Make this process's gloo groups run their collectives on one worker thread
    (torch's creator of gloo groups, with ``threads=1``; gloo's default is 2), so that
    :func:`_settled_collectives` can tell when the worker is done with a collective."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    def create(opts, backend_options):
        o = ProcessGroupGloo._Options()
        o._threads = 1
        o._timeout = opts.timeout
        o._devices = [ProcessGroupGloo.create_default_device()]
        pg = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, o)
        pg.options.global_ranks_in_group = opts.global_ranks_in_group
        pg.options.group_name = opts.group_id
        return pg

    dist.Backend._ensure_backend_registered("gloo")
    plugin = dist.Backend._plugins["GLOO"]
    dist.Backend._plugins["GLOO"] = plugin._replace(creator_fn=create)


_SETTLED_OPS = ("allreduce_", "broadcast_", "allgather_", "_allgather_base_",
                "_reduce_scatter_base_", "reduce_scatter_", "allgather_into_tensor_coalesced_",
                "reduce_scatter_tensor_coalesced_", "allreduce_coalesced_", "reduce_", "gather_",
                "scatter_", "alltoall_base_", "barrier")


def _settled_collectives():
    """In the measured process: every collective completes, and gloo's worker thread
    lets go of it, before the caller goes on.

    Why. A gloo collective's ``Work`` holds its input and output tensors (and, for a
    reduce-scatter, a clone of its input that gloo makes on the calling thread), and the
    worker thread holds the Work until a moment after it completes. When the caller has
    dropped its own references by then, those tensors are freed on the worker thread,
    where the profiler does not see it: the allocator's total (kept only for profiled
    threads) stays high for the rest of the run, by a different amount each run. So
    after each collective this waits for it, then runs a one-element all-reduce on a
    tensor made before profiling: gloo has one worker thread here
    (:func:`_one_worker_gloo`), which takes the next collective only after letting go of
    the previous one. The collective's Work is then released here, on the calling
    thread, and the caller gets a completed Work holding the outputs, as gloo's does.

    How. A kernel for the collectives' ``AutogradCPU`` key, which runs before their CPU
    kernel (gloo's) and calls it: collectives called from C++ (DDP's Reducer) are caught
    too, and no other op is touched (a Python dispatch mode would be: with one active,
    ops with Python scalars allocate extra scalar tensors). Every tensor is allocated
    and freed by the same code as without this, on the calling thread; a collective's
    own buffers are freed as it returns (gloo's clone would be freed a moment later, on
    the worker thread: no op runs in between)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Work

    flag = torch.zeros(1)  # made before the profiler starts: its frees are not reported
    inside = threading.local()

    def kernel_for(op):
        def kernel(keyset, *args, **kwargs):
            out = op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)
            if getattr(inside, "active", False):
                return out
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.ScriptObject):
                tensors, boxed = out
            elif isinstance(out, torch.ScriptObject):
                tensors, boxed = None, out
            else:
                return out
            del out
            inside.active = True
            try:
                work = Work.unbox(boxed)
                work.wait()
                dist.all_reduce(flag)  # the worker is done with `work` once this one ran
                del work, boxed        # the collective's Work goes here, on this thread
            finally:
                inside.active = False
            return (tensors, _completed_work(tensors)) if tensors is not None else \
                _completed_work([])
        return kernel

    @contextlib.contextmanager
    def settled():
        lib = torch.library.Library("c10d", "IMPL")
        for name in _SETTLED_OPS:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is not None:
                lib.impl(name, kernel_for(packet.default), "AutogradCPU", with_keyset=True)
        try:
            yield
        finally:
            lib._destroy()

    return settled()


def _rank_main(rank, world_size, port, spec, strategies, optimizer, warmup, threads, options,
               out_dir):
    """One rank of :func:`measure_sharded`: every strategy in turn, each under its own
    profiler session, on a fresh copy of the workload made inside that session."""
    import json
    import os
    import time
    import traceback

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    results: dict = {}
    try:
        import torch
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile, record_function

        from ..traces.record import quiet_profiler_logs

        torch.set_num_threads(threads)
        _one_worker_gloo()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            torch.manual_seed(0)
            base_model, base_inputs, loss_fn = _load_workload(spec)
            if isinstance(base_inputs, torch.Tensor):
                base_inputs = (base_inputs,)
            base_model.train()
            quiet_profiler_logs()
            for strategy in strategies:
                settled = _settled_collectives()
                clock = [time.perf_counter()]
                # Everything of this strategy's run is made, and freed, while the profiler
                # runs: its totals are then the rank's live bytes.
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=False, with_stack=False) as prof, settled:
                    model = copy.deepcopy(base_model)
                    inputs = copy.deepcopy(base_inputs)
                    wrapped, opt = apply_strategy(model, strategy, optimizer,
                                                  **options.get(strategy, {}))

                    def step():
                        out = wrapped(*inputs)
                        loss = _loss_of(out, loss_fn)
                        del out
                        loss.backward()
                        del loss
                        if opt is not None:
                            opt.step()

                    clock.append(time.perf_counter())
                    for _ in range(warmup):
                        step()
                        (opt or wrapped).zero_grad(set_to_none=True)
                    gc.collect()
                    dist.barrier()
                    clock.append(time.perf_counter())
                    with record_function(_MARK):
                        step()
                    clock.append(time.perf_counter())
                    del step, wrapped, opt, model, inputs
                    gc.collect()
                    dist.barrier()
                start, peak, end, n = _allocation_window(prof, _MARK)
                clock.append(time.perf_counter())
                results[strategy] = {
                    "rank": rank, "peak_bytes": peak, "start_bytes": start, "end_bytes": end,
                    "events": n, "seconds": {k: round(b - a, 2) for k, a, b in zip(
                        ("wrap", "warm-up", "step", "events"), clock, clock[1:])}}
        finally:
            dist.destroy_process_group()
    except Exception:
        results["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_sharded(workload: dict, strategy, world_size: int = 2, *, optimizer=None,
                    warmup: int = 2, timeout: float = 600, threads: int | None = None,
                    options: dict | None = None):
    """Run a strategy for real on ``world_size`` CPU processes (gloo backend, started with
    torch.multiprocessing's spawn) and measure each rank's exact peak.

    ``workload``: ``{"builtin": name, "kwargs": {...}}`` (pymemplan.planner.models) or
    ``{"factory": "package.module:function", "kwargs": {...}}``: each rank builds it in a
    fresh process. ``strategy``: one name, or a list to measure in turn in the same
    processes. ``options``: ``{strategy: {option: value}}`` as for :func:`trace_sharded`.

    Each rank copies the model and inputs, wraps them with :func:`apply_strategy` (the
    code :func:`trace_sharded` runs on fake tensors), runs ``warmup`` steps (optimizer
    state, FSDP's lazy init, DDP's bucket rebuild at the second), then the measured
    step, all under one profiler session whose allocation events give the rank's live
    tensor bytes (``pymemplan.traces.record``; gloo is made to free on the calling
    thread, see :func:`_settled_collectives`).

    Returns, per rank, ``{"peak_bytes", "start_bytes", "end_bytes", "events",
    "seconds"}``: a list over ranks for one strategy, ``{strategy: list}`` for several.
    Raises RuntimeError with every rank's traceback if a rank fails, or after
    ``timeout`` seconds (the ranks are then killed).
    """
    import json
    import os
    import tempfile
    import time

    import torch
    import torch.multiprocessing as mp

    several = not isinstance(strategy, str)
    strategies = list(strategy) if several else [strategy]
    options = options or {}
    for s in strategies:
        _check_strategy(s, world_size)
        _check_options(s, options.get(s, {}))
    threads = threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="pymemplan-ranks-") as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(world_size, _free_port(), workload, strategies, optimizer,
                              warmup, threads, options, out_dir),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        crashed = None
        try:
            # A rank that fails makes torch stop the others, after a grace period for them
            # to finish (a rank can also crash on exit, after writing its result).
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())),
                               grace_period=max(1.0, min(120.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"measuring {', '.join(strategies)} on {world_size} gloo ranks took "
                        f"more than {timeout:.0f} s; the ranks were stopped")
        except mp.ProcessExitedException as e:
            crashed = str(e)
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        per_rank = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    per_rank.append(json.load(f))
            else:
                per_rank.append({"error": f"no result from rank {r} ({crashed or 'it died'})"})
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(per_rank) if "error" in res]
    if errors:
        raise RuntimeError(f"measuring {', '.join(strategies)} on {world_size} gloo ranks "
                           f"failed:\n" + "\n".join(errors))
    out = {s: [res[s] for res in per_rank] for s in strategies}
    return out if several else out[strategies[0]]
