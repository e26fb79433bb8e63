"""Turning pymemplan's out-of-memory RuntimeError into torch.cuda.OutOfMemoryError."""

from __future__ import annotations

import contextlib
from typing import Any

OOM_PREFIX = "pymemplan: out of memory"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is pymemplan's out-of-memory error as PyTorch surfaces it."""
    # PyTorch may put its own lines around the allocator's message; ours starts a line.
    return isinstance(error, RuntimeError) and any(
        line.lstrip().startswith(OOM_PREFIX) for line in str(error).splitlines())


class oom_as_torch_error(contextlib.ContextDecorator):
    """Re-raise pymemplan's out-of-memory errors as torch.cuda.OutOfMemoryError.

    Under a pluggable allocator PyTorch cannot raise its own OutOfMemoryError: when
    pymemplan runs out of memory (oom_action:raise, the default), PyTorch surfaces a plain
    RuntimeError whose message starts with "pymemplan: out of memory" and gives the request,
    the allocated and reserved bytes, the largest free block and the capacity. Code that
    catches torch's OOM (``except torch.cuda.OutOfMemoryError``, e.g. to retry with a
    smaller batch) keeps working inside this context, or under it as a decorator::

        with pymemplan.oom_as_torch_error():
            loss = model(batch).sum()

        @pymemplan.oom_as_torch_error()
        def step(batch): ...

    The new error has the same message, and the original as its __cause__. Every other
    exception passes through unchanged.
    """

    def __enter__(self) -> "oom_as_torch_error":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not is_out_of_memory(exc):
            return False
        import torch  # only here: an OOM from PyTorch means torch is loaded anyway

        torch_oom = getattr(torch.cuda, "OutOfMemoryError", None) or torch.OutOfMemoryError
        if isinstance(exc, torch_oom):
            return False
        raise torch_oom(str(exc)) from exc
