"""``pymemplan.trace``: predict one training step's memory, and the object it returns."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .capture import OUTSIDE, capture
from .errors import PlannerError, UntraceableError
from .graph import BEFORE_STEP, CATEGORIES, PHASES, StepGraph, TensorInfo
from .profile import get_profile
from .timeline import Timeline, build_timeline, live_at, live_interval


def trace(model, inputs, *, loss_fn=None, optimizer=None, device=None, autocast=None,
          train: bool = True, probe_kernels: bool | None = None, progress=None,
          grads_present: bool = False, grad_scaler: bool = False,
          nonzero_density: float | None = None) -> "MemoryTrace":
    """Predict the memory of one training step of ``model`` on ``inputs``, without running it.

    - ``inputs``: a tuple of positional arguments (a single tensor is accepted too).
      Tensors may live anywhere, including the meta device; only their shapes are read.
    - ``loss_fn``: maps the model's output to a scalar loss. Not needed when the model
      returns a scalar, or a Hugging Face output with ``.loss``.
    - ``optimizer``: None (forward + backward), a ``torch.optim.Optimizer`` class, a
      callable ``params -> optimizer``, or an optimizer instance (rebuilt with the same
      class and hyperparameters). With one, the traced step is the steady state: the
      optimizer's state already exists and gradients start as None, and the scalars its step
      branches on (step counts) are those of a step well into training, the 1,000th.
    - ``device``: the device predicted, ``"cuda"`` (default) or ``"cpu"``. No GPU needed.
    - ``autocast``: None, ``torch.bfloat16`` or ``torch.float16``.
    - ``train``: trace in training mode (dropout, batch-norm statistics); the model's own
      mode is restored afterwards. ``progress(phase, ops_so_far)`` is called as it goes.
    - ``probe_kernels``: measure the scratch memory kernels take inside an op by running
      each distinct op signature once on real zero tensors (``planner/probe.py``). Only
      possible for the CPU target, where it is on by default; signatures needing more than
      a quarter of this machine's memory are skipped. With it off, and for CUDA, nothing
      real is allocated.
    - ``grads_present``: gradients already exist when the step starts and backward adds
      into them: a micro-step of gradient accumulation after the first. With an
      optimizer, it is the last micro-step, the one that also runs the optimizer.
    - ``grad_scaler``: trace ``torch.amp.GradScaler``'s part of the step too (fp16).
    - ``nonzero_density``: ops whose output size depends on tensor values (``nonzero``,
      ``torch.where(mask)``, ``masked_select``, indexing with a boolean mask) are sized as
      if this share (0 < d <= 1) of each mask's elements were true. For a
      mixture-of-experts router over E experts, 1/E: every expert gets its even share of
      the tokens. Under training, the saved activations of all experts together do not
      depend on how tokens are routed; one expert's temporaries at a time do, so an uneven
      routing can take the real peak a little higher. 1.0 (every mask all true) bounds it
      from above. None (the default): such ops are an error that says so.

    The model is never modified: its parameters, gradients and modes are as before.
    """
    import torch

    profile = get_profile(device)
    inputs, probe_kernels = check_trace_args(model, inputs, profile, autocast=autocast,
                                             loss_fn=loss_fn, probe_kernels=probe_kernels)
    check_density(nonzero_density)
    for name, value in (("train", train), ("grads_present", grads_present),
                        ("grad_scaler", grad_scaler)):
        if not isinstance(value, bool):
            raise PlannerError(f"{name} must be True or False, got {value!r}")
    if grad_scaler and optimizer is None:
        raise PlannerError("grad_scaler=True traces GradScaler's part of an optimizer step "
                           "(unscale, the inf check, the scaled step): pass optimizer=...")
    _warn_compiled(model)
    with _cuda_autocast_noticed(profile) as regions:
        g = capture(model, inputs, loss_fn=loss_fn, optimizer=optimizer, profile=profile,
                    autocast=autocast, train=train, progress=progress,
                    probe_limit=_probe_limit() if probe_kernels else 0,
                    grads_present=grads_present, grad_scaler=grad_scaler,
                    nonzero_density=nonzero_density)
    _warn_cuda_autocast(regions, autocast)
    t = MemoryTrace(g)
    # How to trace the same step again (a checkpoint plan is verified that way).
    t._trace_kwargs = dict(loss_fn=loss_fn, optimizer=optimizer, device=device,
                           autocast=autocast, train=train, probe_kernels=probe_kernels,
                           grads_present=grads_present, grad_scaler=grad_scaler,
                           nonzero_density=nonzero_density)
    t._traced_with = _remember(model, inputs)
    return t


@contextlib.contextmanager
def _cuda_autocast_noticed(profile):
    """The autocast regions the model opens for CUDA itself (torch.autocast("cuda", ...),
    torch.cuda.amp.autocast): on the CPU tensors the planner traces they do nothing, since
    CUDA's autocast cannot be enabled without a GPU. Collected on a CUDA target, as (dtype,
    enabled), to be said after the trace."""
    from torch.amp import autocast_mode

    regions: list = []
    if not profile.cuda_kernels:
        yield regions
        return
    init = autocast_mode.autocast.__init__

    def noticing(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            regions.append((dtype, enabled))
        init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    autocast_mode.autocast.__init__ = noticing
    try:
        yield regions
    finally:
        autocast_mode.autocast.__init__ = init


def _warn_cuda_autocast(regions, autocast) -> None:
    import warnings

    import torch

    if not regions:
        return
    dtypes = sorted({str(d or torch.float16).replace("torch.", "") for d, on in regions if on})
    if dtypes and autocast is None:
        warnings.warn(
            f"the model opens torch.autocast('cuda', ...) itself ({', '.join(dtypes)}): the "
            f"planner runs the step on CPU tensors, where CUDA's autocast does nothing, so that "
            f"code was predicted in full precision. Pass autocast=torch.{dtypes[0]} to "
            f"pymemplan.trace to predict the step under CUDA's autocast (the whole forward "
            f"pass).", stacklevel=3)
    elif autocast is not None:
        warnings.warn(
            "the model opens torch.autocast('cuda', ...) regions itself: they were traced as "
            f"the rest of the forward pass, under the autocast={autocast} given to "
            "pymemplan.trace (a region the model runs in full precision, enabled=False, was "
            "cast too).", stacklevel=3)


def _warn_compiled(model) -> None:
    """torch.compile'd modules run their original forward here, op by op: the prediction is
    the eager step's, where Inductor's fused kernels keep fewer buffers and activations (an
    elementwise MLP: 2.6 times the compiled step's peak). Said, not silent."""
    import warnings

    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo compiles nothing
        return
    compiled = [name or "the model" for name, m in model.named_modules()
                if isinstance(m, OptimizedModule)]
    if compiled:
        where = ", ".join(repr(n) if n != "the model" else n for n in compiled[:3])
        warnings.warn(
            f"{where} {'is' if len(compiled) == 1 else 'are'} compiled with torch.compile: "
            f"pymemplan.trace predicts the eager step, op by op, and a compiled step keeps "
            f"fewer buffers and activations, so its peak is usually lower. To plan "
            f"checkpointing for the compiled step, compile with "
            f"pymemplan.compile_backend(...) (README: Fit a budget).", stacklevel=3)


def _remember(model, inputs):
    """The model and inputs a step was traced with, for t.plan(budget) and friends. Held
    weakly (model and tensors): a trace must not keep the user's model or batch alive."""
    import weakref

    import torch

    def ref(a):
        if isinstance(a, torch.Tensor):
            return weakref.ref(a)
        return lambda: a  # ints, strings, containers: small, kept as they are
    return weakref.ref(model), [ref(a) for a in inputs]


def check_trace_args(model, inputs, profile, *, autocast, loss_fn, probe_kernels):
    """The checks every traced step shares (plain or sharded). Returns the inputs as a
    tuple and whether to probe kernels."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise PlannerError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    lazy = [name for name, p in model.named_parameters()
            if isinstance(p, torch.nn.parameter.UninitializedParameter)]
    if lazy:
        raise PlannerError(
            f"the model has parameters not made yet ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): a lazy module (nn.LazyLinear, nn.LazyConv2d, "
            f"...) makes them at its first forward, from the input's shape. Run the model once "
            f"on a real batch (model(*inputs), under torch.no_grad() if you like), then trace it.")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        raise PlannerError(f"inputs must be a tuple of positional arguments for the model's "
                           f"forward (or a single tensor), got {type(inputs).__name__}")
    _refuse_sparse_state(model, inputs)
    _refuse_post_accumulate_hooks(model)
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise PlannerError(f"autocast={autocast!r}: use None, torch.bfloat16 or torch.float16")
    if loss_fn is not None and not callable(loss_fn):
        raise PlannerError(f"loss_fn must be callable (output -> scalar loss), got "
                           f"{type(loss_fn).__name__}")
    if probe_kernels is None:
        probe_kernels = profile.name == "cpu"
    if probe_kernels and profile.name != "cpu":
        raise PlannerError(f"probe_kernels=True needs the target device to run kernels on; "
                           f"it works for device='cpu' only, not {profile.name!r}")
    return inputs, probe_kernels


def _refuse_sparse_state(model, inputs) -> None:
    """Sparse parameters, buffers and inputs: their fake copies would be dense (a sparse
    tensor's strides are zeros), and the step predicted as if its sparse products were dense
    ones (a GCN's sparse adjacency 10 times over)."""
    import torch
    from torch.utils import _pytree as pytree

    named = [*(("parameter", n, t) for n, t in model.named_parameters()),
             *(("buffer", n, t) for n, t in model.named_buffers())]
    named += [("input", f"{i}", t) for i, t in
              enumerate(x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor))]
    for kind, name, t in named:
        if t.layout != torch.strided:
            layout = str(t.layout).replace("torch.", "")
            raise UntraceableError(
                f"{kind} {name!r} is a {layout} tensor of shape {tuple(t.shape)}: the planner "
                f"does not model sparse tensors yet, and traced as a dense one the step would be "
                f"predicted far above what it takes (its products with the sparse tensor as dense "
                f"ones). Measure such a step on a real run instead.")


def _refuse_post_accumulate_hooks(model) -> None:
    """Hooks that run once a parameter's gradient is accumulated (optimizer-in-backward,
    gradients freed in backward) step or free the real parameters' state: they cannot run on
    the trace's fake copies, and left out, the step's memory would be another step's."""
    hooked = [n for n, p in model.named_parameters()
              if getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:
        raise UntraceableError(
            f"parameter(s) {', '.join(hooked[:3])}{', ...' if len(hooked) > 3 else ''} have "
            f"hooks registered with register_post_accumulate_grad_hook (an optimizer step or a "
            f"gradient freed in backward): the planner cannot run them, since they act on the "
            f"real parameters, and without them the step would not be yours. Trace the step "
            f"with the optimizer passed as optimizer= (its memory with every gradient kept "
            f"until the step), or measure the hooked step on a real run.")


def check_density(density) -> None:
    """``nonzero_density`` is None or a share of a mask's elements, in (0, 1]."""
    import numbers

    if density is None:
        return
    if (isinstance(density, bool) or not isinstance(density, numbers.Real)
            or not 0 < density <= 1):
        raise PlannerError(
            f"nonzero_density={density!r}: it is the share of a mask's elements that are true, "
            f"a number in (0, 1], e.g. 1/8 for a mixture-of-experts router over 8 experts; "
            f"or None to have value-dependent sizes reported as an error")


def _probe_limit() -> int:
    """A quarter of this machine's physical memory (4 GiB if unknown)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


@dataclass(frozen=True)
class LiveTensor:
    """A tensor live at some op, for reports (see :meth:`MemoryTrace.tensors_at_peak`)."""

    id: int
    bytes: int
    shape: tuple
    dtype: str
    category: str
    op: str             # the op that produced it ("" if it existed before the step)
    module: str
    phase: str
    name: str
    alloc_op: int       # -1: before the step
    last_use: int       # last op that used it
    freed_after: int | None  # op after which it was released; None: live at the end


def run_trace(steps, *, first_step: bool = True):
    """The allocation trace of a run whose steps are ``steps`` in order: ``MemoryTrace``
    objects of one model and one optimizer, traced on other inputs (sequence lengths, batch
    sizes) or the same one repeated. Replay it through allocator policies
    (``pymemplan.traces.replay``) to predict what each reserves over such a run, where
    PyTorch's allocator fragments most.

    Tensors from before a step that it keeps (parameters, buffers, the optimizer's state) are
    allocated once; inputs the step frees come anew with every step, and so do inputs it holds
    where the steps' shapes differ (each step's batch made as it starts, the last one's then
    released, as a loop rebinding its batch does); tensors a step creates and keeps
    (gradients) are freed when the next one starts, as ``zero_grad(set_to_none=True)`` does. The first step is a first step: the optimizer makes
    its state there, where its first ``step()`` made it (``StepGraph.first_optimizer_step``),
    among what is left of the backward pass, rather than before the run (``first_step=False``:
    before). ``meta["step_starts"]`` holds the index of each step's first event.

    Raises ``ValueError`` when the steps do not keep the same tensors across steps (another
    model, another optimizer, or a model whose parameters depend on the input's shape)."""
    from ..traces.trace import ALLOC, FREE, Trace

    steps = list(steps)
    if not steps or not all(isinstance(t, MemoryTrace) for t in steps):
        raise ValueError("run_trace needs a non-empty list of MemoryTrace objects "
                         "(pymemplan.trace(...) of each step)")
    parts = [t._step_rows() for t in steps]
    sizes = parts[0][0]
    # An input the caller holds across the step is kept too; where steps differ in shape, each
    # step has its own, made as the step starts, and the last one's is then released (a loop
    # rebinding its batch). Any other difference is another model or optimizer.
    inputs = {i for i in sizes if steps[0].graph.tensors[i].category == "input"}
    per_step = set()
    for k, part in enumerate(parts[1:], start=1):
        differ = {i for i in set(part[0]) | set(sizes) if part[0].get(i) != sizes.get(i)}
        if differ - inputs:
            shown = sorted((i, sizes.get(i), part[0].get(i)) for i in differ - inputs)[:3]
            raise ValueError(
                f"step {k} does not keep the tensors step 0 keeps across steps (tensor id, bytes "
                f"in step 0, bytes in step {k}: {shown}): trace every step from the same model "
                f"and optimizer, changing only the inputs")
        per_step |= differ
    kept = set(sizes)
    first = steps[0].graph.first_optimizer_step if first_step else None
    made_first = ({ev[1] for ev in first["events"] if ev[0] == ALLOC and ev[1] in kept}
                  if first else set())
    out = [r for r in parts[0][2] if r[1] not in made_first and r[1] not in per_step]
    fresh = sum(part[3] for part in parts)  # ids of the first step's own temporaries
    leftovers: list[tuple] = []
    held: list[tuple] = []  # the last step's own inputs
    starts, base = [], 0
    for k, (t, (_, step, prologue, offset, _)) in enumerate(zip(steps, parts)):
        starts.append(len(out))
        batch = [(ALLOC, r[1] + base, r[2], r[3], r[4]) for r in prologue if r[1] in per_step]
        out.extend(batch)
        out.extend((FREE, r[1], r[2], r[3], r[4]) for r in held + leftovers)
        held = batch
        live: dict[int, tuple] = {}
        events = step if k > 0 or not first else t._first_step(step, fresh)
        for a, ptr, size, stream, time in events:
            if ptr not in kept and ptr < offset:
                ptr += base
            out.append((a, ptr, size, stream, time))
            if a == ALLOC:
                live[ptr] = (a, ptr, size, stream, time)
            elif a == FREE:
                live.pop(ptr, None)
        leftovers = [r for r in live.values() if r[1] not in made_first]
        base += offset
    names = [part[4] for part in parts]
    name = f"{names[0]} x{len(steps)}" if len(set(names)) == 1 else " + ".join(names)
    return Trace.from_events(out, name=name, meta={"step_starts": starts})


class MemoryTrace:
    """The predicted memory of one training step. Build with :func:`trace`."""

    def __init__(self, graph: StepGraph):
        self.graph = graph
        self._trace_kwargs = None  # set by trace(): the step can be traced again
        self._traced_with = None   # set by trace(): weak references to model and inputs

    def _forgotten_check(self, model, inputs):
        """:meth:`_model_and_inputs`, with a warning where the step's model or inputs were
        given to :func:`trace` but are gone (they are held weakly: inputs built in the
        call, ``trace(model, (torch.randn(...),))``, go at once)."""
        recalled = self._model_and_inputs(model, inputs)
        if model is None and inputs is None and self._traced_with is not None \
                and recalled == (None, None):
            import warnings
            warnings.warn("the model or inputs this step was traced with no longer exist "
                          "(a trace holds them weakly): the plan is made from the trace "
                          "alone, its recompute priced by bytes moved and not verified by a "
                          "trace with it applied. Pass model= and inputs=.", stacklevel=3)
        return recalled

    def _model_and_inputs(self, model, inputs):
        """``model``/``inputs`` as given, or, when neither is, those the step was traced
        with if they are still alive (None, None otherwise: a trace read from a file, or a
        model since deleted)."""
        if model is not None or inputs is not None or self._traced_with is None:
            return model, inputs
        model_ref, input_refs = self._traced_with
        recalled = [r() for r in input_refs]
        m = model_ref()
        if m is None or any(a is None for a in recalled):
            return None, None
        return m, tuple(recalled)

    # -- core figures --------------------------------------------------------------------
    @cached_property
    def _timeline(self) -> Timeline:
        return build_timeline(self.graph)

    @property
    def device(self) -> str:
        return self.graph.device

    @property
    def ops(self):
        return self.graph.ops

    @property
    def tensors(self) -> list[TensorInfo]:
        return self.graph.tensors

    @property
    def peak_bytes(self) -> int:
        """Peak of live tensor bytes on the device (allocator-rounded for CUDA)."""
        return self._timeline.peak_bytes

    @property
    def peak_index(self) -> int:
        """Index of the op at which the peak happens (the first one, on ties)."""
        return self._timeline.peak_index

    @property
    def peak_op(self):
        return self.graph.ops[self.peak_index] if self.graph.ops else None

    @property
    def timeline(self) -> dict[str, np.ndarray]:
        """Live bytes at each op: one array per category, plus ``"total"``."""
        d = dict(self._timeline.by_category)
        d["total"] = self._timeline.total
        return d

    def ops_around_peak(self, k: int = 5) -> list:
        i = self.peak_index
        return self.graph.ops[max(0, i - k): i + k + 1]

    def phase_of(self, index: int) -> str:
        return self.graph.ops[index].phase if self.graph.ops else ""

    def phase_ranges(self) -> dict[str, tuple[int, int]]:
        """phase -> [first op, end) for the phases the step ran."""
        starts = sorted((s, p) for p, s in self.graph.phase_starts.items())
        out = {}
        for j, (s, p) in enumerate(starts):
            end = starts[j + 1][0] if j + 1 < len(starts) else self.graph.num_ops
            out[p] = (s, end)
        return out

    def phase_peaks(self) -> dict[str, int]:
        total = self._timeline.total
        return {p: int(total[a:b].max()) if b > a else 0 for p, (a, b) in self.phase_ranges().items()}

    # -- what fills the peak -------------------------------------------------------------
    def breakdown(self, index: int | None = None) -> dict[str, int]:
        """Bytes by category at op `index` (default: the peak)."""
        i = self.peak_index if index is None else index
        return {c: int(a[i]) if len(a) else 0 for c, a in self._timeline.by_category.items()}

    def by_module(self, depth: int | None = None) -> dict[str, int]:
        """Activation bytes saved for backward, per module path, largest first.

        ``depth`` groups paths to their first `depth` components (``depth=3``:
        ``transformer.h.3``); None keeps the innermost module that made each tensor.
        """
        out: dict[str, int] = {}
        for t in self.graph.tensors:
            if t.category != "activation" or not t.size:
                continue
            path = t.module
            if depth is not None and path and path != OUTSIDE:
                path = ".".join(path.split(".")[:depth])
            path = path or "(model)"  # the root module's own forward code
            out[path] = out.get(path, 0) + t.size
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _live(self, t: TensorInfo) -> LiveTensor:
        return LiveTensor(t.id, t.size, t.shape, t.dtype, t.category, t.op, t.module, t.phase,
                          t.name, t.alloc_op, t.last_use, t.freed_after)

    def tensors_at(self, index: int, k: int | None = None) -> list[LiveTensor]:
        """Tensors live at op `index`, largest first; the op's kernel scratch, if any, is
        listed as a tensor of dtype uint8 named "kernel scratch"."""
        if k is not None and (not isinstance(k, int) or k < 0):
            raise PlannerError(f"k must be a count of tensors (an int >= 0) or None for all, "
                               f"got {k!r}")
        live = [self._live(t) for t in live_at(self.graph, index)]
        op = self.graph.ops[index] if self.graph.ops else None
        if op is not None and op.scratch:
            live.append(LiveTensor(-1, op.scratch, (op.scratch,), "uint8", "temporary", op.name,
                                   op.module, op.phase, "kernel scratch", index, index, index))
            live.sort(key=lambda x: -x.bytes)
        return live if k is None else live[:k]

    def tensors_at_peak(self, k: int = 10) -> list[LiveTensor]:
        """The `k` largest tensors live at the peak."""
        return self.tensors_at(self.peak_index, k)

    @property
    def free_schedule(self) -> dict[int, int]:
        """tensor id -> the op after which it is no longer needed (its last use), for every
        tensor made during the step. Tensors that exist before the step (parameters,
        buffers, inputs, optimizer state) outlive it and are not in the schedule."""
        return {t.id: t.last_use for t in self.graph.tensors if t.alloc_op != BEFORE_STEP}

    # -- allocator view ------------------------------------------------------------------
    def reserved_peak(self, policy: str = "torch", *, iterations: int = 3,
                      capacity="80GiB", granularity="2MiB") -> int:
        """Predicted peak *reserved* memory under an allocator policy, fragmentation included:
        the predicted allocation trace, with the step repeated ``iterations`` times (the
        state left by one step shapes the next), replayed through the allocator model.

        ``policy``: "torch" (PyTorch's native caching allocator),
        "torch=expandable_segments:True" (with PYTORCH_CUDA_ALLOC_CONF's expandable
        segments), "pymemplan", "pymemplan-vmm", "pymemplan-planned" (which finds and plans the
        repeated step as it would in the run, the first steps served by its pool), "nocache",
        or "name=key:value,..." as for ``pymemplan replay``; or "offline": the most pages of
        ``granularity`` held by an allocator that knew the whole run in advance
        (``pymemplan.traces.offline_layout``), the least reserved memory any allocator mapping
        such pages can hope for, within the precision of the packer. The run's first step
        makes the optimizer's state where its first ``step()`` makes it
        (``graph.first_optimizer_step``).
        This is the number that decides whether a run hits OOM; compare it with
        ``peak_bytes``, the live tensor bytes no allocator can go below.
        """
        from ..traces.offline import offline_layout
        from ..traces.replay import replay

        if not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be a positive integer, not {iterations!r}")
        if policy == "offline":
            return offline_layout(self._repeated_trace(iterations),
                                  granularity).peak_reserved_bytes
        (result,) = replay(self._repeated_trace(iterations), [policy], capacity=capacity,
                           granularity=granularity)
        if result.ooms:
            raise ValueError(
                f"the predicted step does not fit in a {capacity} device under policy "
                f"{policy!r} ({result.ooms} allocations refused); pass a larger capacity")
        return result.peak_reserved_bytes

    def _repeated_trace(self, iterations: int, first_step: bool = True):
        """The allocation trace of a run of ``iterations`` steps of this one (see
        :func:`run_trace`)."""
        return run_trace([self] * iterations, first_step=first_step)

    def _step_rows(self):
        """This step's allocation rows: (the tensors that live across steps, with their
        sizes; the rows of the step itself, without their allocations; the prologue's rows,
        their allocations; one more than the largest tensor id; the trace's name)."""
        from ..traces.trace import ALLOC, FREE

        one = self.allocation_trace()
        rows = list(zip(one.action.tolist(), one.ptr.tolist(), one.size.tolist(),
                        one.stream.tolist(), one.time.tolist()))
        before = {t.id for t in self.graph.tensors if t.alloc_op == BEFORE_STEP}
        freed_in_step = {r[1] for r in rows if r[0] == FREE}
        kept = before - freed_in_step
        sizes = {r[1]: r[2] for r in rows if r[0] == ALLOC and r[1] in kept}
        step = [r for r in rows if not (r[0] == ALLOC and r[1] in kept)]
        prologue = [r for r in rows if r[0] == ALLOC and r[1] in kept]
        return sizes, step, prologue, 1 + max((r[1] for r in rows), default=0), one.name

    def _first_step(self, step: list[tuple], fresh: int) -> list[tuple]:
        """The step's rows with its ``optimizer.step()`` replaced by the optimizer's first
        step. Frees in that span of tensors made before it stay; the first step's own
        temporaries get ids from ``fresh`` up."""
        from ..traces.trace import ALLOC

        first = self.graph.first_optimizer_step
        start, end = first["ops"]
        inside = {r[1] for r in step if r[0] == ALLOC and start <= r[4] < end}
        out = [r for r in step if r[4] < start]
        sizes = {t.id: t.size for t in self.graph.tensors}
        for action, tid, local, size in first["events"]:
            if tid >= 0:  # state of the traced step: its size, in case the graph was resized
                out.append((action, tid, sizes[tid], 0, float(start)))
            else:
                out.append((action, fresh + local, size, 0, float(start)))
        out.extend(r for r in step if r[4] >= start and r[1] not in inside
                   and not (r[0] == ALLOC and r[4] < end))
        return out

    def allocation_trace(self, name: str | None = None):
        """The predicted allocations and frees, as a :class:`pymemplan.traces.Trace`.

        Tensors that exist before the step are allocated first; then every allocation and
        release in the order capture saw them. ``ptr`` is the tensor id, ``time`` the op
        index. Sizes are device bytes (rounded for CUDA). Replay it through allocator
        policies (``pymemplan.traces.replay``) to predict *reserved* memory.
        """
        from ..traces.trace import ALLOC, FREE, Trace

        n = self.graph.num_ops
        events = []
        for t in self.graph.tensors:
            if not t.size:
                continue
            start, _ = live_interval(t, n)
            seq = -1 if t.alloc_op == BEFORE_STEP else t.alloc_seq
            events.append((seq, t.alloc_seq, ALLOC, t.id, t.size, start))
            if t.free_seq is not None:
                events.append((t.free_seq, t.free_seq, FREE, t.id, t.size, t.freed_before))
        sid = len(self.graph.tensors)  # scratch blocks get ids after the tensors'
        for op in self.graph.ops:
            if op.scratch:  # held from the op's last output until it returns
                events.append((op.seq + 0.25, 0, ALLOC, sid + op.index, op.scratch, op.index))
                events.append((op.seq + 0.5, 0, FREE, sid + op.index, op.scratch, op.index))
        events.sort(key=lambda e: (e[0], e[1]))
        rows = [(a, tid, size, 0, float(when)) for _, _, a, tid, size, when in events]
        return Trace.from_events(rows, name=name or f"predicted:{self.graph.meta.get('model', 'step')}",
                                 meta={"format": "pymemplan-planner", "device": self.device,
                                       "time": "op index"})

    # -- checkpoint planning (pymemplan.planner.checkpoint) ------------------------------
    def checkpoint_problem(self, model=None, inputs=None, modules=None,
                           policies=("full", "save-compute")):
        """The checkpoint problem of this step (candidates, deltas, costs). With ``model``
        and ``inputs`` the recompute costs count FLOPs; without, bytes moved only, and
        containers are no candidates (a ModuleList cannot be called, and the trace alone
        cannot tell one from a Sequential). Neither given: those of :func:`trace`, while
        they are alive (held weakly).
        ``modules``: fnmatch patterns of the module paths that may be checkpointed;
        ``policies``: "full" (recompute the module) and/or "save-compute" (selective:
        keep matmul/conv/attention outputs)."""
        from .checkpoint.apply_eager import cache_configs, caches_off
        from .checkpoint.cost import forward_facts
        from .checkpoint.problem import build_problem

        model, inputs = self._model_and_inputs(model, inputs)
        key = (id(model) if model is not None else None,
               tuple(modules) if modules is not None else None, tuple(policies))
        cache = self.__dict__.setdefault("_ckpt_problems", {})
        if key not in cache and model is not None and inputs is not None \
                and self._trace_kwargs is not None and cache_configs(model):
            # A plan applied turns use_cache off, and the step then keeps other tensors
            # (GPT-NeoX 7.5% more, Falcon 4.5%): the problem is that step's, traced so.
            with caches_off(model):
                again = trace(model, inputs, **self._trace_kwargs)
                cache[key] = again.checkpoint_problem(model, inputs, modules, policies)
        if key not in cache:
            if model is not None and inputs is None:
                raise PlannerError("checkpoint_problem(model=...) also needs inputs=..., the "
                                   "inputs the step was traced with, to count FLOPs")
            flops = callable_modules = sequential = outputs = mutated = None
            if model is not None:
                import torch

                inputs = (inputs,) if not isinstance(inputs, (tuple, list)) else tuple(inputs)
                flops, outputs, names, mutated = forward_facts(model, inputs,
                                                      train=self.graph.meta.get("train", True),
                                                      device=self.graph.device,
                                                      autocast=self.graph.meta.get("autocast"),
                                                      nonzero_density=self.graph.meta.get(
                                                          "nonzero_density"))
                # Module outputs by op index are only meaningful if the ops line up with
                # the trace's (they may not under a device profile or autocast).
                traced = [op.name for op in self.graph.ops[:len(names)]]
                if traced != names:
                    outputs = None
                # A forward set on the instance is the one that runs (and is checkpointed).
                callable_modules = {name for name, m in model.named_modules()
                                    if type(m).forward is not torch.nn.Module.forward
                                    or "forward" in m.__dict__}
                sequential = {name for name, m in model.named_modules()
                              if type(m).forward is torch.nn.Sequential.forward
                              and "forward" not in m.__dict__}
            cache[key] = build_problem(self.graph, flops=flops, modules=modules,
                                       callable_modules=callable_modules,
                                       sequential_modules=sequential, outputs=outputs,
                                       policies=tuple(policies),
                                       mutated_inputs=mutated and mutated["arguments"],
                                       mutated_compute=mutated and mutated["compute_outputs"],
                                       mutated_state=mutated and mutated["state"])
        return cache[key]

    def plan(self, budget, *, model=None, inputs=None, modules=None,
             policies=("full", "save-compute"), solver: str = "auto", time_limit: float = 10.0,
             verify: bool | None = None):
        """Which modules to checkpoint so the step's peak stays within ``budget`` (bytes or
        "6GiB"), at the least recompute cost. Returns a
        :class:`pymemplan.planner.checkpoint.Plan`; raises ``BudgetTooSmallError`` with
        the least achievable peak when no plan fits. Pass the traced ``model`` and
        ``inputs`` for FLOP-based costs; ``modules`` (fnmatch patterns, e.g.
        ``["transformer.h.*"]``) restricts which modules may be checkpointed, and
        ``policies`` how (see :meth:`checkpoint_problem`).
        ``solver``: "auto" (chain DP if the candidates form a chain, else MILP, else
        greedy), "chain-dp", "milp" or "greedy"; ``time_limit`` bounds the MILP.
        ``verify`` (default: whenever ``model`` and ``inputs`` are known, given or those
        :func:`trace` was called with): trace the step again with the plan applied and, if
        that peak is over the budget, solve again for less (``checkpoint.plan.verify_plan``);
        the traced peak is ``plan.verified_peak_bytes``. It costs one more trace per plan."""
        from .checkpoint.plan import make_plan, verify_plan

        model, inputs = self._forgotten_check(model, inputs)
        if verify is None:
            verify = model is not None and inputs is not None and self._trace_kwargs is not None
        if verify and (model is None or inputs is None or self._trace_kwargs is None):
            raise PlannerError("verify=True needs model= and inputs= (the step is traced again "
                               "with the plan applied), on a trace made by pymemplan.trace")
        pl = make_plan(self.checkpoint_problem(model, inputs, modules, policies), budget,
                       solver=solver, time_limit=time_limit)
        if not verify:
            return pl
        kwargs = self._trace_kwargs
        return verify_plan(pl, lambda m, x: trace(m, x, **kwargs), model, inputs,
                           self.peak_bytes, solver=solver, time_limit=time_limit)

    def pareto(self, points: int = 12, *, model=None, inputs=None, modules=None,
               policies=("full", "save-compute"), path=None,
               time_limit: float = 5.0) -> list[dict]:
        """Peak versus recompute cost across budgets (from the least achievable peak to the
        unplanned one); a PNG at ``path`` if given. ``model``/``inputs`` as for :meth:`plan`."""
        from .checkpoint.plan import pareto

        model, inputs = self._forgotten_check(model, inputs)
        return pareto(self.checkpoint_problem(model, inputs, modules, policies), points, path=path,
                      time_limit=time_limit)

    # -- reports -------------------------------------------------------------------------
    def summary(self, top: int = 10, width: int | None = None) -> str:
        from .report import summary_text
        return summary_text(self, top=top, width=width)

    def print(self, top: int = 10) -> None:
        from .report import print_summary
        print_summary(self, top=top)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        from ..units import format_bytes
        return (f"<MemoryTrace {self.graph.meta.get('model', '')} device={self.device} "
                f"peak={format_bytes(self.peak_bytes)} at op {self.peak_index}/{self.graph.num_ops}>")

    def plot(self, path, title: str | None = None):
        from .report import plot
        return plot(self, path, title=title)

    def to_dict(self, top: int = 20, timeline: bool = True) -> dict:
        from .report import to_dict
        return to_dict(self, top=top, timeline=timeline)

    def to_json(self, path=None, top: int = 20, timeline: bool = True) -> str:
        import json
        s = json.dumps(self.to_dict(top=top, timeline=timeline), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(s)
        return s


__all__ = ["trace", "MemoryTrace", "LiveTensor", "PlannerError", "CATEGORIES", "PHASES"]
