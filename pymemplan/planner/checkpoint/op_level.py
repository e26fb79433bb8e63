"""Op-level recompute units for the compiled step: which forward ops of AOTAutograd's
joint graph to save for backward and which to recompute, chosen by a MILP.

Module-level units (``problem.py``) recompute a whole module or a run of a Sequential's
children. In a compiled step the cheapest memory is often finer-grained: keep the
output of each convolution or matmul, recompute the normalisation, activation and
pointwise ops after it (Inductor fuses them into the backward kernels that read them).
Here every forward op of the joint graph is a unit, in a Checkmate-style 0/1 programme
(Jain et al., 2020) reduced to one forward and one backward pass:

- variables, for every forward node ``v`` that backward may need (directly or to
  recompute something it needs): ``s_v`` (kept from the forward pass until its last
  backward use) and ``r_v`` (recomputed in backward);
- ``s_v + r_v >= 1`` if a backward op reads ``v``;
- ``r_v <= s_u + r_u`` for every forward input ``u`` of ``v``: recomputing needs the
  inputs, saved or recomputed in turn (parameters and the batch are always there);
- ``r_v = 0`` for random ops (a recompute would draw a new mask), impure ops and
  anything the partitioner must keep in one pass; ``s_v = 0`` for views and the tuple of
  a multi-output op (their storage is saved through the base or the ``getitem``);
- memory, at every point ``t`` of the joint graph (forward ops, then backward ops, in
  order): what is there whatever is chosen (forward temporaries until their last forward
  use, backward values until their last use, parameter gradients to the end), plus
  ``size_v`` for each saved ``v`` from its last forward use to its last backward use,
  plus ``size_v`` for each recomputed ``v`` that a non-pointwise backward op reads (it
  is materialised again) from its first to its last backward use, must stay within the
  budget, less a constant: the difference between the measured (or predicted) peak of
  the unplanned compiled step and this model's figure for what the unplanned partition
  saves;
- cost (minimised): ``sum_v r_v c_v``, with ``c_v`` from the same roofline as the
  module-level units (``cost.py``, and ``compile_backend.compiled_costs`` for the
  compiled step): FLOPs (PyTorch's FLOP formulas) over the FLOP rate, plus bytes over
  the bandwidth: for a pointwise op twice its output (one write, one read, as the eager
  model counts) scaled by ``FUSED_POINTWISE`` (0.01: Inductor fuses its recompute into
  the kernel that reads it), for other ops (reductions, matmuls, convolutions) its inputs and
  output; views are free. Ops the unplanned partition already recomputes cost nothing:
  the unplanned compiled step pays for them too. Module-level plans are priced the same
  way, by the ops their partition recomputes, when the backend compares the two.

Compute-bound ops are units too, so a plan can recompute a whole block (as a
module-level unit would) where recomputing cheap ops alone cannot reach the budget.
The memory rows are added lazily: solve with the rows nearest the budget, check every
point, add the violated rows, solve again. HiGHS (``scipy.optimize.milp``) solves it
under a time limit; the gap is reported.

The solution becomes checkpoint tags on the joint graph: ``MUST_RECOMPUTE`` for the
recomputed nodes, ``MUST_SAVE`` for the other candidates, which PyTorch's min-cut
partitioner honours (:func:`tag_ops`). ``compile_backend`` partitions the tagged graph for
real and predicts its compiled peak before taking the plan, and compares it with the
module-level plans at the same cost model.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlannerError

_SCALE = 1024.0

# Share of a pointwise op's eager bytes cost left when Inductor recomputes it in backward:
# a hundredth. Its recompute is fused into the backward kernel that reads it (or, when a
# convolution's or matmul's backward reads it, into the kernel that writes it, which
# reads the saved input instead of the saved output). Measured on resnet50 (CPU,
# Inductor): PyTorch's partition at activation_memory_budget=0.75, which recomputes
# every BatchNorm normalisation and ReLU, costs no measurable step time (0.99-1.00 of
# the unplanned step), where a tenth of the bytes cost (the earlier figure) priced it at
# 7% of the forward. Not nothing: with pointwise recomputes free, the MILP recomputes
# them at will where any plan fits (GPT-2: 137 modules' ops, measured +15%).
FUSED_POINTWISE = 0.01


@dataclass
class OpPlan:
    """An op-level plan for one joint graph: ``tags`` maps node names to "recompute" or
    "save". Offers what the benchmark and the backend read from a module-level
    ``Plan``."""

    budget_bytes: int
    tags: dict                        # node name -> "recompute" | "save"
    targets: dict                     # node name -> str(target), to check a graph matches
    recompute_seconds: float          # estimated, beyond what the unplanned step recomputes
    forward_seconds: float
    solver: str
    optimal: bool
    gap: float | None
    solve_seconds: float
    modelled_peak_bytes: int          # this model's own prediction (calibrated)
    by_module: dict = field(default_factory=dict)  # module -> ops recomputed in it
    problem = None                    # no module-level problem: never re-adapted
    recomputed: list = field(default_factory=list)

    @property
    def recompute_cost(self) -> dict:
        frac = self.recompute_seconds / self.forward_seconds if self.forward_seconds else 0.0
        return {"seconds": self.recompute_seconds, "fraction_of_forward": frac}

    @property
    def policies(self) -> dict:
        """Module path -> "ops: <n> recomputed" (a summary; ``tags`` is the plan)."""
        return {m: f"ops: {n} recomputed" for m, n in sorted(self.by_module.items())}

    @property
    def modules(self) -> list:
        return list(self.by_module)

    @property
    def key(self) -> tuple:
        return tuple(sorted(n for n, p in self.tags.items() if p == "recompute"))


def _val(n):
    return n.meta.get("val") if hasattr(n, "meta") else None


def _storage(v):
    try:
        return v.untyped_storage()._cdata, int(v.untyped_storage().nbytes())
    except Exception:  # no storage to ask (sparse, opaque)
        return None, int(v.numel() * v.element_size())


def _is_tensor(v) -> bool:
    import torch
    return isinstance(v, torch.Tensor)


def node_flops(node) -> float:
    """Forward FLOPs of one joint-graph node, from PyTorch's FLOP formulas (0 if none)."""
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils.flop_counter import flop_registry

    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return 0.0
    f = flop_registry.get(t.overloadpacket)
    if f is None:
        return 0.0
    args, kwargs = pytree.tree_map_only(torch.fx.Node, _val, (node.args, node.kwargs))
    try:
        return float(f(*args, out_val=_val(node), **kwargs))
    except Exception:  # a formula that does not take these arguments: count nothing
        return 0.0


