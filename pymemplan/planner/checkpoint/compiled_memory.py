"""The compiled step's memory, predicted from its partitioned forward and backward graphs.

A compiled training step runs the forward graph, the loss (eagerly, outside the model),
then the backward graph. Inductor turns each graph into kernels; each kernel's buffers
are allocated where it runs and freed after the last kernel that reads them. This
module walks the two graphs' kernels (:class:`GraphMemory`) with a model of what
Inductor makes of the FX nodes:

- a view (or an item of a multi-output op) shares its base's storage;
- an extern kernel (matmul, convolution, attention, an op with no lowering) writes a
  buffer, and so do reductions and scatters; the values an extern kernel reads are
  materialised;
- a pointwise op is computed inline in the kernels that read it, with no buffer, and
  the buffers it reads stay live until those kernels run; unless it is a graph output,
  an extern kernel reads it, Inductor's reuse heuristics realise it, or a pooling or
  nearest-upsampling op reads it (their lowerings' ``realize_hint``); random values
  are always a buffer (their lowering realises them), which a dropout the backward
  recomputes keeps from the recomputed forward to the dropout's backward;
- pointwise and reduction kernels between two extern kernels that share a buffer are
  fused, and a buffer used only inside one kernel is never allocated;
- ``add(x, mm(a, b))`` becomes ``addmm`` (Inductor's post-grad pattern);
- a pointwise kernel writes in place into a same-size buffer it reads last;
- a freed buffer may be held for a later allocation of its size (the wrapper's reuse
  pool, :meth:`GraphMemory._pool`);
- with convolutions, the layout optimisation's channels-last copies of weights and
  input, and the extern kernels' scratch (measured: :func:`extern_scratch`).

The rest of the step comes from the eager step's trace (:class:`EagerFrame`): what is
live before the forward (parameters, inputs), and what the loss adds and frees between
the forward and the backward. The forward's saved storages live from where the forward
writes them to their last read in the backward; the backward's outputs (the gradients)
stay. :func:`predict_step` puts the three parts together.
"""

from __future__ import annotations

import operator

# Inductor's reuse heuristic (ir.StorageBox.should_realize_on_reuse): on CPU, a value read
# by several kernels is materialised once if computing it involves one of these ops.
HEAVY_OPS = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}
REUSE_READS = 4     # torch._inductor.config.realize_reads_threshold
MAX_ACC_READS = 12  # torch._inductor.config.realize_cpu_acc_reads_threshold


def _op_name(node) -> str:
    import torch

    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return getattr(t, "__name__", str(t))


def _val(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


def _nbytes(v) -> int:
    try:
        return int(v.untyped_storage().nbytes())
    except Exception:  # no storage to ask (e.g. a sparse or opaque value)
        return int(v.numel() * v.element_size())


def _is_view(node) -> bool:
    import torch

    t = node.target
    if t is operator.getitem:
        return False
    return isinstance(t, torch._ops.OpOverload) and (
        t.is_view or t.overloadpacket.__name__ in ("_unsafe_view", "alias", "view", "reshape"))


# Reductions Inductor fuses with their producer or consumer as one loop nest.
SINKABLE = {"sum", "mean", "amax", "amin", "max", "min", "prod", "any", "all", "var_mean",
            "var", "std", "logsumexp"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var_mean",
               "var", "std", "prod", "any", "all", "logsumexp", "_softmax", "_log_softmax",
               "native_layer_norm", "native_layer_norm_backward", "native_batch_norm",
               "native_batch_norm_backward", "_native_batch_norm_legit_functional",
               "_native_batch_norm_legit_no_training", "cumsum", "sort", "topk"}


# Multi-output reductions: each output is a reduction's buffer (a layer norm's
# statistics, which its backward reads again when it recomputes the forward).
MULTI_REDUCTIONS = {"var_mean", "max", "min", "aminmax"}

# Pointwise ops whose lowering realizes the result (lowering.py: ``result.realize()``):
# random values are computed once, so that each kernel reading them sees the same ones.
# Read only inside one fused kernel they are never allocated; a dropout recomputed in
# the backward keeps them from the recomputed forward to the dropout's backward.
REALIZED = {"inductor_random", "searchsorted", "bucketize"}


# Graph inputs Inductor's memory estimate leaves out (utils.is_nonfreeable_buffers).
NONFREEABLE = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")

# Ops whose lowering calls ``realize_hint()`` on their first argument (pooling and
# nearest upsampling, forward and backward: they read each element several times); a
# pointwise value computed from more than one buffer is then materialised
# (StorageBox.realize_hint).
HINT_REALIZE = {"_low_memory_max_pool_with_offsets", "max_pool2d_with_indices",
                "max_pool3d_with_indices", "max_pool2d_with_indices_backward",
                "_adaptive_avg_pool2d", "adaptive_max_pool2d", "fractional_max_pool2d",
                "fractional_max_pool3d", "avg_pool2d", "avg_pool3d", "avg_pool2d_backward",
                "avg_pool3d_backward", "upsample_nearest1d", "upsample_nearest2d",
                "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                "_upsample_nearest_exact3d", "upsample_nearest2d_backward"}


# Ops Inductor runs as extern kernels (a library call writing a buffer of its own): the
# matmuls and convolutions it tunes; any op it has no lowering for (a fallback) too.
EXTERN = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_int_mm",
          "_scaled_mm", "convolution", "_convolution", "convolution_backward",
          "_convolution_pointwise", "_linear_pointwise", "_mkl_linear"}
# Of those, the ones Inductor calls with an ``out=`` buffer its wrapper allocates
# (ExternKernelOut); ``add`` is an ``add(x, mm(a, b))`` it runs as ``addmm``.
OUT_VARIANTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "add"}


