"""The checkpoint problem: which modules to recompute in backward instead of saving.

One problem type, read by every solver (``chain_dp``, ``milp``, ``greedy``). Built from a
traced step (:class:`~pymemplan.planner.graph.StepGraph`):

- **Candidates** are modules, and runs of consecutive children of an ``nn.Sequential``
  (segments, as ``checkpoint_sequential`` makes). Checkpointing module M (``torch.utils.checkpoint``,
  non-reentrant) changes the step's memory in three ways, each read off the trace:

  1. *Dropped activations*: storages M's forward ops made that autograd keeps for M's own
     backward (category activation, last used inside M's backward ops) are released when
     M's forward ends, and re-made when M's backward starts. M's output (what its last
     allocating op made) is kept: the next module holds it.
  2. *Held inputs*: checkpoint keeps M's arguments until M's backward. Storages made
     before M that M reads or is given (read or not), and that would be released before
     M's backward, now live until M's backward ends.
     Under the selective policy, the compute-bound outputs it caches live until then too.
  3. *Recompute transient*: re-running M's forward at the start of its backward needs, on
     top of what is live then, the temporaries M's forward had at its worst moment, less
     the dropped activations not yet re-made at that moment.

  So the memory at op ``i`` with candidates ``x`` (0/1) chosen is exactly
  ``base[i] + sum_s x_s * delta[s, i]``: the effects of distinct, non-nested modules
  touch distinct storages and add up. :meth:`CheckpointProblem.simulate` re-simulates the
  timeline with the plan applied (rewriting the storages' live intervals) and is the
  figure reported; tests check that it equals the linear form.
- **Cost** of a candidate: re-running its forward (``cost.py``).
- **Fixed memory**: everything the plan cannot touch (parameters, gradients, optimizer
  state, inputs, backward temporaries) stays in ``base``.

Each module comes in up to two variants: ``full`` (recompute its whole forward) and
``save-compute`` (selective checkpointing: the outputs of its matmuls, convolutions and
attention kernels stay saved, only the cheap memory-bound ops are recomputed). Nested
candidates (a block and its MLP) and two variants of one module exclude each other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from ..capture import OUTSIDE
from ..errors import PlannerError
from ..graph import ACTIVATION, BACKWARD, FORWARD, TEMPORARY, StepGraph, TensorInfo
from ..timeline import build_timeline
from .cost import DeviceSpeed, forward_bytes_per_op, is_compute_bound

FULL = "full"                  # recompute the module's whole forward
SAVE_COMPUTE = "save-compute"  # keep matmul/conv/attention outputs, recompute the rest


@dataclass
class Candidate:
    index: int
    module: str
    f0: int                # first and last forward op of the module
    f1: int
    b0: int                # first and last backward op attributed to it
    b1: int
    dropped: list          # tensor ids released after its forward, re-made in backward
    held: list             # tensor ids checkpoint keeps alive as its inputs
    transient: int         # recompute's extra bytes at b0
    saved_bytes: int       # bytes of the dropped activations
    cost: float            # estimated seconds to re-run its forward
    flops: float | None = None
    policy: str = "full"   # FULL, or SAVE_COMPUTE: selective checkpointing
    # Selective policy: tensor ids of compute-bound outputs, released before the unit's
    # backward, that its cache keeps to the recompute.
    cached: list = field(default_factory=list)
    # A module called several times (a layer shared across depth, as ALBERT's): checkpoint
    # wraps every call, and each call is one part: (f0, f1, b0, b1, dropped, held,
    # transient, cached), as the fields above are for a single call. The fields above then span
    # the calls (f0 of the first, f1 of the last, ...); units exclude each other where
    # their calls' forward ranges overlap (conflicts).
    parts: list = field(default_factory=list)


@dataclass
class CheckpointProblem:
    graph: StepGraph
    base: np.ndarray                 # live bytes at each op, nothing checkpointed
    candidates: list
    delta: np.ndarray                # [candidate, op]: change in live bytes if chosen
    forward_cost: float              # estimated seconds of the whole forward pass
    cost_model: str                  # "flops+bytes" or "bytes"
    skipped: dict = field(default_factory=dict)   # module -> why it is no candidate
    # True when each unit's output storages came from the model's forward (lined up with
    # the trace); False when they were taken to be what the unit's last op made.
    outputs_known: bool = False

    @property
    def n(self) -> int:
        return len(self.candidates)

    def conflicts(self) -> list[tuple[int, int]]:
        """Pairs that cannot both be chosen: units whose calls' forward ops overlap (a
        module and its submodules, overlapping Sequential segments, two policies of one
        unit, a module and one it runs)."""
        spans = [_spans(c) for c in self.candidates]
        out = []
        for a in self.candidates:
            for b in self.candidates:
                if b.index > a.index and any(f0 <= g1 and g0 <= f1 for f0, f1 in spans[a.index]
                                             for g0, g1 in spans[b.index]):
                    out.append((a.index, b.index))
        return out

    def cliques(self) -> list[list[int]]:
        """The same exclusions as cliques: two overlapping ranges both cover the later one's
        start, so one row per distinct start point, of the candidates with a call there."""
        spans = [_spans(c) for c in self.candidates]
        out = []
        for f in sorted({f0 for s in spans for f0, _ in s}):
            members = [c.index for c in self.candidates
                       if any(f0 <= f <= f1 for f0, f1 in spans[c.index])]
            if len(members) > 1:
                out.append(members)
        return out

    def memory(self, x) -> np.ndarray:
        """Live bytes at each op with the candidates in ``x`` checkpointed (linear form)."""
        x = np.asarray(x, dtype=np.int64)
        return self.base + (x @ self.delta if self.n else 0)

    def peak(self, x) -> int:
        return int(self.memory(x).max())

    def cost(self, x) -> float:
        return float(sum(c.cost for c, xi in zip(self.candidates, x) if xi))

    def simulated_graph(self, x) -> StepGraph:
        """The step's graph with the plan applied: dropped activations split into a
        forward life and a recomputed one, held inputs kept to the module's backward, the
        recompute transient as scratch of the module's first backward op, and (CPU target)
        the RNG state checkpoint saves, from the module's forward to its backward."""
        g = self.graph
        tensors = list(g.tensors)
        ops = list(g.ops)
        next_id = len(tensors)
        rng_state = checkpoint_rng_bytes(g.device)
        last_read = _last_forward_reads(g)
        for c, xi in zip(self.candidates, x):
            if not xi:
                continue
            for f0, f1, b0, b1, dropped, held, transient, cached in _parts(c):
                if rng_state:
                    tensors.append(TensorInfo(
                        id=next_id, nbytes=rng_state, size=rng_state, shape=(rng_state,),
                        dtype="uint8", category=TEMPORARY, alloc_op=f0, freed_before=b1 + 1,
                        last_use=b1, op="checkpoint: saved RNG state", module=c.module,
                        phase=FORWARD))
                    next_id += 1
                for tid in dropped:
                    t = tensors[tid]
                    fwd = copy.copy(t)
                    fwd.freed_before = _dropped_after(t, f1, last_read)
                    tensors[tid] = fwd
                    if t.freed_before is None or t.freed_before > b0:
                        again = copy.copy(t)
                        again.id, again.alloc_op, again.phase = next_id, b0, BACKWARD
                        next_id += 1
                        tensors.append(again)
                for ids, end in ((held, b1 + 1), (cached, b0 + 1)):
                    for tid in ids:
                        t = copy.copy(tensors[tid])
                        t.freed_before = max(t.freed_before, end)
                        tensors[tid] = t
                if transient:
                    op = copy.copy(ops[b0])
                    op.scratch += transient
                    ops[b0] = op
        return StepGraph(ops=ops, tensors=tensors, device=g.device,
                         phase_starts=g.phase_starts, meta=dict(g.meta, checkpointed=True),
                         first_optimizer_step=g.first_optimizer_step, op_calls=g.op_calls,
                         op_reads=g.op_reads)

    def simulate(self, x):
        """Timeline of the step with the plan applied, re-simulated from the storages."""
        return build_timeline(self.simulated_graph(x))


