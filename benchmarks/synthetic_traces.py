"""Allocation traces built in code for the patterns where fragmentation bites, beside the
recorded training runs: many tensor sizes, memory that grows then shrinks, and two streams.

Each one is a program with the shape of training: parameters and optimizer state allocated
once, then iterations of a forward pass (activations kept for backward, temporaries freed
at once), a backward pass freeing activations in reverse, and an optimizer step.
Deterministic: a seed gives the same trace.
"""

from __future__ import annotations

import numpy as np

from pymemplan.traces import ALLOC, FREE, Trace

KiB, MiB = 1 << 10, 1 << 20


class _Program:
    def __init__(self, name: str):
        self.name = name
        self.events: list[tuple[int, int, int, int, float]] = []
        self.next_id = 1
        self.sizes: dict[int, int] = {}

    def alloc(self, size: int, stream: int = 0) -> int:
        i = self.next_id
        self.next_id += 1
        self.sizes[i] = size
        self.events.append((ALLOC, i, int(size), stream, 0.0))
        return i

    def free(self, i: int, stream: int = 0) -> None:
        self.events.append((FREE, i, self.sizes.pop(i), stream, 0.0))

    def trace(self) -> Trace:
        return Trace.from_events(self.events, name=self.name)


def _layer_sizes(rng: np.random.Generator, layers: int, lo: int, hi: int) -> list[int]:
    # Log-uniform between lo and hi, not aligned to anything: real shapes rarely are.
    return [int(np.exp(rng.uniform(np.log(lo), np.log(hi)))) for _ in range(layers)]


def _step(p: _Program, acts: list[int], temps: list[int], grads: list[int], scale: float = 1.0,
          comm_stream: int | None = None, bucket: int = 0) -> None:
    """One training step: forward keeps activations, backward frees them in reverse."""
    kept = []
    for a, t in zip(acts, temps):
        tmp = p.alloc(max(512, int(t * scale)))
        kept.append(p.alloc(max(512, int(a * scale))))
        p.free(tmp)
    grad_ids = []
    pending_bucket = []
    for layer in reversed(range(len(kept))):
        g_in = p.alloc(max(512, int(acts[layer] * scale)))  # gradient of the activation
        p.free(kept[layer])
        grad_ids.append(p.alloc(grads[layer]))  # parameter gradient
        p.free(g_in)
        if comm_stream is not None:
            # Gradients reduced in buckets on a communication stream, as DDP does.
            pending_bucket.append(grads[layer])
            if sum(pending_bucket) >= bucket or layer == 0:
                buf = p.alloc(sum(pending_bucket), stream=comm_stream)
                p.free(buf, stream=comm_stream)
                pending_bucket = []
    for g in grad_ids:  # optimizer step, then zero_grad(set_to_none=True)
        p.free(g)


def many_sizes(seed: int = 0, iterations: int = 6) -> Trace:
    """Sixty layers whose activations, temporaries and weights all differ in size."""
    rng = np.random.default_rng(seed)
    p = _Program("synthetic_many_sizes")
    acts = _layer_sizes(rng, 60, 64 * KiB, 96 * MiB)
    temps = _layer_sizes(rng, 60, 4 * KiB, 48 * MiB)
    weights = _layer_sizes(rng, 60, 4 * KiB, 24 * MiB)
    for w in weights:  # parameters and two Adam states each
        p.alloc(w), p.alloc(w), p.alloc(w)
    for _ in range(iterations):
        _step(p, acts, temps, weights)
    return p.trace()


def grow_shrink(seed: int = 1) -> Trace:
    """The batch grows step by step, then shrinks: every step has new sizes."""
    rng = np.random.default_rng(seed)
    p = _Program("synthetic_grow_shrink")
    acts = _layer_sizes(rng, 40, 1 * MiB, 24 * MiB)
    temps = _layer_sizes(rng, 40, 256 * KiB, 12 * MiB)
    weights = _layer_sizes(rng, 40, 64 * KiB, 16 * MiB)
    for w in weights:
        p.alloc(w), p.alloc(w), p.alloc(w)
    for scale in (1, 1.5, 2, 3, 4, 3, 2, 1.5, 1, 1):
        _step(p, acts, temps, weights, scale=scale)
    return p.trace()


def two_streams(seed: int = 2, iterations: int = 6) -> Trace:
    """Compute on stream 0 and gradient buckets reduced on stream 1, repeated."""
    rng = np.random.default_rng(seed)
    p = _Program("synthetic_two_streams")
    acts = _layer_sizes(rng, 48, 512 * KiB, 40 * MiB)
    temps = _layer_sizes(rng, 48, 64 * KiB, 16 * MiB)
    weights = _layer_sizes(rng, 48, 64 * KiB, 20 * MiB)
    for w in weights:
        p.alloc(w), p.alloc(w), p.alloc(w)
    for _ in range(iterations):
        _step(p, acts, temps, weights, comm_stream=1, bucket=25 * MiB)
    return p.trace()


ALL = {t.__name__: t for t in (many_sizes, grow_shrink, two_streams)}