def _extern(node, lowerings, fallbacks) -> bool:
    import torch

    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return True
    name = _op_name(node)
    return (name in EXTERN or "scaled_dot_product" in name or "flash_attention" in name
            or t in fallbacks or (t not in lowerings and t.overloadpacket not in lowerings))


def _kind(node, lowerings, fallbacks) -> str:
    """"item" (an output of an extern multi-output op), "multi" (that op), "view",
    "extern", "reduction" (an output of a multi-output reduction too) or "pointwise"
    (outputs of other lowered multi-output ops too)."""
    if node.target is operator.getitem:
        parent = node.args[0]
        if _extern(parent, lowerings, fallbacks):
            return "item"
        return "reduction" if _op_name(parent) in MULTI_REDUCTIONS else "pointwise"
    if _is_view(node):
        return "view"
    if _extern(node, lowerings, fallbacks):
        return "multi" if isinstance(_val(node), (tuple, list)) else "extern"
    name = _op_name(node)
    if (name in _REDUCTIONS or name in REALIZED or "scatter" in name or "index_put" in name
            or name in ("index_add", "index_reduce", "embedding_dense_backward")) \
            and not isinstance(_val(node), (tuple, list)):
        return "reduction"  # a kernel of its own (a scatter writes a buffer it made)
    return "pointwise"


def _has_conv(nodes) -> bool:
    """Whether the graph holds convolutions (forward or backward) in channels-last."""
    import torch

    return any(nd.op == "call_function" and nd.target in (
        torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
        for nd in nodes)


def _layout_opt(nodes, convs) -> bool:
    """Inductor's GraphLowering.decide_layout_opt for a training graph: on with
    convolutions, always on the CPU with oneDNN, elsewhere unless they are few (one per
    300 nodes or fewer)."""
    import torch

    if not convs:
        return False
    vals = [_val(a) for nd in convs for a in nd.args[:2] if isinstance(a, torch.fx.Node)]
    cpu = all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in vals)
    if cpu and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
        return True
    return len(nodes) < 300 * len(convs)


def _layout_copies(nodes) -> list:
    """Graph inputs Inductor's layout optimisation copies to channels-last: those a
    convolution reads (input or weight) that are 4-d and not channels-last already, in a
    graph with convolutions where Inductor turns it on (GraphLowering.decide_layout_opt:
    always on the CPU with oneDNN; elsewhere unless convolutions are few, one per 300
    nodes or fewer)."""
    import torch

    convs = [nd for nd in nodes if nd.op == "call_function"
             and nd.target is torch.ops.aten.convolution.default]
    if not _layout_opt(nodes, convs):
        return []
    out = []
    for nd in convs:
        for a in nd.args[:2]:
            v = _val(a) if isinstance(a, torch.fx.Node) else None
            if (isinstance(a, torch.fx.Node) and a.op == "placeholder" and a not in out
                    and isinstance(v, torch.Tensor) and v.dim() == 4
                    and not v.is_contiguous(memory_format=torch.channels_last)):
                out.append(a)
    return out


_SCRATCH: dict = {}  # probe signature -> scratch bytes (kernels are the same every call)
SCRATCH_LIMIT = 2 ** 30  # bytes of inputs and outputs above which an extern op is not run


def extern_scratch(node, channels_last: bool) -> int:
    """Bytes an extern kernel allocates and frees inside its call (oneDNN copies its
    convolution operands into blocked layouts, up to twice the weight's size), measured
    by running the op once on zero-filled tensors of the node's shapes under the
    allocation recorder, as ``planner/probe.py`` measures the eager step's ops; 4-d
    operands channels-last where Inductor's layout optimisation makes them so. Only on
    the CPU (0 elsewhere, or above ``SCRATCH_LIMIT``, or when the op cannot run on
    zeros). Cached by signature."""
    import torch
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    keys, need = [], _nbytes(_val(node)) if isinstance(_val(node), torch.Tensor) else 0
    for x in leaves:
        v = _val(x) if isinstance(x, torch.fx.Node) else x
        if isinstance(v, torch.Tensor):
            if v.device.type != "cpu":
                return 0
            cl = channels_last and v.dim() == 4
            keys.append(("T", tuple(v.shape), None if cl else tuple(v.stride()), v.dtype))
            need += v.numel() * v.element_size()
        elif v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device,
                                         torch.memory_format, torch.layout)):
            keys.append(("V", v))
        else:
            return 0
    key = (str(node.target), str(spec), tuple(keys))
    if key in _SCRATCH:
        return _SCRATCH[key]
    ws = 0
    if need <= SCRATCH_LIMIT:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from ...traces import record

        try:
            # Real tensors, even inside the compiler (which traces under a fake mode).
            with unset_fake_temporarily(), torch.no_grad():
                args = [k[1] if k[0] == "V" else
                        torch.empty(k[1], dtype=k[3], memory_format=torch.channels_last).zero_()
                        if k[2] is None else torch.empty_strided(k[1], k[2], dtype=k[3]).zero_()
                        for k in keys]
                a, kw = pytree.tree_unflatten(args, spec)
                with record(device="cpu") as rec:
                    out = node.target(*a, **kw)
                del out, a, kw, args
            m = rec.trace.meta
            if m.get("events"):
                ws = max(int(m["peak_total_allocated"] - m["final_total_allocated"]), 0)
        except Exception:  # an op that cannot run on zeros: no scratch known
            ws = 0
    _SCRATCH[key] = ws
    return ws