def _parts(c: Candidate) -> list[tuple]:
    """A candidate's calls as (f0, f1, b0, b1, dropped, held, transient, cached): its
    parts, or itself for a unit called once."""
    return c.parts or [(c.f0, c.f1, c.b0, c.b1, c.dropped, c.held, c.transient, c.cached)]


def _spans(c: Candidate) -> list[tuple[int, int]]:
    """The forward op ranges of a candidate's calls."""
    return [(p[0], p[1]) for p in _parts(c)]


def _delta(g, n, by_alloc, f0, f1, b0, b1, dropped, held, kept=frozenset(), cached=(),
           last_read=None):
    """Change in live bytes at every op when the module [f0..f1]/[b0..b1] is checkpointed
    dropping ``dropped``, holding ``held`` to its backward's end and ``cached`` to its
    recompute (b0), and the recompute transient (see the module docstring). ``kept``:
    ids of the tensors of the unit that the selective policy keeps, which its recompute
    reads instead of making them. ``last_read``: the last forward op that reads each
    storage; a dropped one read after the unit (an output) goes after that op."""
    d = np.zeros(n + 1, dtype=np.int64)
    dropped_ids = {t.id for t in dropped}
    for t in dropped:
        stop = b0 if t.freed_before is None else min(b0, t.freed_before)
        start = _dropped_after(t, f1, last_read)
        if stop > start:
            d[start] -= t.size
            d[stop] += t.size
    for t in held:
        d[t.freed_before] += t.size
        d[min(b1 + 1, n)] -= t.size
    for t in cached:
        d[t.freed_before] += t.size
        d[min(b0 + 1, n)] -= t.size
    d = np.cumsum(d[:-1])
    # Recompute transient: the module's forward again, on top of what is live anyway at
    # b0: every re-made tensor is counted there already, and what the selective policy
    # keeps is not made again. The recompute's temporaries come while only the tensors
    # re-made before them exist: at each of its ops, those plus the temporaries then,
    # less all the re-made ones.
    live = np.zeros(f1 - f0 + 2, dtype=np.int64)
    remade = np.zeros(f1 - f0 + 2, dtype=np.int64)
    for t in dropped:
        if t.freed_before is None or t.freed_before > b0:
            remade[t.alloc_op - f0] += t.size
    for i in range(f0, f1 + 1):
        for t in by_alloc.get(i, ()):
            if t.id in dropped_ids or t.id in kept or t.phase != FORWARD:
                continue
            stop = f1 + 1 if t.freed_before is None else min(t.freed_before, f1 + 1)
            live[i - f0] += t.size
            live[max(stop, i + 1) - f0] -= t.size
    remade = np.cumsum(remade)[:-1]
    live = (np.cumsum(live)[:-1] + np.array([g.ops[i].scratch for i in range(f0, f1 + 1)])
            + remade - (remade[-1] if len(remade) else 0))
    transient = max(int(live.max()), 0) if len(live) else 0
    d[b0] += transient
    return d, transient


