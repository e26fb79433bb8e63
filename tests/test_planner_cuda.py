"""Predictions for CUDA, made on a machine without a GPU, reflect CUDA's kernels.

Each test traces the same step for device="cuda" and device="cpu" and checks the
difference that CUDA's dispatch makes (see pymemplan/planner/profile.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pymemplan  # noqa: E402

B, H, L, E = 2, 4, 64, 8


class Attention(nn.Module):
    def __init__(self, head_dim=E, dropout_p=0.0, mask=False):
        super().__init__()
        self.qkv = nn.Linear(H * head_dim, 3 * H * head_dim)
        self.head_dim, self.dropout_p, self.mask = head_dim, dropout_p, mask

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, L, 3, H, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril() if self.mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p)


def mean_loss(out):
    return out.float().mean()


def trace_attention(device, head_dim=E, autocast=None, **kw):
    model = Attention(head_dim, **kw)
    return pymemplan.trace(model, (torch.randn(B, L, H * head_dim),), loss_fn=mean_loss,
                           device=device, autocast=autocast)


def op_names(t):
    return {op.name for op in t.ops}


def saved_attention_matrices(t):
    return [x for x in t.tensors if x.category == "activation" and x.shape[-2:] == (L, L)]


def test_attention_matrix_is_saved_on_cpu_but_not_on_cuda():
    # With dropout, CPU falls back to the math kernel (softmax saved); CUDA runs the
    # memory-efficient kernel, which keeps a logsumexp per row instead.
    cpu = trace_attention("cpu", dropout_p=0.1)
    cuda = trace_attention("cuda", dropout_p=0.1)
    assert saved_attention_matrices(cpu)
    assert not saved_attention_matrices(cuda)
    assert "aten._scaled_dot_product_efficient_attention.default" in op_names(cuda)
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in op_names(cuda)
    lse = [x for x in cuda.tensors if x.category == "activation"
           and x.op.endswith("efficient_attention.default") and x.shape == (B, H, L)]
    assert lse, "the logsumexp is saved for backward"
    assert cuda.breakdown(cuda.graph.phase_starts["backward"])["activation"] < \
        cpu.breakdown(cpu.graph.phase_starts["backward"])["activation"]


def test_cuda_attention_backend_follows_dtype_and_shape():
    assert "aten._scaled_dot_product_flash_attention.default" in \
        op_names(trace_attention("cuda", autocast=torch.bfloat16))
    # A boolean mask rules flash out; efficient attention takes it as an additive bias.
    masked = trace_attention("cuda", autocast=torch.bfloat16, mask=True)
    assert "aten._scaled_dot_product_efficient_attention.default" in op_names(masked)
    # fp32 with a head dim that is not a multiple of 4: no fused kernel, the math path
    # saves the attention matrix as on CPU.
    odd = trace_attention("cuda", head_dim=6)
    assert saved_attention_matrices(odd)
    assert not any("efficient" in n or "flash" in n for n in op_names(odd))


def test_dropout_keeps_a_bool_mask_on_cuda():
    model = nn.Sequential(nn.Linear(32, 256), nn.Dropout(0.2), nn.Linear(256, 1))
    x = torch.randn(64, 32)

    def dropout_masks(device):
        t = pymemplan.trace(model, (x,), loss_fn=mean_loss, device=device)
        return [m for m in t.tensors if m.category == "activation" and m.shape == (64, 256)
                and m.module == "1"]

    # Saved: the dropout's output (for the next Linear's weight gradient) and its mask.
    cuda, cpu = dropout_masks("cuda"), dropout_masks("cpu")
    assert sorted(m.dtype for m in cuda) == ["bool", "float32"]     # native_dropout's mask
    assert sorted(m.dtype for m in cpu) == ["float32", "float32"]   # CPU: x * noise (fp32)


def test_optimizer_takes_the_foreach_path_on_cuda_unless_told_otherwise():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)

    def optimizer_ops(device, optimizer=torch.optim.Adam):
        t = pymemplan.trace(model, (x,), loss_fn=mean_loss, optimizer=optimizer, device=device)
        a, b = t.phase_ranges()["optimizer"]
        return [op.name for op in t.ops[a:b]]

    assert any(n.startswith("aten._foreach_") for n in optimizer_ops("cuda"))
    assert not any(n.startswith("aten._foreach_") for n in optimizer_ops("cpu"))
    explicit = optimizer_ops("cuda", lambda p: torch.optim.Adam(p, foreach=False))
    assert not any(n.startswith("aten._foreach_") for n in explicit)


def test_cuda_sizes_are_rounded_and_step_counters_stay_on_the_host():
    model = nn.Sequential(nn.Linear(10, 3), nn.Linear(3, 1))  # odd sizes: 120 B, 12 B, ...
    x = torch.randn(5, 10)
    cuda = pymemplan.trace(model, (x,), loss_fn=mean_loss, optimizer=torch.optim.Adam)
    cpu = pymemplan.trace(model, (x,), loss_fn=mean_loss, optimizer=torch.optim.Adam,
                          device="cpu")
    assert cuda.device == "cuda"  # the default
    assert all(t.size % 512 == 0 and t.size >= t.nbytes for t in cuda.tensors)
    assert all(t.size == t.nbytes for t in cpu.tensors)
    n_params = len(list(model.parameters()))
    # Adam's moments: 2 per parameter on both; the scalar `step` counters only on CPU.
    assert cuda.breakdown(0)["optimizer_state"] == 2 * n_params * 512
    assert cpu.breakdown(0)["optimizer_state"] == 2 * sum(p.numel() * 4 for p in model.parameters()) \
        + n_params * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prediction_against_a_real_gpu_step():
    """On a GPU machine: device="cuda" predictions against max_memory_allocated().

    The measured figure also holds what no tensor shows: the cuBLAS/cuBLASLt workspaces
    (allocated once, through the caching allocator, up to 32 MiB per handle on Hopper) and
    cuDNN workspaces. Those are the documented gap; the rest must match.
    """
    from pymemplan.planner.measure import measure_step

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Dropout(0.1),
                                              nn.Linear(4096, 1024)) for _ in range(4)])
        x = torch.randn(64, 512, 1024)
    predicted = pymemplan.trace(model, (x,), loss_fn=mean_loss, optimizer=torch.optim.Adam)
    measured = measure_step(model, (x,), loss_fn=mean_loss, optimizer=torch.optim.Adam)
    gap = measured.peak_bytes - predicted.peak_bytes
    assert -0.01 * measured.peak_bytes <= gap <= 0.02 * measured.peak_bytes + (80 << 20), \
        (predicted.peak_bytes, measured.peak_bytes)


class _AutocastStep(nn.Module):
    """What the two autocasts treat differently, at a size where it shows: softmax of scores,
    layer norm, and a cross_entropy over a large vocabulary."""

    def __init__(self, width=1024, vocab=32768):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x, target):
        h = self.proj(x)
        h = self.norm(h + (h @ h.mT).softmax(-1) @ h)
        return F.cross_entropy(self.head(h).flatten(0, 1), target.flatten())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_prediction_against_a_real_gpu_step(dtype):
    """On a GPU machine: a step under CUDA's autocast, predicted on fake CPU tensors with
    CUDA's autocast lists (pymemplan/planner/autocast.py), against max_memory_allocated()."""
    from pymemplan.planner.measure import measure_step

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = _AutocastStep()
        x = torch.randn(8, 512, 1024)
        target = torch.randint(0, 32768, (8, 512))
    predicted = pymemplan.trace(model, (x, target), loss_fn=lambda o: o, autocast=dtype,
                                optimizer=torch.optim.Adam)
    measured = measure_step(model, (x, target), loss_fn=lambda o: o, autocast=dtype,
                            optimizer=torch.optim.Adam)
    gap = measured.peak_bytes - predicted.peak_bytes
    assert -0.01 * measured.peak_bytes <= gap <= 0.02 * measured.peak_bytes + (80 << 20), \
        (predicted.peak_bytes, measured.peak_bytes)


