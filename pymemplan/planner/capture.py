"""Capture: run one training step on fake tensors and record every op and storage.

How. The step (forward, loss, backward, optionally ``optimizer.step()``) runs for real,
eagerly, but on ``FakeTensor``s: tensors with shapes, dtypes and strides and no data, so
nothing is allocated and a 7B-parameter model traces on a laptop. Running the real step,
rather than a symbolic graph of it, keeps every effect PyTorch has on memory: the
autograd engine's saved tensors and its release of them, gradient accumulation, the
optimizer's own code path and its temporaries, Python references held by the model.

Two modes watch it:

- a ``TorchDispatchMode`` (:class:`_Recorder`) sees every ATen op after autograd, in
  execution order. A storage seen for the first time as an op's output is an
  allocation; a ``weakref.finalize`` on the storage reports its release at the moment
  the last reference goes, exactly when the real allocator would free it.
- a ``TorchFunctionMode`` (:class:`_FunctionLayer`) applies the target device profile
  (``profile.py``: CUDA's attention and dropout kernels) and tags autograd nodes with the
  module that made them, so backward ops are attributed to modules too.

Fake tensors live on the CPU whatever the target (see ``profile.py`` for why).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import os
import sys
import weakref
from typing import Any, Callable

from .graph import (ACTIVATION, BACKWARD, BEFORE_STEP, BUFFER, FORWARD, GRADIENT, INPUT,
                    OPTIMIZER, OPTIMIZER_STATE, PARAMETER, TEMPORARY, OpNode, StepGraph,
                    TensorInfo)
from .errors import PlannerError, UntraceableError
from .library_shims import eager_paths, note_made, note_real_inputs
from .module_state import HeldTensors, function_caches_kept, kept_as_it_was, storage_alias
from .autocast import for_target as autocast_for_target
from .profile import DeviceProfile, kernel_overrides, prepare_optimizer, state_on_device


OUTSIDE = "<outside model>"


_VALUE_HINT = (
    "The planner runs the step on fake tensors, which have shapes and dtypes but no "
    "values. Code that needs a tensor's value cannot run: `.item()`, `.tolist()`, "
    "`if tensor:` or `while tensor > 0:` on tensor values, `torch.nonzero` or boolean-mask "
    "indexing whose result size depends on the data. Make that code depend on shapes only "
    "(e.g. `torch.where(cond, a, b)` instead of `if`), pass the value as a Python number, "
    "or move it out of the model's forward. For `torch.nonzero`, `torch.where(mask)` and "
    "boolean masks (a mixture-of-experts router picking each expert's tokens), pass "
    "nonzero_density=, the share of a mask's elements that are true: 1/E for a router over "
    "E experts, which routes evenly on average.")


# Out-of-place scatters that backward formulas use, where written for tensor subclasses, in
# place of the in-place op they use otherwise (torch/csrc/autograd/FunctionsManual.cpp), and
# the ops that make the zeros they scatter into (_note_scatter).
_SCATTERS = frozenset({"aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default",
                       "aten.index_add.default", "aten.index_put.default",
                       "aten.masked_scatter.default", "aten.put.default",  # take's
                       "aten.index_fill.int_Tensor", "aten.index_fill.int_Scalar"})  # trace's
# Backward formulas that run an op in place on a temporary they made, and out of place when
# any tensor is a subclass (FunctionsManual.cpp; the ops as torch 2.14 runs them):
# autograd node -> {op: the ops that may have made the chain's first tensor}. Only there:
# the same op elsewhere is out of place in eager too (BCE with logits' target gradient
# without pos_weight is ``-self * grad``).
_BCEWL_ROOTS = frozenset({"aten.add.Scalar", "aten.sigmoid.default",
                          "aten.log_sigmoid_forward.default"})
_INPLACE_IN_EAGER = {
    # binary_cross_entropy_with_logits_backward and _target_backward, with pos_weight:
    # t.add(1).sub_(target).mul_(sigmoid).sub_(t), .mul_(grad), .mul_(weight), and
    # log_sigmoid(-x).sub_(log_sigmoid(x).mul_(pos_weight)).mul_(grad)
    "BinaryCrossEntropyWithLogitsBackward0": {"aten.sub.Tensor": _BCEWL_ROOTS,
                                              "aten.mul.Tensor": _BCEWL_ROOTS},
    # binary_cross_entropy_target_backward: logit(self).neg_().mul_(grad).mul_(weight)
    "BinaryCrossEntropyBackward0": {"aten.mul.Tensor": frozenset({"aten.logit.default"})},
    # clamp_backward with tensor bounds: where(...).masked_fill_(...)
    "ClampBackward0": {"aten.masked_fill.Scalar": frozenset({"aten.where.self"})},
    # maximum, minimum, fmax, fmin: where(self == other, grad / 2, grad).masked_fill_(...)
    **{node: {"aten.masked_fill.Scalar": frozenset({"aten.where.self"})}
       for node in ("MaximumBackward0", "MinimumBackward0", "FmaxBackward0", "FminBackward0")},
}
_ZEROS = frozenset({"aten.zeros_like.default", "aten.zeros.default",
                    "aten.new_zeros.default"})


def _storage_key(t) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl's address: stable while it lives


class _Recorder:
    """Dispatch-level record of ops and storages (wrapped in a TorchDispatchMode below)."""

    def __init__(self, profile: DeviceProfile, fake_mode, progress: Callable | None,
                 probes=None):
        self.profile = profile
        self.probes = probes                # ProbeSet: op signatures to measure scratch of
        self.fake_mode = fake_mode
        self.progress = progress
        self.ops: list[OpNode] = []
        self.tensors: list[TensorInfo] = []
        self.live: dict[int, int] = {}      # storage key -> tensor id, while it lives
        self.host: set[int] = set()         # storages that live in host memory on the target
        self.finalizers: list[weakref.finalize] = []
        self.seq = 0
        self.phase = FORWARD
        # A value for .item() on a fake tensor in the optimizer step (_ScalarShadow), or None.
        self.scalar_value: Callable | None = None
        # Module paths: "" is the model itself; OUTSIDE is code outside the model's forward
        # (the loss function, the optimizer).
        self.module_stack: list[str] = [OUTSIDE]
        self.module_calls: dict[str, int] = {}  # forward calls per module path
        # The modules being run, each with its call number (-1 in backward, a recompute),
        # as a tuple; per op, and per autograd node made in forward (as fwd_mod): the calls
        # an op ran in (StepGraph.op_calls). And per op, the tensor ids it read.
        self.call_stack: list[tuple[str, int]] = []
        self.calls_now: tuple = ()
        self.fwd_calls: list[tuple] = []
        self.op_calls: list[tuple] = []
        self.op_reads: list[tuple] = []
        self.fwd_seq: list[int] = []        # sorted autograd sequence numbers ...
        self.fwd_mod: list[str] = []        # ... and the module that made each node
        self.param_module: dict[int, str] = {}  # id(fake parameter) -> owning module path
        self.closed = False
        self.error: tuple | None = None     # (exception, op, module, phase, input shapes)
        # The innermost module an exception raised outside any op (Python code in a
        # forward) unwound through: ((id, type) of the exception, module). The module stack is
        # popped on the way out by the always-called forward hooks, so it is noted as they
        # pop. Only the id is kept: exceptions pass through forwards that succeed too (the
        # one checkpoint raises to stop a recompute early), and holding one would hold its
        # traceback's frames and their tensors, changing the step being measured.
        self.unwound: tuple | None = None
        # trace(nonzero_density=): the share of a mask's elements taken as true where an
        # output's size depends on values (torch.nonzero, boolean masks); None: an error.
        self.nonzero_density: float | None = None
        # A gradient sum the autograd engine made in backward (see _note_sum), whose
        # operands' frees right after it are being watched: (op index, result id,
        # operand ids, operand ids freed since).
        self.sum_watch: tuple | None = None
        self.sum_aliases: list[tuple[int, int]] = []  # (operand, sum): see _settle_sum
        # (operand, result, op index, roots): ops in place in eager (_note_inplace)
        self.inplace_ops: list[tuple[int, int, int, frozenset]] = []
        # In backward: the autograd node (name, sequence number) current when each tensor
        # was made, and when an op last read it (_note_sum tells the engine's sums apart).
        self.made_in_node: dict[int, tuple] = {}
        self.read_in_node: dict[int, tuple] = {}
        # id(real tensor) -> (it, its fake copy) for real tensors the model or the loss
        # closes over: held for the whole step, as the closure holds the real one, so that
        # the copy is one tensor from the start to the end, however often ops read it.
        self.captured: dict[int, tuple] = {}
        # Storages of the real parameters, buffers and inputs: registered already (as their
        # fake copies), so a closure reading the real tensor (a loss_fn over the inputs)
        # reads no new tensor.
        self.known_real: set[int] = set()
        # id(real tensor) -> (it, its fake copy): the real parameters, buffers and inputs the
        # step runs on copies of, an optimizer's other parameters, and (copy_leaves) each
        # real tensor that requires grad, copied when code first reads it. Code that reaches
        # the real tensor (a loss over a list of the parameters, torch.autograd.grad with
        # respect to the real input, an EMA updated in the optimizer step) gets the copy
        # (_function_mode): a real tensor read in the step would be a leaf of the traced
        # graph, and backward would put a fake gradient in it.
        self.copy_of: dict[int, tuple] = {}
        # Real storage key -> (real tensor, its copy): ops that reach a real tensor below
        # the function mode read a view of the copy where it has the same bytes (dispatch).
        self.copy_storage: dict[int, tuple] = {}
        self.copy_leaves = False
        # Storage key of a copy made when first read -> the copy: registered then (dispatch).
        self.lazy_copies: dict[int, Any] = {}
        # id(real tensor) -> (it, its .grad before the step), put back after it (restore_reals).
        self.grads_before: dict[int, tuple] = {}
        # id(real tensor) -> (it, a copy of its data) for real tensors ops wrote (dispatch).
        self.data_before: dict[int, tuple] = {}
        self.quiet = False  # ops pass through unrecorded (a copy being made)

    # -- storages ------------------------------------------------------------------------
    def _new(self, t, category: str, op_index: int, op: str = "", name: str = "",
             module: str = "", phase: str = "") -> int:
        s = t.untyped_storage()
        key = s._cdata
        # A ZeroTensor (aten._efficientzerotensor: forward-mode AD's zero tangents) reports
        # its storage's size, but eager allocates nothing for it.
        nbytes = 0 if t._is_zerotensor() else s.nbytes()
        tid = len(self.tensors)
        self.tensors.append(TensorInfo(
            id=tid, nbytes=nbytes, size=self.profile.device_bytes(nbytes), shape=tuple(t.shape),
            dtype=str(t.dtype).replace("torch.", ""), category=category, alloc_op=op_index,
            freed_before=None, last_use=max(op_index, 0), op=op, module=module, phase=phase,
            name=name, alloc_seq=self._tick()))
        self.live[key] = tid
        # PyTorch keeps one Python object per storage for as long as the storage lives
        # (PyObject preservation), so this runs exactly when the last reference goes,
        # whoever held it: a tensor, a view, autograd's saved variables.
        self.finalizers.append(weakref.finalize(s, self._on_free, key, tid))
        return tid

    def _tick(self) -> int:
        self.seq += 1
        return self.seq

    def _on_free(self, key: int, tid: int) -> None:
        if self.closed:
            return
        w = self.sum_watch
        if w is not None and len(self.ops) == w[0] + 1 and tid in w[2]:
            w[3].append(tid)
        info = self.tensors[tid]
        info.freed_before = len(self.ops)
        info.free_seq = self._tick()
        if self.live.get(key) == tid:
            del self.live[key]

    def _on_host_free(self, key: int) -> None:
        self.host.discard(key)

    def register(self, t, category: str, name: str = "") -> None:
        """A tensor that exists before the step (parameter, input, ...)."""
        key = _storage_key(t)
        if key not in self.live:
            self._new(t, category, BEFORE_STEP, name=name)

    def made_outside(self, t, name: str) -> None:
        """A tensor of the target device made during the step outside the dispatcher."""
        if _storage_key(t) not in self.live:
            self._new(t, TEMPORARY, len(self.ops), op=name, module=self.module_now(),
                      phase=self.phase, name=name)

    # -- real tensors and their copies ---------------------------------------------------
    def add_copy(self, real, fake) -> None:
        """`fake` stands for `real` in the step (copy_of, copy_storage)."""
        import torch

        self.copy_of.setdefault(id(real), (real, fake))
        if real.layout == torch.strided and real.device.type != "meta":
            self.copy_storage.setdefault(_storage_key(real), (real, fake))
        if real.requires_grad and real.is_leaf:
            self.grads_before.setdefault(id(real), (real, real.grad))

    def share_copies(self, other: "_Recorder") -> None:
        """Read `other`'s real tensors through the same copies (the optimizer's first step)."""
        self.copy_of, self.copy_storage = other.copy_of, other.copy_storage
        self.lazy_copies, self.grads_before = other.lazy_copies, other.grads_before
        self.data_before = other.data_before
        self.copy_leaves = other.copy_leaves

    def copy_for(self, t):
        """What code in the step reads for tensor `t`: its copy if it is a real tensor the
        step replaced, or a real leaf that requires grad (copied now); else `t` itself."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensor, is_fake

        found = self.copy_of.get(id(t))
        if found is not None:
            return found[1]
        if (not self.copy_leaves or isinstance(t, FakeTensor) or not t.requires_grad
                or type(t) not in (torch.Tensor, torch.nn.Parameter)
                or t.layout != torch.strided or is_fake(t)
                or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            return t  # functorch's wrappers (torch.func.grad's inputs) are plain Tensors too
        self.quiet = True
        try:
            fake = _fake_like(t, True)
        finally:
            self.quiet = False
        self.add_copy(t, fake)
        self.lazy_copies[_storage_key(fake)] = fake
        return fake

    def view_of_copy(self, t):
        """For real tensor `t` at dispatch: the same bytes of its storage's copy (a view
        taken where the real tensor is visible, p.detach() in an optimizer step), or None.
        Those bytes are counted already, as the copy."""
        import torch

        found = self.copy_storage.get(_storage_key(t))
        if found is None:
            return None
        real, fake = found
        if t is real:
            return fake
        offset = t.storage_offset() - real.storage_offset()
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        if (t.dtype != real.dtype or offset < 0 or 0 in t.shape
                or (offset + extent) * t.element_size() > fake.untyped_storage().nbytes()):
            return None
        return torch.ops.aten.as_strided.default(fake, t.shape, t.stride(), offset)

    def restore_reals(self) -> None:
        """Put back each real tensor's gradient as it was before the step: backward may still
        reach a real leaf the function mode did not see (an autograd.Function's input)."""
        import torch

        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            for real, grad in self.grads_before.values():
                if real.grad is not grad:
                    real.grad = grad
            for real, data in reversed(list(self.data_before.values())):
                real.copy_(data)  # last first: overlapping views end as they began
        self.copy_of, self.copy_storage, self.lazy_copies = {}, {}, {}
        self.grads_before, self.data_before = {}, {}

    def register_host(self, t) -> None:
        key = _storage_key(t)
        if key not in self.host:
            self.host.add(key)
            self.finalizers.append(weakref.finalize(t.untyped_storage(), self._on_host_free, key))

    def _settle_sum(self) -> None:
        """Eager autograd adds a new gradient into the buffered one in place when it holds
        the only reference to the buffered one, and its storage's (torch/csrc/autograd/
        input_buffer.cpp, can_accumulate_inplace); never for tensor subclasses such as fake
        tensors, which get ``old + new`` instead, with both alive at the add. If the
        buffered operand of the add watched died right after it (no one else held it),
        the real step added into it in place: the sum is that operand's storage, living on
        (merged in :meth:`merge_sums`). Never into the new one."""
        w, self.sum_watch = self.sum_watch, None
        if w is None:
            return
        index, result, operands, freed = w
        target = next((t for t in operands if t in freed), None)
        if target is None:
            return
        info, made = self.tensors[target], self.tensors[result]
        if info.nbytes != made.nbytes or info.dtype != made.dtype:
            return
        self.sum_aliases.append((target, result))

    def _note_inplace(self, name, node, node_key, args, outs, index) -> None:
        """Note, in backward, an op that the running formula makes in place in eager on a
        temporary it made (_INPLACE_IN_EAGER); settled in merge_sums, once it is known
        whether anything read the temporary after the op."""
        import torch

        ops = _INPLACE_IN_EAGER.get(node)
        if ops is None or name not in ops or len(outs) != 1 or outs[0] is None:
            return
        a = args[0] if args else None
        if not isinstance(a, torch.Tensor) or a._is_view():
            return
        tid = self.live.get(_storage_key(a))
        if tid is not None and self.made_in_node.get(tid) == node_key:
            self.inplace_ops.append((tid, outs[0][0], index, ops[name]))

    def merge_sums(self) -> None:
        """Each sum that eager autograd makes in place (_settle_sum) becomes its operand's
        storage living on: the operand takes the sum's release, last use and role, and the
        sum allocates nothing. Chains (a sum added into again) end on the first operand.
        A sum that becomes a parameter's gradient is merged too: AccumulateGrad steals the
        engine's sum or adds it into the ``.grad`` there is, in the real step as in the
        trace. (A tied weight's fp32 head gradient is a view, the transpose of a matmul's
        output, which _note_sum never watches: that sum is a new tensor in the real step.)"""
        root: dict[int, int] = {}
        chains: dict[int, list[int]] = {}
        aliases = [(operand, result, -1, None) for operand, result in self.sum_aliases]
        for operand, result, index, roots in sorted(aliases + self.inplace_ops,
                                                    key=lambda a: self.tensors[a[1]].alloc_op):
            first = root.get(operand, operand)
            if roots is not None:  # an op in place in eager: its operand read by no later op
                info, made = self.tensors[operand], self.tensors[result]
                if (info.last_use != index or info.nbytes != made.nbytes
                        or info.dtype != made.dtype or self.tensors[first].op not in roots):
                    continue
            root[result] = first
            chains.setdefault(first, []).append(result)
        for first, results in chains.items():
            keep = self.tensors[first]
            if keep.alloc_op < 0:  # older than the step: held by the model, never freed
                continue
            for result in results:
                gone = self.tensors[result]
                keep.freed_before, keep.free_seq = gone.freed_before, gone.free_seq
                keep.last_use = max(keep.last_use, gone.last_use)
                keep.category = gone.category
                gone.size = gone.nbytes = 0
        self.sum_aliases.clear()
        self.inplace_ops.clear()

    def close(self) -> None:
        self._settle_sum()
        self.closed = True
        for f in self.finalizers:
            f.detach()
        self.finalizers.clear()
        self.captured.clear()

    # Whether sums may be merged (_settle_sum). Not under FSDP (the sharded recorder): there
    # a parameter's unsharded gradient is a temporary the collectives take, and merging its
    # sums took 7.6–9.8% off BERT's and GPT-2's measured FSDP peaks.
    merge_in_place_sums = True

    def _note_scatter(self, func, args, out, outs, index) -> bool:
        """Watch, in backward, a scatter into a tensor of zeros made for it (see
        _settle_sum). Formulas written for tensor subclasses as well (gather's, max(dim)'s,
        topk's, index_select's...) scatter out of place when any tensor is a subclass, as
        fake tensors are, and in place into their zeros otherwise: a whole input-sized
        tensor more in the trace than in the real step (gather and max(dim) 22-25% high)."""
        import torch

        if str(func) not in _SCATTERS or len(outs) != 1 or outs[0] is None:
            return False
        base = args[0] if args else None
        if not (isinstance(base, torch.Tensor) and isinstance(out, torch.Tensor)
                and base.shape == out.shape and base.dtype == out.dtype
                and base.stride() == out.stride() and not base._is_view()):
            return False
        tid = self.live.get(_storage_key(base))
        if tid is None or self.tensors[tid].op not in _ZEROS:
            return False
        self.sum_watch = (index, outs[0][0], [tid], [])
        return True

    def _note_sum(self, func, args, kwargs, out, outs, index, node) -> None:
        """Watch, in backward, an op the real step makes in place where the trace makes a
        new tensor (see _settle_sum): a scatter into zeros (_note_scatter), or an ``add`` of
        two gradients of the same size, the autograd engine's sum of two contributions to
        one gradient."""
        import torch

        if not self.merge_in_place_sums or self.phase != BACKWARD:
            return
        if self._note_scatter(func, args, out, outs, index):
            return
        if (func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2
                or len(outs) != 1 or outs[0] is None or not isinstance(out, torch.Tensor)):
            return
        a, b = args  # the engine's ``old_var + var``: the buffered gradient first
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype):
            return
        # Only the buffered gradient is added into, and only if it is laid out as the sum
        # is: one added into in place keeps its own strides (a transposed matmul gradient,
        # say), and what needs the sum's layout then copies it (a parameter's gradient
        # follows the parameter's strides), which the sum made out of place here stands
        # for. Not a view either: its base shares the storage (a gradient through
        # ``.view(...).mean(1)``, as MultiheadAttention's averaged weights have, was taken
        # for a sum in place, 7.7% low).
        if a.stride() != out.stride() or a._is_view():
            return
        key_a, key_b = self.live.get(_storage_key(a)), self.live.get(_storage_key(b))
        if key_a is None or key_a == key_b or not self._engine_sum(key_a, key_b, node,
                                                                    b._is_view()):
            return
        self.sum_watch = (index, outs[0][0], [key_a], [])

    def _engine_sum(self, a, b, node, b_view=False) -> bool:
        """Whether an add of tensors ``a`` and ``b`` (ids) under autograd node ``node`` can be
        the engine's sum of two gradients rather than an add inside a backward formula (a
        custom Function's, or pinv's, whose result is a new tensor: nothing there is in
        place). The engine adds, after a node ran, its new output ``b`` into a gradient
        ``a`` buffered from an earlier node, which the node that ran neither made nor read
        (the node stays current meanwhile). The node's output it made, or passed on as it
        came (a residual's), or made as a view (``b_view``: the view op read its base). A
        formula adds tensors it made, or its incoming gradient, which it read before
        (``g + g * 2``). One case still looks alike: a formula whose first use of its
        incoming gradient is an add."""
        if a is None or b is None or node is None:
            return False
        if self.made_in_node.get(a) == node or self.read_in_node.get(a) == node:
            return False
        return (self.made_in_node.get(b) == node or b_view
                or self.read_in_node.get(b) != node)

    # -- module attribution --------------------------------------------------------------
    def module_now(self) -> str:
        return self.attribution()[0]

    def attribution(self) -> tuple[str, tuple]:
        """The module an op now belongs to, and the calls of the modules it runs in: in
        backward, those of the forward that made the running autograd node."""
        if self.phase != BACKWARD:
            return self.module_stack[-1], self.calls_now
        import torch

        node = torch._C._current_autograd_node()
        if node is None:
            return OUTSIDE, ()
        var = getattr(node, "variable", None)  # AccumulateGrad: the parameter it feeds
        if var is not None:
            return self.param_module.get(id(var), ""), ()
        i = bisect.bisect_left(self.fwd_seq, node._sequence_nr())
        return (self.fwd_mod[i], self.fwd_calls[i]) if i < len(self.fwd_mod) else (OUTSIDE, ())

    def enter_module(self, name: str) -> None:
        k = -1
        if self.phase == FORWARD:
            k = self.module_calls.get(name, 0)
            self.module_calls[name] = k + 1
        self.module_stack.append(name)
        self.call_stack.append((name, k))
        self.calls_now = tuple(self.call_stack)

    def leave_module(self) -> None:
        self.module_stack.pop()
        if self.call_stack:
            self.call_stack.pop()
        self.calls_now = tuple(self.call_stack)

    def note_autograd_outputs(self, out) -> None:
        """Remember which module made the autograd nodes of `out` (forward only)."""
        import torch
        from torch.utils import _pytree as pytree

        if self.phase != FORWARD:
            return
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.grad_fn is not None:
                seq = o.grad_fn._sequence_nr()
                # A composite call makes several nodes; all get numbers <= its output's,
                # and above the previous call's, so bisect finds the right module.
                if not self.fwd_seq or seq > self.fwd_seq[-1]:
                    self.fwd_seq.append(seq)
                    self.fwd_mod.append(self.module_stack[-1])
                    self.fwd_calls.append(self.calls_now)

    # -- ops -----------------------------------------------------------------------------
    def dispatch(self, func, args, kwargs):
        import torch
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils import _pytree as pytree

        if self.quiet:
            return func(*args, **(kwargs or {}))
        if self.sum_watch is not None:
            self._settle_sum()

        flat_in = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if self.copy_storage and any(not is_fake(a) for a in flat_in):
            # A real tensor whose bytes the step has a copy of, reached below the function
            # mode: the op reads the copy's bytes, which are counted (a view of it is of it).
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda a: a if is_fake(a) else (self.view_of_copy(a) or a),
                (args, kwargs))
            flat_in = [a for a in pytree.tree_leaves((args, kwargs))
                       if isinstance(a, torch.Tensor)]
        _refuse_sparse(func, flat_in)
        real_in = False
        for a in flat_in:
            if not is_fake(a) and a.device.type != "meta":
                real_in = True
                # A real tensor the model or loss closes over (e.g. targets): FakeTensorMode
                # converts it; it exists before the step, as an input.
                if _storage_key(a) in self.known_real:
                    continue
                if id(a) not in self.captured:
                    self.captured[id(a)] = (a, self.fake_mode.from_tensor(a))
                    if a.requires_grad and a.is_leaf:  # backward may write its .grad
                        with torch._C.DisableTorchFunction():
                            self.grads_before.setdefault(id(a), (a, a.grad))
                self.register(self.captured[id(a)][1], INPUT, name="captured tensor")
            elif self.lazy_copies:
                # A real tensor's copy made when first read (copy_for): it exists before the
                # step, as the captured tensors above.
                copy = self.lazy_copies.get(_storage_key(a))
                if copy is not None:
                    self.register(copy, INPUT, name="captured tensor")
        if real_in and func._schema.is_mutable:
            # FakeTensorMode runs an op whose operands are all real for real: an in-place
            # update of a real tensor (running statistics kept by the loss, an EMA's counter)
            # would outlive the trace. Its data is put back after it (restore_reals).
            for t in _written(func, args, kwargs):
                if not is_fake(t) and t.device.type != "meta" and id(t) not in self.data_before:
                    with _disable_current_modes(), torch._C.DisableTorchFunction():
                        self.data_before[id(t)] = (t, t.detach().clone())
        in_keys = [_storage_key(a) if is_fake(a) else _storage_key(self.fake_mode.from_tensor(a))
                   for a in flat_in if a.device.type != "meta"]
        index = len(self.ops)
        module, calls = self.attribution()
        node = ""
        node_key = None
        if self.phase == BACKWARD:
            n = torch._C._current_autograd_node()
            node = n.name() if n is not None else ""
            node_key = None if n is None else (node, n._sequence_nr())
        density = self.nonzero_density
        if node == "MaskedFillBackward1" and func is torch.ops.aten.where.self:
            # masked_fill's gradient for a value tensor: under a tensor subclass (fake tensors)
            # the formula is where(mask, grad, 0).sum(); eager's is grad.masked_select(mask)
            # .sum(), whose kernel holds far more (FunctionsManual.cpp masked_fill_backward).
            # Without a density, every element is taken as selected: an upper bound.
            func, args, kwargs = torch.ops.aten.masked_select.default, (args[1], args[0]), {}
            density = 1.0 if density is None else density
        name = str(func)
        if self.phase == OPTIMIZER and func is torch.ops.aten._local_scalar_dense.default:
            value = self.scalar_value(args[0]) if self.scalar_value is not None else None
            return _placeholder_scalar(args[0]) if value is None else value
        self.ops.append(OpNode(index, name, module, self.phase, node))
        self.op_calls.append(calls)
        self.op_reads.append(tuple(t for t in (self.live.get(k) for k in in_keys) if t is not None))
        try:
            _refuse_mixed_dtypes(func, args)
            out = run_op(func, args, kwargs, density)
        except Exception as e:
            if self.error is None:
                shapes = [tuple(a.shape) for a in flat_in]
                self.error = (e, name, module, self.phase, shapes)
            raise
        if func in _batch_norm_ops():
            out = _mixed_batch_norm_stats(args, out)
        elif func in _cpu_norm_ops():
            out = _mixed_cpu_norm_stats(func, args, out)

        _refuse_sparse(func, [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)])
        on_host = bool(in_keys) and all(k in self.host for k in in_keys)
        used = []
        new_bytes = 0
        # Per tensor output (None outputs included, as the probe sees the real ones):
        # (tensor id, bytes) if this op made it, else None.
        outs = []
        for o in pytree.tree_leaves(out, is_leaf=lambda x: x is None):
            if o is None:
                outs.append(None)
                continue
            if not isinstance(o, torch.Tensor):
                continue
            if not is_fake(o):
                outs.append(None)
                continue
            key = _storage_key(o)
            if on_host:
                self.register_host(o)
                outs.append(None)
                continue
            tid, made = self.live.get(key), None
            if tid is None:
                if getattr(func, "is_view", False) or key in in_keys:
                    # An alias of a storage made before the step that we were not told
                    # about (e.g. a plain tensor attribute of a module).
                    tid = self._new(o, BUFFER, BEFORE_STEP, name="untracked tensor")
                else:
                    tid = made = self._new(o, TEMPORARY, index, op=name, module=module,
                                           phase=self.phase)
                    new_bytes += self.tensors[tid].nbytes
            outs.append(None if made is None else (made, self.tensors[made].nbytes))
            used.append(tid)
        for k in in_keys:
            tid = self.live.get(k)
            if tid is not None:
                used.append(tid)
        for tid in used:
            self.tensors[tid].last_use = index
        op = self.ops[index]
        op.seq = self._tick()
        op.written = new_bytes
        op.scratch = _mask_scratch(func, args, density, self.profile)
        if flat_in:
            op.dtype = str(flat_in[0].dtype).replace("torch.", "")
        formula = _flop_formula(func)
        if formula is not None:
            try:
                op.flops = float(formula(*args, **(kwargs or {}), out_val=out))
            except Exception:  # an overload the formula does not cover: no FLOPs known
                op.flops = 0.0
        self._note_sum(func, args, kwargs, out, outs, index, node_key)
        self._note_inplace(name, node, node_key, args, outs, index)
        if node_key is not None:
            for k in in_keys:
                tid = self.live.get(k)
                if tid is not None:
                    self.read_in_node[tid] = node_key
            for o in outs:
                if o is not None:
                    self.made_in_node[o[0]] = node_key
        if self.probes is not None and not on_host:
            self.probes.add(index, func, args, kwargs, new_bytes, outs, out)
        if self.progress is not None and index % 500 == 0:
            self.progress(self.phase, index)
        return out