def _dropped_after(t, f1, last_read) -> int:
    """The op before which a storage a checkpointed unit [..f1] drops goes: after the unit,
    or after the last forward op that reads it (an output the caller reads, then drops)."""
    if last_read is None:
        return f1 + 1
    return max(f1, last_read.get(t.id, f1)) + 1


def _forward_and_backward_reads(g):
    """Storage id -> the forward ops that read it, in order, and -> the first backward op
    that reads it (None, None without the trace's reads)."""
    if g.op_reads is None:
        return None, None
    start = g.phase_starts.get(BACKWARD, len(g.ops))
    fwd, first = {}, {}
    for i, reads in enumerate(g.op_reads):
        for tid in reads:
            if i < start:
                fwd.setdefault(tid, []).append(i)
            else:
                first.setdefault(tid, i)
    return fwd, first


def _last_forward_reads(g, reads=None) -> dict | None:
    """Storage id -> the last forward op that reads it (None without the trace's reads);
    ``reads``: :func:`_forward_and_backward_reads` of ``g``, if made already."""
    fwd = (reads or _forward_and_backward_reads(g))[0]
    return None if fwd is None else {tid: ops[-1] for tid, ops in fwd.items()}


def _dropped_outputs(g, path, outs, by_alloc, reads, f1, b0, b1) -> set:
    """The outputs (``(alloc op, bytes)`` keys) of the unit ``path`` [f0..f1]/[b0..b1]
    that only its own backward holds: the unit's backward reads them, nothing before it in
    backward does, and they go within it. Checkpointed, the unit saves nothing, and they go
    once the forward ops that read them have run, as anything else it drops (Hugging Face
    layers return their attention probabilities, which the encoder drops: RemBERT's least
    achievable peak was 24.8 MB, a plan measured 14.6; an Inception block's branches go
    once concatenated: GoogLeNet's plans were 2.7% high). An output a later op saves for
    its backward (a max-pool's input) is read by that op's backward, before the unit's,
    and is kept. So is one that a module after the unit reads: checkpointed too, that
    module would hold it to its own backward, which no unit's delta alone shows."""
    fwd_reads, first_bwd_read = reads
    owner = path.partition("[")[0]  # a segment's Sequential

    def outside_modules(i):  # an op of the unit's ancestors' own code, or of the loss
        m = g.ops[i].module
        return m in ("", OUTSIDE) or owner == m or owner.startswith(m + ".")

    out = set()
    for op, nbytes in outs:
        for t in by_alloc.get(op, ()):
            if (t.nbytes == nbytes and t.category == ACTIVATION and b0 <= t.last_use <= b1
                    and t.freed_before is not None and t.freed_before <= b1 + 1
                    and first_bwd_read.get(t.id, b0) >= b0
                    and all(outside_modules(i) for i in fwd_reads.get(t.id, ()) if i > f1)):
                out.add((op, nbytes))
    return out


