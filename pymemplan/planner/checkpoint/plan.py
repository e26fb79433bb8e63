"""``Plan``: what to checkpoint for a memory budget, and how it was decided.

:func:`make_plan` picks the solver: the exact chain DP when the candidates form a chain,
else the MILP under a time limit (its gap reported), else the greedy heuristic. The
reported peak is always re-simulated from the storages with the plan applied
(:meth:`CheckpointProblem.simulate`), whole step included: parameters, gradients,
optimizer state, temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...units import format_bytes, parse_bytes
from ..errors import PlannerError
from ..graph import GRADIENT, INPUT, OPTIMIZER_STATE, PARAMETER, BUFFER
from .chain_dp import solve_chain
from .greedy import solve_greedy
from .milp import ProvenInfeasible, least_peak, solve_milp
from .problem import CheckpointProblem, Solution

SOLVERS = ("auto", "chain-dp", "milp", "greedy")


class BudgetTooSmallError(PlannerError):
    """No plan reaches the budget; ``least_peak_bytes`` is the least any plan reaches."""

    def __init__(self, message: str, least_peak_bytes: int, breakdown: dict):
        super().__init__(message)
        self.least_peak_bytes = least_peak_bytes
        self.breakdown = breakdown


@dataclass(frozen=True)
class Decision:
    module: str
    activation_bytes: int     # saved for backward by the module; dropped when recomputed
    recompute_seconds: float  # estimated cost of re-running its forward
    policy: str = "full"      # "full" or "save-compute" (selective: matmul outputs kept)


@dataclass
class Plan:
    budget_bytes: int
    solver: str
    optimal: bool
    gap: float | None
    solve_seconds: float
    predicted_peak_bytes: int          # whole step, re-simulated with the plan applied
    unplanned_peak_bytes: int          # the same step, nothing checkpointed
    recompute_seconds: float           # estimated extra time per step
    forward_seconds: float             # estimated forward time, for the fraction
    recomputed: list                   # Decisions: modules checkpointed
    saved: list                        # Decisions: candidate modules left as they are
    breakdown: dict                    # bytes by category at the predicted peak
    cost_model: str
    note: str = ""
    problem: CheckpointProblem | None = None
    choice: np.ndarray | None = None   # 0/1 per candidate of ``problem``
    # The peak of the step traced again with the plan applied to the model (verify_plan);
    # None when not verified.
    verified_peak_bytes: int | None = None

    @property
    def recompute_cost(self) -> dict:
        frac = self.recompute_seconds / self.forward_seconds if self.forward_seconds else 0.0
        return {"seconds": self.recompute_seconds, "fraction_of_forward": frac}

    @property
    def modules(self) -> list[str]:
        return [d.module for d in self.recomputed]

    @property
    def policies(self) -> dict[str, str]:
        """module path -> "full" or "save-compute", for the checkpointed modules."""
        return {d.module: d.policy for d in self.recomputed}

    def apply(self, model):
        """Checkpoint the planned modules of ``model`` in place; returns ``model``."""
        from .apply_eager import apply
        return apply(model, self.policies)

    @staticmethod
    def remove(model):
        """Restore every module of ``model`` that a plan checkpointed; returns ``model``."""
        from .apply_eager import remove
        return remove(model)

    def summary(self) -> str:
        rc = self.recompute_cost
        status = ("optimal" if self.optimal else
                  f"gap {self.gap:.2%}" if self.gap is not None else "heuristic, no bound")
        lines = [
            f"checkpoint plan for a budget of {format_bytes(self.budget_bytes)}",
            f"  predicted peak  {format_bytes(self.predicted_peak_bytes)} "
            f"(unplanned {format_bytes(self.unplanned_peak_bytes)})",
            f"  recompute       {rc['seconds'] * 1e3:.3f} ms est. = "
            f"{rc['fraction_of_forward']:.1%} of the forward (cost model: {self.cost_model})",
            f"  solver          {self.solver}, {status}, {self.solve_seconds:.2f} s"
            + (f" ({self.note})" if self.note else ""),
            f"  checkpointed    {len(self.recomputed)} module(s)",
        ]
        for d in self.recomputed[:20]:
            lines.append(f"    {d.module:<40} {d.policy:<12} drops "
                         f"{format_bytes(d.activation_bytes):>10}")
        if len(self.recomputed) > 20:
            lines.append(f"    ... and {len(self.recomputed) - 20} more")
        if self.verified_peak_bytes is not None:
            lines.insert(2, f"  verified peak   {format_bytes(self.verified_peak_bytes)} "
                            f"(the step traced again with the plan applied)")
        lines.append("  at the peak     " + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in self.breakdown.items() if v))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "solver": self.solver,
                "optimal": self.optimal, "gap": self.gap, "solve_seconds": self.solve_seconds,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "verified_peak_bytes": self.verified_peak_bytes,
                "unplanned_peak_bytes": self.unplanned_peak_bytes,
                "recompute_cost": self.recompute_cost, "cost_model": self.cost_model,
                "recomputed": self.policies,
                "breakdown": self.breakdown, "note": self.note}


def _budget(budget) -> int:
    try:
        b = parse_bytes(budget)
    except (TypeError, ValueError) as e:
        raise PlannerError(f"budget={budget!r} is not a size: give bytes (an int) or a "
                           f"string such as '6GiB' or '512MiB' ({e})") from None
    if b <= 0:
        raise PlannerError(f"budget must be positive, got {budget!r}")
    return b


def _too_small(p: CheckpointProblem, budget: int) -> BudgetTooSmallError:
    least, x = least_peak(p)
    tl = p.simulate(x)
    i = tl.peak_index
    bd = {c: int(a[i]) for c, a in tl.by_category.items()}
    phase = p.graph.ops[i].phase if p.graph.ops else "?"
    top = sorted(bd.items(), key=lambda kv: -kv[1])[:3]
    fixed = sum(bd.get(c, 0) for c in (PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, INPUT))
    hints = ["a smaller batch (or micro-batches with gradient accumulation)"]
    if bd.get(OPTIMIZER_STATE):
        hints.append("an optimizer with less state (SGD, Adafactor) or sharded/offloaded "
                     "optimizer state")
    hints.append("bf16/fp16 autocast")
    if fixed > budget:
        hints.append("sharding parameters and gradients (FSDP/ZeRO)")
    # Planned from the trace alone, containers were left out: with the model they may fit.
    unknown = sorted(m for m, why in p.skipped.items() if "plan with the model" in why)
    without_model = (f" This was planned without the model: {len(unknown)} module(s) that may "
                     f"be containers ({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}) "
                     "were no candidates. Pass model= and inputs= (the ones traced) to "
                     "plan them too." if unknown else "")
    # Modules that could have saved memory but are no candidates: the user may change that
    # (a module called twice, a forward that changes state, an inplace activation).
    left_out = [(m, why) for m, why in sorted(p.skipped.items())
                if not any(s in why for s in ("saves (almost) nothing", "no forward of its own",
                                              "plan with the model", "no backward ops"))]
    not_candidates = (f" {len(left_out)} module(s) were no candidates: "
                      + "; ".join(f"'{m}': {why}" for m, why in left_out[:3])
                      + ("; ..." if len(left_out) > 3 else "")
                      + " (all of them: checkpoint_problem(...).skipped)." if left_out else "")
    return BudgetTooSmallError(
        f"no checkpoint plan fits {format_bytes(budget)}: the least achievable peak is "
        f"{format_bytes(least)} (in the {phase} pass, at op {i}), dominated by "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in top)
        + f"; {format_bytes(fixed)} of it is parameters, gradients, optimizer state and "
        f"inputs, which checkpointing cannot remove. Options: raise the budget to at "
        f"least {format_bytes(least)}, or use " + "; ".join(hints) + "." + without_model
        + not_candidates,
        least, bd)


def make_plan(p: CheckpointProblem, budget, *, solver: str = "auto",
              time_limit: float = 10.0) -> Plan:
    b = _budget(budget)
    if solver not in SOLVERS:
        raise PlannerError(f"solver={solver!r}: choose one of {', '.join(SOLVERS)}")
    sol: Solution | None = None
    note = ""
    if p.peak(np.zeros(p.n, dtype=np.int64)) <= b:
        sol = Solution(np.zeros(p.n, dtype=np.int64), "none", True, 0.0, 0.0,
                       "the step fits without checkpointing")
    elif solver in ("auto", "chain-dp"):
        sol = solve_chain(p, b)
        if sol is None and solver == "chain-dp":
            if not _is_chain(p):
                raise PlannerError(
                    "solver='chain-dp' needs candidates that form a chain (no nested "
                    "modules, forward and backward in reverse order); use solver='milp' "
                    "or 'auto'")
    if sol is None and solver in ("auto", "milp"):
        sol = solve_milp(p, b, time_limit=time_limit)
        if isinstance(sol, ProvenInfeasible):  # greedy would search in vain
            raise _too_small(p, b)
    if sol is None and solver in ("auto", "greedy"):
        sol = solve_greedy(p, b)
        if sol is not None and solver == "auto":
            note = "MILP found no plan in its time limit; greedy used"
    if sol is None:
        raise _too_small(p, b)
    tl = p.simulate(sol.x)
    peak = tl.peak_bytes
    if peak > b:  # the linear model and the re-simulation disagree: a bug, say it plainly
        raise PlannerError(f"internal error: the plan's re-simulated peak "
                           f"{format_bytes(peak)} exceeds the budget {format_bytes(b)}")
    i = tl.peak_index
    dec = [Decision(c.module, c.saved_bytes, c.cost, c.policy) for c in p.candidates]
    chosen = [d for d, xi in zip(dec, sol.x) if xi]
    done = {d.module for d in chosen}
    kept = {}
    for d, xi in zip(dec, sol.x):  # one entry per module left alone (its full variant)
        if not xi and d.module not in done and d.module not in kept:
            kept[d.module] = d
    return Plan(b, sol.solver, sol.optimal, sol.gap, sol.seconds, peak,
                int(p.base.max()), sum(d.recompute_seconds for d in chosen), p.forward_cost,
                chosen, list(kept.values()),
                {c: int(a[i]) for c, a in tl.by_category.items()}, p.cost_model,
                "; ".join(s for s in (sol.note, note) if s), p, np.asarray(sol.x))


VERIFY_ROUNDS = 3  # re-solves after a plan re-traced over its budget


def verify_plan(pl: Plan, retrace, model, inputs, unplanned_peak: int, *,
                solver: str = "auto", time_limit: float = 10.0) -> Plan:
    """Trace the step again with ``pl`` applied to ``model`` (``retrace(model, inputs)``
    returns a trace) and record its peak in ``verified_peak_bytes``. The plan's peak is
    predicted by a model linear in the units' choices; checkpointed units can interact
    in ways it does not see (DenseNet's layers, which read every earlier layer's output:
    3 MiB over a 111 MiB budget). A plan traced over its budget is solved again for
    the budget less the excess, up to ``VERIFY_ROUNDS`` times. If none fits, the plan
    that traced lowest is returned with a warning (its ``verified_peak_bytes`` says by
    how much it misses), or no plan at all where every one traced above the step without
    one. The trace counts the RNG state checkpoint saves at each call (CPU target). The
    model is left as it was."""
    import warnings

    from .apply_eager import apply, checkpointed_modules, remove

    if checkpointed_modules(model):
        raise PlannerError("verifying a plan applies it to the model, which already has a "
                           "plan applied: call plan.remove(model) first, or pass "
                           "verify=False")
    budget, target = pl.budget_bytes, pl.budget_bytes
    tried = []
    for round_ in range(VERIFY_ROUNDS + 1):
        if not pl.recomputed:
            peak = unplanned_peak
        else:
            apply(model, pl.policies)
            try:
                peak = int(retrace(model, inputs).peak_bytes)
            finally:
                remove(model)
        pl.verified_peak_bytes = peak
        tried.append(pl)
        if peak <= budget or round_ == VERIFY_ROUNDS:
            break
        target -= peak - budget
        try:
            again = make_plan(pl.problem, target, solver=solver, time_limit=time_limit)
        except BudgetTooSmallError:
            break
        again.budget_bytes = budget
        again.note = "; ".join(x for x in (again.note, (
            f"solved for {format_bytes(target)}: the plan for the budget traced at "
            f"{format_bytes(peak)} with it applied")) if x)
        pl = again
    if pl.verified_peak_bytes > budget:
        # None fits: the one that traced lowest, and no plan at all rather than one that
        # takes more memory than the step without it.
        pl = min(tried, key=lambda t: (t.verified_peak_bytes, t.recompute_seconds))
        if pl.verified_peak_bytes >= unplanned_peak and pl.recomputed:
            none = make_plan(pl.problem, max(unplanned_peak, int(pl.problem.base.max())),
                             solver=solver, time_limit=time_limit)
            none.budget_bytes, none.verified_peak_bytes = budget, unplanned_peak
            none.note = (f"every plan for {format_bytes(budget)} traced above the step "
                         f"without one ({format_bytes(pl.verified_peak_bytes)} at best, "
                         f"against {format_bytes(unplanned_peak)}): nothing is checkpointed")
            warnings.warn(f"no checkpoint plan for {format_bytes(budget)} traces under it, "
                          f"nor under the step without one: {none.note}", RuntimeWarning,
                          stacklevel=3)
            return none
        warnings.warn(f"the checkpoint plan for {format_bytes(budget)} traces at "
                      f"{format_bytes(pl.verified_peak_bytes)} when applied, over the budget "
                      f"(predicted {format_bytes(pl.predicted_peak_bytes)}); a lower budget "
                      f"gives one that fits", RuntimeWarning, stacklevel=3)
    return pl


def _is_chain(p: CheckpointProblem) -> bool:
    from .chain_dp import chain_structure
    return chain_structure(p, np.unique(p.delta.T, axis=0)) is not None if p.n else False


def pareto(p: CheckpointProblem, points: int = 12, *, time_limit: float = 5.0,
           path=None) -> list[dict]:
    """Peak versus recompute cost from the least achievable peak to the unplanned one.
    Writes a PNG to ``path`` if given."""
    hi = int(p.base.max())
    lo, _ = least_peak(p, time_limit=time_limit)
    out = []
    for b in np.linspace(lo, hi, max(points, 2)):
        try:
            pl = make_plan(p, int(np.ceil(b)), time_limit=time_limit)
        except BudgetTooSmallError:
            continue
        out.append({"budget_bytes": int(np.ceil(b)), "peak_bytes": pl.predicted_peak_bytes,
                    "recompute_seconds": pl.recompute_seconds,
                    "recompute_fraction": pl.recompute_cost["fraction_of_forward"],
                    "solver": pl.solver, "optimal": pl.optimal, "gap": pl.gap,
                    "modules": pl.policies})
    if path is not None:
        _plot(out, path)
    return out


def _plot(points, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [q["peak_bytes"] / 2**20 for q in points]
    ys = [100 * q["recompute_fraction"] for q in points]
    ax.step(xs, ys, where="post", marker="o")
    ax.set_xlabel("predicted peak (MiB)")
    ax.set_ylabel("recompute (% of forward)")
    ax.set_title("checkpointing: memory vs recompute")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