def mutated_placeholders(graph) -> set:
    """Graph inputs that the step mutates (BatchNorm's running statistics, say): written
    in place by an op of the graph (Inductor keeps such mutations in the graph), or
    returned as an input mutation (``InputMutationAOTOutput``) for the runtime to copy
    back. An op that reads one must not be recomputed in backward: the input has changed
    by then (autograd's version check fails, or the recompute reads the new value)."""
    import torch
    from torch.utils import _pytree as pytree

    placeholders = [nd for nd in graph.nodes if nd.op == "placeholder"]
    out = set()
    for nd in graph.nodes:
        t = nd.target
        if nd.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        for k, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = nd.args[k] if k < len(nd.args) else nd.kwargs.get(a.name)
                if isinstance(v, torch.fx.Node) and v.op == "placeholder":
                    out.add(v)
    by_desc = {}
    for ph in placeholders:
        d = ph.meta.get("desc")
        if d is not None:
            by_desc[repr(d)] = ph
    outputs = next(iter(graph.find_nodes(op="output")), None)
    for d in pytree.tree_leaves(outputs.meta.get("desc") or []) if outputs is not None else ():
        mutated = getattr(d, "mutated_input", None)
        if mutated is not None and repr(mutated) in by_desc:
            out.add(by_desc[repr(mutated)])
    return out


def _module_of(node) -> str:
    from .compile_backend import _module_path
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return _module_path(stack[-1][0]) if stack else ""


