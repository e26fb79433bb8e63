"""Libraries that take another code path when they see fake tensors.

Hugging Face transformers treats a fake tensor as a sign of graph tracing
(``transformers.utils.import_utils.is_tracing``) and then skips checks that read values.
One of them decides the attention path of every decoder built on ``masking_utils``: whether
the batch packs several sequences (``find_packed_sequence_indices``). Under tracing it
cannot tell, builds a full boolean mask, and attention leaves its causal fast path (grouped
query attention then copies keys and values per layer). The eager step the planner
predicts reads the position ids and finds one sequence per row: the usual case, where the
model makes its position ids itself. While tracing, that question gets that answer.
"""

from __future__ import annotations

import contextlib
import sys


def _unpacked_when_fake(original):
    def find_packed_sequence_indices(position_ids):
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(position_ids):
            return None  # one sequence per row, as eager finds for position ids it made
        return original(position_ids)

    find_packed_sequence_indices.__wrapped__ = original
    return find_packed_sequence_indices


@contextlib.contextmanager
def eager_paths():
    """While tracing, library code that branches on fake tensors takes its eager path.
    Only libraries already imported are touched (the model was built with them)."""
    patched = []
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is not None and not hasattr(original, "__wrapped__"):
        masking.find_packed_sequence_indices = _unpacked_when_fake(original)
        patched.append((masking, "find_packed_sequence_indices", original))
    try:
        yield
    finally:
        for module, name, value in patched:
            setattr(module, name, value)
