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
tokens: 11% high; BART's decoder, which makes its own mask of ones when given none, 1%). The
tracer knows which fake tensors are all ones: inputs standing for real ones
(``note_real_inputs``) and what ``torch.ones`` and its kin made, and their casts and views,
unchanged since (``note_made``, from every op the tracer runs). Such a mask is passed on
as none, as eager finds it.
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


# One entry per eager_paths() in progress: id -> (weak reference, version) of each fake
# tensor known to hold only ones. Weak: a reference here must not keep a tensor alive, the
# tracer counts a storage live until its last reference goes.
_all_ones: list[dict] = []


def _known(t) -> None:
    import weakref

    _all_ones[-1][id(t)] = (weakref.ref(t), t._version)


def all_ones(t) -> bool:
    """Whether fake tensor ``t`` is known to hold only ones (and has not been written since)."""
    if not _all_ones:
        return False
    entry = _all_ones[-1].get(id(t))
    return entry is not None and entry[0]() is t and entry[1] == t._version


def note_real_inputs(fakes, reals) -> None:
    """The step's fake inputs and the real ones they stand for (pytree leaves, in order),
    read here for what the shims need of their values. Outside eager_paths(), nothing."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    if not _all_ones:
        return
    for f, r in zip(fakes, reals):
        if (isinstance(r, torch.Tensor) and isinstance(f, torch.Tensor)
                and r.device.type != "meta" and r.layout == torch.strided
                and not r.is_complex() and 0 < r.numel() <= 1 << 24):
            # Read for real, past the tracer's modes: the step records nothing of it.
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                if bool((r == 1).all()):
                    _known(f)


_ONES: dict = {}      # op -> where its fill value is (None: ones by name)
_KEEPS: set = set()   # ops whose output holds its first argument's values (casts, views)


def _op_tables() -> None:
    import torch

    aten = torch.ops.aten
    _ONES.update({aten.ones.default: None, aten.ones_like.default: None,
                  aten.new_ones.default: None, aten.full.default: 1,
                  aten.full_like.default: 1, aten.new_full.default: 2})
    _KEEPS.update({aten._to_copy.default, aten.clone.default, aten.view.default,
                   aten._unsafe_view.default, aten.unsqueeze.default, aten.expand.default,
                   aten.slice.Tensor, aten.alias.default, aten.detach.default})


def note_made(func, args, kwargs, out) -> None:
    """Called with every op the tracer runs: notes outputs made all ones."""
    import torch

    if not _all_ones or not isinstance(out, torch.Tensor):
        return
    if not _ONES:
        _op_tables()
    if func in _ONES:
        at = _ONES[func]
        if at is None or (len(args) > at and args[at] == 1):
            _known(out)
    elif func in _KEEPS and args and isinstance(args[0], torch.Tensor) and all_ones(args[0]):
        _known(out)


def _no_padding_when_all_ones(original):
    def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, *args, **kwargs):
        if attention_mask is not None and getattr(attention_mask, "ndim", 0) == 2 \
                and all_ones(attention_mask):
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
    _all_ones.append({})
    try:
        yield
    finally:
        _all_ones.pop()
        for module, name, value in patched:
            setattr(module, name, value)
