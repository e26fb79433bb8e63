"""The planner's exceptions."""


class PlannerError(ValueError):
    """Bad arguments to the planner; the message says what was wrong and how to fix it."""


class UntraceableError(PlannerError):
    """The step cannot run on fake tensors; the message names the op and module."""