@functools.lru_cache(maxsize=None)
def _written_args(func) -> tuple:
    """(position, name) of the arguments an op writes (Tensor(a!) in its schema)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _written(func, args, kwargs) -> list:
    """The tensors op `func` writes, of its operands (a list for foreach ops)."""
    import torch
    from torch.utils import _pytree as pytree

    out = []
    for i, name in _written_args(func):
        v = args[i] if i < len(args) else (kwargs or {}).get(name)
        out += [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]
    return out


def _disable_current_modes():
    from torch.utils._python_dispatch import _disable_current_modes as disabled

    return disabled()


def real_storages(values) -> set[int]:
    """Storage keys of the real (not meta, not sparse) tensors among ``values``: what a
    recorder counts already when a closure reads them (_Recorder.known_real)."""
    import torch

    return {_storage_key(t) for t in values
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
            and t.layout == torch.strided}


def _refuse_sparse(func, tensors) -> None:
    import torch

    for t in tensors:
        if t.layout != torch.strided:
            raise UntraceableError(
                f"op {func} makes or reads a {str(t.layout).replace('torch.', '')} tensor of "
                f"shape {tuple(t.shape)}: the planner does not model sparse tensors yet (a "
                "sparse gradient of nn.Embedding(sparse=True) or nn.EmbeddingBag(sparse=True)). "
                "Trace the model with sparse=False for an upper bound: a dense gradient is the "
                "size of the weight, a sparse one that of the rows the batch looked up.")


@functools.lru_cache(maxsize=None)
def _same_dtype_ops() -> dict:
    """Ops whose source must have the destination's dtype, which their CPU and CUDA kernels
    check and their meta kernels do not: under fake tensors they trace where eager raises
    (an MoE layer's index_add_ of bf16 expert outputs into an fp32 buffer under autocast).
    Op -> (argument index of the source, eager's message)."""
    import torch

    aten = torch.ops.aten
    table = {
        "index_add": (3, "index_add_(): self ({self}) and source ({src}) must have the same "
                         "scalar type"),
        "index_copy": (3, "index_copy_(): self and source expected to have the same dtype, but "
                          "got (self) {self} and (source) {src}"),
        "index_reduce": (3, "index_reduce_(): self ({self}) and source ({src}) must have the "
                            "same scalar type"),
        "index_put": (2, "Index put requires the source and destination dtypes match, got "
                         "{self} for the destination and {src} for the source."),
        "_index_put_impl_": (2, "Index put requires the source and destination dtypes match, "
                                "got {self} for the destination and {src} for the source."),
        "put": (2, "put_(): self and source expected to have the same dtype, but got "
                   "self.dtype = {self} and source.dtype = {src}"),
    }
    ops = {}
    for name, rule in table.items():
        for variant in (name, name + "_"):
            packet = getattr(aten, variant, None)
            if packet is not None and hasattr(packet, "default"):
                ops[packet.default] = rule
    return ops


def _scalar_type(dtype) -> str:
    import torch

    # c10's names, as eager's messages print them (torch.float32 -> Float).
    name = torch.empty(0, dtype=dtype, device="meta").type()  # "torch.BFloat16Tensor"
    return name.rsplit(".", 1)[-1].removesuffix("Tensor")


def _refuse_mixed_dtypes(func, args) -> None:
    import torch

    rule = _same_dtype_ops().get(func)
    if rule is None or len(args) <= rule[0]:
        return
    self, src = args[0], args[rule[0]]
    if isinstance(src, torch.Tensor) and src.dtype != self.dtype:
        eager = rule[1].format(self=_scalar_type(self.dtype), src=_scalar_type(src.dtype))
        raise RuntimeError(f"{eager} (eager PyTorch raises this too, on the CPU and on CUDA: "
                           f"cast the source to {self.dtype} before "
                           f"{func.__name__.split('.')[0]})")


@functools.lru_cache(maxsize=None)
def _batch_norm_ops() -> frozenset:
    import torch

    aten = torch.ops.aten
    return frozenset(getattr(getattr(aten, n), o)
                     for n, o in (("native_batch_norm", "default"),
                                  ("_native_batch_norm_legit", "default"),
                                  ("_native_batch_norm_legit", "no_stats"),
                                  ("_native_batch_norm_legit_functional", "default"),
                                  ("_batch_norm_with_update", "default"))
                     if hasattr(aten, n) and hasattr(getattr(aten, n), o))


def _mixed_batch_norm_stats(args, out):
    """Batch norm on an fp16/bf16 input with fp32 weight or running stats (autocast) saves
    its mean and inverse std in fp32 (CPU: ``param_scalar_type``; CUDA and cuDNN alike),
    but torch's meta kernel gives them the input's dtype. Correct them, so the saved
    statistics have their real size and the CPU kernel probe does not run
    ``native_batch_norm_backward`` on half-size buffers (it reads past them)."""
    return _fp32_stats(args[0], args[1:5], out)


def _fp32_stats(x, params, out):
    """``out`` with its 2nd and 3rd tensors (a norm's mean and inverse std) made fp32 where
    ``x`` is fp16/bf16 and a parameter among ``params`` is fp32."""
    import torch

    if (x.dtype not in (torch.float16, torch.bfloat16)
            or not any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params)):
        return out
    out = list(out)
    for i in (1, 2):
        if out[i].dtype != torch.float32:
            out[i] = torch.empty_like(out[i], dtype=torch.float32)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _cpu_norm_ops() -> frozenset:
    import torch

    aten = torch.ops.aten
    return frozenset({aten.native_layer_norm.default, aten.native_group_norm.default,
                      aten.native_group_norm_backward.default})


def _mixed_cpu_norm_stats(func, args, out):
    """Layer and group norm on the CPU, on an fp16/bf16 input with an fp32 weight or bias
    (autocast leaves both ops' weights as they are there), keep their mean and inverse std in
    fp32 (``param_scalar_type`` of a mixed type), where torch's meta kernel gives them the
    input's dtype. Corrected as for batch norm (:func:`_mixed_batch_norm_stats`): the CPU
    kernel probe refused to run the backward on them, and its scratch (a float copy of a
    half-size input gradient, as large as the input) went uncounted: 14% low on a step of
    layer norm under bf16 autocast, 29% for group norm. On CUDA the meta kernel is right."""
    import torch

    aten = torch.ops.aten
    if func is aten.native_group_norm_backward.default:
        # Given fp32 statistics, the meta kernel makes the input's gradient fp32 too; the CPU
        # kernel makes it in the input's dtype.
        x = args[1]
        if x.device.type == "cpu" and out[0] is not None and out[0].dtype != x.dtype:
            return (torch.empty_like(out[0], dtype=x.dtype), *out[1:])
        return out
    if args[0].device.type != "cpu":
        return out
    return _fp32_stats(args[0], args[2:4] if func is aten.native_layer_norm.default else args[1:3], out)


def run_op(func, args, kwargs, nonzero_density=None):
    """``func(*args, **kwargs)`` on fake tensors, where the fake kernel's refusal has an
    answer: fp32 ``_grouped_mm`` (:func:`_grouped_mm_any_dtype`) and, with a density,
    value-dependent sizes (:func:`_at_density`). Otherwise the kernel's error stands.
    Every pass that runs a model on fake tensors (capture, sharded warm-up, the checkpoint
    planner's forward) goes through it, so that they all see the same ops."""
    _check_matmul_dtypes(func, args)
    # Before the fake kernel, which would log its refusal at error level on every call.
    out = _grouped_mm_any_dtype(func, args, kwargs)
    if out is not None:
        return out
    try:
        out = func(*args, **(kwargs or {}))
    except RuntimeError:
        out = _ctc_loss_outputs(func, args, kwargs)
        if out is None:
            out = _at_density(func, args, kwargs, nonzero_density)
        if out is None:
            raise
        return out
    note_made(func, args, kwargs, out)  # masks of ones, which library code asks about
    return out


def _matmul_ops():
    import torch

    aten = torch.ops.aten
    return (aten.mm.default, aten.addmm.default, aten.mv.default, aten.addbmm.default)


def _check_matmul_dtypes(func, args) -> None:
    """The dtype check of eager matmuls that their fake kernels leave out (CPU and CUDA
    alike: "mat1 and mat2 must have the same dtype"). Without it, a model fed inputs of the
    wrong dtype (int64 token ids into a Linear, float64 data into a float32 model) traced
    and got a peak for a step that cannot run. bmm, baddbmm, dot, addmv and convolutions
    check in their fake kernels already."""
    import torch

    if func not in _matmul_ops():
        return
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
    if len(set(dtypes)) > 1:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise RuntimeError(f"{func.overloadpacket.__name__}'s operands must have the same dtype "
                           f"(as in eager), but got {names}")


def _ctc_loss_outputs(func, args, kwargs):
    """``aten._ctc_loss`` on fake tensors, which refuse it: its second output, the forward
    variables (batch, input length, 2 * the longest target + 1), is sized by the target
    lengths. Given as Python ints (``F.ctc_loss(..., [64] * B, [10] * B)``), they are
    known. Given as tensors (Hugging Face's CTC heads), their values are not, and the
    longest target is taken as the targets' padded width (2-D targets), which no target
    exceeds, or their mean length (1-D concatenated targets). None for any other op."""
    import torch

    aten = torch.ops.aten
    if func not in (aten._ctc_loss.default, aten._ctc_loss.Tensor):
        return None
    kw = dict(kwargs or {})
    names = ("log_probs", "targets", "input_lengths", "target_lengths")
    vals = list(args[:4]) + [kw.get(n) for n in names[len(args):4]]
    log_probs, targets, _, target_lengths = vals
    batched = log_probs.dim() == 3
    batch = log_probs.shape[1] if batched else 1
    if isinstance(target_lengths, torch.Tensor):
        if targets.dim() == 2:
            longest = targets.shape[1]
        else:
            longest = -(-targets.numel() // max(batch, 1))
    else:
        longest = max(target_lengths, default=0)
    loss_shape = (batch,) if batched else ()
    alpha_shape = ((batch,) if batched else ()) + (log_probs.shape[0], 2 * longest + 1)
    device = log_probs.device
    return (torch.empty(loss_shape, dtype=log_probs.dtype, device=device),
            torch.empty(alpha_shape, dtype=log_probs.dtype, device=device))


def _at_density(func, args, kwargs, density):
    """Ops whose output size depends on tensor values, sized as if ``density`` of each mask's
    elements were true (``trace(nonzero_density=...)``): ``nonzero`` (and ``torch.where``
    with one argument, ``argwhere``), ``masked_select``, and indexing or index-putting with a
    boolean mask, whose masks become index tensors of that many entries. None for any other
    op, or without a density: the fake kernel's error stands."""
    import torch

    if density is None:
        return None
    aten = torch.ops.aten

    def count(numel):
        return int(round(numel * density))

    def as_indices(indices):
        # A boolean mask over k dims selects count(mask) positions: k long index tensors.
        out, changed = [], False
        for ix in indices:
            if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8):
                n = count(ix.numel())
                out.extend(torch.zeros(n, dtype=torch.long, device=ix.device) for _ in range(ix.dim()))
                changed = True
            else:
                out.append(ix)
        return out, changed

    kwargs = kwargs or {}
    if func is aten.nonzero.default:
        x = args[0]
        return torch.empty((count(x.numel()), x.dim()), dtype=torch.long, device=x.device)
    if func is aten.masked_select.default:
        x, mask = args[0], args[1]
        n = count(torch.Size(torch.broadcast_shapes(x.shape, mask.shape)).numel())
        return torch.empty((n,), dtype=x.dtype, device=x.device)
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default):
        indices, changed = as_indices(args[1])
        if changed:
            return func(args[0], indices, *args[2:], **kwargs)
    return None


