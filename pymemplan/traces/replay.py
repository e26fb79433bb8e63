"""Replay allocation traces through allocator policies on a simulated device."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import _core
from ..units import parse_bytes
from .trace import Trace

DEFAULT_POLICIES = ("pymemplan", "pymemplan-vmm", "torch", "nocache")


@dataclass
class ReplayResult:
    trace: str
    policy: str
    events: int
    peak_live_bytes: int        # the lower bound: peak of the sum of requested sizes
    peak_allocated_bytes: int   # peak of allocated (rounded) block bytes
    peak_reserved_bytes: int    # peak of segment bytes held from the device
    reserved_over_live: float
    device_allocs: int
    device_frees: int
    ooms: int
    ns_per_event: float
    # Steady state: the events from the first one a plan served (found by replaying a
    # plan-guided policy), the same events for every policy; None when no plan was used.
    steady_from_event: int | None = None
    steady_peak_live_bytes: int | None = None
    steady_peak_reserved_bytes: int | None = None
    steady_reserved_over_live: float | None = None
    # Device allocations + frees over the same events: driver calls a steady state should
    # not make (a cudaFree waits for the whole device).
    steady_device_calls: int | None = None
    # pymemplan-planned: its plans at the end of the run, as Allocator.export_plans() writes
    # them (for `replay(..., plans=...)` or a later run); not in to_dict().
    plans: str | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("plans")
        return d


def parse_policy(spec: str) -> tuple[str, str]:
    """'torch' or 'torch=max_split_size_mb:256,...' -> (name, config); validated."""
    name, _, config = spec.partition("=")
    name = name.strip()
    _core.parse_config(name, config)  # raises AllocatorError naming the bad key/value
    return name, config


# PYTORCH_CUDA_ALLOC_CONF keys the torch model follows; others are reported as left out.
_MODELLED_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
                  "expandable_segments")


def torch_policy_from_conf(conf: str | None) -> tuple[str, list[str]]:
    """The replay policy for PyTorch's allocator as ``PYTORCH_CUDA_ALLOC_CONF=conf`` sets it
    ("torch" or "torch=key:value,..."), and the settings the model leaves out (e.g.
    ``garbage_collection_threshold``, or ``backend:cudaMallocAsync``, another allocator).
    Raises ValueError for a value the model rejects, naming the variable."""
    from ..allocator._config import split_items

    kept, left = [], []
    for item in split_items(conf or ""):
        key, _, value = item.strip().partition(":")
        if key.strip():
            if key.strip() in _MODELLED_KEYS:
                kept.append(f"{key.strip()}:{value.strip()}")
            else:
                left.append(item.strip())
    policy = "torch=" + ",".join(kept) if kept else "torch"
    try:
        parse_policy(policy)
    except _core.AllocatorError as e:  # names the bad key or value, and the valid ones
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF={conf!r}: {e}") from None
    return policy, left


def replay(trace: Trace, policies=DEFAULT_POLICIES, *, capacity="80GiB",
           granularity="2MiB", plans: str | None = None) -> list[ReplayResult]:
    """Replay `trace` once per policy (a name, or 'name=key:value,...'), each on a fresh
    simulated device of `capacity` bytes. Allocations that do not fit are counted as OOMs
    and skipped, with their frees.

    When a plan-guided policy among them serves requests from a plan, every result also
    gets the steady-state peaks: over the events from the first one a plan served.

    `plans`: text from an earlier run (a result's `plans`, or `Allocator.export_plans()`)
    that each pymemplan-planned policy starts with, as a restarted job would; results of
    that policy carry their own plans in `plans`."""
    if isinstance(policies, str):
        policies = [policies]
    cap = parse_bytes(capacity)
    gran = parse_bytes(granularity)
    parsed = [(spec, *parse_policy(spec)) for spec in policies]
    trace.validate()
    results = []
    runs = []
    if plans is not None and not any(name == "pymemplan-planned" for _, name, _ in parsed):
        raise ValueError("replay: plans are for the pymemplan-planned policy, which is not "
                         f"among {[spec for spec, _, _ in parsed]}")
    seed = {name: (plans or "") if name == "pymemplan-planned" else "" for _, name, _ in parsed}
    for spec, name, config in parsed:
        runs.append(_core.replay(trace.action, trace.ptr, trace.size, trace.stream, name, config,
                                 cap, gran, plans=seed[name]))
    planned = [r["first_planned_event"] for r in runs if r["first_planned_event"] >= 0]
    steady_from = min(planned) if planned else None
    for (spec, name, config), r in zip(parsed, runs):
        live = r["peak_live_bytes"]
        result = ReplayResult(
            trace=trace.name, policy=spec, events=r["events"], peak_live_bytes=live,
            peak_allocated_bytes=r["peak_allocated_bytes"],
            peak_reserved_bytes=r["peak_reserved_bytes"],
            reserved_over_live=r["peak_reserved_bytes"] / live if live else 0.0,
            device_allocs=r["device_allocs"], device_frees=r["device_frees"], ooms=r["ooms"],
            ns_per_event=r["ns_per_event"],
            plans=r["plans"] if name == "pymemplan-planned" else None)
        if steady_from is not None:
            # A second run: polling reserved memory after every event would skew the timing.
            s = _core.replay(trace.action, trace.ptr, trace.size, trace.stream, name, config,
                             cap, gran, steady_from, plans=seed[name])
            result.steady_from_event = steady_from
            result.steady_peak_live_bytes = s["steady_peak_live_bytes"]
            result.steady_peak_reserved_bytes = s["steady_peak_reserved_bytes"]
            result.steady_device_calls = s["steady_device_allocs"] + s["steady_device_frees"]
            if s["steady_peak_live_bytes"] > 0:
                result.steady_reserved_over_live = (s["steady_peak_reserved_bytes"]
                                                    / s["steady_peak_live_bytes"])
        results.append(result)
    return results
