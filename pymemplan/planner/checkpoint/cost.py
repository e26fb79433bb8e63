"""The cost model: what recomputing a module's forward costs, in estimated seconds.

Roofline per module, on a nominal device (``DeviceSpeed``): compute-bound work is
FLOPs / peak FLOP rate, with FLOPs from shapes (PyTorch's own formulas in
``torch.utils.flop_counter``: matmul, addmm, bmm, convolution, SDPA/flash/efficient
attention); memory-bound work is bytes moved / bandwidth, with bytes moved estimated as
twice the bytes each forward op writes (one read of an input of the same size, one write).
Only ratios between costs matter to the solvers, so the device's absolute speed cancels
out; its balance (FLOPs per byte) decides how a matmul weighs against an elementwise op.

Without the model (``MemoryTrace.plan`` on a trace alone) FLOPs are unknown and only the
bytes term is used: say so when reporting, and prefer ``pymemplan.plan(model, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph import FORWARD, StepGraph


# Ops whose cost is FLOPs rather than bytes: selective checkpointing keeps their outputs.
COMPUTE_BOUND = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution",
    "aten.mkldnn_convolution", "aten.cudnn_convolution", "aten._convolution",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward", "aten._efficient_attention_forward",
})


def is_compute_bound(op_name: str) -> bool:
    """``op_name`` as recorded in the trace ("aten.mm.default") or an overload packet."""
    parts = str(op_name).split(".")
    return ".".join(parts[:2]) in COMPUTE_BOUND


@dataclass(frozen=True)
class DeviceSpeed:
    flops_per_s: float = 400e12      # dense bf16 matmul throughput actually reached (H100-class)
    bytes_per_s: float = 2.0e12      # HBM bandwidth actually reached

    def seconds(self, flops: float, bytes_moved: float) -> float:
        return flops / self.flops_per_s + bytes_moved / self.bytes_per_s


def forward_bytes_per_op(g: StepGraph) -> np.ndarray:
    """Estimated bytes moved by each op: twice the bytes it wrote (forward ops only)."""
    out = np.zeros(max(g.num_ops, 1), dtype=np.float64)
    for t in g.tensors:
        if t.alloc_op >= 0 and t.phase == FORWARD:
            out[t.alloc_op] += 2.0 * t.nbytes
    return out


def module_flops(model, inputs) -> dict[str, float]:
    """Forward FLOPs per module path, inclusive of submodules ("" = the whole model)."""
    return forward_facts(model, inputs)[0]


class ModuleFacts(dict):
    """``forward_facts``'s module path -> ``(op index, bytes)`` of the storages each
    module's calls returned, with ``arguments``: the same for the tensors they were given."""

    arguments: dict


