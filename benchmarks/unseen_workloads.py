"""Workloads the allocator policies were never tuned on.

The 63 traces of `alloc_replay.py` have each been studied, and placement rules were measured on
all of them: the figures there are partly in-sample. These were written after that work (session
47), recorded, and replayed before anything was changed for them; `python
benchmarks/alloc_replay.py --unseen` records and replays them into
`benchmarks/results/alloc_replay_unseen.json`. A workload added here later is measured the same
way: first, before any change made for it.

Each brings a pattern none of the 63 has:
- simclr_r18: contrastive learning, two views of a batch through ResNet-18 and a 2B x 2B
  similarity matrix, SGD with momentum and weight decay;
- layerdrop_enc: a transformer encoder that skips each layer at random in training (LayerDrop),
  so no two steps need to allocate the same sequence;
- curriculum_gpt2: GPT-2 trained on sequences that grow (64, 64, 128, 128, 256, 256 tokens);
- mixer_ckpt: an MLP-Mixer with every block checkpointed (`torch.utils.checkpoint`, not
  reentrant), Adam; mixer_ckpt_dict: the same model written as notebooks often do (each block
  a ModuleDict, the checkpointed function a closure), whose allocation sequence differs in its
  details;
- phi_bf16_clip: Phi under bf16 autocast with gradient clipping, AdamW;
- effnet_b1_cl: EfficientNet-B1 in channels-last memory format, SGD with Nesterov momentum;
- mistral_smooth: Mistral (grouped-query attention, a sliding window) with a label-smoothed loss
  computed outside the model, Adam.
"""

from __future__ import annotations

# Steps that do not repeat: no steady state for a plan to reach.
NO_REPEATED_ITERATION = frozenset({"layerdrop_enc"})


def _loop(make_model, make_optimizer, loss_of, steps, bf16=False, clip=None):
    import torch

    def run():
        torch.manual_seed(0)
        model = make_model()
        opt = make_optimizer(model.parameters())
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_of(model, step)
            loss.backward()
            del loss
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


def _simclr():
    import torch
    import torch.nn.functional as F
    import torchvision

    def loss(model, step):
        x = torch.randn(32, 3, 64, 64)
        z = F.normalize(torch.cat([model(x + 0.1 * torch.randn_like(x)), model(x.flip(3))]), dim=1)
        sim = (z @ z.t() / 0.2).masked_fill(torch.eye(64, dtype=torch.bool), float("-inf"))
        positives = torch.cat([torch.arange(32, 64), torch.arange(32)])
        return F.cross_entropy(sim, positives)
    return _loop(lambda: torchvision.models.resnet18(num_classes=128),
                 lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, weight_decay=1e-4), loss, 5)


def _layerdrop():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Encoder(nn.Module):
        def __init__(self, layers=8, width=256):
            super().__init__()
            self.embed = nn.Embedding(8000, width)
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 1024, batch_first=True)
                                        for _ in range(layers))
            self.head = nn.Linear(width, 8000)

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                if self.training and torch.rand(()) < 0.25:
                    continue  # dropped for this step
                h = layer(h)
            return self.head(h)

    def loss(model, step):
        ids = torch.randint(0, 8000, (8, 128))
        return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    return _loop(Encoder, lambda p: torch.optim.AdamW(p, 1e-4), loss, 6)


def _curriculum():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    lengths = [64, 64, 128, 128, 256, 256]

    def loss(model, step):
        ids = torch.randint(0, 8000, (8, lengths[step]))
        return model(input_ids=ids, labels=ids).loss
    return _loop(lambda: GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000,
                                                    n_positions=256)),
                 lambda p: torch.optim.AdamW(p, 1e-4), loss, len(lengths))


def _mixer_loop(model_class):
    import torch
    import torch.nn.functional as F

    return _loop(model_class, lambda p: torch.optim.Adam(p, 1e-3),
                 lambda model, step: F.cross_entropy(model(torch.randn(32, 3, 64, 64)),
                                                     torch.randint(0, 10, (32,))), 5)


