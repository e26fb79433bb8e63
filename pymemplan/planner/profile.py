"""Target-device profiles: how the step would allocate on the device being predicted.

Why profiles. The planner runs the step on *fake CPU tensors*, for any target. Fake CUDA
tensors would be the obvious choice, but on a machine without a GPU the autograd engine
refuses them (``hasPrimaryContext expects a valid device index``), so the backward pass
could not run. On CPU tensors the same Python code runs, but some ops pick different
kernels than on CUDA, and those kernels keep different buffers. A profile closes that
gap: it intercepts the few torch functions whose CUDA dispatch differs and calls, on the
CPU fake tensors, the ATen op CUDA would call. Those ops have meta kernels (and autograd
formulas), so their outputs, saved tensors and backward buffers are CUDA's:

- ``scaled_dot_product_attention``: CUDA runs flash or memory-efficient attention, which
  saves a logsumexp per row, never the (L x S) attention matrix; the math fallback does.
  The choice follows PyTorch's ``sdp_utils.cpp`` (priority flash > efficient > math).
- ``dropout``: CUDA runs ``native_dropout`` and keeps a 1-byte bool mask; CPU's
  composite dropout keeps a mask of the input's dtype (4 bytes in fp32).
- optimizers: on CUDA, ``torch.optim`` defaults to the multi-tensor ``foreach`` path
  (``_default_to_fused_or_foreach``), whose temporaries are whole lists of tensors; on
  CPU it takes the single-tensor path. Non-capturable ``step`` counters stay on the CPU.
- sizes: the CUDA caching allocator rounds every block up to 512 bytes; the CPU
  allocator's sizes are exact.

Known, documented gaps (kernel internals that never appear as tensors): cuDNN
convolution workspaces and cuBLAS workspaces, sort buffers inside some CUDA kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import PlannerError

CUDA_ROUND = 512  # c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, round_size()


@dataclass(frozen=True)
class DeviceProfile:
    name: str                  # "cuda" or "cpu"
    round_to: int              # allocator rounding of block sizes (1 = exact)
    cuda_kernels: bool         # route SDPA/dropout as CUDA dispatches them
    optimizer_foreach: bool    # default optimizers to the foreach path
    step_counters_on_host: bool  # non-capturable optimizer `step` tensors live in host memory

    def device_bytes(self, nbytes: int) -> int:
        """Bytes the device allocator hands out for a storage of `nbytes`."""
        if nbytes <= 0:
            return 0  # both allocators return no block for an empty storage
        r = self.round_to
        return nbytes if r <= 1 else -(-nbytes // r) * r


PROFILES = {
    "cuda": DeviceProfile("cuda", CUDA_ROUND, True, True, True),
    "cpu": DeviceProfile("cpu", 1, False, False, False),
}


def get_profile(device) -> DeviceProfile:
    """`device`: None (CUDA), "cuda", "cuda:N", "cpu" or a torch.device."""
    if device is None:
        return PROFILES["cuda"]
    kind = str(getattr(device, "type", device)).split(":")[0].strip().lower()
    if kind not in PROFILES:
        raise PlannerError(f"device={device!r} is not supported; the planner predicts memory for "
                         f"'cuda' (default) or 'cpu'")
    return PROFILES[kind]


# ---------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------

def prepare_optimizer(opt, profile: DeviceProfile) -> None:
    """Make `opt` take the code path it takes on the target device.

    Only groups left at ``foreach=None`` (PyTorch's "choose for me") are changed: an
    explicit user choice is what runs on the device too.
    """
    if not profile.optimizer_foreach:
        return
    if "foreach" not in opt.defaults:
        return  # optimizer without a multi-tensor path
    for group in opt.param_groups:
        if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True


def state_on_device(opt, name: str, value, profile: DeviceProfile) -> bool:
    """Whether optimizer state `name` lives in device memory on the target.

    On CUDA, scalar ``step`` counters of non-capturable, non-fused optimizers are CPU
    tensors (torch/optim/adam.py: ``torch.tensor(0.0, dtype=_get_scalar_dtype())``).
    """
    if not profile.step_counters_on_host or name != "step" or value.dim() != 0:
        return True
    defaults = opt.defaults
    return bool(defaults.get("capturable") or defaults.get("fused"))


# ---------------------------------------------------------------------------------------
# Attention and dropout as CUDA dispatches them
# ---------------------------------------------------------------------------------------

def _sdpa_backend(q, k, v, attn_mask, dropout_p, enable_gqa) -> str:
    """Which kernel CUDA's ``select_sdp_backend`` picks (aten/src/ATen/native/transformers/
    cuda/sdp_utils.cpp), reduced to the checks that shapes and dtypes decide."""
    import torch

    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    dims4 = q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    half = q.dtype in (torch.float16, torch.bfloat16)
    # Flash: fp16/bf16, no arbitrary mask, head dim <= 256 (a multiple of 8 after padding),
    # equal q/v head dims.
    if dims4 and half and attn_mask is None and head_dim <= 256 and head_dim == head_dim_v \
            and not enable_gqa:
        return "flash"
    # Memory-efficient: fp32/fp16/bf16, masks allowed, head dim a multiple of 4 (fp32) or 8.
    align = 4 if q.dtype == torch.float32 else 8
    if dims4 and q.dtype in (torch.float32, torch.float16, torch.bfloat16) \
            and head_dim % align == 0 and head_dim_v % align == 0:
        return "efficient"
    return "math"


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """``F.scaled_dot_product_attention`` as CUDA runs it, on tensors of any device."""
    import torch

    backend = _sdpa_backend(query, key, value, attn_mask, dropout_p, enable_gqa)
    if backend == "math":
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
            enable_gqa=enable_gqa)[0]
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        # The efficient kernel has no GQA support: CUDA repeats K and V to all heads.
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # sdp_utils: boolean masks become an additive bias of the query's dtype.
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device) \
            .masked_fill_(attn_mask.logical_not(), -math.inf)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    need_lse = query.requires_grad or key.requires_grad or value.requires_grad
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, need_lse, dropout_p, is_causal, scale=scale)[0]


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout`` with a bool mask
    (aten/src/ATen/native/Dropout.cpp, ``is_fused_kernel_acceptable``)."""
    import torch

    if not training or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input.mul_(0) if inplace else input * 0
    out = torch.ops.aten.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


