"""The planner's central data type: the ops of one training step and the tensors they make.

Capture (``capture.py``) fills a :class:`StepGraph`; liveness (``timeline.py``), reports
(``report.py``) and the allocation-trace export read it and nothing else. A "tensor" here
is one *storage*: views and in-place results share their base's storage and cost nothing,
which is exactly how an allocator sees them.

This module imports neither torch nor numpy, so the type can be loaded and inspected
anywhere (e.g. from JSON).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# What a byte of memory is for. Order is the stacking order of plots and tables.
PARAMETER = "parameter"
BUFFER = "buffer"
GRADIENT = "gradient"
OPTIMIZER_STATE = "optimizer_state"
INPUT = "input"
ACTIVATION = "activation"   # made in the forward pass and still live when it ends: saved for backward
TEMPORARY = "temporary"     # everything else made during the step
CATEGORIES = (PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, INPUT, ACTIVATION, TEMPORARY)

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)

BEFORE_STEP = -1  # alloc_op of tensors that exist before the step starts (parameters, ...)


@dataclass
class OpNode:
    """One ATen op as dispatched during the step, in dispatch order."""

    index: int
    name: str            # "aten.mm.default"
    module: str          # module path whose forward made it ("" = top level / outside the model)
    phase: str           # forward, backward or optimizer
    autograd_node: str   # the backward node running it ("MmBackward0"), "" outside backward
    scratch: int = 0     # bytes its kernel allocates and frees inside the op (probe.py)
    seq: int = 0         # position of the op's end in the global event order
    flops: float = 0.0   # from shapes, by torch.utils.flop_counter's formulas (0: none known)
    dtype: str = ""      # dtype of its first tensor input: the precision it computes in
    written: int = 0     # bytes of the new storages it allocated


@dataclass
class TensorInfo:
    """One storage live at some point during the step.

    Live interval: from ``alloc_op`` (inclusive; ``BEFORE_STEP`` for tensors that exist
    when the step starts) to ``freed_before`` (exclusive: the first op that ran after the
    storage was released), or to the end of the step when ``freed_before`` is None.
    """

    id: int
    nbytes: int           # exact storage bytes
    size: int             # bytes on the target device (allocator rounding applied)
    shape: tuple
    dtype: str
    category: str
    alloc_op: int
    freed_before: int | None
    last_use: int         # last op that read or wrote it (alloc_op if never used)
    op: str = ""          # op that produced it ("" for tensors that exist before the step)
    module: str = ""
    phase: str = ""
    name: str = ""        # parameter/buffer/input/state name where known
    alloc_seq: int = 0    # position of its allocation in the global event order
    free_seq: int | None = None

    @property
    def freed_after(self) -> int | None:
        """The op after which the storage was released (None: live at the end)."""
        return None if self.freed_before is None else self.freed_before - 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass
class StepGraph:
    ops: list[OpNode]
    tensors: list[TensorInfo]
    device: str                                   # target device: "cuda" or "cpu"
    phase_starts: dict[str, int] = field(default_factory=dict)  # phase -> first op index
    meta: dict = field(default_factory=dict)
    # The optimizer's first step, in which it makes its state (a real run's first step; the
    # traced step is a later one, with the state present): ``ops``, the [start, end) op
    # indices of ``optimizer.step()`` in the traced step, and ``events``, its allocations
    # and frees in order as [action (0 alloc, 1 free), tensor id of the state it makes or
    # -1, id local to this list, bytes]. None when there is no optimizer.
    first_optimizer_step: dict | None = None
    # Per op: the module calls it ran in, outermost first, as ((module path, call number),
    # ...); in backward, those of the forward that made its autograd node (none for
    # AccumulateGrad). And the storages (tensor ids) it read. Checkpoint planning reads a
    # unit's ops, its inputs and its calls (a layer shared across depth is called several
    # times) off them. None when not recorded (a graph made otherwise, as the sharded
    # recorder's).
    op_calls: list | None = None
    op_reads: list | None = None

    @property
    def num_ops(self) -> int:
        return len(self.ops)
