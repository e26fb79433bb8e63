"""``torch.compile`` backend whose forward/backward partition follows a checkpoint plan.

Dynamo records, on every node of the graph it captures, the stack of modules that made it
(``nn_module_stack``); AOTAutograd keeps that on the joint forward+backward graph. Before
partitioning we tag the forward nodes of each planned module, as ``torch.utils.checkpoint``
does under compile:

- policy ``full``: every node ``MUST_RECOMPUTE``;
- policy ``save-compute``: matmul/convolution/attention ``MUST_SAVE``, the rest
  ``MUST_RECOMPUTE``;

random ops (dropout) are never tagged for recompute: recomputing them would draw new
masks; nor are ops that read an input the step mutates (BatchNorm's running statistics,
when not decomposed): the recompute would read the new value. Each module gets its own ``ac_graph_id``, so the boundary between two adjacent
recomputed modules stays saved. PyTorch's min-cut partitioner then honours the tags and
decides the rest itself.

Segments of an ``nn.Sequential`` (``"path[first:last]"``) cover the nodes of those
children, in the order the traced forward ran them.

The plan is made for the eager step. A compiled step differs: Inductor fuses pointwise
ops and the min-cut partitioner recomputes cheap ones by itself, so the forward saves
less for backward, and a recomputed memory-bound op costs little once fused into the
backward kernel that reads it. So by default (``adapt=True``) the backend re-chooses,
inside the partitioner where it sees the joint graph, the cheapest plan whose *compiled*
step is predicted to fit the budget. Two kinds of plan compete:

- module-level: the eager plans for budgets between the given one and the unplanned
  peak, priced for the compiled step (:func:`compiled_costs`: the bytes term of each
  recompute cost scaled down, FLOPs kept);
- op-level (``op_level.py``): every forward op of the joint graph saved or recomputed,
  chosen by a MILP (HiGHS) over the joint graph, so that memory-bound ops (norms,
  activations, pointwise ops, views) are recomputed from saved compute-bound outputs
  where that is cheap, and compute-bound ops too where the budget needs it;
- PyTorch's own (:class:`TorchBudgetPlan`): the joint graph, without our tags,
  partitioned by the min-cut partitioner under ``activation_memory_budget`` set to each
  of ``TORCH_BUDGETS`` (the knob ``torch.compile`` users turn). Partitions that
  recompute a random op or one that reads an input the step mutates are dropped.

Each candidate plan is partitioned for real on a copy of the joint graph and its
compiled peak predicted by walking its forward and backward graphs as Inductor runs them
(``compiled_memory.py``: buffers per kernel, fusion, reordering, in-place reuse, layout
copies, extern kernels' scratch), with what the eager step holds before the forward and
around the loss (``predictor="eager"``, or when the walk fails: on the eager timeline,
:func:`predict_compiled_peak`). All kinds
are priced the same way for the comparison: by the ops their partition recomputes
beyond the unplanned one, on the joint graph, with the op-level cost model. The
cheapest plan predicted to fit is taken (costs within ``COST_TIE`` of the forward: the
lower predicted peak). PyTorch's knob is not monotonic and can overshoot what it is
asked for; the predicted-fit check is what makes its partitions safe to take, so the
backend never does worse than the knob, as far as its predictions are right. If the unplanned compiled step fits, nothing is recomputed. A measured peak of the unplanned compiled
step (``unplanned_peak_bytes``) calibrates the predictions for what the compiler
allocates that the eager trace cannot see.

``compiler="inductor"`` (the default) installs the partitioner as Inductor's
``custom_partitioner_fn`` (after Inductor's joint-graph passes) and compiles as usual;
``"aot_eager"`` runs the partitioned graphs as they are (exact, for testing and
debugging).
"""

from __future__ import annotations

import operator
import re
import warnings

from ..errors import PlannerError


def _module_path(fqn: str) -> str:
    """Dynamo's "L['self'].layers[0].mlp" or "L['self'].layers.0.mlp" -> "layers.0.mlp"."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", fqn)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.lstrip(".")


_SEGMENT = re.compile(r"^(.*)\[([^\[\]:]+):([^\[\]:]+)\]$")


def _units(policies: dict[str, str], child_order: dict | None = None):
    """Split plan units into modules (path -> policy) and Sequential segments
    (Sequential path -> {child name -> unit}). ``child_order``: Sequential path -> its
    children's names in order (from the trace); without it, numbered children are
    ordered by number."""
    modules, segments = {}, {}
    for unit in policies:
        m = _SEGMENT.match(unit)
        if m is None:
            modules[unit] = unit
            continue
        seq, first, last = m.groups()
        names = list((child_order or {}).get(seq) or [])
        if first not in names or last not in names:
            if not (first.isdigit() and last.isdigit()):
                raise PlannerError(f"cannot place the segment '{unit}' in the compiled "
                                   f"graph: the order of the children of '{seq}' is unknown; "
                                   f"give the backend a plan made with model=...")
            names = [str(k) for k in range(int(first), int(last) + 1)]
        i, j = names.index(first), names.index(last)
        for child in names[i:j + 1]:
            segments.setdefault(seq, {})[child] = unit
    return modules, segments


def child_order(graph) -> dict[str, list]:
    """Module path -> its children's names, in the order the traced forward ran them."""
    from ..graph import FORWARD

    out: dict[str, list] = {}
    for op in graph.ops:
        if op.phase != FORWARD or not op.module:
            continue
        parts = op.module.split(".")
        for k in range(len(parts)):
            parent, child = ".".join(parts[:k]), parts[k]
            kids = out.setdefault(parent, [])
            if not kids or kids[-1] != child:
                if child not in kids:
                    kids.append(child)
    return out