def ctc_loss_int_lengths(log_probs, targets, input_lengths, target_lengths, blank=0,
                         reduction="mean", zero_infinity=False):
    """``ctc_loss`` with lengths given as Python ints, as its composite kernel runs it
    (aten/src/ATen/native/LossCTC.cpp, ``ctc_loss``), in ops fake tensors can run: the
    composite turns the lengths into a tensor by writing into its memory, which a fake
    tensor has none of. The cuDNN path (int32 targets on the host) is not modelled."""
    import torch

    if isinstance(reduction, int):  # torch.ctc_loss's enum: 0 none, 1 mean, 2 sum
        reduction = ("none", "mean", "sum")[reduction]
    if isinstance(input_lengths, torch.Tensor) or isinstance(target_lengths, torch.Tensor):
        # The torch-function layer is off while its replacements run: the real function.
        return torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths,
                                            blank, reduction, zero_infinity)
    if (torch.is_autocast_enabled(log_probs.device.type)
            and log_probs.dtype in (torch.float16, torch.bfloat16)):
        # Autocast runs ctc_loss in fp32 (its fp32 list, CPU and CUDA alike); the aten op
        # called below is not on that list, and has no half backward on the CPU.
        log_probs = log_probs.float()
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    res = torch.ops.aten._ctc_loss(lp, targets.to(lp.device, torch.long), list(input_lengths),
                                   list(target_lengths), blank, zero_infinity)[0]
    if zero_infinity:
        res = torch.where(res == float("inf"), torch.zeros((), dtype=res.dtype,
                                                            device=res.device), res)
    if reduction == "mean":
        lengths = torch.tensor(list(target_lengths), dtype=res.dtype, device=res.device)
        return (res / lengths.clamp_min(1)).mean()
    if reduction == "sum":
        return res.sum()
    return res if batched else res.squeeze(0)


def linear_bias_in_place(input, weight, bias=None):
    """``F.linear`` as eager runs it on an input it does not flatten into one ``addmm``
    (aten/src/ATen/native/Linear.cpp, ``linear``: not 2-D, and not contiguous 3-D or
    contiguous with a 1-D bias): a ``matmul``, then the bias added in place. With any
    tensor a subclass, as fake tensors are, the bias is added out of place instead, and
    the matmul's output and the sum are both alive at the add (a Linear on a transposed
    input was predicted up to 73% high)."""
    import torch

    flattened = input.dim() == 2 or (input.is_contiguous() and (
        input.dim() == 3 or (bias is not None and bias.dim() == 1)))
    if bias is None or flattened or not isinstance(bias, torch.Tensor):
        return torch.nn.functional.linear(input, weight, bias)
    return torch.nn.functional.linear(input, weight).add_(bias)


def cpu_evenly_distributed(real):
    """``real`` (``max``, ``min``, ``median`` or ``nanmedian``) over a whole tensor, with the
    backward eager runs on the CPU (FunctionsManual.cpp, ``evenly_distribute_backward``):
    the gradient's zeros are made first, then the mask's sum (whose int64 cast is that
    kernel's peak), then filled in place. With any tensor a subclass, as fake tensors are,
    autograd runs ``mask * (grad / mask.sum())`` instead: the gradient is made after the sum,
    and a step whose peak is that sum was predicted 6-9% low."""
    import torch

    class EvenlyDistributed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input):
            value = real(input)
            ctx.save_for_backward(input, value)
            return value

        @staticmethod
        def backward(ctx, grad):
            input, value = ctx.saved_tensors
            # Eager's mask is input.isnan() where the value is NaN: the same size.
            mask = input == value
            zeros = grad.new_zeros(input.shape, dtype=input.dtype)
            return zeros.masked_fill_(mask, grad / mask.sum())

    def whole_tensor(input, *args, **kwargs):
        if (args or kwargs or not isinstance(input, torch.Tensor) or not input.requires_grad
                or not torch.is_grad_enabled()):
            return real(input, *args, **kwargs)
        return EvenlyDistributed.apply(input)

    return whole_tensor


def kernel_overrides(profile: DeviceProfile) -> dict:
    """torch function -> replacement, for the torch-function layer of capture."""
    import torch
    import torch.nn.functional as F

    general = {F.ctc_loss: ctc_loss_int_lengths, torch.ctc_loss: ctc_loss_int_lengths,
               F.linear: linear_bias_in_place}
    if not profile.cuda_kernels:
        reductions = {f: cpu_evenly_distributed(f)
                      for name in ("max", "min", "median", "nanmedian")
                      for f in (getattr(torch, name), getattr(torch.Tensor, name))}
        return {**general, **reductions}
    return {**general, F.scaled_dot_product_attention: cuda_sdpa, F.dropout: cuda_dropout}