def forward_facts(model, inputs, train: bool = True, device: str = "cpu", autocast=None,
                  nonzero_density=None):
    """Run the model's forward once on fake tensors (nothing computed or allocated) and
    return ``(flops, outputs, op_names, mutated)``.

    ``device`` (the traced step's target, whose profile reroutes attention and dropout to
    the kernels that device runs), ``autocast`` (a dtype, or its name as the trace's
    meta records it) and ``nonzero_density`` (see :func:`pymemplan.trace`) reproduce the
    trace's conditions, so the ops line up with it:

    - ``flops``: forward FLOPs per module path, inclusive of submodules ("" = the model);
    - ``outputs``: module path -> ``(op index, bytes)`` of the storages its forward
      returned, by the index of the op that allocated them, counting every ATen op as
      capture does. In-place ops (``out += x; relu_(out)``) keep the storage's first
      allocation, which is what the trace records;
      Its attribute ``arguments`` (a :class:`ModuleFacts`): module path -> ``(op index,
      bytes)`` of the storages of the tensors its calls were given (positional and
      keyword, in lists, tuples and dicts too), found the same way: checkpoint keeps
      them all to the unit's backward, whether an op of the unit reads them or not;
    - ``op_names``: the ops in order, so the caller can check that they line up with the
      trace before trusting ``outputs``;
    - ``mutated``: what the forward changes in place that checkpointing must keep as it
      was, as two sets of module paths. ``"arguments"``: modules one of whose tensor
      arguments was changed in place after the module was called (by the module itself,
      as an ``inplace=True`` activation, or by later code). Checkpoint keeps a module's
      arguments for the recompute, and autograd refuses one changed since: such a module
      cannot be checkpointed. ``"compute_outputs"``: modules in which a matmul,
      convolution or attention made an output that was changed in place later
      (EfficientNet's squeeze-excitation: a 1x1 convolution, then ``SiLU(inplace=True)``).
      Selective checkpointing caches those outputs and refuses them changed: no module
      containing one can be checkpointed ``save-compute``. ``"state"``: modules whose
      forward changes one of their own buffers, in place or by replacing it (spectral
      norm's power iteration, an observer's range, a counter), BatchNorm's running
      statistics excepted (the checkpoint wrapper puts those back), rebinds one of its
      Python attributes (a step counter), or draws random numbers from a generator of its
      own (checkpoint restores only the default generator's state); and modules that call
      such a module without owning it (given it as an argument, holding it by reference);
      a dict of module path -> what it changes. A recompute would
      compute with the state the first run left and change it again: no unit
      containing one can be checkpointed.
    """
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from ..autocast import for_target as autocast_for_target
    from ..capture import run_op
    from ..profile import get_profile, kernel_overrides

    profile = get_profile(device)
    overrides = kernel_overrides(profile)
    if isinstance(autocast, str):
        autocast = getattr(torch, autocast)

    def fake_like(t, grad=False):
        f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
        return f.requires_grad_(grad) if grad else f

    names: list[str] = []
    first: dict[int, int] = {}   # storage address -> index of the op that allocated it
    # Every storage seen stays referenced until the end, so no address is reused: a
    # storage freed mid-forward would otherwise hand its address, and its op index, to
    # a later one. Fake storages hold no memory.
    alive: list = []

    stack: list[str] = []  # the module paths being called, innermost last
    computed: list = []    # (module path, output, its version) of compute-bound ops

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = run_op(func, args, kwargs, nonzero_density)
            if stack and (kwargs or {}).get("generator") is not None:
                # A generator of its own: checkpoint restores only the default one's
                # state, so the recompute would draw other numbers.
                changed_state.setdefault(stack[-1], "the state of a random generator of its own")
            heavy = is_compute_bound(str(func))
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    st = o.untyped_storage()
                    if st._cdata not in first:
                        first[st._cdata] = len(names)
                        alive.append(st)
                    if heavy and stack:
                        computed.append((stack[-1], o, o._version))
            names.append(str(func))
            return out

    class Kernels(TorchFunctionMode):
        """The target device's attention/dropout kernels, as capture routes them."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            return overrides.get(func, func)(*args, **(kwargs or {}))

    from ..library_shims import eager_paths, note_real_inputs
    from ..module_state import Snapshot, function_caches_kept
    from .apply_eager import restored_buffers

    outputs = ModuleFacts()
    outputs.arguments = {}
    hooks = []
    called: list = []  # (path, [(tensor, version at the call)])
    own_buffers: dict[str, list] = {}  # path -> per call in progress: [(name, tensor, version)]
    changed_state: dict[str, str] = {}  # module path -> what of its state it changes
    # module path -> the calls it ran inside that are not its ancestors (a module passed
    # as an argument or held by reference): a recompute of theirs runs it again.
    callers: dict[str, set] = {}

    def enter(path):
        def hook(_m, args, kwargs):
            keep = restored_buffers(_m)
            own_buffers.setdefault(path, []).append(
                [(n, b, b._version) for n, b in _m._buffers.items()
                 if b is not None and n not in keep])
            callers.setdefault(path, set()).update(
                c for c in stack if c and c != path and not path.startswith(c + "."))
            stack.append(path)
            leaves = pytree.tree_leaves((args, kwargs))
            called.append((path, [(t, t._version) for t in leaves
                                  if isinstance(t, torch.Tensor)]))
            outputs.arguments.setdefault(path, []).extend(
                (first.get(t.untyped_storage()._cdata, -1), t.untyped_storage().nbytes())
                for t in leaves if isinstance(t, torch.Tensor))
        return hook

    def leave(path):
        def hook(_m, _args, out):
            if stack and stack[-1] == path:
                stack.pop()
            calls = own_buffers.get(path)
            if calls:
                moved = [n for n, b, v in calls.pop()
                         if _m._buffers.get(n) is not b or b._version != v]
                if moved:
                    changed_state.setdefault(path, f"its buffer '{moved[0]}'")
            # Every call's: a module called several times is checkpointed at each call.
            outputs.setdefault(path, []).extend(
                (first.get(o.untyped_storage()._cdata, -1), o.untyped_storage().nbytes())
                for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor))
        return hook

    modes = {m: m.training for m in model.modules()}
    snapshot = Snapshot(model)  # put back at the end: the forward's side effects
    try:
        for path, m in model.named_modules():
            hooks.append(m.register_forward_hook(leave(path)))
            hooks.append(m.register_forward_pre_hook(enter(path), with_kwargs=True))
        if train:
            model.train()
        with FakeTensorMode(allow_non_fake_inputs=True):
            # One name per tensor: functional_call re-ties shared weights itself.
            state = {n: fake_like(p, p.requires_grad) for n, p in model.named_parameters()}
            state.update({n: fake_like(b) for n, b in model.named_buffers()})
            args = pytree.tree_map_only(torch.Tensor, lambda t: fake_like(t, t.requires_grad),
                                        tuple(inputs))
            # Inputs exist before the step: their storages are not allocations.
            for a in pytree.tree_leaves(args):
                if isinstance(a, torch.Tensor):
                    first[a.untyped_storage()._cdata] = -1
            for v in state.values():
                first[v.untyped_storage()._cdata] = -1
            counter = FlopCounterMode(display=False)
            amp = (torch.autocast("cpu", dtype=autocast) if autocast is not None
                   else contextlib.nullcontext())
            with counter, Ops(), Kernels(), autocast_for_target(profile, autocast), amp, \
                    eager_paths(), function_caches_kept():
                note_real_inputs(pytree.tree_leaves(args), pytree.tree_leaves(tuple(inputs)))
                torch.func.functional_call(model, state, args)
            # Python attributes the forward rebinds (a step counter, a schedule) are state
            # as its buffers are.
            for path, attrs in snapshot.changed(ours=state.values()).items():
                changed_state.setdefault(path, f"its attribute '{sorted(attrs)[0]}'")
            # A module that runs one with state without owning it (given it as an argument,
            # holding it by reference) changes that state as much as its own.
            for path, what in list(changed_state.items()):
                for c in sorted(callers.get(path, ())):
                    changed_state.setdefault(
                        c, f"the state of '{path}', which it calls without owning it ({what})")
            mutated = {"arguments": {path for path, seen in called
                                     if any(t._version != v for t, v in seen)},
                       "compute_outputs": {path for path, o, v in computed
                                           if o._version != v},
                       "state": changed_state}
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
        snapshot.restore()
    root = type(model).__name__
    flops: dict[str, float] = {}
    for name, per_op in counter.get_flop_counts().items():
        if name == "Global":
            continue
        # FlopCounterMode names modules "<RootClass>.child.grandchild".
        path = "" if name == root else name[len(root) + 1:] if name.startswith(root + ".") else None
        if path is not None:
            flops[path] = float(sum(per_op.values()))
    return flops, outputs, names, mutated
