"""Kernel scratch: memory a kernel allocates and frees *inside* one op.

Fake tensors see an op's inputs and outputs, never the buffers its kernel takes from the
allocator while it runs. Most kernels take none; some take a lot. On the CPU, oneDNN
convolution copies input, weight and output into its own blocked layouts (each as large
as the tensor itself) and batch-norm backward keeps a full-size buffer; which ops do
this, and how much, depends on the library build and on the machine's instruction set.

So the planner measures instead of guessing: when the target device is this machine's
CPU, every distinct op signature of the step (op, shapes, strides, dtypes, arguments) is
run once on real zero-filled tensors under the allocation recorder
(:class:`pymemplan.traces.record`). The op's scratch is the highest rise of the
allocator's total during the op minus what is still allocated when it returns (its
outputs). That is exact for this machine and needs no list of ops. Signatures whose
tensors would need more than ``limit`` bytes are not run (their scratch counts as 0 and
the trace says how many were skipped). Nor are ops that take a buffer an earlier kernel
filled for them (an argument named ``workspace`` or ``reserve``: the backward of an RNN
layer reads its forward's workspace as an opaque structure) on a zero-filled one: the
fake trace cannot describe such a buffer (it is often empty there), and a kernel run on it
can corrupt memory (``mkldnn_rnn_layer_backward`` on the CPU does). Such an op is probed
*chained* instead: the op that made the buffer is run first, on zeros, and its real output
is what the op reads (an RNN layer's backward gets the workspace of a real forward of the
same shapes). One whose buffer no probed op made is not run.

A CUDA target cannot be probed without a GPU: cuDNN and cuBLAS workspaces are a
documented gap of the CUDA prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class _Unprobeable(Exception):
    pass


def _leaf_key(x):
    import torch

    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset(),
                x.untyped_storage().nbytes())
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device,
                                   torch.memory_format, torch.layout)):
        return ("V", type(x).__name__, x)
    raise _Unprobeable(type(x).__name__)


_OPAQUE = frozenset({"workspace", "reserve", "reserveSpace"})


def _reads_opaque_buffer(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.name in _OPAQUE for a in schema.arguments)


def _opaque_arguments(func, args, kwargs) -> list:
    """The tensors passed to ``func`` as workspace-like arguments."""
    import torch

    found = []
    for i, a in enumerate(func._schema.arguments):
        if a.name not in _OPAQUE:
            continue
        v = args[i] if i < len(args) else (kwargs or {}).get(a.name)
        if isinstance(v, torch.Tensor):
            found.append(v)
    return found


def _storage_id(t) -> int:
    return t.untyped_storage()._cdata  # as capture's storage keys: stable while it lives


# Kernels whose scratch depends on the values, and whose zeros take a path real data does
# not: the matrix exponential picks its Taylor degree from the input's norm, and on zeros
# its cheapest one (a third of the scratch at 1024 x 1024). Probed on random normal values.
_VALUE_SENSITIVE = frozenset({"aten.linalg_matrix_exp.default"})
# Kernels that return early on a mask with no true element, before the buffers they take for
# true ones (masked_scatter's and masked_select's prefix sums of the mask, as int64): probed
# with every mask element true. Their outputs do not depend on the mask's values.
_MASK_SENSITIVE = frozenset({"aten.masked_scatter.default", "aten.masked_scatter_.default",
                             "aten.masked_scatter_backward.default"})


def _true_mask(func, args) -> tuple:
    """The arguments of a _MASK_SENSITIVE op with a mask whose leading elements are true, as
    many as its source has (masked_scatter needs one per true element; its backward selects
    as many): a new contiguous mask, where the signature's may be a view (an expanded one)."""
    import torch

    import math

    mask, source = args[1], args[2]
    # masked_scatter_backward(grad, mask, sizes): `sizes` is the source's shape
    n = min(mask.numel(), math.prod(source) if isinstance(source, (list, tuple)) else source.numel())
    true = torch.zeros(mask.shape, dtype=torch.bool)
    true.view(-1)[:n] = True
    return (args[0], true, *args[2:])


def _valid_pivots(func, args) -> tuple:
    """Pivots of an LU factorization (``linalg_lu_solve``, ``lu_unpack``) that the kernel
    accepts: on zeros it refuses to run ("Pivots given to lu_solve must all be greater or
    equal to 1"), and its scratch went uncounted. No row swaps (1, 2, ..., n)."""
    import torch

    schema = getattr(func, "_schema", None)
    if schema is None:
        return args
    out = list(args)
    for i, a in enumerate(schema.arguments[:len(out)]):
        t = out[i]
        if a.name in ("pivots", "LU_pivots") and isinstance(t, torch.Tensor) and t.dim() > 0:
            n = t.shape[-1]
            out[i] = torch.arange(1, n + 1, dtype=t.dtype).expand(t.shape).contiguous()
    return tuple(out)


def _zeros_like_key(k):
    import torch

    _, shape, stride, dtype, offset, nbytes = k
    base = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), offset, shape, stride)