def _mask_scratch(func, args, density, profile) -> int:
    """Bytes the kernel of a boolean-mask op holds while it runs, which fake tensors do not
    see. Indexing with a mask (``x[mask]``, ``x[mask] = v``) first turns each mask into the
    positions of its true elements (``nonzero``: int64, one column per dimension), and so does
    ``masked_select`` on CUDA. On the CPU, ``masked_select`` keeps the mask and its prefix sums
    as int64 instead, unless it takes the serial path (contiguous operands of one shape, under
    32,768 elements or one thread). Masks are sized by ``density``, as the ops' outputs are
    (:func:`_at_density`); 0 without one (``nonzero_static`` on the CPU, whose output has a
    fixed size: every element counted then). On CUDA, ``masked_scatter`` takes an int64 prefix
    sum of its mask, and its backward selects as many elements as the source has (on the
    CPU, the kernel probe measures both, with true masks: probe.py)."""
    import math

    import torch

    aten = torch.ops.aten
    if profile.name == "cuda" and func in (aten.masked_scatter.default, aten.masked_scatter_.default):
        # the mask's exclusive prefix sum, int64 (the CPU kernel's is measured by the probe)
        shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
        return profile.device_bytes(torch.Size(shape).numel() * 8)
    if profile.name == "cuda" and func is aten.masked_scatter_backward.default:
        # grad.masked_select(mask): as many true elements as the source has
        mask = args[1]
        return profile.device_bytes(min(mask.numel(), math.prod(args[2])) * mask.dim() * 8)
    if profile.name == "cpu" and func is aten.nonzero_static.default:
        # The CPU kernel makes the whole nonzero of its input, then copies the first `size`
        # rows: counted at the density, or with every element nonzero without one.
        x = args[0]
        count = x.numel() if density is None else int(round(x.numel() * density))
        return count * max(x.dim(), 1) * 8
    if density is None:
        return 0
    if func is aten.masked_select.default:
        x, mask = args[0], args[1]
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        n = torch.Size(shape).numel()
        if profile.name == "cuda":
            return profile.device_bytes(int(round(n * density)) * len(shape) * 8)
        serial = ((n < 32768 or torch.get_num_threads() == 1) and x.shape == mask.shape
                  and x.is_contiguous() and mask.is_contiguous())
        return 0 if serial or n == 0 else 16 * n
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default):
        return sum(profile.device_bytes(int(round(ix.numel() * density)) * ix.dim() * 8)
                   for ix in args[1]
                   if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8))
    return 0