@dataclass
class OpProblem:
    """The op-level programme for one joint graph (see the module docstring)."""

    names: list            # candidate node names, index = variable
    nodes: list            # the fx nodes
    size: np.ndarray       # bytes of each candidate's own storage (0: view / tuple)
    cost: np.ndarray       # recompute seconds
    can_save: np.ndarray   # bool
    can_recompute: np.ndarray
    needed: np.ndarray     # read directly by backward
    deps: list             # (v, u): r_v <= s_u + r_u
    save_from: np.ndarray  # saved: live over (save_from, until]
    until: np.ndarray
    mat_from: np.ndarray   # recomputed and materialised: live over [mat_from, mat_until];
    mat_until: np.ndarray  # mat_from -1: never materialised
    base: np.ndarray       # bytes at each point whatever is chosen
    forward_seconds: float
    baseline_recomputed: set

    @property
    def n(self) -> int:
        return len(self.names)

    def memory(self, s, r) -> np.ndarray:
        """Modelled bytes at each point with the choice ``s``, ``r`` (0/1 per candidate)."""
        d = np.zeros(len(self.base) + 1, dtype=np.float64)
        for k in np.nonzero(s)[0]:
            if self.until[k] > self.save_from[k]:
                d[self.save_from[k] + 1] += self.size[k]
                d[self.until[k] + 1] -= self.size[k]
        for k in np.nonzero(r)[0]:
            if self.mat_from[k] >= 0:
                d[self.mat_from[k]] += self.size[k]
                d[self.mat_until[k] + 1] -= self.size[k]
        return self.base + np.cumsum(d[:-1])

    def place(self, base, save_span, materialised_span):
        """Move the model onto another timeline (the eager step's, as the backend's
        prediction of the compiled peak uses): ``base``, the bytes at each of its points
        whatever is chosen; ``save_span(node)`` and ``materialised_span(node)``: the
        points at which a saved, or a recomputed and materialised, value is live."""
        self.base = np.asarray(base, dtype=np.float64)
        for k, nd in enumerate(self.nodes):
            a, b = save_span(nd)
            self.save_from[k], self.until[k] = a - 1, b
            if self.mat_from[k] >= 0:
                self.mat_from[k], self.mat_until[k] = materialised_span(nd)


def recompute_all(p: OpProblem):
    """The choice that recomputes every op that may be (and whose inputs can be saved or
    recomputed in turn), saving only what that needs: ``(s, r)``. Its modelled peak is
    about the least any plan reaches."""
    r = p.can_recompute.copy()
    changed = True
    while changed:
        changed = False
        for v, u in p.deps:
            if r[v] and not r[u] and not p.can_save[u]:
                r[v] = False
                changed = True
    s = p.needed & ~r
    for v, u in p.deps:
        if r[v] and not r[u]:
            s[u] = True
    return s.astype(np.int64), r.astype(np.int64)


