"""The planner: predict a training step's memory without a GPU.

    import torch, pymemplan
    t = pymemplan.trace(model, (x,), loss_fn=..., optimizer=torch.optim.Adam)
    t.peak_bytes, t.breakdown(), t.by_module(), t.tensors_at_peak(5)
    print(t); t.plot("step.png"); t.allocation_trace()
    run_trace([t_128, t_512, t_256])  # a run of steps of several shapes, to replay

Modules, one concern each: ``profile`` (target-device kernels and allocator rounding),
``capture`` (the step on fake tensors), ``probe`` (CPU kernel scratch, measured),
``graph`` (the data type), ``timeline`` (liveness), ``api`` (``trace`` and
``MemoryTrace``), ``report``, ``models`` (built-in examples), ``measure`` (ground truth
from a real step), ``cli``, ``errors``. Importing this package does not import torch.
"""

from .api import LiveTensor, MemoryTrace, run_trace, trace
from .errors import PlannerError, UntraceableError
from .graph import CATEGORIES, PHASES

__all__ = ["trace", "run_trace", "MemoryTrace", "LiveTensor", "PlannerError", "UntraceableError",
           "CATEGORIES", "PHASES"]