def _grouped_mm_any_dtype(func, args, kwargs):
    """``aten._grouped_mm`` (the experts of mixture-of-experts layers, e.g. transformers'
    ``grouped_mm`` implementation) on fp32 operands: torch's meta kernel accepts only bf16
    and fp16, while its CPU and CUDA kernels run fp32 too (a fallback). The output has the
    shape bf16 operands give it, and fp32 (or ``out_dtype``). None for any other op or dtype:
    the fake kernel runs as usual."""
    import torch

    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    if grouped is None or func is not getattr(grouped, "default", None):
        return None
    mats = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if len(mats) != 2 or any(m.dtype != torch.float32 for m in mats):
        return None
    # _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None)
    kwargs = dict(kwargs or {})
    out_dtype = kwargs.pop("out_dtype", None) or (args[4] if len(args) > 4 else None)
    bias = kwargs.pop("bias", None) if len(args) <= 3 else args[3]
    half = [m.to(torch.bfloat16) for m in mats] + list(args[2:3])
    if bias is not None:
        kwargs["bias"] = bias.to(torch.bfloat16)
    shape = func(*half, **kwargs).shape
    return torch.empty(shape, dtype=out_dtype or torch.float32, device=mats[0].device)


def _flop_formula(func):
    from torch.utils.flop_counter import flop_registry

    return flop_registry.get(getattr(func, "overloadpacket", None))


