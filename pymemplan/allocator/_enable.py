"""Making pymemplan PyTorch's CUDA allocator: configure the plugin, then swap it in."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from . import _library, _plans
from ._config import DEFAULT_POLICY, canonical, format_config, format_value, parse_config

# PyTorch's optional CUDAPluggableAllocator hooks and our functions for them. Not every torch
# version exposes the setters to Python, so each is set only where it exists.
_OPTIONAL_HOOKS = (
    ("set_init_fn", "pymemplan_init"),
    ("set_reset_fn", "pymemplan_reset"),  # torch.cuda.empty_cache()
    ("set_memory_fraction_fn", "pymemplan_memory_fraction"),  # set_per_process_memory_fraction
    ("set_record_stream_fn", "pymemplan_record_stream"),  # Tensor.record_stream
    ("set_base_alloc_fn", "pymemplan_base_alloc"),  # CUDA IPC (torch.multiprocessing)
)


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.canonical: tuple[str, str, str] | None = None  # what configure() last set
        self.config: dict[str, str] | None = None  # the same, as the user wrote it
        self.enabled = False  # swapped into PyTorch
        self.torch_allocator: Any = None  # kept alive: it holds the plugin's function pointers
        self.hooks: tuple[str, ...] = ()  # the optional hooks that were set
        self.warned_cudnn = False
        self.plans: str | None = None  # enable(plans=...): where plans are loaded and saved


_state = _State()


def _config_text(config: dict[str, str] | None) -> str:
    if not config:
        return "policy:pymemplan (defaults)"
    return format_config(config)


def _already_active_message(policy: str, config: dict[str, Any]) -> str:
    asked = _config_text({"policy": policy, **{k: format_value(v) for k, v in config.items()}})
    return (
        f"pymemplan is already the active CUDA allocator of this process, with config "
        f"{_config_text(_state.config)!r}; it cannot be reconfigured once active (asked for "
        f"{asked!r}). Give the config you want to the first pymemplan.enable() call (or in "
        "PYMEMPLAN_ALLOC_CONF) and restart the process.")


def _too_late_message(reason: str, policy: str, config: dict[str, Any]) -> str:
    items = {k: format_value(v) for k, v in config.items()}
    if policy != DEFAULT_POLICY:
        items = {"policy": policy, **items}
    env_conf = (f'PYMEMPLAN_ALLOC_CONF="{format_config(items)}" for the config you asked for'
                if items else 'PYMEMPLAN_ALLOC_CONF="key:value,...", e.g. "max_split_size_mb:512"')
    return (
        f"pymemplan.enable() came too late: {reason}. PyTorch chooses its CUDA allocator once, "
        "when CUDA is initialized, and cannot swap it afterwards. Fix it in one of two ways:\n"
        "  1. call pymemplan.enable() first thing in your program, before any CUDA tensor, "
        ".cuda()/.to('cuda') or torch.cuda call that initializes CUDA; or\n"
        "  2. set PYMEMPLAN_ENABLE=1 in the environment (and optionally "
        f"{env_conf}), so that `import pymemplan` enables it; import "
        "pymemplan before anything touches CUDA.")


def configure(policy: str = DEFAULT_POLICY, **config: Any) -> None:
    """Set the plugin's policy and config, without touching PyTorch.

    enable() calls this; call it yourself only to use the plugin without PyTorch (CuPy
    alone, before ``pymemplan.cupy.use()``). Keys are those of
    enable(). Raises ValueError naming a bad key or value and listing the valid ones, and
    RuntimeError once an allocator is in use with a different config.
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a string such as 'pymemplan', not {policy!r}")
    with _state.lock:
        wanted = canonical(policy, config)
        if _state.enabled and wanted != _state.canonical:
            raise RuntimeError(_already_active_message(policy, config))
        text = format_config(config)
        lib = _library.load()
        if lib.pymemplan_configure(policy.encode(), text.encode()) != 0:
            message = _library.last_error()
            if "already in use" in message:  # allocators exist with another config: not a bad key
                raise RuntimeError(message)
            if "unknown key" in message and "oom_action" not in message:
                # The policy lists its own keys; the plugin adds one of its own.
                message += "; and the plugin's oom_action (raise or null)"
            raise ValueError(message)
        _state.canonical = wanted
        _state.config = {"policy": policy, **{k: format_value(v) for k, v in config.items()}}


def _warn_cudnn_benchmark(torch: Any) -> None:
    if torch.backends.cudnn.benchmark and not _state.warned_cudnn:
        _state.warned_cudnn = True
        warnings.warn(
            "torch.backends.cudnn.benchmark is True: cuDNN's autotuner asks the CUDA allocator "
            "for cacheInfo(), which every pluggable allocator (pymemplan included) lacks, so "
            "convolutions will raise 'CUDAPluggableAllocator does not yet support cacheInfo'. "
            "Set torch.backends.cudnn.benchmark = False.",
            RuntimeWarning, stacklevel=3)