def tag_graph(graph, policies: dict[str, str], order_of_children: dict | None = None) -> int:
    """Tag the forward nodes of ``graph`` (an FX joint graph) that belong to planned
    units (modules, or runs of a Sequential's children); returns how many were tagged
    for recompute."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from .cost import is_compute_bound

    from .op_level import mutated_placeholders

    order = {m: k for k, m in enumerate(policies)}
    modules, segments = _units(policies, order_of_children)
    mutated = mutated_placeholders(graph)
    tagged = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        owner = None
        for fqn, _cls in stack.values():  # outermost first: the planned unit that holds it
            path = _module_path(fqn)
            if path in modules:
                owner = path
                break
            parent, _, leaf = path.rpartition(".") if "." in path else ("", "", path)
            unit = segments.get(parent, {}).get(leaf)
            if unit is not None:
                owner = unit
                break
        if owner is None:
            continue
        target = node.target
        tags = getattr(target, "tags", ())
        name = (f"aten.{target.overloadpacket.__name__}"
                if isinstance(target, torch._ops.OpOverload) else str(target))
        if torch.Tag.nondeterministic_seeded in tags:
            policy = CheckpointPolicy.MUST_SAVE  # a new mask on recompute would be wrong
        elif any(a in mutated for a in node.all_input_nodes):
            policy = CheckpointPolicy.MUST_SAVE  # it reads an input the step mutates
        elif (target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
              and node.args[0].meta.get("recompute") == CheckpointPolicy.MUST_SAVE):
            policy = CheckpointPolicy.MUST_SAVE  # a kept op's outputs are kept
        elif policies[owner] == "save-compute" and is_compute_bound(name):
            policy = CheckpointPolicy.MUST_SAVE
        else:
            policy = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = order[owner]
    return tagged


def _saved_bytes(fw, num_fwd_outputs: int) -> int:
    """Bytes of the forward graph's outputs kept for backward (beyond the user outputs)."""
    import torch

    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    total = 0
    for n in out.args[0][num_fwd_outputs:]:
        v = n.meta.get("val") if hasattr(n, "meta") else None
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def _saved_storages(fw, num_fwd_outputs: int) -> list:
    """``(bytes, module path)`` of each new storage the forward graph keeps for backward,
    once each; graph inputs (parameters, the batch) and views of them cost nothing. The
    user outputs are left out: the caller drops them once the loss is computed, as in
    the eager step. The module is the innermost one that made the storage ("" if none)."""
    import torch

    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    seen, found = set(), []
    for n in out.args[0][num_fwd_outputs:]:
        if not isinstance(n, torch.fx.Node):
            continue
        base = n
        while (base.op == "call_function" and isinstance(base.target, torch._ops.OpOverload)
               and base.target.is_view and base.args and isinstance(base.args[0], torch.fx.Node)):
            base = base.args[0]
        if base.op == "placeholder" or base in seen:
            continue
        seen.add(base)
        v = base.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        try:
            size = int(v.untyped_storage().nbytes())
        except Exception:  # no storage to ask (e.g. a sparse or opaque value)
            size = v.numel() * v.element_size()
        stack = list((base.meta.get("nn_module_stack") or {}).values())
        found.append((size, _module_path(stack[-1][0]) if stack else ""))
    return found


def _graph_modules(graph) -> set:
    """Module paths whose forward ops are in ``graph`` ("" for the top level)."""
    paths = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
            continue
        for fqn, _cls in (node.meta.get("nn_module_stack") or {}).values():
            paths.add(_module_path(fqn))
    return paths


def _inside(module: str, modules) -> bool:
    return any(module == m or not m or module.startswith(m + ".") for m in modules)


def _bw_module(u) -> str | None:
    stack = list((u.meta.get("fwd_nn_module_stack") or
                  u.meta.get("nn_module_stack") or {}).values())
    return _module_path(stack[-1][0]) if stack else None


def _pointwise(nd) -> bool:
    import torch

    t = nd.target
    return (t is operator.getitem or (isinstance(t, torch._ops.OpOverload)
                                      and (torch.Tag.pointwise in t.tags or t.is_view)))


def _recompute_transients(bw, recomputed: set) -> list:
    """``(bytes, modules, start)`` of each value the backward graph ``bw`` recomputes
    (of the forward nodes named in ``recomputed``) and materialises: one a backward op
    reads. ``modules``: the modules whose backward reads it (the backward nodes'
    ``fwd_nn_module_stack``), until the end of whose backward it is live. ``start``:
    the modules from the first of whose backwards its buffer is live. A recomputed value
    is computed where a backward op reads it, or where a recomputed value made from it
    is computed. Its buffer exists from there if it is no pointwise op (a convolution,
    matmul or reduction: a kernel of its own), else only where a backward op or a
    recomputed non-pointwise op reads it: Inductor computes a pointwise op inline in
    the kernels that read it, so a chain of pointwise ops (BatchNorm, ReLU, residual
    adds) recomputed from saved values keeps no buffer of its own before its reader;
    a chain through convolutions or matmuls keeps each buffer from where the chain is
    recomputed."""
    import torch

    nodes = [nd for nd in bw.graph.nodes if nd.op == "call_function" and nd.name in recomputed]
    readers_of, computed = {}, {}
    for nd in reversed(nodes):  # users before their inputs
        readers = [u for u in nd.users if u.op == "call_function" and u.name not in recomputed]
        mods = {m for m in map(_bw_module, readers) if m is not None}
        at = set(mods)
        for u in nd.users:
            if u in computed:
                at |= computed[u]
        readers_of[nd], computed[nd] = (mods, bool(readers)), at
    out = []
    for nd in nodes:
        v = nd.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        if any(isinstance(a.meta.get("val"), torch.Tensor) and
               a.meta["val"].untyped_storage()._cdata == v.untyped_storage()._cdata
               for a in nd.all_input_nodes):
            continue  # a view: no storage of its own
        mods, read = readers_of[nd]
        if not read:
            continue
        start = set()
        if not _pointwise(nd):
            start |= computed[nd]
        for u in nd.users:
            if u in computed and not _pointwise(u):
                start |= computed[u]
        start = (start - {""}) | mods  # the top level says nothing of where it runs
        out.append((int(v.untyped_storage().nbytes()), sorted(mods), sorted(start)))
    return out