def _dispatch_mode(rec: _Recorder):
    from torch.utils._python_dispatch import TorchDispatchMode

    class _RecorderMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return rec.dispatch(func, args, kwargs)

    return _RecorderMode()


@contextlib.contextmanager
def rng_states_recorded(rec: _Recorder, profile: DeviceProfile):
    """Record the CPU generator's state that ``torch.utils.checkpoint`` saves at each
    checkpointed call to replay its random ops (preserve_rng_state), as a tensor of the
    step: made outside the dispatcher, no mode sees it, and on the CPU target it is device
    memory (5,056 bytes on this torch), held until the call's backward. On CUDA the saved
    states are host tensors."""
    import torch

    if profile.name != "cpu":
        yield
        return
    real = torch.get_rng_state

    def get_rng_state():
        state = real()
        rec.made_outside(state, "checkpoint: saved RNG state")
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = real


@contextlib.contextmanager
def conversions_in_forward(model):
    """Let a module convert itself in forward where that changes nothing, as Switch
    Transformers' router does (``self.classifier = self.classifier.to(self.dtype)``):
    ``Module._apply`` swaps each parameter for its converted self, which fails on the fake
    ones the step runs with. A conversion that would change a tensor (another dtype or
    device) makes new parameters mid-step, which the planner does not model: that is a
    clear error naming the module."""
    import torch

    real = torch.nn.Module._apply
    names = {id(m): name for name, m in model.named_modules()}

    def _apply(module, fn, recurse=True):
        mods = module.modules() if recurse else (module,)
        tensors = [t for m in mods for t in (*m._parameters.values(), *m._buffers.values())
                   if t is not None]
        with torch.no_grad():
            if all(fn(t) is t for t in tensors):
                return module
        where = repr(names[id(module)]) if names.get(id(module)) else "the model"
        raise PlannerError(
            f"module {where} converts its parameters or buffers to another dtype or device "
            f"inside forward ({type(module).__name__}.to/.half/.float/.cuda), which the "
            f"planner does not model: convert the model before tracing it, so that the "
            f"conversion in forward changes nothing")

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = real


def _any_real(values) -> bool:
    """Whether `values` (args or kwargs, lists within) hold a tensor that is not fake."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(values, dict):
        values = values.values()
    for v in values:
        if isinstance(v, (list, tuple, dict)):
            if _any_real(v):
                return True
        elif isinstance(v, _torch().Tensor) and not isinstance(v, FakeTensor):
            return True
    return False


def _function_mode(rec: _Recorder, overrides: dict):
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils import _pytree as pytree

    class _FunctionLayer(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            back = None
            if _any_real(args) or _any_real(kwargs):
                # Real tensors the step has copies of are read as the copies (copy_of); one
                # given back unchanged (an in-place op's self, .contiguous()) is the real one.
                back = {}

                def to_copy(t):
                    c = rec.copy_for(t)
                    if c is not t:
                        back[id(c)] = t
                    return c

                args, kwargs = pytree.tree_map_only(torch.Tensor, to_copy, (args, kwargs))
            out = overrides.get(func, func)(*args, **kwargs)
            if back:
                out = pytree.tree_map_only(torch.Tensor, lambda o: back.get(id(o), o), out)
            rec.note_autograd_outputs(out)
            return out

    return _FunctionLayer()


# -----------------------------------------------------------------------------------------
# The step
# -----------------------------------------------------------------------------------------

def _fake_like(t, requires_grad: bool):
    """A fake CPU tensor with `t`'s metadata. Never reads `t`'s data, so `t` may be on the
    meta device, a GPU, or far larger than this machine's memory."""
    import torch

    if t.layout != torch.strided:  # a sparse tensor's strides are zeros: it would be dense
        raise UntraceableError(
            f"a {str(t.layout).replace('torch.', '')} tensor of shape {tuple(t.shape)} is part "
            f"of the step: the planner does not model sparse tensors yet. Measure such a step "
            f"on a real run instead.")
    f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    if not requires_grad:
        return f
    f.requires_grad_(True)
    # Hooks on the gradient (register_hook: clipping, scaling) run on the fake's, as the
    # real one's would: what they make is the step's.
    for hook in (getattr(t, "_backward_hooks", None) or {}).values():
        f.register_hook(hook)
    return f


def _held_copies(known: set[int]):
    """For HeldTensors.swap: a fake copy of a tensor a module holds, its storage's bytes
    shared by the copies of its views; None for one the step has already (a parameter's
    view, an input), a leaf that requires grad, and what is not a plain dense tensor."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    bases: dict[int, Any] = {}  # real storage key -> a fake one of its bytes

    def copy(t):
        if (type(t) not in (torch.Tensor, torch.nn.Parameter) or is_fake(t)
                or t.layout != torch.strided or t.is_quantized or t._is_zerotensor()
                or (t.requires_grad and t.is_leaf)):
            return None
        if t.device.type != "meta" and t.untyped_storage()._cdata in known:
            return None
        return storage_alias(bases, t, "cpu")  # under the fake mode: fake

    return copy


def _made_by(rec: _Recorder):
    """Whether the step `rec` recorded made a fake tensor (alive): not one from before it."""
    def made(t) -> bool:
        tid = rec.live.get(_storage_key(t))
        return tid is not None and rec.tensors[tid].alloc_op != BEFORE_STEP
    return made


def _make_optimizer(optimizer, params: list, fake_of: dict, profile: DeviceProfile):
    import torch

    if isinstance(optimizer, torch.optim.Optimizer):
        # An instance built on the real parameters: rebuild it, same class and
        # hyperparameters, over the fake ones.
        groups = []
        for g in optimizer.param_groups:
            fg = {k: v for k, v in g.items() if k != "params"}
            fg["params"] = [fake_of[id(p)] for p in g["params"] if id(p) in fake_of]
            groups.append(fg)
        opt = type(optimizer)(groups)
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        opt = optimizer(params)
    elif isinstance(optimizer, type) or not callable(optimizer):
        raise PlannerError(
            f"optimizer={optimizer!r} is not an optimizer: pass a torch.optim.Optimizer "
            f"class (e.g. torch.optim.Adam), a callable params -> optimizer (e.g. "
            f"lambda params: torch.optim.AdamW(params, lr=1e-4)), or None for forward + "
            f"backward only")
    else:
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise PlannerError(
                f"the optimizer factory returned {type(opt).__name__}, not a "
                f"torch.optim.Optimizer; it must build the optimizer from the parameters it "
                f"is given, e.g. lambda params: torch.optim.Adam(params, lr=1e-3)")
    _refuse_closure_optimizers(opt, params)
    prepare_optimizer(opt, profile)
    return opt


def _refuse_closure_optimizers(opt, params: list) -> None:
    from ..units import format_bytes

    """An optimizer whose step() must be given a closure (torch.optim.LBFGS) runs forward
    and backward again inside its step, as often as its line search asks: a step the
    planner's one forward, backward and step() do not describe."""
    import inspect

    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is None or closure.default is not inspect.Parameter.empty:
        return
    name = type(opt).__name__
    group = opt.param_groups[0] if opt.param_groups else {}
    history = group.get("history_size")
    trained = sum(p.numel() * p.element_size() for p in params)
    held = ""
    if isinstance(history, int):
        held = (f" {name} keeps up to {history} pairs of flat copies of the trained parameters "
                f"(history_size) and two more: {format_bytes((2 * history + 2) * trained)} for "
                f"these {format_bytes(trained)} of parameters, beside what one forward and "
                f"backward take.")
    raise UntraceableError(
        f"{name}.step() takes a closure that runs forward and backward again, as many "
        f"times as the optimizer asks (max_iter), which pymemplan.trace does not trace."
        f"{held} Trace with optimizer=None for forward and backward alone, and add the "
        f"optimizer's state to its peak.")