@dataclass
class ProbeSet:
    """Distinct op signatures seen during capture, and the ops that share each."""

    limit: int
    signatures: dict = field(default_factory=dict)   # key -> (func, spec, leaf keys, bytes)
    ops: dict = field(default_factory=dict)          # key -> [op index, ...]
    unprobeable: int = 0
    opaque_buffers: int = 0  # ops not run: they read a workspace an earlier kernel filled
    outputs: dict = field(default_factory=dict)      # op index -> add()'s outputs
    grown: dict = field(default_factory=dict)        # tensor id -> real bytes (measure())
    # Storage of a tensor output -> (signature that made it, its index among the op's
    # tensor outputs): where an op reading it as a workspace gets the real one from.
    made_by: dict = field(default_factory=dict)
    chained: dict = field(default_factory=dict)      # key -> ((leaf, producer, output), ...)

    def add(self, index: int, func, args, kwargs, out_bytes: int, outputs=(),
            out=None) -> None:
        """``outputs``: per tensor output of the op, in order, ``(tensor id, bytes)`` of
        the storage it made under fake tensors (None for one it did not make); ``out``:
        the op's result."""
        import torch
        from torch.utils import _pytree as pytree

        if getattr(func, "is_view", False):
            return  # views allocate nothing
        leaves, spec = pytree.tree_flatten((args, kwargs or {}))
        chain = ()
        if _reads_opaque_buffer(func):
            # Probed after the op that made each such buffer, on its real output.
            links = []
            for t in _opaque_arguments(func, args, kwargs):
                made = self.made_by.get(_storage_id(t))
                leaf = next((i for i, x in enumerate(leaves) if x is t), None)
                if made is None or leaf is None:
                    self.opaque_buffers += 1
                    return
                links.append((leaf, *made))
            chain = tuple(links)
        try:
            keys = tuple(_leaf_key(x) for x in leaves)
        except _Unprobeable:
            self.unprobeable += 1
            return
        # Kernels may read grad mode (an RNN layer keeps its workspace only with grad on):
        # each signature runs under the mode it ran in during the step.
        key = (func, str(spec), keys, torch.is_grad_enabled(), chain)
        if key not in self.signatures:
            need = out_bytes + sum(k[5] for k in keys if k[0] == "T")
            self.signatures[key] = (func, spec, keys, need)
        self.ops.setdefault(key, []).append(index)
        self.outputs[index] = list(outputs)
        if out is not None:
            real = [o for o in pytree.tree_leaves(out, is_leaf=lambda x: x is None)
                    if o is None or isinstance(o, torch.Tensor)]
            for n, o in enumerate(real):
                if o is not None:
                    self.made_by[_storage_id(o)] = (key, n)

    def _leaves(self, keys) -> list:
        return [_zeros_like_key(k) if k[0] == "T" else k[2] for k in keys]

    def _run(self, key, leaves):
        import torch
        from torch.utils import _pytree as pytree

        func, spec, _, _ = self.signatures[key]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        with torch.set_grad_enabled(key[3]):
            return func(*args, **kwargs)

    def _chained_inputs(self, key, leaves) -> None:
        """Puts the real buffers a chained signature reads into its leaves, running the
        ops that make them (on zeros)."""
        import torch
        from torch.utils import _pytree as pytree

        for leaf, producer, n in key[4]:
            if producer[4]:
                raise _Unprobeable("a buffer made by an op that itself reads one")
            made = self._run(producer, self._leaves(self.signatures[producer][2]))
            outs = [o for o in pytree.tree_leaves(made, is_leaf=lambda x: x is None)
                    if o is None or isinstance(o, torch.Tensor)]
            leaves[leaf] = outs[n]

    def measure(self, progress=None) -> tuple[dict[int, int], dict]:
        """Run each signature once; return ({op index: scratch bytes}, statistics)."""
        import torch
        from torch.utils import _pytree as pytree

        from ..traces import record

        scratch: dict[int, int] = {}
        stats = {"signatures": len(self.signatures), "probed": 0, "skipped_over_limit": 0,
                 "failed": 0, "unprobeable_ops": self.unprobeable,
                 "opaque_buffer_ops": self.opaque_buffers, "chained": 0,
                 "ops_with_scratch": 0}
        for n, (key, (func, spec, keys, need)) in enumerate(self.signatures.items()):
            if need > self.limit:
                stats["skipped_over_limit"] += 1
                continue
            leaves = self._leaves(keys)  # zeros: valid as indices, harmless as values
            if str(func) in _VALUE_SENSITIVE:
                gen = torch.Generator().manual_seed(0)
                for leaf in leaves:
                    if isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point:
                        leaf.normal_(generator=gen)
            try:
                if key[4]:
                    self._chained_inputs(key, leaves)
                    stats["chained"] += 1
                args, kwargs = pytree.tree_unflatten(leaves, spec)
                if str(func) in _MASK_SENSITIVE:
                    args = _true_mask(func, args)
                args = _valid_pivots(func, args)
                with torch.set_grad_enabled(key[3]), record(device="cpu", name=str(func)) as rec:
                    out = func(*args, **kwargs)
            except Exception:  # an op that cannot run on zeros (e.g. needs a positive size)
                stats["failed"] += 1
                continue
            # A real output larger than the fake one (a kernel's workspace, which fake
            # tensors leave empty) is taken at its real size. A ZeroTensor's reports a size
            # but holds nothing.
            real = [o.untyped_storage().nbytes()
                    if isinstance(o, torch.Tensor) and not o._is_zerotensor() else 0
                    for o in pytree.tree_leaves(out, is_leaf=lambda x: x is None)
                    if o is None or isinstance(o, torch.Tensor)]
            del out
            for i in self.ops[key]:
                for made, nbytes in zip(self.outputs.get(i, ()), real):
                    if made is not None and nbytes > made[1]:
                        self.grown[made[0]] = nbytes
            m = rec.trace.meta
            ws = (m["peak_total_allocated"] - m["final_total_allocated"]) if m.get("events") else 0
            stats["probed"] += 1
            if ws > 0:
                stats["ops_with_scratch"] += len(self.ops[key])
                for i in self.ops[key]:
                    scratch[i] = ws
            if progress is not None and n % 50 == 0:
                progress("probing kernels", n)
        return scratch, stats