def _addmm(nodes, kind) -> None:
    """Inductor's post-grad pattern add(inp, mm(a, b)) -> addmm(inp, a, b): the matmul
    runs once ``inp`` exists, writing into the sum's buffer (a tied embedding's gradient
    is the last one backward makes, so the output gradient the matmul reads stays until
    then). The mm becomes ``inline`` (no buffer of its own), the add an extern kernel."""
    import torch

    aten = torch.ops.aten
    for nd in nodes:
        if nd.op != "call_function" or nd.target is not aten.add.Tensor or nd.kwargs:
            continue
        args = [a for a in nd.args if isinstance(a, torch.fx.Node)]
        if len(args) != 2 or len(nd.args) != 2:
            continue
        # Inductor tries add(inp, mm) first (registered first): of two matmuls, the
        # second is the one that waits for the first.
        for inp, mm in (args, args[::-1]):
            vm, vi = _val(mm), _val(inp)
            if not (mm.op == "call_function" and mm.target is aten.mm.default
                    and len(mm.users) == 1 and isinstance(vi, torch.Tensor)
                    and isinstance(vm, torch.Tensor) and vi.dtype == vm.dtype):
                continue
            try:
                expandable = torch.broadcast_shapes(vi.shape, vm.shape) == vm.shape
            except RuntimeError:  # shapes that do not broadcast
                expandable = False
            if expandable:
                kind[mm], kind[nd] = "inline", "extern"
                break


def _inductor_tables():
    try:
        import torch._inductor.kernel  # noqa: F401 - registers the matmul/conv lowerings
        from torch._inductor import lowering as L

        return L.lowerings, L.fallbacks, L.needs_realized_inputs
    except Exception:  # no Inductor: every op its own kernel
        return {}, set(), set()


