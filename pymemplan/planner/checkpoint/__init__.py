"""Activation checkpointing planned from a traced step: what to recompute for a budget.

One problem type (``problem.py``: candidates = modules, their dropped activations, held
inputs, recompute transient and cost, the memory at every op as a linear function of the
choice), one cost model (``cost.py``), one module per solver (``chain_dp.py`` exact on
chains, ``milp.py`` exact on any graph under a time limit, ``greedy.py`` fallback), the
plan and its report (``plan.py``), and two ways to apply it: eager
(``apply_eager.py``) and ``torch.compile`` (``compile_backend.py``). For the compiled
step, ``op_level.py`` adds op-level units on AOTAutograd's joint graph (save or recompute
each forward op, a MILP), which the backend weighs against the module-level plans.
"""

from .apply_eager import apply, remove
from .compile_backend import CompileBackend, compile_backend
from .op_level import OpPlan
from .plan import BudgetTooSmallError, Decision, Plan, make_plan, pareto
from .problem import Candidate, CheckpointProblem, build_problem

__all__ = ["BudgetTooSmallError", "Candidate", "CheckpointProblem", "CompileBackend",
           "Decision", "OpPlan", "Plan", "apply", "build_problem", "compile_backend", "make_plan",
           "pareto", "plan", "remove"]


def plan(model, inputs, budget, *, modules=None, policies=("full", "save-compute"),
         solver: str = "auto", time_limit: float = 10.0, **trace_kwargs) -> Plan:
    """Trace one training step of ``model`` (``pymemplan.trace`` keywords accepted) and
    plan checkpointing for ``budget`` (bytes or a string such as "6GiB"), with FLOP-based
    recompute costs."""
    from ..api import trace

    t = trace(model, inputs, **trace_kwargs)
    return t.plan(budget, model=model, inputs=inputs, modules=modules, policies=policies,
                  solver=solver, time_limit=time_limit)