class _ScalarShadow:
    """The values an optimizer's scalar state holds at a step, from a shadow of it.

    Optimizers branch on scalars of their state (ASGD: ``if mu.item() != 1`` allocates a
    parameter-sized temporary, which with its default t0 it does not do for a million steps;
    RAdam on the step count), and fake tensors have no values. The shadow is the same
    optimizer class with the same hyperparameters, per parameter group, over one real
    one-element parameter, stepped on zero gradients: scalar state that depends on the
    hyperparameters and the step count only (steps, decays, averaging weights) takes the
    values it takes in the traced run. ``.item()`` on a fake state tensor answers with the
    shadow's value of that key after that many steps: 1 for the first step (its in-place
    increments read so), _STEADY_STEP for the traced one, a step well into training; anything
    else, or an optimizer the shadow cannot run, answers None (the placeholder)."""

    def __init__(self, opt, values: dict):
        self.opt = opt
        self.values = values  # _shadow_scalars(opt, steps), made outside the fake mode
        self.where: dict[int, tuple[int, str]] = {}  # id(state tensor) -> (group, key)
        self.indexed = -1  # len(opt.state) when `where` was made

    def __call__(self, t):
        if not self.values:
            return None
        found = self.where.get(id(t))
        if found is None and len(self.opt.state) != self.indexed:
            # State made since the last look (the first step makes it, parameter by
            # parameter); a read of anything else (a parameter's norm) costs no scan.
            self.indexed = len(self.opt.state)
            group_of = {id(p): gi for gi, g in enumerate(self.opt.param_groups)
                        for p in g["params"]}
            for p, st in self.opt.state.items():
                for k, v in st.items():
                    if id(p) in group_of:
                        self.where[id(v)] = (group_of[id(p)], k)
            found = self.where.get(id(t))
        if found is None:
            return None
        value = self.values.get(found)
        if value is None:
            return None
        if t.dtype == _torch().bool:
            return bool(value)
        return float(value) if t.dtype.is_floating_point else int(value)


# The step whose scalars the traced step reads: one well into training, past the warm-ups
# optimizers branch on (RAdam's rectified update begins at step 6 with its default betas and
# takes 1.5 parameter-sized temporaries more than steps 2 to 5), and short of schedules
# that change only after very long runs (ASGD averages from t0 = a million steps).
_STEADY_STEP = 1000


def _shadow_class(cls):
    """The optimizer class a shadow runs: for a subclass of one of torch's optimizers, that
    optimizer. The shadow's steps are real, and a subclass's own step may reach real tensors
    outside it (an EMA of the model updated after each step: its counter moved 1,001 steps
    per trace); torch's own steps touch their parameters and state only."""
    import torch

    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base is not torch.optim.Optimizer:
            return base
    return cls


def _shadow_scalars(opt, steps: int) -> dict:
    """(group index, key) -> the value of each scalar in a shadow optimizer's state after
    `steps` steps (see _ScalarShadow); {} where it cannot be built or stepped."""
    import torch

    try:
        with torch.device("cpu"), torch.no_grad():  # called outside the fake mode
            params, groups = [], []
            for g in opt.param_groups:
                p = torch.zeros(1, requires_grad=True)
                params.append(p)
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [p]})
            shadow = _shadow_class(type(opt))(groups)
            for _ in range(steps):
                for p in params:
                    p.grad = torch.zeros_like(p)
                shadow.step()
    except Exception:  # fused or capturable kernels need a GPU; a closure; custom code
        return {}
    values = {}
    for gi, p in enumerate(params):
        for k, v in shadow.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dim() == 0:
                values[(gi, k)] = v.item()
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                values[(gi, k)] = v
    return values


def _placeholder_scalar(t):
    """A value for ``.item()`` on a fake tensor in the optimizer step. Some optimizers
    read scalars there (Adafactor's parameter norm scales its step size); the memory the
    step takes does not depend on them, and fake tensors have no values. 0.5, not 1.0:
    bias corrections divide by ``1 - beta_product`` (NAdam's ``1 - mu_product``)."""
    return False if t.dtype == _torch().bool else (0 if not t.dtype.is_floating_point else 0.5)


def _torch():
    import torch

    return torch


def _first_optimizer_step(opt, profile: DeviceProfile, fake_mode, trained,
                          scalars: dict, step_rec: "_Recorder | None" = None) -> "_Recorder":
    """The optimizer's first step, on zero gradients, recorded: it makes the optimizer's
    state, so that the traced step is the steady state, as in every step after the first,
    and the record says where a real run's first step makes that state (Adam: all of it
    before the first update; SGD with momentum: each buffer as its parameter comes).

    It runs after the traced backward pass, once it is known which parameters get a
    gradient (``trained``: their ids): torch's optimizers skip a parameter whose ``.grad``
    is None, in the first step as in every later one, so one the step does not train (never
    used in forward, or frozen but given to the optimizer) gets no state. The traced step's
    gradients are set aside meanwhile and put back. ``step_rec``: the traced step's
    recorder, whose copies of real tensors this step reads too."""
    import torch

    rec = _Recorder(profile, fake_mode, None)
    rec.scalar_value = _ScalarShadow(opt, scalars)
    if step_rec is not None:
        rec.share_copies(step_rec)
    params = [p for g in opt.param_groups for p in g["params"]]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in trained else None
    begin_first_step(rec, opt, [p for p in params if p.grad is not None])
    try:
        with _dispatch_mode(rec), _function_mode(rec, {}):
            opt.step()
    finally:
        rec.close()
        for p, g in zip(params, kept):
            p.grad = g
    return rec


def begin_first_step(rec: "_Recorder", opt, params, local=lambda t: t) -> None:
    """Ready ``rec`` to record an optimizer's first step: the parameters and gradients
    exist before it, and so does state some optimizers make when they are built (Adagrad's
    sums), which is not the first step's. ``local``: as for :func:`_first_step_events`."""
    import torch

    rec.phase = OPTIMIZER  # scalars read from fake tensors get placeholders (dispatch)
    for p in params:
        rec.register(local(p), PARAMETER)
        if p.grad is not None:
            rec.register(local(p.grad), GRADIENT)
    rec.state_before = {_storage_key(local(v)) for st in opt.state.values()
                        for v in st.values() if isinstance(v, torch.Tensor)}


def _trained(rec: "_Recorder", params, grad_versions: dict) -> set:
    """Ids of the parameters the traced step gave a gradient. With ``grads_present``, every
    parameter starts with one; one that backward did not add into belongs to a parameter
    the step does not train, which in a real run has none: it goes, as if it never
    existed."""
    trained = set()
    for p in params:
        if p.grad is None:
            continue
        before = grad_versions.get(id(p))
        # Untouched since the step began: the same tensor (backward may also replace it by
        # a sum made out of place, as for fake tensors), not written since.
        if before is not None and before[0] is p.grad and before[1] == p.grad._version:
            tid = rec.live.get(_storage_key(p.grad))
            if tid is not None:
                rec.tensors[tid].size = rec.tensors[tid].nbytes = 0
            p.grad = None
            continue
        trained.add(id(p))
    return trained


def _first_step_events(first: "_Recorder", rec: "_Recorder", opt, profile: DeviceProfile,
                       span: tuple[int, int], local=lambda t: t) -> dict:
    """``StepGraph.first_optimizer_step`` from the record of the optimizer's first step:
    the state it makes refers to the state tensors of the traced step (``rec``); state
    that lives in host memory on the target (CUDA's step counters) makes no event.
    ``local``: the tensor whose storage holds a state value (a DTensor's local shard)."""
    import torch

    state_of: dict[int, int] = {}  # local id -> tensor id in the traced step (-2: host)
    for st in opt.state.values():
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            v = local(v)
            if _storage_key(v) not in first.state_before:
                here = first.live.get(_storage_key(v))
                if here is not None:
                    on_device = state_on_device(opt, k, v, profile)
                    state_of[here] = rec.live.get(_storage_key(v), -1) if on_device else -2
    events = []
    for t in first.tensors:
        state = state_of.get(t.id, -1)
        if not t.size or state == -2:
            continue
        if t.alloc_op == BEFORE_STEP:
            # State made without a dispatched op (Adam's torch.tensor(0.0) step counter),
            # seen first when the step updated it: made before anything else.
            if state >= 0:
                events.append((0, 0, state, t.id, t.size))
            continue
        events.append((t.alloc_seq, 0, state, t.id, t.size))
        if t.free_seq is not None:
            events.append((t.free_seq, 1, -1, t.id, t.size))
    events.sort()
    return {"ops": list(span), "events": [list(e[1:]) for e in events]}


def _to_loss(out, loss_fn):
    import torch

    if loss_fn is not None:
        return loss_fn(out)
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)  # Hugging Face outputs computed with labels
    if isinstance(loss, torch.Tensor):
        return loss
    raise PlannerError(
        f"the model returned {type(out).__name__}, not a scalar loss; pass loss_fn=... that "
        f"maps the model's output to a scalar, e.g. loss_fn=lambda out: out.float().mean()")


class _ScalerState:
    """``torch.amp.GradScaler``'s tensors and ops (torch/amp/grad_scaler.py), without
    its ``.item()`` on the inf flag, which fake tensors have no value for."""

    def __init__(self):
        import torch

        self.scale = torch.full((), 2.0 ** 16, dtype=torch.float32)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.found_inf = None

    def scale_loss(self, loss):
        return loss * self.scale

    def unscale(self, grads) -> None:
        import torch

        inv_scale = self.scale.double().reciprocal().float()
        self.found_inf = torch.full((), 0.0, dtype=torch.float32)
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, self.found_inf, inv_scale)

    def update(self) -> None:
        import torch

        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf,
                                 2.0, 0.5, 2000)
        self.found_inf = None


def finish_recording(rec, probes, progress, activations, grads):
    """Close the record, measure kernel scratch if probing, and mark activations and
    gradients; returns the probe's statistics (None without a probe)."""
    rec.close()
    probe_stats = None
    if probes is not None:
        scratch, probe_stats = probes.measure(progress)
        for i, ws in scratch.items():
            rec.ops[i].scratch = max(rec.ops[i].scratch, ws)
        # Outputs the real kernel makes larger than the fake one says (an RNN layer's
        # workspace, empty under fake tensors, is kept from forward to backward).
        for tid, nbytes in probes.grown.items():
            t = rec.tensors[tid]
            t.nbytes, t.size = nbytes, rec.profile.device_bytes(nbytes)
    for tid in activations:
        rec.tensors[tid].category = ACTIVATION
    for tid in grads:
        rec.tensors[tid].category = GRADIENT
    rec.merge_sums()
    return probe_stats