def _set_optional_hooks(raw_allocator: Any) -> tuple[str, ...]:
    done = []
    for setter, symbol in _OPTIONAL_HOOKS:
        if hasattr(raw_allocator, setter):
            getattr(raw_allocator, setter)(_library.function_address(symbol))
            done.append(setter)
    return tuple(done)


def enable(policy: str = DEFAULT_POLICY, *, plans: str | os.PathLike | None = None,
           **config: Any) -> None:
    """Make pymemplan PyTorch's CUDA allocator. Call it before CUDA is initialized.

    ``config`` holds the allocator's keys: max_split_size_mb, roundup_power2_divisions,
    max_non_split_rounding_mb, release_before_grow, cross_stream_reuse, medium_segment_mb,
    and oom_action ("raise", the default: an OOM is a RuntimeError starting with
    "pymemplan: out of memory"; "null": PyTorch gets NULL). ``policy`` is "pymemplan",
    "pymemplan-vmm" (stitched virtual-memory segments), "pymemplan-planned" (plan-guided
    placement over the vmm pool), "torch" (a model of PyTorch's own rules) or "nocache";
    each policy's keys are listed in the README's Policies section.

    ``plans`` (pymemplan-planned only): a file of plans kept across runs. If it exists, its
    plans (save_plans' text) are loaded, so that a job run again with the same shapes (a
    restart, the next run of a sweep) serves its second step from them; the plans this run
    armed are written there when the process exits normally (not when a signal kills it:
    call save_plans() for that). ``{device}`` in the path makes a file per device.

    Calling it again with the same config does nothing; with another config it raises.
    Raises ValueError for a bad key or value, RuntimeError when CUDA was initialized first,
    PluginLoadError when libpymemplan_alloc.so cannot be loaded.
    """
    with _state.lock:
        template = None if plans is None else os.fspath(plans)
        if _state.enabled:
            if canonical(policy, config) != _state.canonical:
                raise RuntimeError(_already_active_message(policy, config))
            if template is not None and template != _state.plans:
                raise RuntimeError(
                    f"pymemplan is already enabled with plans={_state.plans!r}; plans= is taken "
                    f"from the first enable() only (asked for {template!r})")
            return
        if template is not None and policy != "pymemplan-planned":
            raise ValueError(f"plans={template!r} needs the policy 'pymemplan-planned' (asked "
                             f"for {policy!r}): only it makes plans")
        # Read and checked before PyTorch's allocator is swapped: a bad file changes nothing.
        staged = _plans.read_plans(template) if template is not None else {}
        configure(policy, **config)
        try:
            import torch
        except ImportError as e:
            raise ImportError(
                "pymemplan.enable() installs the allocator into PyTorch, which is not "
                "installed. For CuPy alone, use pymemplan.cupy.use().") from e
        if not hasattr(torch._C, "_cuda_customAllocator"):
            raise RuntimeError(
                f"this PyTorch ({torch.__version__}) is built without CUDA, so it has no CUDA "
                "allocator to replace; install a CUDA build of PyTorch (pytorch.org/get-started).")
        if torch.cuda.is_initialized():
            raise RuntimeError(_too_late_message(
                "CUDA is already initialized in this process", policy, config))
        _warn_cudnn_benchmark(torch)
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _library.library_path(), "pymemplan_alloc", "pymemplan_free")
        hooks = _set_optional_hooks(allocator.allocator())
        try:
            torch.cuda.memory.change_current_allocator(allocator)
        except RuntimeError as e:
            if "already initialized" not in str(e):
                raise
            raise RuntimeError(_too_late_message(
                "PyTorch refused to swap its CUDA allocator, which is already in use (CUDA was "
                "initialized, or another allocator was installed first)",
                policy, config)) from e
        _state.enabled = True
        _state.torch_allocator = allocator
        _state.hooks = hooks
        if template is not None:
            _plans.stage(template, staged)
            _state.plans = template


def is_enabled() -> bool:
    """Whether pymemplan is PyTorch's CUDA allocator in this process."""
    return _state.enabled


def active_config() -> dict[str, str] | None:
    """The policy and keys configured in this process ({"policy": ..., key: value}), or None."""
    return dict(_state.config) if _state.config is not None else None


def enable_from_environment() -> None:
    """enable() with PYMEMPLAN_ALLOC_CONF ("key:value,...", `policy:` picks the policy) and
    PYMEMPLAN_PLANS (enable's plans=)."""
    text = os.environ.get("PYMEMPLAN_ALLOC_CONF", "")
    plans = os.environ.get("PYMEMPLAN_PLANS") or None
    try:
        policy, config = parse_config(text)
        enable(policy or DEFAULT_POLICY, plans=plans, **config)
    except ValueError as e:  # say where the bad config came from
        where = f"PYMEMPLAN_ALLOC_CONF={text!r}"
        if plans is not None:
            where += f", PYMEMPLAN_PLANS={plans!r}"
        raise ValueError(f"{where}: {e}") from None
