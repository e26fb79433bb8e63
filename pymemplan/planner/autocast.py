"""CUDA's autocast, run over the CPU tensors the planner traces.

The planner traces a CUDA step on fake CPU tensors, under the CPU's autocast (CUDA's cannot be
enabled without a GPU). The two autocasts cast different ops: CUDA's runs softmax, log_softmax,
layer and group norm, exp, log, pow and the losses in fp32, the CPU's keeps them in the lower
precision (and casts others: linear algebra, FFTs, 3-D pooling, cross_entropy as a whole). On a
GPT-2 step under bf16 that made the tensors saved for backward 12% smaller than a GPU holds.

Inside :func:`cuda_autocast`, the AutocastCPU kernels follow CUDA's lists instead
(``aten/src/ATen/autocast_mode.h``: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE, and the two ``norm`` overloads that append a
dtype), with CUDA's rules for which tensors are cast and which casts are cached. Ops the CPU's
autocast casts and CUDA's does not fall through, as under CUDA's: those made of other ops run
them, and autocast meets those. The kernels are registered for the duration of a trace and
removed after it; the registration is process-wide, so other threads under the CPU's autocast
meanwhile get CUDA's lists too.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

LOWER = ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
         "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
         "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
         "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
         "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
         "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
         "scaled_dot_product_attention")
FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
        "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
        "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
        "upsample_bicubic2d", "_upsample_bicubic2d_aa", "linalg_matrix_sqrth")
FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod",
                      "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                      "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype",
                     "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
           "index_put", "tensordot", "scatter_add")
BANNED = {"binary_cross_entropy": (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")}


def _op(name: str):
    """The aten overload, or None where this torch has no such op."""
    import torch

    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


def _eligible(t) -> bool:
    import torch

    # CUDA's is_eligible: a floating tensor, not double.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _Casts:
    """CUDA's cached_cast: casts of fp32 leaf tensors that require grad (parameters) to the
    lower precision are made once per autocast region."""

    def __init__(self):
        self.cache: dict[int, tuple] = {}

    def __call__(self, t, dtype):
        import torch

        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = (dtype != torch.float32 and t.dtype == torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view())
        if not cacheable:
            return t.to(dtype)
        hit = self.cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(dtype)
        self.cache[id(t)] = (weakref.ref(t), out)
        return out


def _kernel(op, policy: str, casts: _Casts, lower):
    import torch
    from torch.utils import _pytree as pytree

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_arg = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    fused = {"aten::softmax": torch.ops.aten._softmax.default,
             "aten::log_softmax": torch.ops.aten._log_softmax.default}.get(op._schema.name)

    def run(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below):
            if policy == "lower":
                args, kwargs = pytree.tree_map(lambda t: casts(t, lower), (args, kwargs))
            elif policy == "fp32":
                args, kwargs = pytree.tree_map(lambda t: casts(t, torch.float32), (args, kwargs))
            elif policy == "promote":
                floats = [t for t in pytree.tree_leaves((args, kwargs)) if _eligible(t)]
                if len({t.dtype for t in floats}) > 1:
                    wide = functools.reduce(torch.promote_types, {t.dtype for t in floats})
                    args, kwargs = pytree.tree_map(lambda t: casts(t, wide), (args, kwargs))
            elif policy == "set_opt_dtype":
                # With a lower-precision input and no dtype given, the op runs with dtype=fp32.
                given = kwargs.get("dtype") if dtype_arg is None or len(args) <= dtype_arg \
                    else args[dtype_arg]
                if given is None and any(_eligible(t) and t.dtype != torch.float32
                                         for t in pytree.tree_leaves(args)):
                    if fused is not None and args[0].dtype == torch.float16:
                        # CUDA's softmax and log_softmax read fp16 and write fp32 in one
                        # kernel (SoftMax.cpp: half_to_float), with no fp32 copy of the input.
                        return fused(args[0], args[1], True)
                    kwargs = {**kwargs, "dtype": torch.float32}
                    if dtype_arg is not None and len(args) > dtype_arg:
                        args = args[:dtype_arg]
            return op(*args, **kwargs)

    return run


def _append_dtype(op, target):
    import torch
    from torch.utils import _pytree as pytree

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    positional = [a for a in op._schema.arguments if not a.kwarg_only]

    def run(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below):
            if any(_eligible(t) and t.dtype != torch.float32 for t in pytree.tree_leaves(args)):
                # The dtype overload takes every argument: defaults filled in.
                full = list(args) + [kwargs.pop(a.name, a.default_value)
                                     for a in positional[len(args):]]
                return target(*full, **kwargs, dtype=torch.float32)
            return op(*args, **kwargs)

    return run


def _banned(message):
    def run(*args, **kwargs):
        raise RuntimeError(message)

    return run


def _passthrough(op):
    """What CUDA's autocast does with an op it has no kernel for: it falls through, and an op
    made of others (cross_entropy_loss: log_softmax, then nll_loss) meets autocast again in
    them, which CUDA's autocast casts. So such an op runs its decomposition here; any other
    runs below autocast, as a kernel of its own would."""
    import torch

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                               "CompositeImplicitAutograd")

    def run(*args, **kwargs):
        if composite:
            return op.decompose(*args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return run


@functools.lru_cache(maxsize=None)
def _cpu_only() -> tuple:
    """Ops the CPU's autocast has a kernel for and CUDA's does not."""
    import torch

    cpu = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    return tuple(sorted(n.removeprefix("aten::") for n in cpu - cuda if n.startswith("aten::")))


@contextlib.contextmanager
def cuda_autocast(lower):
    """While inside, wherever the CPU's autocast is on (entered by the caller at dtype
    ``lower``: the forward pass, and its recomputation under activation checkpointing), it
    casts as CUDA's does. Cached casts are dropped where autocast drops its own, on leaving
    the outermost autocast region."""
    import torch

    casts = _Casts()
    clear = torch.clear_autocast_cache

    def clear_both():
        casts.cache.clear()
        clear()

    lib = torch.library.Library("aten", "IMPL")
    table = {**{n: "lower" for n in LOWER}, **{n: "fp32" for n in FP32},
             **{n: "set_opt_dtype" for n in FP32_SET_OPT_DTYPE},
             **{n: "promote" for n in PROMOTE}}
    kernels = {}
    for name in _cpu_only():
        if name not in table and name not in BANNED and _op(name) is not None:
            kernels[name] = _passthrough(_op(name))
    for name, policy in table.items():
        if _op(name) is not None:
            kernels[name] = _kernel(_op(name), policy, casts, lower)
    for name, target in FP32_APPEND_DTYPE.items():
        if _op(name) is not None and _op(target) is not None:
            kernels[name] = _append_dtype(_op(name), _op(target))
    for name, message in BANNED.items():
        kernels[name] = _banned(message)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        for name, kernel in kernels.items():
            lib.impl(name, kernel, "AutocastCPU")
    torch.clear_autocast_cache = clear_both
    try:
        yield
    finally:
        torch.clear_autocast_cache = clear
        lib._destroy()
        casts.cache.clear()


def for_target(profile, dtype):
    """What a trace for ``profile`` under autocast to ``dtype`` (None: none) enters around the
    whole step: :func:`cuda_autocast` for a CUDA target, nothing otherwise."""
    if dtype is None or not profile.cuda_kernels:
        return contextlib.nullcontext()
    return cuda_autocast(dtype)