class Blocks(nn.Module):
    """Attention blocks with dropout; ``checkpointed`` blocks run under
    torch.utils.checkpoint, which re-runs their forward during backward."""

    def __init__(self, n=3, checkpointed=()):
        super().__init__()
        self.blocks = nn.ModuleList(Attention(dropout_p=0.1) for _ in range(n))
        self.checkpointed = set(checkpointed)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for i, b in enumerate(self.blocks):
            y = checkpoint(b, x, use_reentrant=False) if i in self.checkpointed else b(x)
            x = x + y.transpose(1, 2).reshape(B, L, H * E)
        return x


def test_checkpointed_model_traces_with_cuda_kernels_in_the_recompute():
    # The recompute in backward must dispatch the same CUDA kernels as the forward did
    # (efficient attention, with its dropout inside), or checkpoint's saved-tensor check
    # fails.
    x = torch.randn(B, L, H * E)
    plain = pymemplan.trace(Blocks(), (x,), loss_fn=mean_loss, device="cuda")
    ckpt = pymemplan.trace(Blocks(checkpointed={0, 1}), (x,), loss_fn=mean_loss, device="cuda")
    names = {op.name for op in ckpt.ops if op.phase == "backward"}
    assert "aten._scaled_dot_product_efficient_attention.default" in names  # recomputed
    assert ckpt.breakdown(plain.peak_index)["activation"] < \
        plain.breakdown(plain.peak_index)["activation"]


def test_grads_present_traces_a_later_accumulation_micro_step():
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    x = torch.randn(64, 256)
    first = pymemplan.trace(model, (x,), loss_fn=mean_loss, device="cuda")
    later = pymemplan.trace(model, (x,), loss_fn=mean_loss, device="cuda", grads_present=True)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    # Gradients exist from the start: they are under the whole forward...
    assert later.breakdown(0)["gradient"] == grad_bytes
    assert first.breakdown(0)["gradient"] == 0
    # ... and backward adds into them instead of making new ones.
    assert later.breakdown(later.graph.num_ops - 1)["gradient"] == grad_bytes
    assert later.peak_bytes > first.peak_bytes
    assert all(p.grad is None for p in model.parameters())