def _mixer():
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, width, tokens):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.tokens = nn.Sequential(nn.Linear(tokens, 256), nn.GELU(), nn.Linear(256, tokens))
            self.channels = nn.Sequential(nn.Linear(width, 1024), nn.GELU(), nn.Linear(1024, width))

        def forward(self, h):
            h = h + self.tokens(self.norm1(h).transpose(1, 2)).transpose(1, 2)
            return h + self.channels(self.norm2(h))

    class Mixer(nn.Module):
        def __init__(self, depth=6, width=256, tokens=64):
            super().__init__()
            self.patch = nn.Conv2d(3, width, 8, 8)
            self.blocks = nn.ModuleList(Block(width, tokens) for _ in range(depth))
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            h = self.patch(x).flatten(2).transpose(1, 2)
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            return self.head(h.mean(1))

    return _mixer_loop(Mixer)


def _mixer_dict():
    # The same Mixer as _mixer(), each block a ModuleDict and the checkpointed function a
    # closure over it, as notebooks often write it: the same layers and tensor sizes, an
    # allocation sequence that differs in its details.
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Mixer(nn.Module):
        def __init__(self, depth=6, width=256, tokens=64):
            super().__init__()
            self.patch = nn.Conv2d(3, width, 8, 8)
            self.blocks = nn.ModuleList(nn.ModuleDict(dict(
                n1=nn.LayerNorm(width),
                tok=nn.Sequential(nn.Linear(tokens, 256), nn.GELU(), nn.Linear(256, tokens)),
                n2=nn.LayerNorm(width),
                ch=nn.Sequential(nn.Linear(width, 1024), nn.GELU(), nn.Linear(1024, width))))
                for _ in range(depth))
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            h = self.patch(x).flatten(2).transpose(1, 2)
            for b in self.blocks:
                def f(h, b=b):
                    h = h + b["tok"](b["n1"](h).transpose(1, 2)).transpose(1, 2)
                    return h + b["ch"](b["n2"](h))
                h = checkpoint(f, h, use_reentrant=False)
            return self.head(h.mean(1))

    return _mixer_loop(Mixer)


def _phi():
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    def loss(model, step):
        ids = torch.randint(0, 8000, (4, 192))
        return model(input_ids=ids, labels=ids).loss
    return _loop(lambda: PhiForCausalLM(PhiConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=256)),
        lambda p: torch.optim.AdamW(p, 1e-4), loss, 5, bf16=True, clip=1.0)


def _effnet_channels_last():
    import torch
    import torch.nn.functional as F
    import torchvision

    def loss(model, step):
        x = torch.randn(16, 3, 128, 128).to(memory_format=torch.channels_last)
        return F.cross_entropy(model(x), torch.randint(0, 10, (16,)))
    return _loop(lambda: torchvision.models.efficientnet_b1(num_classes=10).to(
        memory_format=torch.channels_last),
        lambda p: torch.optim.SGD(p, 0.05, momentum=0.9, nesterov=True), loss, 5)


def _mistral():
    import torch
    import torch.nn.functional as F
    from transformers import MistralConfig, MistralForCausalLM

    def loss(model, step):
        ids = torch.randint(0, 8000, (4, 256))
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), label_smoothing=0.1)
    return _loop(lambda: MistralForCausalLM(MistralConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, sliding_window=64)),
        lambda p: torch.optim.Adam(p, 1e-4), loss, 5)


def workloads():
    """name -> callable that runs the workload (recorded by alloc_replay.record_traces)."""
    return {
        "simclr_r18": _simclr(),
        "layerdrop_enc": _layerdrop(),
        "curriculum_gpt2": _curriculum(),
        "mixer_ckpt": _mixer(),
        "mixer_ckpt_dict": _mixer_dict(),
        "phi_bf16_clip": _phi(),
        "effnet_b1_cl": _effnet_channels_last(),
        "mistral_smooth": _mistral(),
    }