class GraphMemory:
    """One FX graph's buffers as Inductor makes them. ``storage[node]``: the storage a
    tensor value lives in (a node: views map to their base; None for an inlined value
    or a graph input the caller keeps), ``size[storage]`` its bytes; ``kernels`` with
    what each ``writes`` and ``reads``, run in ``order``; ``alloc_at[storage]`` the
    step that writes it, ``free_at[storage]`` the step after which it is freed (None:
    kept, a graph output), ``inplace[storage]`` the step whose kernel takes it over
    (``inplace_into``: the storage it becomes), ``held``/``reused``: Inductor's reuse
    pool (:meth:`_pool`), ``scratch[kernel]`` what an extern kernel allocates inside
    its call.

    ``fused``: Inductor's kernels (False: one per op, as aot_eager runs the graph).
    ``donated``: inputs the graph may write over (saved tensors backward owns).
    ``inputs``: input node -> (storage key, bytes) of the inputs handed over and freed
    after their last reader (the backward's saved tensors and output gradients).
    ``reorder``: see :func:`predict_step`. ``probe``: measure extern kernels' scratch."""

    def __init__(self, gm, fused: bool = True, donated=(), inputs=None, reorder=False,
                 probe=True):
        import torch

        self.reorder, self.fused = reorder, fused

        lowerings, fallbacks, realized_inputs = _inductor_tables()
        nodes = list(gm.graph.nodes)
        self.index = {nd: k for k, nd in enumerate(nodes)}
        self.nodes = nodes
        kind = {}
        for nd in nodes:
            if nd.op == "call_function":
                kind[nd] = _kind(nd, lowerings, fallbacks) if fused else (
                    "item" if nd.target is operator.getitem else
                    "multi" if isinstance(_val(nd), (tuple, list)) else
                    "view" if _is_view(nd) else "extern")
            elif nd.op == "placeholder":
                kind[nd] = "input"
        if fused:
            _addmm(nodes, kind)
        out = next(n for n in reversed(nodes) if n.op == "output")
        outputs = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        self.outputs = [a for a in outputs if isinstance(a, torch.fx.Node)]
        is_out = set(self.outputs)

        # Which pointwise values are materialised: graph outputs (or the base of a view
        # that is one), values an extern kernel reads (through views), and values read by
        # several kernels where Inductor's reuse heuristics realise them.
        real = {nd for nd, k in kind.items() if k in ("extern", "reduction", "item", "input")}
        heavy, reads = {}, {}

        def base(nd):
            while kind.get(nd) == "view":
                nd = nd.args[0]
            return nd

        def realizes(u):  # an extern kernel reads it
            return kind.get(u) == "extern" or u.target in realized_inputs

        for nd in nodes:
            if kind.get(nd) != "pointwise":
                continue
            srcs, hv = set(), _op_name(nd) in HEAVY_OPS
            for a in nd.all_input_nodes:
                b = base(a)
                if b in real or kind.get(b) in (None, "multi"):
                    srcs.add(b)
                else:
                    srcs |= reads.get(b, set())
                    hv = hv or heavy.get(b, False)
            reads[nd], heavy[nd] = srcs, hv
            users = len(nd.users)
            if not isinstance(_val(nd), torch.Tensor):
                continue  # a tuple of lowered outputs: its items are the values
            if nd in is_out or any(realizes(u) for u in nd.users):
                real.add(nd)
            elif len(srcs) > 1 and any(_op_name(u) in HINT_REALIZE and u.args[:1] == (nd,)
                                       for u in nd.users):
                real.add(nd)
            elif users > 1 and (hv or len(srcs) > REUSE_READS):
                real.add(nd)
            elif len(srcs) > MAX_ACC_READS:
                real.add(nd)
        for nd in nodes:  # a view that is an output or read by an extern kernel
            if kind.get(nd) == "view" and (nd in is_out or any(realizes(u)
                                                               for u in nd.users)):
                b = base(nd)
                if kind.get(b) == "pointwise":
                    real.add(b)
        self.kind, self.real = kind, real

        # Storages: each materialised non-view value is one (an item of a multi-output
        # op is its own); inputs are storages the caller owns.
        self.storage, self.size = {}, {}
        for nd in nodes:
            k = kind.get(nd)
            if k is None or k == "multi":
                continue
            if k == "input":  # the caller's, unless handed over (``inputs``)
                key, size = (inputs or {}).get(nd, (None, 0))
                self.storage[nd] = key
                if key is not None:
                    self.size[key] = size
                continue
            if k == "view" or (k in ("pointwise", "inline") and nd not in real):
                b = base(nd)
                self.storage[nd] = self.storage.get(b, b) if k == "view" else None
                continue
            v = _val(nd)
            if not isinstance(v, torch.Tensor):
                continue
            self.storage[nd] = nd
            self.size[nd] = _nbytes(v)
        # Inductor's layout optimisation: with convolutions in the graph, a graph input a
        # convolution reads (a weight, the image) that is not channels-last is copied to
        # channels-last before the first kernel, and the copy is what the graph keeps.
        self.copies = _layout_copies(nodes) if fused else []
        for ph in self.copies:
            if self.storage.get(ph) is None:
                self.storage[ph] = ph
                self.size[ph] = _nbytes(_val(ph))
        self.keep = {self.storage.get(o) for o in self.outputs} - {None}
        self.inputs = list(dict.fromkeys(k for k, _ in (inputs or {}).values()))

        # Kernels: each materialised value, or an extern multi-output op with its items;
        # what each writes and reads (through views and the values it computes inline).
        kernels, writes, reads = list(self.copies), {}, {}
        for ph in self.copies:
            writes[ph], reads[ph] = [ph], set()
        for nd in nodes:
            k = kind.get(nd)
            if k == "multi":
                outs = [u for u in nd.users if kind.get(u) == "item" and u in self.size]
            elif k in ("extern", "reduction", "pointwise") and self.storage.get(nd) is nd:
                outs = [nd]
            else:
                continue
            kernels.append(nd)
            writes[nd] = outs
            rs = set()
            for a in nd.all_input_nodes:
                self._read(a, rs)
            reads[nd] = rs - set(outs)
        self.kernels, self.writes, self.reads = kernels, writes, reads
        self.pointwise_writes = {w for k in kernels if kind.get(k) == "pointwise"
                                 for w in writes[k]}
        if fused:
            self._fuse()
            kernels = self.kernels
        # What extern kernels allocate inside their call, on top of what is live there.
        layout = bool(self.copies) or (fused and _has_conv(nodes))
        self.scratch = {k: extern_scratch(k, layout) for k in kernels
                        if probe and kind.get(k) in ("extern", "multi")
                        and (fused or _op_name(k) in EXTERN) and _op_name(k) != "add"}
        self.order = self._reorder(kernels)
        self._place(donated)

    def _fuse(self):
        """Inductor's fusion, coarsely: between two extern kernels (in graph order), the
        pointwise and reduction kernels that read each other's buffers or share an input
        become one kernel, and a buffer written and read only inside it (not kept) is
        never allocated (the scheduler's removed buffers)."""
        groups, run = [], []

        def flush():
            parent = {k: k for k in run}

            def find(k):
                while parent[k] is not k:
                    parent[k] = parent[parent[k]]
                    k = parent[k]
                return k
            seen = {}  # storage -> a kernel of the run that writes or reads it
            for k in run:
                for st in list(self.writes[k]) + list(self.reads[k]):
                    if st in seen:
                        parent[find(k)] = find(seen[st])
                    else:
                        seen[st] = k
            comps = {}
            for k in run:
                comps.setdefault(find(k), []).append(k)
            groups.extend(comps.values())
            run.clear()

        for k in self.kernels:
            if self.kind.get(k) in ("extern", "multi") or k in self.copies:
                flush()
                groups.append([k])
            else:
                run.append(k)
        flush()
        groups.sort(key=lambda g: self.index[g[0]])
        groups = self._sink(groups)
        readers = {}
        for g in groups:
            for k in g:
                for st in self.reads[k]:
                    readers.setdefault(st, set()).add(g[0])
        kernels, writes, reads = [], {}, {}
        for g in groups:
            head = g[0]
            w = [st for k in g for st in self.writes[k]]
            own = set(w)
            # written and read only here, and not an output: a value inside the kernel
            w = [st for st in w if st in self.keep or readers.get(st, set()) - {head}
                 or not readers.get(st)]
            kernels.append(head)
            writes[head] = w
            reads[head] = {st for k in g for st in self.reads[k]} - own
            if len(g) > 1:
                self.kind[head] = "pointwise"
        self.kernels, self.writes, self.reads = kernels, writes, reads

    def _loops(self, k):
        """The loop sizes of kernel node ``k``: its output's numel and, for a reduction,
        the numel of what it reduces (else the same)."""
        import torch

        out = _val(k)
        n = out.numel() if isinstance(out, torch.Tensor) else None
        if self.kind.get(k) != "reduction":
            return n, n
        src = k.args[0] if k.args else None
        v = _val(src) if isinstance(src, torch.fx.Node) else None
        return n, v.numel() if isinstance(v, torch.Tensor) else None

    def _sink(self, groups):
        """Inductor's vertical fusion has no distance limit: a pointwise or reduction
        kernel whose buffers are read by one later pointwise or reduction kernel only,
        over the same loop, is fused into it across any extern kernels between them,
        and runs there; what it reads stays live until then. A weight used several
        times is where it shows: each use's bias-gradient reduction sinks into the sum
        of the uses at the end of backward, which holds every use's output gradient."""
        def fusible(g):
            return all(self.kind.get(k) == "pointwise" or (
                self.kind.get(k) == "reduction" and _op_name(k) in SINKABLE) for k in g)

        def compatible(g, h):
            outer = {self._loops(k)[0] for k in h} | {self._loops(k)[1] for k in h}
            return all(set(self._loops(k)) & outer - {None} for k in g)

        readers = {}  # storage -> groups that read it
        for i, g in enumerate(groups):
            for k in g:
                for st in self.reads[k]:
                    readers.setdefault(st, set()).add(i)
        gone = set()
        for i, g in enumerate(groups):
            if i in gone or not fusible(g):
                continue
            writes = [st for k in g for st in self.writes[k]]
            if not writes or any(st in self.keep for st in writes):
                continue
            into = set().union(*(readers.get(st, set()) for st in writes)) - {i}
            if len(into) != 1:
                continue
            j = into.pop()
            if j < i or not fusible(groups[j]) or not compatible(g, groups[j]):
                continue
            groups[j] = groups[j] + g  # the head (and so the place) stays the consumer's
            gone.add(i)
            for k in g:
                for st in self.reads[k]:
                    readers[st].discard(i)
                    readers[st].add(j)
        return [g for i, g in enumerate(groups) if i not in gone]

    def _read(self, a, into):
        """Add the storage(s) behind ``a`` to ``into``; an inlined value reads its own
        inputs."""
        s = self.storage.get(a)
        if s is not None:
            into.add(s)
        elif self.kind.get(a) == "view":
            self._read(a.args[0], into)
        elif self.kind.get(a) in ("pointwise", "inline"):
            for b in a.all_input_nodes:
                self._read(b, into)

    def _timeline(self, order):
        """``(alloc step, free step)`` of each storage for kernels run in ``order``
        (inputs from step 0; outputs kept: free step ``None``)."""
        step = {k: i for i, k in enumerate(order)}
        last = {}
        for k in order:
            for s in self.reads[k]:
                last[s] = max(last.get(s, -1), step[k])
        out = {}
        for s in self.inputs:
            out[s] = (0, None if s in self.keep else last.get(s, -1))
        for k in order:
            for s in self.writes[k]:
                out[s] = (step[k], None if s in self.keep else max(last.get(s, -1), step[k]))
        return out

    def _estimate_curve(self, order):
        """Bytes of this graph's buffers and inputs live at each kernel run in ``order``,
        as Inductor's memory.estimate_peak_memory counts them: no in-place reuse, and
        not the inputs it takes for parameters, user inputs or output gradients."""
        import numpy as np

        n = len(order)
        diff = np.zeros(n + 1, dtype=np.int64)
        inputs = set(self.inputs)
        for s, (a, f) in self._timeline(order).items():
            if s in inputs and getattr(s, "name", "").startswith(NONFREEABLE):
                continue
            diff[a] += self.size[s]
            if f is not None:
                diff[f + 1] -= self.size[s]
        return np.cumsum(diff[:n])

    def _estimate(self, order) -> int:
        """Peak bytes of this graph run in ``order``, as Inductor estimates it."""
        return int(self._estimate_curve(order).max()) if len(order) else 0

    def _reorder(self, kernels):
        """The kernel order Inductor runs: of the graph's own order and the orders of
        its reorder_for_peak_memory (least peak memory first, BFS, DFS), the one its
        estimate gives the least peak."""
        if not self.reorder or len(kernels) < 2:
            return list(kernels)
        best, best_peak = list(kernels), self._estimate(kernels)
        for method in (self._lpmf, self._bfs, self._dfs):
            order = method(kernels)
            if len(order) != len(kernels):
                continue
            pk = self._estimate(order)
            if pk < best_peak:
                best, best_peak = order, pk
        return best

    def _deps(self, kernels):
        """Kernel -> kernels whose buffers it reads; storage -> kernels that read it."""
        maker = {s: k for k in kernels for s in self.writes[k]}
        preds = {k: {maker[s] for s in self.reads[k] if s in maker} for k in kernels}
        readers = {}
        for k in kernels:
            for s in self.reads[k]:
                readers.setdefault(s, []).append(k)
        return preds, readers

    def _lpmf(self, kernels):
        """Inductor's topological_sort_lpmf: of the kernels ready to run, the one that
        stays under the peak so far and leaves the least memory, else the one that
        raises the peak least."""
        preds, readers = self._deps(kernels)
        index = {k: i for i, k in enumerate(kernels)}
        succs = {k: set() for k in kernels}
        for k, ps in preds.items():
            for q in ps:
                succs[q].add(k)
        indeg = {k: len(preds[k]) for k in kernels}
        size = {k: sum(self.size[s] for s in self.writes[k]) for k in kernels}
        outdeg = {s: len(set(readers.get(s, ()))) + (1 if s in self.keep else 0)
                  for s in list(self.size)}
        to_free = {k: 0 for k in kernels}
        for k in kernels:
            for s in self.reads[k]:
                if outdeg.get(s) == 1:
                    to_free[k] += self.size[s]
            for s in self.writes[k]:
                if outdeg.get(s) == 0:
                    to_free[k] += self.size[s]
        live = sum(self.size[s] for s in self.inputs)
        peak = max(live, sum(self.size[s] for s in self.keep if s in self.size))
        gap = peak - live
        ready = [k for k in kernels if indeg[k] == 0]
        out = []
        while ready:
            k = min(ready, key=lambda c: (size[c] if size[c] > gap else 0,
                                          size[c] - to_free[c], index[c]))
            ready.remove(k)
            out.append(k)
            live += size[k]
            peak = max(peak, live)
            live -= to_free[k]
            gap = peak - live
            for u in succs[k]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    ready.append(u)
            for s in self.reads[k]:
                outdeg[s] -= 1
                if outdeg[s] == 1:
                    for r in set(readers.get(s, ())):
                        to_free[r] += self.size[s]
        return out

    def _bfs(self, kernels):
        """Inductor's topological_sort_bfs: the ready kernel whose inputs were made
        earliest first."""
        import heapq

        preds, _ = self._deps(kernels)
        index = {k: i for i, k in enumerate(kernels)}
        succs = {k: [] for k in kernels}
        for k in kernels:
            for q in preds[k]:
                succs[q].append(k)
        indeg = {k: len(preds[k]) for k in kernels}
        order_of = {}
        heap = [([], index[k], k) for k in kernels if indeg[k] == 0]
        heap = [(p, i) for p, i, _ in heap]
        heapq.heapify(heap)
        out = []
        while heap:
            _, i = heapq.heappop(heap)
            k = kernels[i]
            order_of[k] = len(out)
            out.append(k)
            for u in succs[k]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(heap, (sorted({order_of[q] for q in preds[u]}), index[u]))
        return out

    def _dfs(self, kernels):
        """Inductor's topological_sort_dfs: kernels visited by the bytes they write and
        read, smallest first, each after its inputs' makers."""
        import sys

        preds, _ = self._deps(kernels)
        index = {k: i for i, k in enumerate(kernels)}
        weight = {k: sum(self.size[s] for s in self.writes[k])
                  + sum(self.size.get(s, 0) for s in self.reads[k]) for k in kernels}
        key = lambda k: (weight[k], index[k])  # noqa: E731
        seen, out = set(), []
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * len(kernels) + 100))
        try:
            def visit(k):
                if k in seen:
                    return
                seen.add(k)
                for q in sorted(preds[k], key=key):
                    visit(q)
                out.append(k)
            for k in sorted(kernels, key=key):
                visit(k)
        finally:
            sys.setrecursionlimit(limit)
        return out

    def _place(self, donated):
        """Allocation and free steps in the chosen order (``alloc_at``, ``free_at``:
        freed after that step; ``None``: kept), with in-place reuse: a kernel that writes
        a pointwise value into a buffer of the same dtype and (nearly) the same size that
        it reads last takes that buffer over (Inductor's decide_inplace_update), as it
        may a saved tensor the backward owns (AOTAutograd's donated buffers); the buffer
        is then freed before the kernel's allocation, not after it."""
        import torch

        life = self._timeline(self.order)
        self.alloc_at = {s: a for s, (a, _) in life.items() if s not in self.inputs}
        self.free_at = {s: f for s, (_, f) in life.items()}
        self.inplace, self.inplace_into = {}, {}
        own = set(self.alloc_at) | set(donated)
        for i, k in enumerate(self.order):
            if self.kind.get(k) == "multi":
                continue
            for w in self.writes[k]:
                v = _val(w)
                if w not in self.pointwise_writes or not isinstance(v, torch.Tensor):
                    continue
                for s in sorted(self.reads[k], key=self.index.get):
                    sv = _val(s)
                    if (s in own and s not in self.inplace and self.free_at.get(s) == i
                            and isinstance(sv, torch.Tensor) and sv.dtype == v.dtype
                            and 0.95 * self.size[s] <= self.size[w] <= self.size[s]):
                        self.inplace[s] = i
                        self.inplace_into[w] = s
                        break
        self._pool()

    def _pool(self):
        """Inductor's buffer reuse (PythonWrapperCodegen.memory_plan_reuse): a freed
        buffer goes to a pool keyed by dtype and storage size instead of being released;
        a later allocation of that key takes the last one pushed, whose memory stays
        held in between; one never taken is released where it was freed. Inductor takes
        it for the next kernel always, further on only if holding it keeps its estimate
        of the kernels in between (memory.estimate_peak_memory, plus what it already
        holds) within its estimate of the graph's peak (AllocateLine.
        should_reuse_buffer). ``held``: bytes held at each step; ``reused``: storage ->
        the freed one whose memory it takes. Graph inputs are released, never pooled
        (FreeLine); an extern kernel that returns its own tensor (a fallback, a
        multi-output op) takes nothing from the pool, but its buffers join it when
        freed."""
        import numpy as np

        n = len(self.order)
        self.held = np.zeros(n, dtype=np.int64)
        self.reused = {}
        if not self.fused:  # run as the graph is (aot_eager): no wrapper, no pool
            return
        est = self._estimate_curve(self.order)
        overall = int(est.max()) if n else 0
        frees = {}
        for s, f in self.free_at.items():
            if f is not None and s in self.alloc_at and s not in self.inplace:
                frees.setdefault(f, []).append(s)
        pool = {}
        for i, k in enumerate(self.order):
            if self._allocates(k):
                for w in self.writes[k]:
                    if w in self.inplace_into or self.alloc_at.get(w) != i:
                        continue
                    entries = pool.get(self._reuse_key(w))
                    if not entries:
                        continue
                    s, f = entries[-1]
                    size = self.size[w]
                    if f + 1 == i or size + int(est[f + 1:i].max(initial=0)) <= overall:
                        entries.pop()
                        est[f + 1:i] += size
                        self.held[f + 1:i] += self.size[s]
                        self.reused[w] = s
            for s in sorted(frees.get(i, ()), key=self.index.get):
                pool.setdefault(self._reuse_key(s), []).append((s, i))

    def _reuse_key(self, s):
        """Inductor's buffer_reuse_key on one device: dtype and storage size."""
        v = _val(s)
        return (getattr(v, "dtype", None), self.size[s])

    def _allocates(self, k) -> bool:
        """Whether Inductor's wrapper allocates ``k``'s outputs itself (AllocateLine: a
        generated kernel's buffers, the ``out=`` of a matmul), so they may take pooled
        memory; an extern kernel that returns its own tensor does not."""
        if k in self.copies or self.kind.get(k) in ("pointwise", "reduction"):
            return True
        return self.kind.get(k) == "extern" and _op_name(k) in OUT_VARIANTS

    def curve(self):
        """Bytes this graph holds at each step of its kernel order (its buffers and its
        inputs' storages, each input freed after its last reader), and after it."""
        import numpy as np

        n = len(self.order)
        diff = np.zeros(n + 2, dtype=np.int64)
        for s in self.inputs:
            diff[0] += self.size[s]
        for s, a in self.alloc_at.items():
            diff[a] += self.size[s]
        for s, f in self.free_at.items():
            if s in self.inplace:
                diff[self.inplace[s]] -= self.size[s]
            elif f is not None:
                diff[f + 1] -= self.size[s]
        out = np.cumsum(diff[:-1])
        out[:n] += self.held
        for i, k in enumerate(self.order):
            out[i] += self.scratch.get(k, 0)
        return out