class EagerAxis:
    """The eager step's timeline, as the compiled step's memory is predicted on it: the
    live bytes at every op of the eager step with plan ``x`` and the eager activations
    the model's forward leaves for backward (made in ``modules``, if given; live from
    the op that made them until eager frees them) taken out (``base``), and where each
    module's forward and backward run (:meth:`saved_span`, :meth:`backward_span`), to
    place what the compiled step keeps instead."""

    def __init__(self, problem, x, modules=None):
        import numpy as np

        from ..capture import OUTSIDE
        from ..graph import ACTIVATION, BACKWARD, FORWARD
        from ..timeline import build_timeline

        g = problem.simulated_graph(np.asarray(x, dtype=np.int64))
        n = self.n = max(g.num_ops, 1)
        mem = build_timeline(g).total.astype(np.int64)
        end = self.end = g.phase_starts.get(BACKWARD, n)
        diff = np.zeros(n + 1, dtype=np.int64)
        for t in g.tensors:  # the eager activations
            if (t.category != ACTIVATION or t.alloc_op < 0 or t.alloc_op >= end or not t.size
                    or t.module == OUTSIDE
                    or (t.freed_before is not None and t.freed_before <= end)
                    or (modules is not None and not _inside(t.module, modules))):
                continue
            diff[t.alloc_op] -= t.size
            diff[min(t.freed_before if t.freed_before is not None else n, n)] += t.size
        self.base = mem + np.cumsum(diff[:-1])
        # module path (and each parent) -> its first forward, first and last backward op
        self.first, self.bfirst, self.last = {}, {}, {}
        for op in g.ops:
            if op.module == OUTSIDE or op.phase not in (FORWARD, BACKWARD):
                continue
            parts = op.module.split(".") if op.module else []
            for k in range(len(parts) + 1):
                key = ".".join(parts[:k])
                if op.phase == FORWARD:
                    self.first.setdefault(key, op.index)
                else:
                    self.last[key] = op.index
                    self.bfirst.setdefault(key, op.index)

    def saved_span(self, module: str) -> tuple:
        """Ops during which a storage the compiled forward saves, made in ``module``,
        is live: from the start of the module's forward to the end of its backward (of
        the innermost enclosing module that has both)."""
        m = module
        while m and (m not in self.last or m not in self.first):
            m = m.rpartition(".")[0]
        return min(self.first.get(m, 0), self.n - 1), min(self.last.get(m, self.n - 1),
                                                          self.n - 1)

    def backward_span(self, modules) -> tuple:
        """Ops from the first to the last backward op of ``modules`` (all backward if
        none is known)."""
        spans = []
        for m in modules or [""]:
            while m and (m not in self.last or m not in self.bfirst):
                m = m.rpartition(".")[0]
            spans.append((self.bfirst.get(m, self.end), self.last.get(m, self.n - 1)))
        return (min(min(a for a, _ in spans), self.n - 1),
                min(max(b for _, b in spans), self.n - 1))

    def curve(self, saved=(), transients=()):
        import numpy as np

        diff = np.zeros(self.n + 1, dtype=np.int64)
        for size, module in saved:
            a, b = self.saved_span(module)
            diff[a] += size
            diff[b + 1] -= size
        for size, mods, *start in transients:
            a, b = self.backward_span(mods)
            if start and start[0]:  # live from where it, or one made from it, is needed
                a = min(a, self.backward_span(start[0])[0])
            diff[a] += size
            diff[b + 1] -= size
        return self.base + np.cumsum(diff[:-1])


def predict_compiled_peak(problem, x, saved: list, modules=None, transients=()) -> int:
    """The compiled step's peak with plan ``x``, from the eager one (:class:`EagerAxis`):
    at every op, the eager activations the model's forward leaves for backward are
    replaced by what the compiled forward saves (``saved``: ``(bytes, module)`` from
    :func:`_saved_storages`), each saved storage live from the start of its module's
    forward to the end of its module's backward. ``transients``: ``(bytes, modules,
    start)`` of values recomputed in backward (:func:`_recompute_transients`), live from
    the first backward op of ``start`` (the modules where it, or a value recomputed
    from it, is first needed) to the last backward op of those modules."""
    return int(EagerAxis(problem, x, modules).curve(saved, transients).max())


FUSED_BYTES = 0.1  # share of a memory-bound op's eager cost left when Inductor recomputes it


def compiled_costs(problem):
    """``problem`` with each candidate's recompute cost as the compiled step pays it.
    Inductor fuses a recomputed memory-bound op (normalisation, activation, residual
    add) into the backward kernel that reads it, so recomputing it costs little beyond
    reading its inputs; matmuls, convolutions and attention cost their FLOPs as in eager.
    The bytes term of every candidate is scaled by ``FUSED_BYTES``; the FLOPs term is
    kept. The result is cached on the problem."""
    import dataclasses

    cached = getattr(problem, "_compiled_costs", None)
    if cached is not None:
        return cached
    from .cost import DeviceSpeed

    speed = DeviceSpeed().flops_per_s
    cands = []
    for c in problem.candidates:
        flops_s = (c.flops or 0.0) / speed
        cands.append(dataclasses.replace(
            c, cost=flops_s + FUSED_BYTES * max(c.cost - flops_s, 0.0)))
    fwd = problem.forward_cost  # the fraction is reported against the same forward
    out = dataclasses.replace(problem, candidates=cands, forward_cost=fwd,
                              cost_model=problem.cost_model + ", compiled")
    object.__setattr__(problem, "_compiled_costs", out)
    return out


TORCH_BUDGETS = (0.9, 0.75, 0.5, 0.3, 0.1, 0.0)  # activation_memory_budget values tried
# Two candidates whose estimated recompute costs differ by less than this share of the
# forward's estimated time cost the same, as far as the cost model can tell: the one
# with the lower predicted peak is taken.
COST_TIE = 0.005
# A least compiled peak predicted less than this share below the unplanned one is not
# resolved by the predictions (see CompileBackend.least_compiled_peak).
LEAST_RESOLUTION = 0.001


