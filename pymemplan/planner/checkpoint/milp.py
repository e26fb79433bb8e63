"""Exact solver for the general graph: a 0/1 MILP, solved by HiGHS (``scipy.optimize.milp``).

Formulation (``problem.py`` for the memory model)::

    minimize    sum_s cost_s * x_s                     x_s in {0, 1}: checkpoint module s
    subject to  base[i] + sum_s delta[s, i] * x_s <= budget   for every op i that could exceed it
                sum_{s covers f} x_s <= 1              f: each candidate's first forward op

(the second family says no two chosen units overlap: a module and its submodules, two
overlapping Sequential segments, two policies of one unit; forward ranges are intervals,
so these point cliques are all the exclusions, in at most one row per candidate).

Ops with identical delta columns are merged (tightest limit kept), so the rows are few.
Bytes are scaled to KiB for the solver's numerics and the answer is checked again in exact
integers. Under a time limit HiGHS returns its best plan and the gap to its bound.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

import numpy as np

from .problem import CheckpointProblem, Solution, binding_rows

_SCALE = 1024.0


@contextlib.contextmanager
def _without_highs_debug_lines():
    """The HiGHS bundled with scipy prints debug lines of its MIP solver (such as
    "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();") to the C
    stdout even with disp=False. The process's stdout (fd 1) goes to a file while it
    solves; afterwards everything but those lines is written back, so nothing else the
    process printed meanwhile is lost."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield  # no fd 1 to redirect
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            try:
                import ctypes

                ctypes.CDLL(None).fflush(None)  # C stdio buffers, before fd 1 is restored
            except (OSError, AttributeError):
                pass
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not line.startswith(b"Highs")]
            if kept:
                os.write(1, b"".join(kept))


_INFEASIBLE = 2  # scipy.optimize.milp's status for a problem proven infeasible


def highs_milp(*args, **kwargs):
    """``scipy.optimize.milp`` without HiGHS's debug lines on stdout."""
    from scipy.optimize import milp

    with _without_highs_debug_lines():
        return milp(*args, **kwargs)


def _solve(c, A, ub, cliques, n, extra_cols=0, time_limit=10.0):
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import coo_matrix

    cons = []
    if A.shape[0]:
        cons.append(LinearConstraint(A, -np.inf, ub))
    if cliques:
        r = np.concatenate([np.full(len(q), k) for k, q in enumerate(cliques)])
        cidx = np.concatenate([np.asarray(q) for q in cliques])
        M = coo_matrix((np.ones(len(cidx)), (r, cidx)), shape=(len(cliques), n + extra_cols))
        cons.append(LinearConstraint(M, -np.inf, 1))
    integrality = np.r_[np.ones(n), np.zeros(extra_cols)]
    lb = np.zeros(n + extra_cols)
    ubx = np.r_[np.ones(n), np.full(extra_cols, np.inf)]
    return highs_milp(c, constraints=cons, integrality=integrality, bounds=Bounds(lb, ubx),
                      options={"time_limit": float(time_limit), "mip_rel_gap": 1e-6,
                               "disp": False})


class ProvenInfeasible:
    """solve_milp's answer where no choice of candidates fits the budget, proven (by
    HiGHS, or because the budget is below memory no candidate touches): no other solver
    of the same model can find one, so none need be tried."""


def solve_milp(p: CheckpointProblem, budget: int,
               time_limit: float = 10.0) -> Solution | ProvenInfeasible | None:
    """The cheapest plan within ``budget``; ProvenInfeasible if there is none; None if
    HiGHS found none in its time limit (or numerical trouble)."""
    t0 = time.perf_counter()
    D, limit = binding_rows(p, budget)
    if len(limit) and ((D == 0).all(axis=1) & (limit < 0)).any():
        return ProvenInfeasible()  # the budget is below memory no candidate can touch
    c = np.array([c.cost for c in p.candidates], dtype=float)
    c = c / (c.max() if len(c) and c.max() > 0 else 1.0) + 1e-9  # prefer fewer, all else equal
    res = _solve(c, D / _SCALE, np.floor(limit) / _SCALE, p.cliques(), p.n,
                 time_limit=time_limit)
    if res.x is None:
        return ProvenInfeasible() if res.status == _INFEASIBLE else None
    x = np.round(res.x[:p.n]).astype(np.int64)
    if len(limit) and (D @ x > limit).any():
        return None  # numerical trouble: let the caller fall back
    optimal = res.status == 0
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    return Solution(x, "milp", optimal=optimal, gap=0.0 if optimal else gap,
                    seconds=time.perf_counter() - t0,
                    note="" if optimal else f"time limit {time_limit:g} s reached")


def least_peak(p: CheckpointProblem, time_limit: float = 10.0) -> tuple[int, np.ndarray]:
    """The least peak any choice of candidates reaches, and that choice:
    minimize z subject to base[i] + delta[:, i] @ x <= z."""
    if p.n == 0:
        return int(p.base.max()), np.zeros(0, dtype=np.int64)
    # Only ops that could be the peak matter: those above the best single-op floor.
    floor = p.base + np.clip(p.delta, None, 0).sum(axis=0)
    rows = np.nonzero(p.base + np.clip(p.delta, 0, None).sum(axis=0) >= floor.max())[0]
    A = np.c_[p.delta[:, rows].T / _SCALE, -np.ones(len(rows))]
    cost = np.array([c.cost for c in p.candidates], dtype=float)
    c = np.r_[1e-6 * cost / max(cost.max(), 1e-30), 1.0]
    res = _solve(c, A, -p.base[rows] / _SCALE, p.cliques(), p.n, extra_cols=1,
                 time_limit=time_limit)
    if res.x is None:
        x = np.zeros(p.n, dtype=np.int64)
    else:
        x = np.round(res.x[:p.n]).astype(np.int64)
    return p.peak(x), x