def _backward(loss) -> None:
    """``loss.backward()``, calling the autograd engine directly. Through
    ``Tensor.backward`` the call would enter the torch-function layer, which is switched
    off while its handler runs: Python code that runs during backward (activation
    checkpointing re-running a module's forward) would miss the device profile's kernels."""
    import torch
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward((loss,), (torch.ones_like(loss, memory_format=torch.preserve_format),),
                         False, False, (), allow_unreachable=True, accumulate_grad=True)


def backward_phase(rec, loss, phase_starts: dict) -> set:
    """The forward pass has made ``loss``: whatever it made and is still alive now is kept
    for backward (or is the loss itself), the activations. Runs backward as its own phase
    and returns the activations' tensor ids."""
    activations = {tid for tid in rec.live.values() if rec.tensors[tid].alloc_op != BEFORE_STEP}
    rec.phase = BACKWARD
    phase_starts[BACKWARD] = len(rec.ops)
    _backward(loss)
    return activations


def _check_loss(loss) -> None:
    import torch

    if not isinstance(loss, torch.Tensor):
        raise PlannerError(f"the loss must be a scalar tensor, got {type(loss).__name__}; "
                           f"make loss_fn return a tensor")
    if loss.numel() != 1:
        raise PlannerError(
            f"the loss must be a scalar, got a tensor of shape {tuple(loss.shape)}; reduce it "
            f"in loss_fn, e.g. loss_fn=lambda out: out.float().mean()")
    if not loss.requires_grad:
        raise PlannerError("the loss does not depend on any parameter that requires grad, so "
                           "there is no backward pass to trace; check that the model has "
                           "trainable parameters and that loss_fn uses the model's output")


def _signature_hint(model) -> str:
    try:
        return f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError):
        return f"{type(model).__name__}.forward"


def _describe_inputs(args) -> str:
    import torch

    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"tensor{tuple(a.shape)} {str(a.dtype).replace('torch.', '')}")
        else:
            parts.append(type(a).__name__)
    return "(" + ", ".join(parts) + ")"


def _untraceable(rec: _Recorder, exc: Exception, model, args) -> UntraceableError:
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException)

    if rec.error is not None:
        err, op, module, phase, shapes = rec.error
    else:
        module = (rec.unwound[1] if rec.unwound is not None and _in_chain(rec.unwound[0], exc)
                  else rec.module_now())
        err, op, phase, shapes = exc, None, rec.phase, []
    where = ("code outside the model (the loss function?)" if module == OUTSIDE else
             f"module '{module}'" if module else "the model's own forward (top level)")
    value_dependent = isinstance(err, (DataDependentOutputException, DynamicOutputShapeException))
    if not value_dependent:
        try:
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
            value_dependent = isinstance(err, GuardOnDataDependentSymNode)
        except ImportError:  # pragma: no cover - older torch
            pass
    if not value_dependent and "FakeTensor(" in str(err):
        # A tensor's value used as a Python value: formatted into a key (Switch
        # Transformers' f"expert_{idx[0]}"), compared, hashed.
        return UntraceableError(
            f"cannot trace the {phase} pass: {where} uses the value of a tensor as a Python "
            f"value ({type(err).__name__}: {err}). {_VALUE_HINT}")
    if value_dependent:
        # The line of the model's code that asked (the op's own traceback ends in dispatch),
        # else the line of the library code that did (a torch module's own forward).
        line = _raising_line(exc, _module_at(model, module), own_only=True)
        at = f" Asked for by the model's code{line}." if line else ""
        if not line and _library_line(exc):
            at = f" Asked for by library code{_library_line(exc)}."
        known = _known_value_cause(exc, _module_at(model, module))
        if known:
            return UntraceableError(f"cannot trace the {phase} pass: op {op} in {where} needs "
                                    f"the value of a tensor.{at} {known}")
        if op == "aten._pack_padded_sequence.default":
            return UntraceableError(
                f"cannot trace the {phase} pass: {where} packs a padded batch "
                f"(torch.nn.utils.rnn.pack_padded_sequence), whose packed size is the sum of "
                f"the lengths' values, which fake tensors do not have, even where the lengths "
                f"are a list.{at} Packed RNNs cannot be traced yet: run the RNN on the padded "
                f"batch (its memory is the padded batch's, an upper bound) to trace it.")
        return UntraceableError(
            f"cannot trace the {phase} pass: op {op} in {where} needs the value of a tensor "
            f"({type(err).__name__}: {err}).{at} {_value_hint(op, rec.nonzero_density)}")
    if phase == FORWARD and op is not None:
        return UntraceableError(
            f"the forward pass failed at op {op} in {where}, on operands of shapes {shapes}: "
            f"{err}. Check that the inputs fit the model: it was called with "
            f"{_describe_inputs(args)}, and expects {_signature_hint(model)}.")
    if phase == FORWARD and isinstance(err, TypeError):
        return UntraceableError(
            f"the inputs do not fit {_signature_hint(model)} ({err}); it was called with "
            f"{_describe_inputs(args)}. Pass inputs as a tuple of positional arguments.")
    at = f"op {op} in " if op else ""
    line = "" if op else _raising_line(err, _module_at(model, module))
    if phase == OPTIMIZER and module == OUTSIDE:
        return UntraceableError(f"the optimizer's step failed{' at op ' + op if op else ''}"
                                f"{line}: {type(err).__name__}: {err}")
    return UntraceableError(f"the {phase} pass failed at {at}{where}{line}: "
                            f"{type(err).__name__}: {err}")


# Ops trace(nonzero_density=) sizes (_at_density): a mask's true elements.
_DENSITY_OPS = ("aten.nonzero", "aten.argwhere", "aten.masked_select", "aten.index.Tensor",
                "aten.index_put", "aten._index_put_impl_")


def _value_hint(op: str | None, density) -> str:
    """What to do about an op that needs a tensor's value: nonzero_density= where it sizes
    that op and was not given, else the general advice alone."""
    if op is None or op.startswith("aten._local_scalar_dense") or op.startswith(_DENSITY_OPS):
        if density is None or op is None or not op.startswith(_DENSITY_OPS):
            return _VALUE_HINT
    general = _VALUE_HINT[:_VALUE_HINT.index(" For `torch.nonzero`")]
    return (f"{general} nonzero_density= does not size {op}: its output's size depends on the "
            f"values themselves (how many are distinct, their counts or repeats), not on a "
            f"share of a mask.")


def _library_line(exc: BaseException) -> str:
    """The innermost frame of library code (a torch module's forward, torch.distributions)
    under which an op needed a value, as ' (file:line, in f)': not torch's dispatch and fake
    tensor machinery, nor the planner's own."""
    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    ours = os.path.dirname(os.path.dirname(__file__)) + os.sep
    machinery = tuple(torch_dir + d for d in ("_", "utils" + os.sep + "_", "fx" + os.sep))
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith(machinery) and not name.startswith(ours):
            found = f" ({name}:{tb.tb_lineno}, in {tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    return found


def _known_value_cause(exc: BaseException, module) -> str:
    """Settings of PyTorch's own code that read tensor values, and how to trace without them."""
    import torch

    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.momentum is None:
        return (f"{type(module).__name__}(momentum=None) takes a cumulative average, whose "
                f"factor it reads from num_batches_tracked.item(). Trace with a momentum set "
                f"(0.1 is the default): the memory of the step is the same.")
    tb = exc.__traceback__
    while tb is not None:
        if f"{os.sep}distributions{os.sep}" in tb.tb_frame.f_code.co_filename:
            return ("torch.distributions checks its arguments' values (validate_args), which "
                    "fake tensors do not have: pass validate_args=False to the distribution, "
                    "or call torch.distributions.Distribution.set_default_validate_args(False) "
                    "before tracing; the step's memory is the same but for the checks' small "
                    "temporaries.")
        tb = tb.tb_next
    return ""


