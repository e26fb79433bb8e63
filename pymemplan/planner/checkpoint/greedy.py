"""Greedy fallback: any size, no optimality claim.

Repeatedly makes the move that removes the most excess memory per second of added
recompute, until the budget holds. A move adds a candidate, replacing the chosen ones it
conflicts with (a module's other policy, its ancestors or descendants), so an early
cheap choice (a selective policy) can later be upgraded. Finally drops chosen
candidates that turned out unnecessary, most expensive first. Used when the MILP finds
nothing in its time limit, or on request."""

from __future__ import annotations

import time

import numpy as np

from .problem import CheckpointProblem, Solution, binding_rows


def solve_greedy(p: CheckpointProblem, budget: int) -> Solution | None:
    t0 = time.perf_counter()
    D, limit = binding_rows(p, budget)
    if len(limit) == 0:
        return Solution(np.zeros(p.n, dtype=np.int64), "greedy", False, None, 0.0)
    rivals = [set() for _ in range(p.n)]
    for a, b in p.conflicts():
        rivals[a].add(b)
        rivals[b].add(a)
    cost = np.array([max(c.cost, 1e-15) for c in p.candidates])

    def excess(x):
        return float(np.clip(D @ x - limit, 0, None).sum())

    x = np.zeros(p.n, dtype=np.int64)
    now = excess(x)
    for _ in range(4 * p.n + 1):  # each move lowers the excess; bounded for safety
        if now == 0:
            break
        best, best_ratio, best_x = None, 0.0, None
        for i in np.nonzero(x == 0)[0]:
            y = x.copy()
            y[list(rivals[i])] = 0
            y[i] = 1
            gain = now - excess(y)
            if gain <= 0:
                continue
            added = max(float(cost @ y - cost @ x), 1e-15)
            if gain / added > best_ratio:
                best, best_ratio, best_x = i, gain / added, y
        if best is None:
            return None
        x, now = best_x, excess(best_x)
    if now > 0:
        return None
    for i in sorted(np.nonzero(x)[0], key=lambda i: -cost[i]):
        x[i] = 0
        if (D @ x > limit).any():
            x[i] = 1
    return Solution(x, "greedy", optimal=False, gap=None, seconds=time.perf_counter() - t0)