def build_problem(g: StepGraph, *, flops: dict | None = None, speed: DeviceSpeed | None = None,
                  min_fraction: float = 1e-3, callable_modules: set | None = None,
                  modules=None, policies=(FULL, SAVE_COMPUTE), sequential_modules=None,
                  max_segments: int = 600, outputs: dict | None = None,
                  mutated_inputs: set | None = None,
                  mutated_compute: set | None = None,
                  mutated_state: dict | set | None = None) -> CheckpointProblem:
    """Candidates, deltas and costs from a traced training step.

    ``flops``: forward FLOPs per module path (``cost.module_flops``); without them the
    cost model counts bytes moved only. Modules that would save less than
    ``min_fraction`` of all activation bytes are left out (they cannot matter and would
    only slow the MILP down).

    ``callable_modules``: the paths of modules that have a forward of their own (from the
    model); without it, a module with no ops of its own whose children are numbered
    (a ``ModuleList``, or a ``Sequential``: the trace cannot tell them apart) is left out,
    as a ModuleList cannot be called. ``modules``: ``fnmatch`` patterns restricting the
    candidates; each matches a whole path, and ``*`` crosses dots, so ``"h.*"`` admits
    ``h.0`` and ``h.0.mlp`` while ``"h.[0-9]"``/``"h.?"`` admit the blocks only.
    ``policies``: the ways a module may be checkpointed (``FULL``, ``SAVE_COMPUTE``).
    ``sequential_modules``: paths of plain ``nn.Sequential`` modules ("" for the model
    itself); runs of their consecutive children become candidates too, named
    ``"path[first:last]"`` (children names, inclusive), at most about ``max_segments`` per
    Sequential. ``outputs``: module path -> ``(alloc op, bytes)`` of the storages its
    forward returned (``cost.forward_facts``, checked to line up with the trace); those
    are kept when it is checkpointed. Without them a unit's output is taken to be what
    its last allocating op made, which in-place tails (``out += x; relu_(out)``) defeat.
    Their ``arguments`` attribute, where present: the same for the tensors each module
    was given, which checkpoint keeps to its backward even where none of its ops reads
    them (without it, only the arguments its ops read are counted).
    ``mutated_inputs``: module paths whose arguments are changed in place after the call
    (``cost.forward_facts``); they are no candidates, nor are runs of a Sequential that
    start with one (checkpoint keeps the arguments, and autograd refuses them changed).
    ``mutated_compute``: module paths in which a compute-bound op's output is changed in
    place later; a unit containing one has no ``save-compute`` variant (selective
    checkpointing caches that output, and refuses it changed). ``mutated_state``: module
    paths whose forward changes their own state (buffers, Python attributes, a generator
    of their own; ``cost.forward_facts``: a dict path -> what, or a set); no unit
    containing one is a candidate (its recompute would not compute the same).
    On the CPU target, each checkpointed unit also holds the CPU RNG state
    ``torch.utils.checkpoint`` saves at its forward (to replay dropout), until its
    backward: 5,056 bytes on this torch. The step traced with the unit checkpointed has it
    (capture.rng_states_recorded); the unplanned step does not."""
    import fnmatch
    speed = speed or DeviceSpeed()
    unknown = [p for p in policies if p not in (FULL, SAVE_COMPUTE)]
    if unknown or not policies:
        raise PlannerError(f"policies must be some of {FULL!r} and {SAVE_COMPUTE!r}, got "
                           f"{tuple(policies)!r}")
    if BACKWARD not in g.phase_starts:
        raise PlannerError("the traced step has no backward pass, so there is nothing to "
                           "checkpoint; trace a training step (the loss must need grad)")
    n = max(g.num_ops, 1)
    base = build_timeline(g).total.astype(np.int64)
    rng_state = checkpoint_rng_bytes(g.device)
    nbytes = forward_bytes_per_op(g)

    # Where each module runs: its forward ops and the backward ops attributed to it.
    fwd: dict[str, list] = {}
    bwd: dict[str, list] = {}
    for op in g.ops:
        if op.module in ("", OUTSIDE) or op.phase not in (FORWARD, BACKWARD):
            continue
        parts = op.module.split(".")
        target = fwd if op.phase == FORWARD else bwd
        for k in range(1, len(parts) + 1):
            target.setdefault(".".join(parts[:k]), []).append(op.index)

    by_alloc: dict[int, list] = {}
    for t in g.tensors:
        if t.alloc_op >= 0 and t.size:
            by_alloc.setdefault(t.alloc_op, []).append(t)
    # Storages released during the forward pass, by the op before which they went.
    freed_fwd: dict[int, list] = {}
    for t in g.tensors:
        if t.alloc_op >= 0 and t.size and t.freed_before is not None and t.phase == FORWARD:
            freed_fwd.setdefault(t.freed_before, []).append(t)
    total_act = sum(t.size for t in g.tensors if t.category == ACTIVATION) or 1
    reads = _forward_and_backward_reads(g)
    last_read = _last_forward_reads(g, reads)

    flops_total = (flops or {}).get("")
    fwd_ops = [op.index for op in g.ops if op.phase == FORWARD]
    forward_cost = speed.seconds(flops_total or 0.0, float(nbytes[fwd_ops].sum()) if fwd_ops else 0.0)

    cands, deltas, skipped = [], [], {}
    calls_of = _module_calls(g)
    own_ops = {op.module for op in g.ops if op.phase == FORWARD}
    children: dict[str, set] = {}
    for path in fwd:
        parent, _, leaf = path.rpartition(".")
        children.setdefault(parent, set()).add(leaf)
    # The units that can be checkpointed: modules, and runs of consecutive children of an
    # nn.Sequential (checkpoint_sequential-style segments; only known with the model).
    units = []  # (name, f0, f1, b0, b1, flops or None, module whose output it returns)
    matched = modules is None
    for path, idx in fwd.items():
        f0, f1 = idx[0], idx[-1]
        if modules is not None and not any(fnmatch.fnmatchcase(path, pat) for pat in modules):
            continue
        matched = True
        if callable_modules is not None:
            if path not in callable_modules:
                skipped[path] = "it has no forward of its own (a container such as ModuleList)"
                continue
        elif path not in own_ops and all(c.isdigit() for c in children.get(path, {"x"})):
            skipped[path] = "it may be a ModuleList, which cannot be called (plan with the model to tell)"
            continue
        if mutated_inputs is not None and path in mutated_inputs:
            skipped[path] = ("an argument of it is changed in place after the call (an "
                             "inplace=True activation?): checkpoint could not recompute it")
            continue
        changes = _changes_state(path, mutated_state)
        if changes:
            what = (mutated_state[changes] if isinstance(mutated_state, dict)
                    else "its buffers (spectral norm, an observer, a counter?)")
            skipped[path] = (f"the forward of '{changes}' changes {what}: a recompute would "
                             f"not compute the same")
            continue
        b = bwd.get(path)
        if not b:
            skipped[path] = "no backward ops (nothing in it needs a gradient)"
            continue
        if calls_of is not None and path in calls_of:  # checkpoint wraps every call
            calls, why = _calls(calls_of[path], b, by_alloc, g.phase_starts[BACKWARD])
            if calls is None:
                skipped[path] = why
                continue
        elif f1 - f0 + 1 == len(idx):
            calls = [(f0, f1, b[0], b[-1])]
        else:
            skipped[path] = ("its forward ops are not contiguous (called more than once, or "
                             "another module's code runs inside it)")
            continue
        units.append((path, calls, None if flops is None else flops.get(path, 0.0), path))
    for parent in sequential_modules or ():
        kids = sorted((c for c in fwd if c.rpartition(".")[0] == parent and c != parent),
                      key=lambda c: fwd[c][0]) if parent else \
            sorted((c for c in fwd if "." not in c), key=lambda c: fwd[c][0])
        kids = [c for c in kids if bwd.get(c)]
        k = len(kids)
        # Every run of 2..max_len children; max_len bounds the candidates to about
        # max_segments per Sequential (all runs when the Sequential is short).
        max_len = max(2, min(k, max_segments // max(k, 1)))
        for i in range(k):
            for j in range(i + 1, min(k, i + max_len)):
                run = kids[i:j + 1]
                if mutated_inputs is not None and run[0] in mutated_inputs:
                    continue  # its input is the first child's, changed in place
                if any(_changes_state(c, mutated_state) for c in run):
                    continue
                f0, f1 = fwd[run[0]][0], fwd[run[-1]][-1]
                if f1 - f0 + 1 != sum(len(fwd[c]) for c in run):
                    continue  # the parent's own code runs in between: not a plain Sequential
                name = f"{parent}[{kids[i].rpartition('.')[2]}:{kids[j].rpartition('.')[2]}]"
                if modules is not None and not any(fnmatch.fnmatchcase(name, pat)
                                                   for pat in modules):
                    continue
                matched = True
                fl = None if flops is None else sum(flops.get(c, 0.0) for c in run)
                units.append((name, [(f0, f1, min(bwd[c][0] for c in run),
                                      max(bwd[c][-1] for c in run))], fl, run[-1]))

    if not matched:
        some = ", ".join(repr(p) for p in list(fwd)[:6])
        raise PlannerError(f"modules={list(modules)!r} matches no module the traced step "
                           f"calls (fnmatch patterns of module paths, such as {some}); "
                           f"leave modules out to consider every module")
    # The storages each module's calls were given, by allocating op (cost.forward_facts).
    given = {path: set(args) for path, args in
             (getattr(outputs, "arguments", None) or {}).items()}
    for path, calls, unit_flops, returner in units:
        # Each call of the unit: what checkpoint drops there and what it holds.
        per_call = []
        for f0, f1, b0, b1 in calls:
            if outputs is not None and returner in outputs:
                kept_out = set(outputs[returner])
            else:
                last_alloc = max((i for i in range(f0, f1 + 1) if i in by_alloc), default=f1)
                kept_out = {(t.alloc_op, t.nbytes) for t in by_alloc.get(last_alloc, ())}
            if last_read is not None:
                kept_out -= _dropped_outputs(g, path, kept_out, by_alloc, reads, f1, b0, b1)
            dropped, held = [], []
            for i in range(f0, f1 + 1):
                for t in by_alloc.get(i, ()):
                    if (t.category == ACTIVATION and (i, t.nbytes) not in kept_out
                            and b0 <= t.last_use <= b1
                            and (t.freed_before is None or t.freed_before > f1 + 1)):
                        dropped.append(t)
            if g.op_reads is not None:
                # Checkpoint keeps the unit's arguments to its backward: every storage made
                # before the unit that it reads, and that would go before then. (One that
                # goes inside the unit's backward anyway is left as it is: a few ops.)
                read = {tid for i in range(f0, f1 + 1) for tid in g.op_reads[i]}
                # And the tensors it was given that none of its ops reads (position ids
                # passed to every layer): checkpoint keeps every argument.
                read |= {t.id for op, size in given.get(path, ()) if 0 <= op < f0
                         for t in by_alloc.get(op, ()) if t.nbytes == size}
                held = [g.tensors[tid] for tid in sorted(read)
                        if g.tensors[tid].alloc_op < f0 and g.tensors[tid].size
                        and g.tensors[tid].freed_before is not None
                        and f0 < g.tensors[tid].freed_before <= b0]
            else:  # only what its forward reads last
                for i in range(f0 + 1, f1 + 2):
                    for t in freed_fwd.get(i, ()):
                        if t.alloc_op < f0 and f0 <= t.last_use <= f1:
                            held.append(t)
            per_call.append((f0, f1, b0, b1, dropped, held, kept_out))
        # Two ways to checkpoint the unit: recompute all of it, or (selective
        # checkpointing) keep the outputs of its compute-bound ops and recompute the rest.
        all_dropped = [t for call in per_call for t in call[4]]
        heavy = [t for t in all_dropped if is_compute_bound(t.op)]
        variants = [FULL] if FULL in policies else []
        cached_changed = bool(mutated_compute) and any(
            g.ops[i].module in mutated_compute for f0, f1, *_ in calls for i in range(f0, f1 + 1))
        if SAVE_COMPUTE in policies and heavy and len(heavy) < len(all_dropped):
            if cached_changed:
                skipped.setdefault(path, "save-compute: an output it would cache is changed "
                                         "in place later")
            else:
                variants.append(SAVE_COMPUTE)
        for policy in variants:
            d = np.zeros(n, dtype=np.int64)
            parts, moved = [], 0.0
            for f0, f1, b0, b1, dropped, held, kept_out in per_call:
                drop = dropped if policy == FULL else [t for t in dropped
                                                       if not is_compute_bound(t.op)]
                keep, cached, kept = held, [], frozenset()
                if policy == SAVE_COMPUTE:
                    # The selective policy caches *every* compute-bound output of the unit
                    # until the recompute reads it back, even those autograd would have let
                    # go earlier. Measured (traced with the plan applied, and in real CPU
                    # steps): one the unit returns is kept to the end of the unit's
                    # backward; the others go when the recompute is over.
                    heavy = [t for i in range(f0, f1 + 1) for t in by_alloc.get(i, ())
                             if is_compute_bound(t.op)]
                    kept = {t.id for t in heavy}
                    heavy_ids = {t.id for t in dropped if is_compute_bound(t.op)}
                    for t in heavy:
                        if (t.id in heavy_ids or t.phase != FORWARD or t.freed_before is None
                                or t.freed_before >= b1 + 1):
                            continue
                        if (t.alloc_op, t.nbytes) in kept_out:
                            keep = keep + [t]
                        elif t.freed_before < b0 + 1:
                            cached.append(t)
                dc, transient = _delta(g, n, by_alloc, f0, f1, b0, b1, drop, keep, kept, cached,
                                       last_read)
                if rng_state:
                    dc[f0:b1 + 1] += rng_state
                d += dc
                parts.append((f0, f1, b0, b1, [t.id for t in drop], [t.id for t in keep],
                              transient, [t.id for t in cached]))
                if policy == FULL:
                    moved += float(nbytes[f0:f1 + 1].sum())
                else:
                    moved += float(sum(nbytes[i] for i in range(f0, f1 + 1)
                                       if not is_compute_bound(g.ops[i].name)))
            dropped_ids = {i for p in parts for i in p[4]}
            saved = sum(t.size for t in all_dropped if t.id in dropped_ids)
            if saved < min_fraction * total_act:
                skipped.setdefault(path, f"{policy}: saves (almost) nothing")
                continue
            # FLOPs: the unit's (every call's); the selective policy keeps the compute-bound
            # ops, and FLOPs are counted for those only.
            fl = unit_flops if policy == FULL else (0.0 if flops is not None else None)
            cands.append(Candidate(len(cands), path, parts[0][0], parts[-1][1],
                                   min(p[2] for p in parts), max(p[3] for p in parts),
                                   [i for p in parts for i in p[4]],
                                   [i for p in parts for i in p[5]],
                                   max(p[6] for p in parts), saved,
                                   speed.seconds(fl or 0.0, moved), fl, policy,
                                   cached=[i for p in parts for i in p[7]],
                                   parts=parts if len(parts) > 1 else []))
            deltas.append(d)
    delta = np.stack(deltas) if deltas else np.zeros((0, n), dtype=np.int64)
    return CheckpointProblem(g, base, cands, delta, forward_cost,
                             "flops+bytes" if flops else "bytes", skipped,
                             outputs_known=outputs is not None)


def _module_calls(g):
    """Module path -> per call, ``[first forward op, last forward op, [backward ops]]``, from
    the call stacks the trace recorded (``StepGraph.op_calls``): forward, every op run
    inside the call (its children's, and those of any other module it runs); backward, the
    ops of the autograd nodes made inside it. None without that record."""
    if g.op_calls is None:
        return None
    backward_start = g.phase_starts.get(BACKWARD, len(g.ops))
    out: dict[str, list] = {}
    for i, stack in enumerate(g.op_calls):
        for path, k in stack:
            if k < 0:  # a recompute's call, run in backward
                continue
            calls = out.setdefault(path, [])
            while len(calls) <= k:
                calls.append([None, None, []])
            call = calls[k]
            if i < backward_start:
                if call[0] is None:
                    call[0] = i
                call[1] = i
            else:
                call[2].append(i)
    return out


def _calls(recorded, attributed, by_alloc, backward_start):
    """A unit's calls as ``([(f0, f1, b0, b1), ...], None)``, or ``(None, why)``.
    ``recorded``: _module_calls' entry for it; ``attributed``: the backward ops attributed
    to its path (its parameters' gradient accumulation included). Checkpoint wraps every
    call, and each is modelled as a unit of its own; the calls' backward ranges must lie
    apart, in reverse order, as autograd runs them. A call that runs no op, or saves
    nothing its backward reads (run without gradients), changes nothing."""
    count = len(recorded)
    if count == 1:
        f0, f1, ops = recorded[0]
        ops = sorted(set(ops) | set(attributed))
        if f0 is None or not ops:
            return None, "no backward ops (nothing in it needs a gradient)"
        return [(f0, f1, ops[0], ops[-1])], None
    runs = [c for c in recorded if c[0] is not None]
    for (_, f1, _), (g0, _, _) in zip(runs, runs[1:]):
        if g0 <= f1:
            return None, (f"it calls itself: of its {count} calls, some run inside others "
                          "(checkpointing the outer call recomputes the inner ones)")
    out = []
    for f0, f1, b in runs:
        saves = any(t.category == ACTIVATION and t.last_use >= backward_start
                    for i in range(f0, f1 + 1) for t in by_alloc.get(i, ()))
        if b and saves:
            out.append((f0, f1, min(b), max(b)))
    if not out:
        return None, "full: saves (almost) nothing"
    for (_, _, b0, _), (_, _, _, b1_next) in zip(out, out[1:]):
        if not b1_next < b0:
            return None, (f"it is called {count} times, and the backward passes of its "
                          "calls interleave")
    return out, None

def _changes_state(path: str, mutated_state) -> str | None:
    """A module at or under ``path`` whose forward changes its own state, if any."""
    for m in sorted(mutated_state or ()):
        if m == path or not path or m.startswith(path + "."):
            return m
    return None


def checkpoint_rng_bytes(device: str) -> int:
    """Bytes of target-device memory one checkpointed unit holds for the RNG state
    ``torch.utils.checkpoint`` saves (``preserve_rng_state``): the CPU generator's state
    on the CPU target; on CUDA the states are host tensors, none on the device."""
    if device != "cpu":
        return 0
    import torch

    return torch.get_rng_state().untyped_storage().nbytes()


@dataclass
class Solution:
    x: np.ndarray            # 0/1 per candidate
    solver: str              # "chain-dp", "milp", "greedy"
    optimal: bool            # proven optimal for the problem as modelled
    gap: float | None        # relative gap to the best bound (0 when optimal; None: unknown)
    seconds: float
    note: str = ""


def binding_rows(p: CheckpointProblem, budget: int):
    """The ops whose memory could exceed ``budget`` for some choice, deduplicated.

    Returns ``(D, limit)``: ``D[r]`` is a column of ``delta`` (one row per distinct
    pattern), and the constraint is ``D[r] @ x <= limit[r]``. Ops that stay under the
    budget whatever is chosen carry no constraint. ``limit < 0`` with an all-zero row
    means the budget is below memory no candidate touches."""
    upper = p.base + np.clip(p.delta, 0, None).sum(axis=0) if p.n else p.base
    rows = np.nonzero(upper > budget)[0]
    if len(rows) == 0:
        return np.zeros((0, p.n), dtype=np.int64), np.zeros(0, dtype=np.int64)
    cols = p.delta[:, rows].T                       # [rows, n]
    limit = budget - p.base[rows]
    # Same pattern at many ops: only the tightest limit matters.
    uniq, inv = np.unique(cols, axis=0, return_inverse=True)
    tight = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(tight, inv.ravel(), limit)
    return uniq, tight


def feasible(p: CheckpointProblem, x, budget: int) -> bool:
    return p.peak(x) <= budget
