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


def _model(p: _Program, rng: np.random.Generator, layers: int, acts: tuple[int, int],
           temps: tuple[int, int], weights: tuple[int, int]) -> tuple[list[int], list[int], list[int]]:
    """Sizes of each layer's activation, temporary and weight, log-uniform in the (lo, hi)
    given; the weights are allocated with two Adam states each. Returns the three lists."""
    a = _layer_sizes(rng, layers, *acts)
    t = _layer_sizes(rng, layers, *temps)
    w = _layer_sizes(rng, layers, *weights)
    for x in w:
        p.alloc(x), p.alloc(x), p.alloc(x)
    return a, t, w


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
    acts, temps, weights = _model(p, rng, 60, (64 * KiB, 96 * MiB), (4 * KiB, 48 * MiB),
                                  (4 * KiB, 24 * MiB))
    for _ in range(iterations):
        _step(p, acts, temps, weights)
    return p.trace()


def grow_shrink(seed: int = 1) -> Trace:
    """The batch grows step by step, then shrinks: every step has new sizes."""
    rng = np.random.default_rng(seed)
    p = _Program("synthetic_grow_shrink")
    acts, temps, weights = _model(p, rng, 40, (1 * MiB, 24 * MiB), (256 * KiB, 12 * MiB),
                                  (64 * KiB, 16 * MiB))
    for scale in (1, 1.5, 2, 3, 4, 3, 2, 1.5, 1, 1):
        _step(p, acts, temps, weights, scale=scale)
    return p.trace()


def two_streams(seed: int = 2, iterations: int = 6) -> Trace:
    """Compute on stream 0 and gradient buckets reduced on stream 1, repeated."""
    rng = np.random.default_rng(seed)
    p = _Program("synthetic_two_streams")
    acts, temps, weights = _model(p, rng, 48, (512 * KiB, 40 * MiB), (64 * KiB, 16 * MiB),
                                  (64 * KiB, 20 * MiB))
    for _ in range(iterations):
        _step(p, acts, temps, weights, comm_stream=1, bucket=25 * MiB)
    return p.trace()


def periodic_eval(seed: int = 3, steps: int = 24, every: int = 4) -> Trace:
    """Training with an evaluation step every `every` steps, as most loops do: a forward pass
    at twice the batch that keeps nothing (each layer's output frees the one before it). The
    evaluation interrupts the plan of the training step, which must serve again after it."""
    rng = np.random.default_rng(seed)
    p = _Program("synthetic_periodic_eval")
    acts, temps, weights = _model(p, rng, 32, (1 * MiB, 24 * MiB), (256 * KiB, 12 * MiB),
                                  (64 * KiB, 16 * MiB))
    for step in range(steps):
        if step % every != every - 1:
            _step(p, acts, temps, weights)
        else:
            _evaluation_step(p, acts, temps)
    return p.trace()


def _evaluation_step(p: _Program, acts: list[int], temps: list[int], scale: float = 2.0) -> None:
    """A forward pass at `scale` times the batch that keeps nothing: each layer's output frees
    the one before it."""
    x = p.alloc(max(512, int(scale * max(acts))))
    for a, t in zip(acts, temps):
        y = p.alloc(max(512, int(scale * a)))
        p.free(p.alloc(max(512, int(scale * t))))
        p.free(x)
        x = y
    p.free(x)


def evaluation_loop(seed: int, cycles: int = 8) -> Trace:
    """A training loop drawn at random with an evaluation step every few steps: 6 to 20 layers
    with sizes log-uniform around a scale of 1 to 32 MiB, an evaluation (twice the batch,
    nothing kept) every 2 to 8 steps, `cycles` evaluations."""
    rng = np.random.default_rng(seed)
    p = _Program(f"evaluation_loop_{seed}")
    layers = int(rng.integers(6, 21))
    every = int(rng.integers(2, 9))
    scale = float(np.exp(rng.uniform(np.log(1 * MiB), np.log(32 * MiB))))
    acts, temps, weights = _model(p, rng, layers, (int(scale / 3), int(3 * scale)),
                                  (int(scale / 8), int(scale)), (int(scale / 16), int(scale)))
    for step in range(cycles * every):
        if step % every != every - 1:
            _step(p, acts, temps, weights)
        else:
            _evaluation_step(p, acts, temps)
    return p.trace()


ALL = {t.__name__: t for t in (many_sizes, grow_shrink, two_streams, periodic_eval)}