def build_op_problem(joint, node_info, saved_names=(), recomputed_names=()) -> OpProblem:
    """Candidates, dependencies, lifetimes and costs from AOTAutograd's joint graph.
    ``node_info``: the partitioner's classification (``classify_nodes``), which tells
    forward nodes from backward ones. ``recomputed_names``: forward nodes the unplanned
    partition already recomputes (they cost nothing here)."""
    import torch

    from .cost import DeviceSpeed, is_compute_bound

    speed = DeviceSpeed()
    order = list(joint.graph.nodes)
    idx = {nd: i for i, nd in enumerate(order)}
    T = len(order)
    fwd = [nd for nd in order if nd.op == "call_function" and node_info.is_required_fw(nd)]
    fwd_set = set(fwd)
    # An output of a forward multi-output op (dropout's mask) that only backward reads is
    # still made by the forward op: it is saved or recomputed like the others.
    for nd in order:
        if (nd.op == "call_function" and nd.target is operator.getitem and nd not in fwd_set
                and isinstance(nd.args[0], torch.fx.Node) and nd.args[0] in fwd_set):
            fwd_set.add(nd)
    fwd = [nd for nd in order if nd in fwd_set]
    bwd = [nd for nd in order if nd.op == "call_function" and nd not in fwd_set]
    if not bwd:
        raise PlannerError("the joint graph has no backward ops: nothing to checkpoint")
    last_fwd_point = max((idx[nd] for nd in fwd), default=0)

    def users_in(nd, inside):
        return [u for u in nd.users if u in inside]

    bwd_set = set(bwd)
    mutated = mutated_placeholders(joint.graph)
    # Which forward nodes backward may need: those it reads, and their forward ancestors.
    needed_direct = {nd for nd in fwd if users_in(nd, bwd_set)}
    relevant, stack = set(), list(needed_direct)
    while stack:
        nd = stack.pop()
        if nd in relevant:
            continue
        relevant.add(nd)
        stack.extend(a for a in nd.all_input_nodes if a in fwd_set)
    cands = [nd for nd in fwd if nd in relevant and (_is_tensor(_val(nd))
                                                     or isinstance(_val(nd), (tuple, list)))]
    var = {nd: k for k, nd in enumerate(cands)}
    n = len(cands)

    size = np.zeros(n)
    cost = np.zeros(n)
    can_save = np.zeros(n, dtype=bool)
    can_rec = np.zeros(n, dtype=bool)
    needed = np.zeros(n, dtype=bool)
    save_from = np.zeros(n, dtype=np.int64)
    until = np.zeros(n, dtype=np.int64)
    mat_from = np.full(n, -1, dtype=np.int64)
    fwd_seconds = 0.0
    recomputed_names = set(recomputed_names)
    fwd_transient = np.zeros(T + 1)

    def storage_owner(nd):
        """False when ``nd``'s value shares a storage with one of its inputs (a view)."""
        v = _val(nd)
        if not _is_tensor(v):
            return False
        key, _ = _storage(v)
        for a in nd.all_input_nodes:
            av = _val(a)
            if _is_tensor(av) and key is not None and _storage(av)[0] == key:
                return False
        return True

    for nd in fwd:
        v = _val(nd)
        own = storage_owner(nd)
        nbytes = _storage(v)[1] if own else 0
        in_bytes = sum(_storage(_val(a))[1] if _is_tensor(_val(a)) else 0
                       for a in nd.all_input_nodes)
        fl = node_flops(nd)
        t = nd.target
        pointwise = (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
        heavy = fl > 0 or (isinstance(t, torch._ops.OpOverload)
                           and is_compute_bound(f"aten.{t.overloadpacket.__name__}"))
        if not own:
            moved, scale = 0.0, 1.0          # a view: free
        elif pointwise and not heavy:
            # Fused into the kernel that reads it: one write and one read of its output,
            # as the eager cost model counts, scaled by FUSED_POINTWISE.
            moved, scale = 2.0 * nbytes, FUSED_POINTWISE
        else:  # reductions, copies, matmuls, convolutions: read inputs, write the output
            moved, scale = in_bytes + nbytes, 1.0
        c = fl / speed.flops_per_s + scale * moved / speed.bytes_per_s
        fwd_seconds += fl / speed.flops_per_s + moved / speed.bytes_per_s
        fusers = [u for u in nd.users if u in fwd_set]
        last_f = max([idx[u] for u in fusers] + [idx[nd]])
        if any(u.op == "output" for u in nd.users):
            last_f = last_fwd_point
        if own:
            fwd_transient[idx[nd]] += nbytes
            fwd_transient[last_f + 1] -= nbytes
        k = var.get(nd)
        if k is None:
            continue
        random = isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags
        tagged = nd.meta.get("partitioner_tag") in ("must_be_in_forward", "must_be_in_backward")
        impure = (nd.is_impure() if hasattr(nd, "is_impure") else False) or any(
            a in mutated for a in nd.all_input_nodes)
        recomputable = (isinstance(t, torch._ops.OpOverload) or t is operator.getitem)
        size[k] = nbytes
        cost[k] = 0.0 if nd.name in recomputed_names else c
        can_save[k] = own
        can_rec[k] = recomputable and not (random or tagged or impure)
        needed[k] = nd in needed_direct
        save_from[k] = last_f
        bw_users = [idx[u] for u in nd.users if u in bwd_set]
        if bw_users:
            until[k] = max(bw_users)
            if own:
                mat_from[k] = min(bw_users)
        else:
            until[k] = -1  # filled below from the users it is recomputed for
    # A value kept only to recompute others lives until the last of those is needed.
    for nd in reversed(cands):
        k = var[nd]
        if until[k] < 0:
            later = [until[var[u]] for u in nd.users if u in var]
            until[k] = max(later) if later else save_from[k]
        until[k] = max(until[k], save_from[k])
    deps = []
    for nd in cands:
        for a in nd.all_input_nodes:
            if a in var:
                deps.append((var[nd], var[a]))
            elif a in fwd_set and _is_tensor(_val(a)):
                raise PlannerError(f"internal error: forward input {a} of {nd} is no candidate")

    # Backward values: live from their op to their last use (outputs: to the end).
    bwd_live = np.zeros(T + 1)
    for nd in bwd:
        v = _val(nd)
        if not _is_tensor(v) or not storage_owner(nd):
            continue
        b = _storage(v)[1]
        ends = [T - 1 if u.op == "output" else idx[u] for u in nd.users] or [idx[nd]]
        bwd_live[idx[nd]] += b
        bwd_live[max(ends) + 1] -= b
    base = np.cumsum(fwd_transient[:-1]) + np.cumsum(bwd_live[:-1])
    return OpProblem([nd.name for nd in cands], cands, size, cost, can_save, can_rec, needed,
                     deps, save_from, until, mat_from, until.copy(), base, fwd_seconds,
                     recomputed_names)


def _memory_matrix(p: OpProblem, rows):
    """Rows ``rows`` of the memory constraint, over the variables [s..., r...]."""
    from scipy.sparse import csr_matrix

    rows = np.asarray(rows)
    data, ri, ci = [], [], []
    for k in range(p.n):
        if p.can_save[k] and p.until[k] > p.save_from[k]:
            hit = np.nonzero((rows > p.save_from[k]) & (rows <= p.until[k]))[0]
            data.append(np.full(len(hit), p.size[k]))
            ri.append(hit)
            ci.append(np.full(len(hit), k))
        if p.can_recompute[k] and p.mat_from[k] >= 0:
            hit = np.nonzero((rows >= p.mat_from[k]) & (rows <= p.mat_until[k]))[0]
            data.append(np.full(len(hit), p.size[k]))
            ri.append(hit)
            ci.append(np.full(len(hit), p.n + k))
    if not data:
        return csr_matrix((len(rows), 2 * p.n))
    return csr_matrix((np.concatenate(data) / _SCALE, (np.concatenate(ri), np.concatenate(ci))),
                      shape=(len(rows), 2 * p.n))


def solve_op_problem(p: OpProblem, limit_bytes: float, time_limit: float = 10.0,
                     max_rounds: int = 8):
    """Least-cost ``(s, r)`` with modelled memory within ``limit_bytes`` at every point;
    returns ``(s, r, optimal, gap, seconds)`` or None when none is found. Memory rows are
    added lazily (the points nearest the limit first, then whatever the last solution
    violates)."""
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import coo_matrix

    from .milp import highs_milp

    t0 = time.perf_counter()
    n = p.n
    if n == 0:
        return None
    cons = []
    # need: s_v + r_v >= 1
    nk = np.nonzero(p.needed)[0]
    if len(nk):
        A = coo_matrix((np.ones(2 * len(nk)), (np.r_[np.arange(len(nk)), np.arange(len(nk))],
                                               np.r_[nk, n + nk])), shape=(len(nk), 2 * n))
        cons.append(LinearConstraint(A, 1, np.inf))
    # deps: r_v - s_u - r_u <= 0
    if p.deps:
        d = np.asarray(p.deps)
        m = len(d)
        rr = np.r_[np.arange(m), np.arange(m), np.arange(m)]
        cc = np.r_[n + d[:, 0], d[:, 1], n + d[:, 1]]
        vv = np.r_[np.ones(m), -np.ones(m), -np.ones(m)]
        cons.append(LinearConstraint(coo_matrix((vv, (rr, cc)), shape=(m, 2 * n)), -np.inf, 0))
    ub = np.r_[p.can_save.astype(float), p.can_recompute.astype(float)]
    c = np.r_[np.full(n, 1e-12), p.cost + 1e-12]  # all else equal: save and recompute less
    c = c / max(c.max(), 1e-30)
    # Points that could exceed the limit at all.
    everything = p.memory(p.can_save, p.can_recompute)
    candidates_rows = np.nonzero(everything > limit_bytes)[0]
    if (p.base > limit_bytes).any():
        return None
    rows = list(candidates_rows[np.argsort(-everything[candidates_rows])][:64])
    res = None
    for _ in range(max_rounds):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0:
            break
        extra = []
        if rows:
            extra = [LinearConstraint(_memory_matrix(p, rows), -np.inf,
                                      (limit_bytes - p.base[rows]) / _SCALE)]
        res = highs_milp(c, constraints=cons + extra, integrality=np.ones(2 * n),
                         bounds=Bounds(np.zeros(2 * n), ub),
                         options={"time_limit": float(left), "mip_rel_gap": 1e-4, "disp": False})
        if res.x is None:
            return None
        x = np.round(res.x).astype(np.int64)
        s, r = x[:n], x[n:]
        mem = p.memory(s, r)
        bad = np.nonzero(mem > limit_bytes)[0]
        if len(bad) == 0:
            optimal = res.status == 0
            gap = 0.0 if optimal else float(getattr(res, "mip_gap", 0.0) or 0.0)
            return s, r, optimal, gap, time.perf_counter() - t0
        new = [int(i) for i in bad[np.argsort(-mem[bad])][:64] if int(i) not in set(rows)]
        if not new:
            return None
        rows.extend(new)
    return None


def tag_ops(graph, tags: dict, targets: dict | None = None) -> int:
    """Tag the joint graph's nodes named in ``tags`` ("recompute" -> ``MUST_RECOMPUTE``,
    "save" -> ``MUST_SAVE``); returns how many were tagged for recompute. With
    ``targets`` (node name -> target), a graph whose nodes do not match raises."""
    from torch.utils.checkpoint import CheckpointPolicy

    by_name = {nd.name: nd for nd in graph.nodes}
    missing = [nm for nm in tags if nm not in by_name
               or (targets is not None and str(by_name[nm].target) != targets.get(nm))]
    if missing:
        raise PlannerError(f"the op-level plan does not match this graph ({len(missing)} of "
                           f"{len(tags)} nodes differ, e.g. {missing[0]!r}); plan it on this "
                           f"graph (adapt=True)")
    tagged = 0
    for nm, what in tags.items():
        nd = by_name[nm]
        if what == "recompute":
            nd.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
        else:
            nd.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        nd.meta["ac_graph_id"] = 0
    return tagged


def plan_ops(p: OpProblem, limit_bytes: float, budget: int, calibration: float,
             time_limit: float = 10.0) -> OpPlan | None:
    """Solve ``p`` for ``limit_bytes`` of modelled memory and make the plan (tags)."""
    sol = solve_op_problem(p, limit_bytes, time_limit=time_limit)
    if sol is None:
        return None
    s, r, optimal, gap, secs = sol
    if not r.any():
        return None  # nothing recomputed: the unplanned partition is the same plan
    return make_op_plan(p, s, r, budget, calibration, "op-milp", optimal, gap, secs)


def make_op_plan(p: OpProblem, s, r, budget: int, calibration: float,
                 solver: str = "op-milp", optimal: bool = False, gap=None,
                 seconds: float = 0.0) -> OpPlan:
    """The plan (tags) for the choice ``s``, ``r`` of ``p`` (e.g. :func:`recompute_all`'s)."""
    tags, targets, by_module = {}, {}, {}
    for k, nd in enumerate(p.nodes):
        tags[nd.name] = "recompute" if r[k] else "save"
        targets[nd.name] = str(nd.target)
        if r[k] and p.can_save[k] and nd.name not in p.baseline_recomputed:
            m = _module_of(nd)  # beyond what the unplanned partition recomputes; no views
            by_module[m] = by_module.get(m, 0) + 1
    return OpPlan(budget, tags, targets, float(p.cost @ r), p.forward_seconds, solver,
                  optimal, gap, seconds, int(p.memory(s, r).max() + calibration), by_module)
