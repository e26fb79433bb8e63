"""Replay allocation traces through allocator policies on a simulated device."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import _core
from ..units import parse_bytes
from .trace import Trace

DEFAULT_POLICIES = ("pymemplan", "torch", "nocache")


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

    def to_dict(self) -> dict:
        return asdict(self)


def parse_policy(spec: str) -> tuple[str, str]:
    """'torch' or 'torch=max_split_size_mb:256,...' -> (name, config); validated."""
    name, _, config = spec.partition("=")
    name = name.strip()
    _core.parse_config(name, config)  # raises AllocatorError naming the bad key/value
    return name, config


def replay(trace: Trace, policies=DEFAULT_POLICIES, *, capacity="80GiB",
           granularity="2MiB") -> list[ReplayResult]:
    """Replay `trace` once per policy (a name, or 'name=key:value,...'), each on a fresh
    simulated device of `capacity` bytes. Allocations that do not fit are counted as OOMs
    and skipped, with their frees."""
    if isinstance(policies, str):
        policies = [policies]
    cap = parse_bytes(capacity)
    gran = parse_bytes(granularity)
    parsed = [(spec, *parse_policy(spec)) for spec in policies]
    trace.validate()
    results = []
    for spec, name, config in parsed:
        r = _core.replay(trace.action, trace.ptr, trace.size, trace.stream, name, config, cap, gran)
        live = r["peak_live_bytes"]
        results.append(ReplayResult(
            trace=trace.name, policy=spec, events=r["events"], peak_live_bytes=live,
            peak_allocated_bytes=r["peak_allocated_bytes"],
            peak_reserved_bytes=r["peak_reserved_bytes"],
            reserved_over_live=r["peak_reserved_bytes"] / live if live else 0.0,
            device_allocs=r["device_allocs"], device_frees=r["device_frees"], ooms=r["ooms"],
            ns_per_event=r["ns_per_event"]))
    return results