def num_user_outputs(fw, bw_places) -> int:
    """How many of the forward graph's outputs are the model's (the rest are saved for
    backward: they come back as the backward's placeholders of the same name)."""
    import torch

    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    names = {ph.name for ph in bw_places}
    k = len(out)
    while k and isinstance(out[k - 1], torch.fx.Node) and out[k - 1].name in names:
        k -= 1
    return k


def tangent_bytes(v) -> int:
    """Bytes of the buffer AOTAutograd hands the backward for the gradient of an output
    that is not contiguous (a slice of a larger tensor: a sliding-window key/value
    cache's last positions). The gradient that reaches it (autograd's zeros for an
    output the loss does not read, or the loss's gradient) is contiguous; the runtime
    wrapper copies it into ``empty_strided`` of the strides the backward was traced
    with (runtime_wrappers.coerce_to_expected_memory_format), whose storage spans every
    stride (a dense layout, channels-last, its elements only):
    Mistral's six cache slices of 3.5 KB took 42.4 KB each."""
    if v.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(v.shape, v.stride()))
    return int(max(span, v.numel()) * v.element_size())


def predict_step(fw, bw, frame, inductor: bool = True, reorder: bool = False) -> dict:
    """The compiled step's live bytes, from the partitioned graphs ``fw``, ``bw`` and the
    eager step's :class:`EagerFrame`: ``peak`` and where it is (``phase``: forward,
    loss or backward; ``peaks`` of each, ``curves`` at each kernel), and ``saved``:
    bytes of the storages the forward keeps for backward. ``inductor``: the graphs are
    compiled by Inductor (fused); False: run as they are (aot_eager), one buffer per op.
    ``reorder``: kernels in the order Inductor's reorder_for_peak_memory picks as this
    model sees them (:meth:`GraphMemory._reorder`); off: in graph order. Measured
    (benchmarks/compiled_prediction_check.py), reordering is exact on an MLP where the
    graph order is 1.9 MiB high (Inductor starts its backward with what reads the
    output gradient), but our kernels are finer than Inductor's fused ones, so we find
    orders it does not take: resnet50's unplanned step came out 9 MiB low, and through
    the calibration every other candidate 15-17 MiB high. In graph order they are exact."""
    import torch

    fused = inductor
    reorder = reorder and inductor
    F = GraphMemory(fw, fused, reorder=reorder)
    cf = F.curve()
    fw_end = int(cf[-1])
    # The backward's arguments: the forward's saved storages (shared ones once) and the
    # gradients of the outputs, which the loss window already holds (a non-contiguous
    # one is copied into a buffer of its own, see tangent_bytes).
    fw_nodes = {nd.name: nd for nd in F.nodes}
    groups, tangents, coerced = {}, [], []
    places = [ph for ph in bw.graph.nodes if ph.op == "placeholder"
              and isinstance(_val(ph), torch.Tensor)]
    for ph in places:
        f = fw_nodes.get(ph.name)
        if f is None:  # a gradient of an output
            v = _val(ph)
            if v.is_contiguous():
                tangents.append((_nbytes(v), [ph]))
            else:  # copied into a buffer of the output's strides, which the loss lacks
                coerced.append((tangent_bytes(v), [ph]))
            continue
        s = F.storage.get(f)
        if s is None or s not in F.size:
            continue  # a parameter or input, or a view of one: the caller keeps it
        groups.setdefault(s, []).append(ph)
    # A saved storage the user outputs do not share is the backward's to reuse.
    user = {F.storage.get(o) for o in F.outputs[:num_user_outputs(fw, places)]}
    donated = [m[0] for s, m in groups.items() if len(m) == 1 and s not in user]
    saved = [(F.size[s], members) for s, members in groups.items()]
    handed = {}
    for size, members in saved + tangents + coerced:
        for m in members:
            handed[m] = (members[0], size)
    B = GraphMemory(bw, fused, donated, handed, reorder=reorder)
    held = sum(size for size, _ in saved) + sum(size for size, _ in tangents)
    cb = B.curve()
    level = frame.start + fw_end + frame.before_backward - held
    parts = {"forward": frame.start + cf,
             "loss": frame.start + fw_end + frame.window,
             "backward": level + cb}
    peaks = {k: int(v.max()) for k, v in parts.items() if len(v)}
    phase = max(peaks, key=peaks.get)
    return {"peak": peaks[phase], "phase": phase, "peaks": peaks,
            "saved": int(sum(size for size, _ in saved)), "curves": parts,
            "graphs": (F, B)}