class TorchBudgetPlan:
    """A candidate partition made by PyTorch's own min-cut partitioner under
    ``torch._functorch.config.activation_memory_budget = amb``, with no checkpoint tags
    (the knob ``torch.compile`` users turn). The backend predicts its compiled peak and
    prices it like its own plans, and takes it only when it is predicted to fit and is
    the cheapest; ``compile_backend(plan=<TorchBudgetPlan>, adapt=False)`` follows it.
    Offers what the benchmark and the backend read from a ``Plan``."""

    problem = None                    # no module-level problem: never re-adapted
    solver = "torch-budget"
    optimal = False
    gap = None
    solve_seconds = 0.0
    recomputed: list = []
    modules: list = []

    def __init__(self, amb: float, budget_bytes: int | None = None,
                 recompute_seconds: float = 0.0, forward_seconds: float = 0.0):
        self.amb = float(amb)
        self.budget_bytes = budget_bytes
        self.recompute_seconds = recompute_seconds
        self.forward_seconds = forward_seconds

    @property
    def kind(self) -> str:
        return f"torch-budget:{self.amb:g}"

    @property
    def key(self) -> tuple:
        return (self.kind,)

    @property
    def policies(self) -> dict:
        return {"*": self.kind}

    @property
    def recompute_cost(self) -> dict:
        frac = self.recompute_seconds / self.forward_seconds if self.forward_seconds else 0.0
        return {"seconds": self.recompute_seconds, "fraction_of_forward": frac}

    def __repr__(self):
        return f"TorchBudgetPlan({self.amb:g})"


def plan_kind(pl) -> str:
    """"module-level", "op-level" or "torch-budget:<value>": which kind of candidate."""
    return getattr(pl, "kind", None) or (
        "op-level" if getattr(pl, "key", None) is not None else "module-level")


def _partition_as(pl, partitioner, joint, joint_inputs, kwargs):
    """Run the partitioner; under ``pl``'s ``activation_memory_budget`` for a
    :class:`TorchBudgetPlan`."""
    if isinstance(pl, TorchBudgetPlan):
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=pl.amb):
            return partitioner(joint, joint_inputs, **kwargs)
    return partitioner(joint, joint_inputs, **kwargs)


