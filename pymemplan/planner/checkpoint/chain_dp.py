"""Exact dynamic programme for chains of modules (Revolve/rotor-style).

When the candidate modules run one after another (the blocks of a transformer, the stages
of a ResNet, the layers of an MLP) the memory model has prefix structure: at any op, the
blocks before the current one contribute their constant saving ``m_j`` (activations
dropped, not yet recomputed), the current block something op-specific (recompute
transient, held inputs), later blocks nothing (backward done, or forward not yet run).
The constraint at op ``i`` then reads ``S_k + delta[v_k, i] <= budget - base[i]`` with
``S_k = sum_{j<k} m_{v_j}`` (``v_j``: the option block j takes: not checkpointed, or one
of its policies), and a DP over the blocks in forward order that keeps the Pareto front of
(``S_k``, cost) is exact: no discretisation of memory, unlike rotor's.
:func:`chain_structure` checks that the problem really has this shape; if not, the MILP
is used.
"""

from __future__ import annotations

import time

import numpy as np

from .problem import CheckpointProblem, Solution, binding_rows

MAX_STATES = 200_000  # the front is tiny in practice; beyond this, thin it and say so


def chain_structure(p: CheckpointProblem, D: np.ndarray):
    """``(blocks, middle, stage)`` if the binding rows ``D`` have prefix structure, else
    None. ``blocks``: lists of candidate indices (the policies of one module), in forward
    order; ``middle[i]``: candidate i's constant saving while later blocks run;
    ``stage[r]``: the block row r depends on beyond the prefix (-1: none)."""
    if p.n == 0:
        return None
    by_module: dict[str, list] = {}
    for c in p.candidates:
        by_module.setdefault(c.module, []).append(c.index)
    blocks = sorted(by_module.values(), key=lambda b: p.candidates[b[0]].f0)
    for a, b in zip(blocks, blocks[1:]):  # forward and backward must nest like a chain
        ca, cb = p.candidates[a[0]], p.candidates[b[0]]
        if not (ca.f1 < cb.f0 and cb.b1 < ca.b0):
            return None  # overlapping (nested) modules, or backward not in reverse order
    middle = np.array([p.delta[i, max(c.f1 + 1, c.b0 - 1)]
                       for i, c in enumerate(p.candidates)])
    block_of = np.empty(p.n, dtype=np.int64)
    for k, b in enumerate(blocks):
        block_of[b] = k
    stage = np.full(len(D), -1)
    for r, row in enumerate(D):
        nz = np.nonzero(row)[0]
        if len(nz) == 0:
            continue
        k = block_of[nz].max()
        before = block_of < k
        if not np.array_equal(row[before], middle[before]):
            return None
        stage[r] = k
    return blocks, middle, stage


def solve_chain(p: CheckpointProblem, budget: int) -> Solution | None:
    """Exact when :func:`chain_structure` holds; returns None if it does not, or if no
    plan fits the budget."""
    t0 = time.perf_counter()
    D, limit = binding_rows(p, budget)
    shape = chain_structure(p, D)
    if shape is None:
        return None
    blocks, middle, stage = shape
    if ((stage == -1) & (limit < 0)).any():
        return None
    big = np.iinfo(np.int64).max
    states = [(0, 0.0, ())]          # (S, cost, chosen candidates)
    exact = True
    for k, block in enumerate(blocks):
        rows = np.nonzero(stage == k)[0]
        need_none = limit[rows].min() if len(rows) else big
        need = {i: (limit[rows] - D[rows, i]).min() if len(rows) else big for i in block}
        nxt = []
        for S, c, chosen in states:
            if S <= need_none:
                nxt.append((S, c, chosen))
            for i in block:
                if S <= need[i]:
                    nxt.append((S + int(middle[i]), c + p.candidates[i].cost, chosen + (i,)))
        # Pareto front: lower S (more saved) and lower cost are both better.
        nxt.sort(key=lambda s: (s[0], s[1]))
        front, best = [], float("inf")
        for s in nxt:
            if s[1] < best - 1e-15:
                front.append(s)
                best = s[1]
        if len(front) > MAX_STATES:
            exact = False
            front = front[:: len(front) // MAX_STATES + 1]
        states = front
        if not states:
            return None
    _, _, chosen = min(states, key=lambda s: s[1])
    x = np.zeros(p.n, dtype=np.int64)
    x[list(chosen)] = 1
    return Solution(x, "chain-dp", optimal=exact, gap=0.0 if exact else None,
                    seconds=time.perf_counter() - t0,
                    note="" if exact else f"Pareto front thinned to {MAX_STATES} states")