class EagerFrame:
    """What the compiled step shares with the eager one, from the eager step's graph
    ``g`` (a ``StepGraph``): ``start`` the bytes live before the model's forward
    (parameters, buffers, inputs), and the loss window, the ops between the model's last
    forward op and its first backward op (the loss, its backward, the gradient of the
    model's output): ``window`` the live bytes at each of them minus those right after
    the model's forward (``ref``), ``before_backward`` that difference just before the
    model's backward. The compiled forward leaves the same outputs for the loss as the
    eager one, so the loss window adds the same on top of what the compiled forward
    leaves."""

    def __init__(self, g):
        import numpy as np

        from ..capture import OUTSIDE
        from ..graph import BACKWARD, FORWARD

        model = [op for op in g.ops if op.module != OUTSIDE]
        fw = [op.index for op in model if op.phase == FORWARD]
        bw = [op.index for op in model if op.phase == BACKWARD]
        n = max(g.num_ops, 1)
        first = fw[0] if fw else 0
        last = fw[-1] if fw else 0
        bfirst = bw[0] if bw else n

        def live_between(i):  # bytes live after op i-1 ends and before op i starts
            return sum(t.size for t in g.tensors if t.size and t.alloc_op < i
                       and (t.freed_before is None or t.freed_before > i))

        def live_at(i):  # bytes live while op i runs (its outputs and scratch included)
            return sum(t.size for t in g.tensors if t.size and t.alloc_op <= i
                       and (t.freed_before is None or t.freed_before > i)) + g.ops[i].scratch

        self.start = live_between(first)
        self.ref = live_between(last + 1)
        self.window = np.array([live_at(i) - self.ref for i in range(last + 1, bfirst)],
                               dtype=np.int64)
        self.before_backward = live_between(bfirst) - self.ref
