"""pymemplan: make PyTorch training fit in GPU memory, and waste none of it.

``pymemplan.enable()`` makes pymemplan's caching allocator PyTorch's CUDA allocator; see
pymemplan.allocator for its stats, snapshots and known incompatibilities. With
``PYMEMPLAN_ENABLE=1`` in the environment, ``import pymemplan`` enables it, configured by
``PYMEMPLAN_ALLOC_CONF="key:value,..."`` (a ``policy:NAME`` item picks the policy) and, for
pymemplan-planned, ``PYMEMPLAN_PLANS=path`` (plans loaded from there and saved at exit).
"""

import os as _os

__version__ = "0.1.0"

# The allocator's functions, re-exported lazily: `import pymemplan` must stay cheap and
# must not import torch, which would be wasted for the replay tools and the CLI.
_ALLOCATOR_API = frozenset({
    "PluginError", "PluginLoadError", "active_config", "empty_cache", "enable", "explain_memory",
    "is_enabled",
    "is_out_of_memory", "last_error", "library_path", "load_plans", "mark_step",
    "max_memory_allocated",
    "max_memory_reserved", "memory_allocated", "memory_reserved", "memory_stats",
    "memory_summary", "oom_as_torch_error", "record_memory_history", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "save_plans", "save_snapshot", "set_memory_limit", "share_pages",
    "snapshot",
})


# The planner's API, also lazy: `pymemplan.trace(model, inputs)` (pymemplan.planner).
_PLANNER_API = frozenset({"trace", "MemoryTrace", "PlannerError", "UntraceableError"})

# Checkpoint planning, lazy too: `pymemplan.plan(model, inputs, budget="6GiB")` and
# `torch.compile(model, backend=pymemplan.compile_backend(plan=...))`
# (pymemplan.planner.checkpoint).
_CHECKPOINT_API = frozenset({"plan", "compile_backend"})

# What if: `pymemplan.advise(model, inputs, capacity="24GiB")` (pymemplan.whatif).
_WHATIF_API = frozenset({"advise", "Advice"})


def __getattr__(name):
    if name in _ALLOCATOR_API:
        from . import allocator

        value = getattr(allocator, name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _PLANNER_API:
        from . import planner

        value = getattr(planner, name)
        globals()[name] = value
        return value
    if name in _CHECKPOINT_API:
        from .planner import checkpoint

        value = getattr(checkpoint, name)
        globals()[name] = value
        return value
    if name in _WHATIF_API:
        from . import whatif

        value = getattr(whatif, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pymemplan' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _ALLOCATOR_API | _PLANNER_API | _CHECKPOINT_API | _WHATIF_API)


# Enabling at import lets a program use pymemplan without changing its code, and runs
# before the program can initialize CUDA, after which PyTorch cannot swap allocators.
_ENABLE = _os.environ.get("PYMEMPLAN_ENABLE", "").strip()
if _ENABLE.lower() in ("1", "true", "yes", "on"):
    from .allocator._enable import enable_from_environment as _enable_from_environment

    _enable_from_environment()
elif _ENABLE.lower() not in ("", "0", "false", "no", "off") or (
        not _ENABLE and (_os.environ.get("PYMEMPLAN_ALLOC_CONF") or _os.environ.get("PYMEMPLAN_PLANS"))):
    # A user who set one believes pymemplan is on: say that it is not, and why.
    import warnings as _warnings

    _warnings.warn(
        (f"PYMEMPLAN_ENABLE={_ENABLE!r} is neither on (1, true, yes, on) nor off (0, false, no, "
         "off)" if _ENABLE else "PYMEMPLAN_ALLOC_CONF or PYMEMPLAN_PLANS is set, but not "
         "PYMEMPLAN_ENABLE") + ": pymemplan is not PyTorch's allocator in this process. Set "
        "PYMEMPLAN_ENABLE=1, or call pymemplan.enable() before CUDA is used.",
        RuntimeWarning, stacklevel=2)