class _Block(nn.Module):
    """Ops the two autocasts treat differently: softmax, layer norm, exp, log_softmax and
    nll_loss run in fp32 under CUDA's and in the lower precision under the CPU's; cumsum and
    sum keep an fp32 result under CUDA's; einsum is cast down by CUDA's only; cross_entropy
    is cast whole by the CPU's, and by CUDA's in the ops it is made of."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x, target):
        h = self.lin(x)
        a = torch.einsum("bi,bj->bij", h, h).softmax(-1).sum(-1)
        h = self.norm(h + a) + h.exp().cumsum(-1)
        return (F.nll_loss(F.log_softmax(h, -1), target) + h.norm(dim=-1).sum()
                + F.cross_entropy(self.lin(x), target))


def _forward_dtypes(model, inputs, device, emulate, dtype=torch.bfloat16):
    """(op, output dtypes) of the forward pass on fake tensors, under bf16 autocast: the CPU's
    with the planner's CUDA casts (emulate), or CUDA's own kernels on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from pymemplan.planner.autocast import cuda_autocast

    log = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            dtypes = tuple(t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            if dtypes and not str(func).startswith("prim."):
                log.append((str(func), dtypes))
            return out

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        state = {k: mode.from_tensor(v).to(device).detach().requires_grad_(v.requires_grad)
                 for k, v in model.named_parameters()}  # leaves, as parameters are
        args = [mode.from_tensor(t).to(device) for t in inputs]
        if emulate:
            with torch.autocast("cpu", dtype=dtype), cuda_autocast(dtype), Record():
                functional_call(model, state, tuple(args))
        else:
            # CUDA's autocast cannot be entered without a GPU, but its kernels run on fake
            # CUDA tensors once its thread-local state is set.
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", dtype)
            torch.autocast_increment_nesting()
            try:
                with Record():
                    functional_call(model, state, tuple(args))
            finally:
                torch.autocast_decrement_nesting()
                torch.set_autocast_enabled("cuda", False)
                torch.clear_autocast_cache()
    return log


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cuda_target_casts_as_cudas_autocast(dtype):
    model = _Block()
    inputs = (torch.randn(16, 32), torch.zeros(16, dtype=torch.long))
    cuda = _forward_dtypes(model, inputs, "cuda", emulate=False, dtype=dtype)
    ours = _forward_dtypes(model, inputs, "cpu", emulate=True, dtype=dtype)
    assert ours == cuda
    fp32 = [op for op, dtypes in cuda if dtypes[0] == torch.float32]
    assert any("_softmax" in op for op in fp32) and any("layer_norm" in op for op in fp32)
    # The trace for CUDA makes the casts a GPU makes (and saves softmax's output in fp32).
    t = pymemplan.trace(model, inputs, autocast=dtype)
    cast = "aten._to_copy.default"
    casts = [o.name for o in t.graph.ops if o.phase == "forward" and o.name == cast]
    assert len(casts) == sum(op == cast for op, _ in cuda)
    assert t.peak_bytes > pymemplan.trace(model, inputs, autocast=dtype, device="cpu").peak_bytes


def test_every_op_cudas_autocast_casts_has_a_policy_in_the_trace():
    # CUDA's autocast lists, as this torch registers them; cuDNN's ops are never called by a
    # step traced on CPU tensors.
    from pymemplan.planner import autocast as ac

    registered = {n.removeprefix("aten::") for n in
                  torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
                  if n.startswith("aten::")}  # not torchvision's, once it is imported
    ours = {*ac.LOWER, *ac.FP32, *ac.FP32_SET_OPT_DTYPE, *ac.PROMOTE, *ac.FP32_APPEND_DTYPE,
            *ac.BANNED}
    assert {n for n in registered - ours if "cudnn" not in n} == set()


class _Probabilities(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return F.binary_cross_entropy(torch.sigmoid(self.lin(x)), torch.zeros(4, 16))


class _Pool3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return F.avg_pool3d(self.lin(x).view(1, 4, 4, 2, 2), 2).float().sum()


def test_what_only_one_autocast_does_follows_the_target():
    x = torch.randn(4, 16)
    # CUDA's autocast refuses binary_cross_entropy; the CPU's runs it in fp32.
    with pytest.raises(pymemplan.UntraceableError, match="unsafe to autocast"):
        pymemplan.trace(_Probabilities(), (x,), loss_fn=lambda o: o, autocast=torch.bfloat16)
    pymemplan.trace(_Probabilities(), (x,), loss_fn=lambda o: o, autocast=torch.bfloat16,
                    device="cpu")
    # The CPU's autocast runs avg_pool3d in fp32; CUDA's leaves it in bf16.
    for device, casts in (("cuda", 3), ("cpu", 4)):
        t = pymemplan.trace(_Pool3d(), (x,), loss_fn=lambda o: o, autocast=torch.bfloat16,
                            device=device)
        forward = [o.name for o in t.graph.ops if o.phase == "forward"]
        pool = forward.index("aten.avg_pool3d.default")
        assert forward[:pool].count("aten._to_copy.default") == casts, (device, forward)