class CompileBackend:
    """A ``torch.compile`` backend applying ``plan``; see :func:`compile_backend`."""

    def __init__(self, plan, compiler: str = "inductor", adapt: bool = True,
                 search_steps: int = 4, unplanned_peak_bytes: int | None = None,
                 op_level: bool = True, op_time_limit: float = 10.0,
                 torch_budgets=TORCH_BUDGETS, predictor: str = "graphs"):
        if compiler not in ("aot_eager", "inductor"):
            raise PlannerError(f"compiler={compiler!r}: use 'aot_eager' or 'inductor'")
        if predictor not in ("graphs", "eager"):
            raise PlannerError(f"predictor={predictor!r}: use 'graphs' or 'eager'")
        # How a candidate's compiled peak is predicted: walked on its partitioned graphs
        # (compiled_memory.py), or on the eager step's timeline (EagerAxis: the earlier
        # model, and the fallback when the walk fails: graph_prediction_error says why).
        self.predictor = predictor
        self.graph_prediction_error = None
        self.plan = plan
        self.compiler = compiler
        self.adapt = adapt and getattr(plan, "problem", None) is not None
        self.search_steps = search_steps
        # Op-level units (op_level.py) besides the module-level plans, when adapting.
        self.op_level = op_level
        self.op_time_limit = op_time_limit
        self.op_problem = None   # the op-level programme of the first joint graph
        self.op_level_error = None  # why op-level units were dropped, if they were
        # PyTorch's own budgeted partitions compete too (TorchBudgetPlan), when adapting
        # and the op-level model can price them.
        self.torch_budgets = tuple(torch_budgets or ())
        self.torch_budget_error = None  # why a value was dropped, if one was
        self._portfolio = None   # [(TorchBudgetPlan, predicted peak)] of the first graph
        self._least = None       # [(plan, predicted peak)]: the least-peak candidates
        self.least_peak_source = None  # which candidate gave least_compiled_peak()
        self._ctx = None         # the first joint graph's choice context
        self._cost = {}          # id(plan) -> recompute seconds priced on the joint graph
        self.recompute_fraction = None  # the chosen plan's, priced on the joint graph
        self._pred_none = None   # predicted (calibrated) peak of the unplanned compiled step
        # A measured peak of the compiled step without checkpointing calibrates the
        # predictions: the compiler's own buffers are not in the eager trace.
        self.unplanned_peak_bytes = unplanned_peak_bytes
        self.calibration_bytes = 0  # added to every prediction (measured - predicted, if > 0)
        self.chosen = None       # the plan the compiled graphs follow (see _choose)
        self.predicted_peak_bytes = None  # for the compiled step, when adapted
        self.trials: list = []   # (eager budget, recompute fraction, predicted compiled peak)
        self.choose_seconds = 0.0  # spent re-choosing the plan (trial partitions)
        self.tagged = 0          # forward nodes tagged for recompute, over all graphs
        self.saved_bytes = 0     # bytes the forward graphs save for backward
        self._children = None    # Sequential path -> children in order, for segments
        self._graphs = 0
        self._joint = None       # the first joint graph, untagged, for rechoose()
        self._calibrated = False

    def _order(self):
        problem = getattr(self.plan, "problem", None)
        if self._children is None:
            self._children = child_order(problem.graph) if problem is not None else {}
        return self._children

    @staticmethod
    def _untag(graph):
        for node in graph.nodes:
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)

    def _choose(self, joint, joint_inputs, partitioner, kwargs, plan=None):
        """The plan to follow in this joint graph (for ``plan``, by default
        ``self.plan``). Without adaptation, that plan.

        With it (the default), the plan is re-chosen for the compiled step: compiling
        fuses and recomputes cheap ops by itself, so the graph may save less for
        backward than the eager step the plan was made for, and a cheaper plan may fit
        (or, rarely, more, and a tighter one is needed). Two kinds of plan compete:

        - module-level: the eager plans for budgets between ``plan``'s and the unplanned
          peak (bisection over the eager budget, :meth:`_choose_modules`);
        - op-level (``op_level=True``): single ops of the joint graph saved or recomputed,
          chosen by the MILP of ``op_level.py`` (:meth:`_choose_ops`);
        - PyTorch's own partitions (``torch_budgets``): the min-cut partitioner, with no
          tags, under ``activation_memory_budget`` set to each of ``torch_budgets``
          (:class:`TorchBudgetPlan`, :meth:`_torch_portfolio`). The knob is not
          monotonic and may overshoot what it is asked for; the predicted-fit check is
          what makes these candidates safe;
        - once :meth:`least_compiled_peak` has run, the least-peak candidates it made.

        Each candidate plan is partitioned for real on a copy of the joint graph, and its
        compiled peak predicted by walking the partitioned graphs
        (:meth:`_predict_graphs`). Of the plans predicted to fit,
        the one with the least estimated recompute cost (both priced by the same
        roofline, for the compiled step) is chosen; if none fits, the one with the lowest
        predicted peak."""
        from .plan import make_plan

        plan = plan if plan is not None else self.plan
        if not self.adapt or self._graphs > 1:
            return plan  # several graphs (graph breaks): no whole-step view to adapt with
        p = compiled_costs(plan.problem)
        budget = plan.budget_bytes
        ctx = dict(joint=joint, joint_inputs=joint_inputs, partitioner=partitioner,
                   kwargs=kwargs, p=p, modules=_graph_modules(joint.graph))
        if self._ctx is None and self._joint is not None:
            # For least_compiled_peak(): the untagged copy of this joint graph.
            self._ctx = dict(ctx, joint=self._joint[0])

        hi = int(p.base.max())
        none = make_plan(p, hi)
        pred_none, fw0, bw0 = self._predict(ctx, none, keep=True)
        # The op-level model prices every plan on the joint graph, op-level or not.
        if self.op_problem is None and self.op_level_error is None:
            try:
                self._op_problem(ctx, fw0, bw0)
            except Exception as e:  # an op the model does not describe: modules only
                self.op_level_error = f"{type(e).__name__}: {e}"
        if self.unplanned_peak_bytes is not None and not self._calibrated:
            # Only ever raised: a prediction found high on the unplanned step may be
            # right on another partition (a kernel Inductor moves, which that one lacks),
            # and lowering it there would predict below what the step needs.
            self.calibration_bytes = max(int(self.unplanned_peak_bytes - pred_none), 0)
            self._calibrated = True
            pred_none = int(self.unplanned_peak_bytes)
            self.trials[-1] = self.trials[-1][:2] + (pred_none,)
        self._pred_none = pred_none
        if pred_none <= budget:
            self.predicted_peak_bytes = self.trials[-1][2]
            self.recompute_fraction = 0.0
            return none
        best, best_pred = self._choose_modules(ctx, plan, budget, hi, pred_none)
        if self.op_level and self.op_problem is not None:
            try:
                op, op_pred = self._choose_ops(ctx, budget, pred_none)
            except Exception as e:  # the partitioner refused the tags: modules only
                self.op_level_error = f"{type(e).__name__}: {e}"
                op, op_pred = None, None
            if op is not None:
                best, best_pred = self._better(best, best_pred, op, op_pred, budget)
        # PyTorch's own budgeted partitions, and the least-peak candidates once known
        # (least_compiled_peak()): each taken only if predicted to fit and cheaper.
        for pl, pk in self._extra_candidates(ctx):
            best, best_pred = self._better(best, best_pred, pl, pk, budget)
        self.predicted_peak_bytes = int(best_pred)
        if best_pred > budget:
            # Followed anyway, as the least it could do; said, not silent (squeezenet's
            # chosen partition was predicted over its budget, and measured 2% over it).
            from ...units import format_bytes

            warnings.warn(
                f"torch.compile: no candidate partition is predicted to fit the budget of "
                f"{format_bytes(budget)}; following the one predicted lowest, "
                f"{format_bytes(int(best_pred))} ({plan_kind(best)}). "
                f"backend.least_compiled_peak() says how low the candidates go",
                RuntimeWarning, stacklevel=2)
        if self.op_problem is not None and self.op_problem.forward_seconds:
            self.recompute_fraction = self._cost[id(best)] / self.op_problem.forward_seconds
        else:
            self.recompute_fraction = best.recompute_cost["fraction_of_forward"]
        return best

    def _predict(self, ctx, pl, keep=False):
        """Partition a copy of the joint graph tagged for ``pl`` (a module-level
        ``Plan`` or an ``OpPlan``) and predict the compiled peak; records a trial, and
        the plan's recompute cost on the joint graph (the ops its backward graph
        recomputes beyond the unplanned one's, priced as in ``op_level.py``) in
        ``self._cost``. With ``keep``, returns ``(peak, fw, bw)``."""
        import copy

        import numpy as np
        import torch

        from .op_level import OpPlan, tag_ops

        joint, kwargs = ctx["joint"], ctx["kwargs"]
        trial = torch.fx.GraphModule(joint, copy.deepcopy(joint.graph))
        self._untag(trial.graph)
        if isinstance(pl, OpPlan):
            tag_ops(trial.graph, pl.tags, pl.targets)
            x = np.zeros(ctx["p"].n, dtype=np.int64)
        elif isinstance(pl, TorchBudgetPlan):  # PyTorch's partition: no tags
            x = np.zeros(ctx["p"].n, dtype=np.int64)
        else:
            tag_graph(trial.graph, pl.policies, self._order())
            x = pl.choice
        fw, bw = _partition_as(pl, ctx["partitioner"], trial, ctx["joint_inputs"], kwargs)
        op_p = self.op_problem
        if op_p is not None:
            again = {n.name for n in bw.graph.nodes if n.op == "call_function"}
            self._cost[id(pl)] = float(sum(op_p.cost[k] for k, nm in enumerate(op_p.names)
                                           if nm in again))
        peak = None
        if self.predictor == "graphs":
            try:
                peak = self._predict_graphs(ctx, fw, bw)
            except Exception as e:  # a graph the walk does not describe: the eager axis
                self.graph_prediction_error = f"{type(e).__name__}: {e}"
        if peak is None:
            saved = _saved_storages(fw, kwargs.get("num_fwd_outputs", 0))
            transients = ()
            if op_p is not None and isinstance(pl, (OpPlan, TorchBudgetPlan)):
                # module-level plans carry their eager transient
                transients = _recompute_transients(bw, again & set(op_p.names)
                                                   - op_p.baseline_recomputed)
            peak = predict_compiled_peak(ctx["p"], x, saved, ctx["modules"], transients)
        peak += self.calibration_bytes
        frac = (self._cost[id(pl)] / op_p.forward_seconds if op_p is not None
                and op_p.forward_seconds else pl.recompute_cost["fraction_of_forward"])
        kind = plan_kind(pl)
        self.trials.append((pl.budget_bytes if kind == "module-level" else kind,
                            frac, int(peak)))
        return (peak, fw, bw) if keep else peak

    def _predict_graphs(self, ctx, fw, bw) -> int:
        """The compiled peak walked on the partitioned graphs (``compiled_memory.py``),
        with the eager step's frame (what is live before the forward, and the loss
        between forward and backward), made once per joint graph."""
        from .compiled_memory import EagerFrame, predict_step

        if "frame" not in ctx:
            ctx["frame"] = EagerFrame(ctx["p"].graph)
        return int(predict_step(fw, bw, ctx["frame"],
                                inductor=self.compiler == "inductor")["peak"])

    def _choose_modules(self, ctx, plan, budget, hi, pred_none):
        """The cheapest module-level plan predicted to fit (bisection over the eager
        budget); ``(plan, predicted peak)``."""
        import numpy as np

        from .plan import make_plan, BudgetTooSmallError

        p = ctx["p"]
        # What compiling saves on the unplanned step bounds what it can save on any plan:
        # eager budgets beyond budget + that need not be tried.
        hi = min(hi, budget + max(int(hi - pred_none), 0))
        try:  # the same budget, priced for the compiled step
            plan = make_plan(p, budget)
        except BudgetTooSmallError:
            pass
        best, lo = plan, budget
        pred = self._predict(ctx, plan)
        if pred > budget:  # the compiled step needs more than the eager one: ask for less
            target, best_pred = budget, pred
            for _ in range(self.search_steps):
                target -= int(pred - budget)
                try:
                    tighter = make_plan(p, max(target, 1))
                except BudgetTooSmallError:
                    break
                pred = self._predict(ctx, tighter)
                if pred < best_pred:
                    best, best_pred = tighter, pred
                if pred <= budget:
                    break
            return best, best_pred
        best_pred = pred
        for _ in range(self.search_steps):
            mid = (lo + hi) // 2
            if mid <= lo:
                break
            try:
                pl = make_plan(p, mid)
            except BudgetTooSmallError:  # below the least eager peak: no other plan
                lo = mid
                continue
            if not np.array_equal(pl.choice, best.choice):
                pk = self._predict(ctx, pl)
                if pk > budget:
                    hi = mid
                    continue
                best, best_pred = pl, pk
            lo = mid
        return best, best_pred

    def _op_problem(self, ctx, fw0, bw0):
        """The op-level programme (``op_level.py``) of this joint graph, built once from
        the graph and its unplanned partition (``fw0``, ``bw0``: what it saves and
        recomputes), with this model's figure for the unplanned partition's peak."""
        import numpy as np

        from .op_level import _module_of, build_op_problem

        if self.op_problem is not None:
            return self.op_problem
        from torch._functorch.partitioners import classify_nodes

        joint, kwargs = ctx["joint"], ctx["kwargs"]
        info = classify_nodes(joint, list(kwargs.get("static_lifetime_input_indices")
                                          or []), kwargs.get("num_fwd_outputs", 0))
        out = next(n for n in reversed(fw0.graph.nodes) if n.op == "output")
        saved = {a.name for a in out.args[0][kwargs.get("num_fwd_outputs", 0):]
                 if hasattr(a, "name")}
        recomputed = {n.name for n in bw0.graph.nodes if n.op == "call_function"}
        op_p = build_op_problem(joint, info, saved, recomputed)
        # On the eager step's timeline, as the predictions of the compiled peak are: the
        # programme and the check of its answer see the same memory.
        axis = EagerAxis(ctx["p"], np.zeros(ctx["p"].n, dtype=np.int64), ctx["modules"])
        names = set(op_p.names)

        def readers(nd):
            mods = set()
            for u in nd.users:
                if u.op == "call_function" and u.name not in names:
                    stack = list((u.meta.get("fwd_nn_module_stack") or
                                  u.meta.get("nn_module_stack") or {}).values())
                    if stack:
                        mods.add(_module_path(stack[-1][0]))
            return sorted(mods)

        op_p.place(axis.base, lambda nd: axis.saved_span(_module_of(nd)),
                   lambda nd: axis.backward_span(readers(nd)))
        s0 = np.zeros(op_p.n, dtype=np.int64)
        index = {nm: k for k, nm in enumerate(op_p.names)}
        for nm in saved:  # a saved view keeps its base's storage
            k = index.get(nm)
            stack = [op_p.nodes[k]] if k is not None else []
            while stack:
                nd = stack.pop()
                j = index.get(nd.name)
                if j is None:
                    continue
                if op_p.can_save[j]:
                    s0[j] = 1
                else:
                    stack.extend(nd.all_input_nodes)
        op_p.baseline_peak = float(op_p.memory(s0, np.zeros(op_p.n)).max())
        op_p.baseline_recomputed = recomputed & set(op_p.names)
        self.op_problem = op_p
        return op_p

    def _choose_ops(self, ctx, budget, pred_none):
        """The op-level plan (``op_level.py``) for ``budget``: the programme
        (:meth:`_op_problem`) is calibrated so that its figure for the unplanned
        partition equals the predicted unplanned peak ``pred_none``, then solved; if the
        real partition of the solution is predicted over the budget, the model's limit
        is set below that solution's modelled peak by the excess (doubled at each try)
        and it is solved again (``search_steps`` times at most). Returns ``(plan or None, predicted peak)``."""
        from .op_level import plan_ops

        op_p = self.op_problem
        cal = pred_none - op_p.baseline_peak
        limit = budget - cal
        best, best_pred = None, None
        for attempt in range(self.search_steps):
            pl = plan_ops(op_p, limit, budget, cal, time_limit=self.op_time_limit)
            if pl is None:
                break
            pk = self._predict(ctx, pl)
            if best is None or (pk <= budget < best_pred) or (
                    (pk <= budget) == (best_pred <= budget) and
                    (pl.recompute_seconds < best.recompute_seconds if pk <= budget
                     else pk < best_pred)):
                best, best_pred = pl, pk
            if pk <= budget:
                break
            # Below this solution's own modelled peak, so that the next one differs; by
            # more each time.
            limit = min(limit, pl.modelled_peak_bytes - cal) - (pk - budget) * 2 ** attempt
        return best, best_pred

    def _partition(self, partitioner, joint, joint_inputs, **kwargs):
        import time

        from .op_level import OpPlan, tag_ops

        self._graphs += 1
        t0 = time.perf_counter()
        if self._graphs == 1 and self.adapt:
            import copy

            import torch

            self._joint = (torch.fx.GraphModule(joint, copy.deepcopy(joint.graph)),
                           joint_inputs, partitioner, dict(kwargs))
        chosen = self._choose(joint, joint_inputs, partitioner, kwargs)
        self.choose_seconds += time.perf_counter() - t0
        if self.chosen is None:
            self.chosen = chosen
        if isinstance(chosen, OpPlan):
            self.tagged += tag_ops(joint.graph, chosen.tags, chosen.targets)
        elif not isinstance(chosen, TorchBudgetPlan):
            self.tagged += tag_graph(joint.graph, chosen.policies, self._order())
        fw, bw = _partition_as(chosen, partitioner, joint, joint_inputs, kwargs)
        self.saved_bytes += _saved_bytes(fw, kwargs.get("num_fwd_outputs", 0))
        return fw, bw

    def _better(self, best, best_pred, pl, pk, budget):
        """``(plan, predicted peak)``: ``pl`` if it beats ``best`` (fits where ``best``
        does not; both fit and ``pl`` is cheaper on the joint graph, or as cheap, within
        ``COST_TIE`` of the forward's estimated time, with a lower predicted peak;
        neither fits and ``pl``'s predicted peak is lower)."""
        c, cb = self._cost.get(id(pl)), self._cost.get(id(best))
        if c is None or cb is None:
            return best, best_pred
        op_p = self.op_problem
        tie = COST_TIE * op_p.forward_seconds if op_p is not None else 0.0
        if pk <= budget:
            if best_pred > budget or c < cb - tie or (abs(c - cb) <= tie and pk < best_pred):
                return pl, pk
        elif best_pred > budget and pk < best_pred:
            return pl, pk
        return best, best_pred

    def _extra_candidates(self, ctx) -> list:
        """``(plan, predicted peak)`` of PyTorch's budgeted partitions and of the
        least-peak candidates (once :meth:`least_compiled_peak` has made them); none
        without the op-level model, which prices them."""
        if self.op_problem is None:
            return []
        return list(self._torch_portfolio(ctx)) + list(self._least or [])

    def _torch_portfolio(self, ctx) -> list:
        """PyTorch's min-cut partitioner on this joint graph, without our tags, under
        ``activation_memory_budget`` = each of ``torch_budgets``: ``(TorchBudgetPlan,
        predicted compiled peak)``, each priced (``_cost``) as the other candidates are.
        Values that give the same partition as a larger one are dropped. Made once (the
        joint graph is the same for every budget; :meth:`rechoose` reuses them)."""
        import time

        if self._portfolio is not None:
            return self._portfolio
        t0 = time.perf_counter()
        self._portfolio = []
        import torch

        from .op_level import mutated_placeholders

        op_p = self.op_problem
        num_out = ctx["kwargs"].get("num_fwd_outputs", 0)
        seen = set()
        # Forward ops whose recompute would be wrong, as our plans never recompute them:
        # random ones (a new mask) and those that read an input the step mutates (the
        # recompute would read the new value; autograd's version check fails).
        graph = ctx["joint"].graph
        mutated = mutated_placeholders(graph)
        unsafe = {nd.name for nd in graph.nodes if nd.op == "call_function" and (
            any(a in mutated for a in nd.all_input_nodes)
            or (isinstance(nd.target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded in nd.target.tags))}
        unsafe &= set(op_p.names) if op_p is not None else set()
        for amb in self.torch_budgets:
            pl = TorchBudgetPlan(amb, forward_seconds=op_p.forward_seconds if op_p else 0.0)
            try:
                pk, fw, bw = self._predict(ctx, pl, keep=True)
            except Exception as e:  # the partitioner failed under this value: drop it
                self.torch_budget_error = f"{amb:g}: {type(e).__name__}: {e}"
                continue
            out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
            again = frozenset(n.name for n in bw.graph.nodes if n.op == "call_function")
            bad = sorted(again & unsafe)
            if bad:
                self.torch_budget_error = (f"{amb:g}: recomputes {len(bad)} random or "
                                           f"mutated-input ops, e.g. {bad[0]}")
                continue
            sig = (tuple(getattr(a, "name", None) for a in out.args[0][num_out:]), again)
            if sig in seen:
                continue
            seen.add(sig)
            pl.recompute_seconds = self._cost.get(id(pl), 0.0)
            self._portfolio.append((pl, int(pk)))
        self.portfolio_seconds = time.perf_counter() - t0
        return self._portfolio

    def least_compiled_peak(self) -> int:
        """The least compiled peak this backend predicts for any candidate partition it
        can make: the unplanned one; PyTorch's partitions under each of
        ``torch_budgets``; the module-level least-peak plan (``milp.least_peak``); the
        op-level plan that recomputes every op that may be recomputed; and op-level
        MILP plans asked for less than the least of those. Each is partitioned for real
        and its peak predicted as in the choice (calibrated by the measured unplanned
        step), so it is the least peak a budget can ask of the backend with a
        candidate predicted to fit. Those candidates then compete in later choices
        (:meth:`rechoose`). ``least_peak_source`` says which gave it. A least below the
        unplanned peak by less than ``LEAST_RESOLUTION`` of it is not resolved by the
        predictions: then the unplanned peak is returned and no candidate joins. Needs a
        backend that has compiled a graph with ``adapt=True``."""
        import time

        if self.op_problem is None or self._pred_none is None or self._ctx is None:
            raise PlannerError("least_compiled_peak() needs a backend that has compiled a "
                               "graph with adapt=True (and the op-level model)")
        if self._least is not None:
            return self._least_value
        from .milp import least_peak
        from .op_level import make_op_plan, recompute_all
        from .plan import BudgetTooSmallError, make_plan

        t0 = time.perf_counter()
        ctx, op_p = self._ctx, self.op_problem
        cal = self._pred_none - op_p.baseline_peak
        trials, pred = self.trials, self.predicted_peak_bytes
        self.trials = []
        least = []
        try:
            try:  # module-level: the least-peak eager plan
                lo, _ = least_peak(ctx["p"])
                mod = make_plan(ctx["p"], lo)
                least.append((mod, int(self._predict(ctx, mod))))
            except (BudgetTooSmallError, PlannerError):
                pass
            s, r = recompute_all(op_p)
            if r.any():
                allop = make_op_plan(op_p, s, r, 0, cal, solver="recompute-all")
                least.append((allop, int(self._predict(ctx, allop))))
            floor = min([pk for _, pk in least] +
                        [pk for _, pk in self._torch_portfolio(ctx)] + [self._pred_none])
            # op-level: the MILP asked for less than the least so far
            op, op_pred = self._choose_ops(ctx, int(floor) - 1, self._pred_none)
            if op is not None:
                least.append((op, int(op_pred)))
        finally:
            self.least_trials = self.trials
            self.trials, self.predicted_peak_bytes = trials, pred
        self._least_all = least + list(self._torch_portfolio(ctx)) + [(None, self._pred_none)]
        best_pl, best = min(self._least_all, key=lambda c: c[1])
        if best > self._pred_none * (1 - LEAST_RESOLUTION):
            # No candidate is predicted to save more than the predictions resolve (GPT-2:
            # 52 KB of 1.2 GB, by recomputing every op): none is taken as the least, and
            # none joins the choice for that.
            best_pl, best, least = None, self._pred_none, []
        self._least, self._least_value = least, int(best)
        self.least_peak_source = "unplanned" if best_pl is None else plan_kind(best_pl)
        self.least_compiled_seconds = time.perf_counter() - t0
        return int(best)

    def rechoose(self, plan):
        """The plan this backend would follow for ``plan`` (made on the same problem,
        for another budget), on the joint graph it has already compiled: no new
        compilation. Returns ``(chosen plan, predicted compiled peak)``."""
        if self._joint is None:
            raise PlannerError("rechoose() needs a backend that has compiled a graph with "
                               "adapt=True")
        joint, joint_inputs, partitioner, kwargs = self._joint
        graphs, trials, pred = self._graphs, self.trials, self.predicted_peak_bytes
        self._graphs, self.trials, self.predicted_peak_bytes = 1, [], None
        try:
            chosen = self._choose(joint, joint_inputs, partitioner, dict(kwargs), plan)
            return chosen, self.predicted_peak_bytes
        finally:
            self.rechoose_trials = self.trials  # this call's, for reports
            self._graphs, self.trials, self.predicted_peak_bytes = graphs, trials, pred

    def __call__(self, gm, example_inputs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if self.compiler == "inductor":
            import torch._inductor.config as inductor_config
            from torch._inductor.compile_fx import compile_fx
            from torch._inductor.custom_graph_pass import CustomPartitionerFn

            backend = self

            class Partitioner(CustomPartitionerFn):
                def __call__(self, joint, joint_inputs, **kwargs):
                    return backend._partition(min_cut_rematerialization_partition, joint,
                                              joint_inputs, **kwargs)

                def uuid(self):
                    return None  # the plan is not part of any cache key: never cache

            # No FX graph cache: its key cannot tell one plan from another.
            with inductor_config.patch(custom_partitioner_fn=Partitioner(),
                                       fx_graph_cache=False):
                return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.aot_autograd import aot_module_simplified

        def partition(joint, joint_inputs, **kwargs):
            return self._partition(min_cut_rematerialization_partition, joint, joint_inputs,
                                   **kwargs)

        # Boxed graphs clear their argument list and drop each input after its last use, as
        # Inductor's code does and the walk assumes. A plain call of the graph kept every
        # saved tensor alive to the end of backward (a plan measured 5 MiB above its
        # prediction of 29 MiB).
        return aot_module_simplified(gm, example_inputs, fw_compiler=boxed_nop,
                                     bw_compiler=boxed_nop, partition_fn=partition)


def compile_backend(budget=None, *, plan=None, model=None, inputs=None,
                    compiler: str = "inductor", adapt: bool = True,
                    unplanned_peak_bytes: int | None = None, op_level: bool = True,
                    torch_budgets=TORCH_BUDGETS, predictor: str = "graphs",
                    **plan_kwargs) -> CompileBackend:
    """A backend for ``torch.compile(model, backend=...)`` that checkpoints as planned.

    Give either ``plan`` (from ``pymemplan.plan`` / ``MemoryTrace.plan``), or ``budget``
    with the ``model`` and example ``inputs`` to plan for (``pymemplan.plan`` keywords,
    e.g. ``loss_fn``, ``optimizer``, ``device``, go in ``plan_kwargs``).

    ``compiler``: "inductor" (default) or "aot_eager" (the partitioned graphs run as
    they are: for tests and debugging). ``adapt``: re-choose the plan for the compiled
    graph, which saves less than the eager step (see :meth:`CompileBackend._choose`);
    False follows ``plan`` exactly. ``unplanned_peak_bytes``: the measured peak of the
    compiled step without checkpointing (e.g. ``pymemplan.planner.measure.measure_step``
    on ``torch.compile(model)``), if known: the predictions of the compiled peak are
    shifted by its difference from the predicted one, which covers what the compiler
    allocates that the eager trace cannot see (layout conversions, fused kernels'
    buffers). ``op_level``: let single ops of the joint graph be saved or recomputed
    (``op_level.py``), competing with the module-level plans at the same cost model;
    ``plan`` may also be an ``OpPlan`` or a ``TorchBudgetPlan`` that a backend chose
    (``backend.chosen``), followed as it is on the same model's graph.
    ``torch_budgets``: the ``activation_memory_budget`` values under which PyTorch's own
    partitioner makes candidate partitions (:class:`TorchBudgetPlan`) that compete with
    ours when adapting; ``()`` for none. ``predictor``: how candidates' compiled peaks
    are predicted: "graphs" (walked on their partitioned graphs, ``compiled_memory.py``)
    or "eager" (on the eager step's timeline, the earlier model)."""
    if plan is None:
        if budget is None or model is None or inputs is None:
            raise PlannerError(
                "compile_backend needs a plan to follow: pass plan=pymemplan.plan(model, "
                "inputs, budget=...), or budget=... together with model=... and inputs=... "
                "(the backend only sees Dynamo's graph, not the model, so it cannot trace "
                "the step itself)")
        from . import plan as make

        plan = make(model, inputs, budget, **plan_kwargs)
    return CompileBackend(plan, compiler, adapt, unplanned_peak_bytes=unplanned_peak_bytes,
                          op_level=op_level, torch_budgets=torch_budgets,
                          predictor=predictor)