def _in_chain(cause: tuple, exc: BaseException) -> bool:
    """Whether `exc` is the exception `cause` names (its id and type) or was raised from it
    (explicitly or while handling it). `exc` and its chain are alive, so their ids are theirs."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if (id(exc), type(exc)) == cause:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _module_at(model, path: str):
    if path == OUTSIDE:
        return None
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def _raising_line(err: BaseException, module, own_only: bool = False) -> str:
    """Where Python code (not an op) raised, as ' (file:line, in f)': the innermost frame
    of a method of the failing module (its forward, or what the forward called; not
    nn.Module's own, such as __getattr__), else the innermost frame ("" with own_only)."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    if not frames:
        return ""
    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    own = [f for f in frames if module is not None and f[0].f_locals.get("self") is module
           and not f[0].f_code.co_filename.startswith(torch_dir)]
    if own_only and not own:
        return ""
    frame, lineno = (own or frames)[-1]
    return f" ({frame.f_code.co_filename}:{lineno}, in {frame.f_code.co_name})"


def capture(model, inputs: tuple, *, loss_fn=None, optimizer=None, profile: DeviceProfile,
            autocast=None, train: bool = True, progress: Callable | None = None,
            probe_limit: int = 0, grads_present: bool = False,
            grad_scaler: bool = False, nonzero_density: float | None = None) -> StepGraph:
    """Run one training step of `model` on fake copies of its state and record it.

    ``grads_present``: gradients already exist when the step starts, as in every
    micro-step of gradient accumulation after the first; backward adds into them.
    ``grad_scaler``: the step of ``torch.amp.GradScaler`` (fp16 training): the loss is
    scaled, gradients are unscaled and checked for infs before the optimizer step, and
    the scale is updated, on the scaler's own tensors.

    ``nonzero_density``: see :func:`pymemplan.trace`.

    ``probe_limit`` > 0 (CPU target only): measure kernel scratch (probe.py) of op
    signatures whose tensors fit in that many bytes."""
    # The forward's Python side effects (state made lazily, counters) are undone after it.
    with kept_as_it_was(model), function_caches_kept(), eager_paths(), _fake_kernel_log_quiet():
        run = functools.partial(
            _capture, model, inputs, loss_fn=loss_fn, optimizer=optimizer, profile=profile,
            autocast=autocast, train=train, progress=progress, probe_limit=probe_limit,
            grads_present=grads_present, grad_scaler=grad_scaler,
            nonzero_density=nonzero_density)
        held = HeldTensors(model)
        rebound: dict = {}
        graph = run(held=held, rebound=rebound)
        if held.left or rebound:
            # The step left tensors in its modules (a hook's self.activation = o.detach()),
            # or buffers of another shape or dtype (a hidden state of this batch), which
            # every step after it finds there until its forward replaces them: traced again
            # from there, as the model had not run before. (kept_as_it_was puts the real
            # ones back.)
            import torch

            held.stand_in()
            stand_ins: dict = {}
            for name, now in rebound.items():
                owner, _, leaf = name.rpartition(".")
                meta = stand_ins.setdefault(id(now), torch.empty_strided(
                    tuple(now.shape), tuple(now.stride()), dtype=now.dtype, device="meta"))
                model.get_submodule(owner)._buffers[leaf] = meta
            graph = run(held=HeldTensors(model))
        return graph


@contextlib.contextmanager
def _fake_kernel_log_quiet():
    """FakeTensorMode logs a fake kernel's refusal (a model's dtype error, say) with its whole
    traceback at error level before raising it; the planner's own error says the same, with
    the op, the module and the operands' shapes, so the log is held back while tracing."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _capture(model, inputs, *, loss_fn, optimizer, profile, autocast, train, progress,
             probe_limit, grads_present, grad_scaler, nonzero_density,
             held: HeldTensors | None = None,
             rebound: dict | None = None) -> StepGraph:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils import _pytree as pytree

    from .probe import ProbeSet

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    probes = ProbeSet(probe_limit) if probe_limit > 0 else None
    rec = _Recorder(profile, fake_mode, progress, probes)
    rec.nonzero_density = nonzero_density
    modes = {m: m.training for m in model.modules()}
    hooks = []
    held = held if held is not None else HeldTensors(model)
    try:
        with fake_mode:
            fake_of: dict[int, Any] = {}      # id(real tensor) -> fake; keeps weight ties
            state: dict[str, Any] = {}
            names: dict[int, str] = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                if id(p) not in fake_of:
                    fake_of[id(p)] = _fake_like(p, p.requires_grad)
                    names[id(p)] = name
                state[name] = fake_of[id(p)]
            for name, b in model.named_buffers(remove_duplicate=False):
                if id(b) not in fake_of:
                    fake_of[id(b)] = _fake_like(b, False)
                    names[id(b)] = name
                state[name] = fake_of[id(b)]
            fake_args = pytree.tree_map_only(
                torch.Tensor, lambda t: _fake_like(t, t.requires_grad), tuple(inputs))
            note_real_inputs(pytree.tree_leaves(fake_args), pytree.tree_leaves(tuple(inputs)))
            # Parameters of an optimizer instance that are not the model's (a loss module's,
            # a learnable temperature): trained in the step as the model's are, with their
            # gradients and state; the loss reads their copies (copy_of).
            outside = []
            if isinstance(optimizer, torch.optim.Optimizer):
                for gi, g in enumerate(optimizer.param_groups):
                    for j, p in enumerate(g["params"]):
                        if id(p) not in fake_of:
                            fake_of[id(p)] = _fake_like(p, p.requires_grad)
                            names[id(p)] = f"optimizer.param_groups[{gi}][{j}]"
                            outside.append(p)

            params = [fake_of[id(p)] for p in (*model.parameters(), *outside) if p.requires_grad]
            opt = None
            if optimizer is not None:
                opt = _make_optimizer(optimizer, params, fake_of, profile)
            if grads_present:
                for f in params:
                    f.grad = torch.zeros_like(f)
            scaler = _ScalerState() if grad_scaler else None

        # The optimizer's scalar state after its first and second steps (_ScalarShadow).
        shadow_scalars = {n: _shadow_scalars(opt, n) if opt is not None else {}
                          for n in (1, _STEADY_STEP)}
        # What exists when the step starts.
        rec.known_real = real_storages((*model.parameters(), *model.buffers(), *outside,
                                        *pytree.tree_leaves(tuple(inputs))))
        for p in model.parameters():
            rec.register(fake_of[id(p)], PARAMETER, names[id(p)])
            rec.param_module[id(fake_of[id(p)])] = names[id(p)].rpartition(".")[0]
        for p in outside:
            rec.register(fake_of[id(p)], PARAMETER, names[id(p)])
            rec.param_module[id(fake_of[id(p)])] = OUTSIDE
        # Code outside the model's forward (the loss, the optimizer's step) that reaches these
        # real tensors reads their copies, and real leaves that require grad are copied.
        for p in (*model.parameters(), *model.buffers(), *outside):
            rec.add_copy(p, fake_of[id(p)])
        for a, f in zip(pytree.tree_leaves(tuple(inputs)), pytree.tree_leaves(fake_args)):
            if isinstance(a, torch.Tensor):
                rec.add_copy(a, f)
        rec.copy_leaves = True
        for b in model.buffers():
            rec.register(fake_of[id(b)], BUFFER, names[id(b)])
        # Tensors modules keep in plain attributes (a hook's self.activation = o.detach()):
        # there when the step starts, each until the forward rebinds it and drops the copy
        # the module holds meanwhile.
        with fake_mode:
            for name, f in held.swap(_held_copies(rec.known_real)):
                rec.register(f, BUFFER, name)
            f = None  # the module's reference is the only one
        pnames = {id(f): names[rid] for rid, f in fake_of.items() if rid in names}
        if grads_present:
            for f in params:
                rec.register(f.grad, GRADIENT, f"{pnames[id(f)]}.grad")
        for i, a in enumerate(pytree.tree_leaves(fake_args)):
            if isinstance(a, torch.Tensor):
                rec.register(a, INPUT, f"inputs[{i}]")
        if scaler is not None:
            rec.register(scaler.scale, OPTIMIZER_STATE, "grad_scaler.scale")
            rec.register(scaler.growth_tracker, OPTIMIZER_STATE, "grad_scaler.growth_tracker")

        state_mark = rec.seq

        def register_state():
            # Made by the first step (after backward, see _first_optimizer_step), but there
            # before the traced step starts: registered as existing from its start, and
            # ordered among what exists then as if registered now (after the inputs).
            first_new = len(rec.tensors)
            for p, st in opt.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        if state_on_device(opt, k, v, profile):
                            rec.register(v, OPTIMIZER_STATE, f"{pnames.get(id(p), '?')}.{k}")
                        else:
                            rec.register_host(v)
            made = rec.tensors[first_new:]
            for i, info in enumerate(made):
                info.alloc_seq = state_mark + (i + 1) / (len(made) + 1)

        def enter(name):
            def hook(_module, _args):
                rec.enter_module(name)  # returns None: the inputs stay as they are
            return hook

        def leave(_module, _args, _output):
            # Called while an exception propagates too (always_call): then, inside
            # nn.Module's `except` clause, sys.exc_info() holds it.
            exc = sys.exc_info()[1]
            if exc is not None and (rec.unwound is None or rec.unwound[0] != (id(exc), type(exc))):
                rec.unwound = ((id(exc), type(exc)), rec.module_stack[-1])
            del exc
            rec.leave_module()  # returns None: the output stays as it is

        scripted = [name or "the model" for name, m in model.named_modules()
                    if isinstance(m, torch.jit.ScriptModule)]
        if scripted:
            raise PlannerError(
                f"{scripted[0]!r} is a TorchScript module (torch.jit.script/trace), whose "
                f"ops run inside TorchScript where the tracer cannot see or attribute them; "
                f"trace the eager module it was made from instead")
        for mname, m in model.named_modules():
            hooks.append(m.register_forward_pre_hook(enter(mname)))
            hooks.append(m.register_forward_hook(leave, always_call=True))
        if train:
            model.train()

        phase_starts = {}
        activations: set[int] = set()
        # Gradients that exist before the step (grads_present): one that backward does not
        # add into belongs to a parameter the step does not train.
        grad_versions = {id(f): (f.grad, f.grad._version) for f in params if f.grad is not None}
        amp = (torch.autocast("cpu", dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        # On a CUDA target the CPU's autocast casts as CUDA's (the whole step: activation
        # checkpointing runs forward again, under autocast, in backward).
        cuda_amp = autocast_for_target(profile, autocast)
        try:
            with fake_mode, _dispatch_mode(rec), _function_mode(rec, kernel_overrides(profile)), \
                    rng_states_recorded(rec, profile), conversions_in_forward(model), cuda_amp:
                # The fake state stays in place through backward, not just the forward
                # (as functional_call would): activation checkpointing re-runs modules'
                # forward during backward.
                with _reparametrize_module(model, state, tie_weights=True):
                    phase_starts[FORWARD] = len(rec.ops)
                    with amp:
                        out = model(*fake_args)
                        loss = _to_loss(out, loss_fn)
                    del out
                    _check_loss(loss)
                    if scaler is not None:
                        loss = scaler.scale_loss(loss)
                    activations = backward_phase(rec, loss, phase_starts)
                    del loss
            if opt is not None:
                rec.phase = OPTIMIZER  # its first step, which makes the state, fails as one
                trained = _trained(rec, params, grad_versions)
                with fake_mode:
                    first = _first_optimizer_step(opt, profile, fake_mode, trained,
                                                  shadow_scalars[1], rec)
                register_state()
            with fake_mode, _dispatch_mode(rec), _function_mode(rec, kernel_overrides(profile)):
                if opt is not None:
                    rec.phase = OPTIMIZER
                    phase_starts[OPTIMIZER] = len(rec.ops)
                    if scaler is not None:
                        scaler.unscale([f.grad for f in params if f.grad is not None])
                    step_ops = len(rec.ops)
                    rec.scalar_value = _ScalarShadow(opt, shadow_scalars[_STEADY_STEP])
                    opt.step()
                    step_span = (step_ops, len(rec.ops))
                    if scaler is not None:
                        scaler.update()
        except PlannerError:
            raise
        except Exception as e:
            raise _untraceable(rec, e, model, tuple(inputs)) from e

        if rebound is not None:
            # Buffers the step rebound to a tensor of another shape or dtype (a hidden
            # state kept across steps, of this batch): _reparametrize_module left the new
            # ones in `state`.
            for name, b in model.named_buffers(remove_duplicate=False):
                now = state.get(name)
                if (isinstance(now, torch.Tensor) and now is not fake_of[id(b)]
                        and (now.shape != b.shape or now.dtype != b.dtype)):
                    rebound[name] = now
        grads = set()
        for f in params:
            if f.grad is not None:
                tid = rec.live.get(_storage_key(f.grad))
                if tid is not None:
                    grads.add(tid)
        first_step = (_first_step_events(first, rec, opt, profile, step_span)
                      if opt is not None else None)
        probe_stats = finish_recording(rec, probes, progress, activations, grads)
        return StepGraph(ops=rec.ops, tensors=rec.tensors, device=profile.name,
                         phase_starts=phase_starts, first_optimizer_step=first_step,
                         op_calls=rec.op_calls, op_reads=rec.op_reads,
                         meta={"model": type(model).__name__, "train": train,
                               "optimizer": type(opt).__name__ if opt is not None else None,
                               "foreach": (opt.param_groups[0].get("foreach")
                                           if opt is not None else None),
                               "autocast": str(autocast).replace("torch.", "") if autocast else None,
                               "grads_present": grads_present,
                               "nonzero_density": nonzero_density,
                               # Modules the forward called more than once (a shared layer).
                               "module_calls": {k: v for k, v in rec.module_calls.items() if v > 1},
                               "inputs": _describe_inputs(tuple(inputs)),
                               "kernel_scratch_probe": probe_stats,
                               "torch_version": torch.__version__})
    finally:
        rec.close()
        rec.restore_reals()
        held.restore(made_in_step=_made_by(rec))
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