def random_training(seed: int, steps: int | None = None) -> Trace:
    """A training run drawn at random from the shapes real loops take, for measuring the
    policies on workloads nobody tuned them for. Drawn per seed:
    - depth, tensor sizes (log-normal around a scale of 1 to 64 MiB), activations kept per
      layer, temporaries;
    - the optimizer: SGD, SGD with momentum or Adam, its state made lazily in the first step
      (as torch.optim does), gradients kept across steps or freed after each step;
    - how steps vary: not at all, a batch size drawn from a few, a sequence length drawn
      anew each step, or ragged: a third of the layers get sizes drawn anew each step (tokens
      routed to experts, boxes kept by detection), the rest repeat;
    - loop habits: the next batch made before the last one is released (a prefetching data
      loader), the output kept until the next step replaces it (a loop variable), gradient
      buckets reduced on a second stream.

    `steps` runs that many steps instead of the 3 to 7 drawn (the rest is drawn the same)."""
    rng = np.random.default_rng(seed)
    p = _Program(f"random_training_{seed}")
    scale = float(np.exp(rng.uniform(np.log(1 * MiB), np.log(64 * MiB))))

    def draw(n: int, spread: float, factor: float = 1.0) -> list[int]:
        return [max(512, int(rng.lognormal(np.log(scale * factor), spread))) for _ in range(n)]

    layers = int(rng.integers(6, 49))
    kept_per_layer = int(rng.integers(1, 4))
    acts = draw(layers * kept_per_layer, 0.8)
    temps = draw(layers, 1.0)
    weights = draw(layers * int(rng.integers(1, 4)), 1.2, 0.5)
    states = int(rng.choice([0, 1, 2]))  # SGD, momentum, Adam
    keep_grads = bool(rng.random() < 0.5)
    varies = rng.choice(["fixed", "batch", "seqlen", "ragged"], p=[0.4, 0.2, 0.2, 0.2])
    ragged = rng.random(layers) < 1 / 3
    batches = rng.choice([0.5, 0.75, 1.0, 1.25, 1.5], size=3, replace=False)
    prefetch = bool(rng.random() < 0.3)
    keep_output = bool(rng.random() < 0.3)
    comm_stream = 1 if rng.random() < 0.15 else None
    drawn = int(rng.integers(3, 8))  # drawn either way: the rest of the run is drawn the same
    steps = drawn if steps is None else steps

    for w in weights:
        p.alloc(w)
    grads: list[int] = []
    prev_input = prev_output = None
    for step in range(steps):
        s = 1.0 if varies in ("fixed", "ragged") else (
            float(rng.choice(batches)) if varies == "batch" else float(rng.uniform(0.4, 1.6)))
        layer_s = [s * float(rng.uniform(0.5, 1.5)) if varies == "ragged" and r else s for r in ragged]
        x = p.alloc(max(512, int(scale * s)))
        if prev_input is not None:
            p.free(prev_input)
        kept = []
        for i, t in enumerate(temps):
            tmp = p.alloc(max(512, int(t * layer_s[i])))
            for j in range(kept_per_layer):
                kept.append(p.alloc(max(512, int(acts[i * kept_per_layer + j] * layer_s[i]))))
            p.free(tmp)
        out = p.alloc(max(512, int(scale * s * 2)))
        if prev_output is not None:
            p.free(prev_output)
        bucket: list[int] = []
        for i in reversed(range(len(kept))):
            g = p.alloc(max(512, int(acts[i] * layer_s[i // kept_per_layer])))
            p.free(kept[i])
            if i % kept_per_layer == 0 and not (keep_grads and grads):
                # this layer's parameter gradients, as autograd makes them
                layer = i // kept_per_layer
                for w in weights[layer::layers]:
                    grads.append(p.alloc(w))
                    bucket.append(w)
            if comm_stream is not None and (sum(bucket) >= 16 * scale or i == 0) and bucket:
                buf = p.alloc(sum(bucket), stream=comm_stream)
                p.free(buf, stream=comm_stream)
                bucket = []
            p.free(g)
        if step == 0:  # the optimizer's state, made at its first step, alive to the end
            for w in weights:
                for _ in range(states):
                    p.alloc(w)
        for w in weights[: max(1, len(weights) // 4)]:  # the optimizer's temporaries
            p.free(p.alloc(w))
        if not keep_grads:
            for g in grads:
                p.free(g)
            grads = []
        prev_input = x if prefetch else None
        if not prefetch:
            p.free(x)
        if keep_output:
            prev_output = out
        else:
            p.free(out)
    return p.trace()
