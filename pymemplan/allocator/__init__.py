"""pymemplan as PyTorch's CUDA allocator: enable it, read its stats and snapshots.

    import pymemplan
    pymemplan.enable(max_split_size_mb=512)   # first thing, before CUDA is initialized
    ...
    pymemplan.memory_stats()["reserved_bytes.all.peak"]
    pymemplan.save_snapshot("snap.pickle")    # python -m torch.cuda._memory_viz stats snap.pickle

Or, without touching the code: ``PYMEMPLAN_ENABLE=1 PYMEMPLAN_ALLOC_CONF="max_split_size_mb:512"``
in the environment and ``import pymemplan`` at the top of the program
(``PYMEMPLAN_PLANS=plans.txt`` with policy:pymemplan-planned keeps its plans across runs).

The allocator lives in libpymemplan_alloc.so, loaded by PyTorch's
``torch.cuda.memory.CUDAPluggableAllocator``. PyTorch's own torch.cuda.memory_stats(),
max_memory_allocated() and memory._snapshot() cannot look inside a pluggable allocator:
use the functions here, which return the same keys and shapes.

Known incompatibilities of every pluggable allocator, pymemplan included:

- ``torch.backends.cudnn.benchmark = True``: cuDNN's autotuner calls the allocator's
  cacheInfo(), which PyTorch's pluggable allocator does not implement, so convolutions
  raise. enable() warns when it is on; keep it False.
- CUDA graphs: capturing with a private memory pool (``torch.cuda.graph``,
  ``torch.compile(mode="reduce-overhead")``) is not supported.
- ``torch.cuda.memory._record_memory_history()`` records nothing; call
  ``pymemplan.record_memory_history(max_entries=...)`` instead: snapshot() then has the
  allocation history in "device_traces" (allocations, frees, out-of-memory errors; no stacks).
- An out-of-memory error is a RuntimeError starting with "pymemplan: out of memory", not
  torch.cuda.OutOfMemoryError; wrap code that catches the latter in oom_as_torch_error().
"""

from ._enable import active_config, configure, enable, is_enabled
from ._library import PluginError, PluginLoadError, library_path
from ._oom import is_out_of_memory, oom_as_torch_error
from ._stats import (
    empty_cache,
    explain_memory,
    last_error,
    load_plans,
    mark_step,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    record_memory_history,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    save_plans,
    save_snapshot,
    set_memory_limit,
    share_pages,
    snapshot,
)

__all__ = [
    "PluginError",
    "PluginLoadError",
    "active_config",
    "configure",
    "empty_cache",
    "enable",
    "explain_memory",
    "is_enabled",
    "is_out_of_memory",
    "last_error",
    "library_path",
    "load_plans",
    "mark_step",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_summary",
    "oom_as_torch_error",
    "record_memory_history",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "save_plans",
    "save_snapshot",
    "set_memory_limit",
    "share_pages",
    "snapshot",
]
