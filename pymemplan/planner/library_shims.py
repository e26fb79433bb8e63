"""Libraries that take another code path when they see fake tensors.

Hugging Face transformers treats a fake tensor as a sign of graph tracing
(``transformers.utils.import_utils.is_tracing``) and then skips checks that read values.
One of them decides the attention path of every decoder built on ``masking_utils``: whether
the batch packs several sequences (``find_packed_sequence_indices``). Under tracing it
cannot tell, builds a full boolean mask, and attention leaves its causal fast path (grouped
query attention then copies keys and values per layer). The eager step the planner
predicts reads the position ids and finds one sequence per row: the usual case, where the
model makes its position ids itself. While tracing, that question gets that answer.

Another reads the 2D padding mask's values: where it is all ones (no padding), attention
needs no mask and SDPA runs its causal kernel. A fake mask cannot tell, and a (B, 1, S, S)
mask the eager step never makes is built and kept by every layer (a 3-layer Qwen2 at 4 x 96
tokens: 11% high). The real inputs answer it: the tracer notes the fake inputs that stand
for an all-ones integer mask (``note_real_inputs``), and such a mask is passed on as none.
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


# One entry per eager_paths() in progress: id -> fake input standing for a real 2D integer
# mask of all ones (note_real_inputs). The fakes are held, so no id is reused meanwhile.
_no_padding: list[dict] = []


def note_real_inputs(fakes, reals) -> None:
    """The step's fake inputs and the real ones they stand for (pytree leaves, in order),
    read here for what the shims need of their values. Outside eager_paths(), nothing."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    if not _no_padding:
        return
    for f, r in zip(fakes, reals):
        if (isinstance(r, torch.Tensor) and isinstance(f, torch.Tensor) and r.dim() == 2
                and r.device.type != "meta" and not r.is_floating_point()
                and not r.is_complex() and r.numel() > 0):
            # Read for real, past the tracer's modes: the step records nothing of it.
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                if bool((r == 1).all()):
                    _no_padding[-1][id(f)] = f


def _no_padding_when_all_ones(original):
    def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, *args, **kwargs):
        if (attention_mask is not None and _no_padding
                and _no_padding[-1].get(id(attention_mask)) is attention_mask):
            attention_mask = None  # no padding: what eager finds reading the values
        return original(config, inputs_embeds, attention_mask, *args, **kwargs)

    _preprocess_mask_arguments.__wrapped__ = original
    return _preprocess_mask_arguments


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
    pre = getattr(masking, "_preprocess_mask_arguments", None)
    if pre is not None and not hasattr(pre, "__wrapped__"):
        masking._preprocess_mask_arguments = _no_padding_when_all_ones(pre)
        patched.append((masking, "_preprocess_mask_arguments", pre))
    _no_padding.append({})
    try:
        yield
    finally:
        _no_padding.pop()
        for module, name, value in patched:
            setattr(module, name, value)
