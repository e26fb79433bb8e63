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

Added in session 48, recorded and replayed before anything was changed for them:
- distill_r18: knowledge distillation, a frozen ResNet-34 teacher run under no_grad beside a
  ResNet-18 student, a temperature-scaled KL loss plus cross-entropy, AdamW;
- multitask_alt: one transformer encoder with two heads whose steps take turns (sentence
  classification on 128 tokens, token tagging on 96), Adam;
- wgan_gp: a WGAN with gradient penalty, five critic steps per generator step, the penalty a
  double backward (`create_graph=True`), two Adam optimizers;
- sparse_rec: a recommender with sparse embedding gradients (`sparse=True`, SparseAdam) whose
  sizes follow the ids drawn, and an MLP under Adam;
- maml_mlp: MAML, two inner SGD steps per task taken with `create_graph=True` and a
  second-order meta-gradient over four tasks, Adam.

Added in session 51, recorded and replayed before anything was changed for them:
- sam_r18: sharpness-aware minimization on ResNet-18: each step runs forward and backward
  twice, the weights moved along the gradient in between (a perturbation per parameter, made
  and kept across the second pass), SGD with momentum;
- gpt2_foreach: GPT-2 under AdamW and gradient clipping with the multi-tensor (`foreach`)
  implementations, which CUDA runs use by default and which allocate lists of temporaries;
- tbptt_lstm: an LSTM language model trained by truncated backpropagation through time, the
  hidden state carried (detached) from one chunk of 35 tokens to the next, Adam;
- gpipe_enc: a transformer encoder whose batch is cut into four micro-batches run forward one
  after the other and backward together (GPipe's schedule on one device), so that the
  activations of all four are alive at the peak, Adam;
- ppo_rollout: PPO: episodes of varying length (32 environments) collected under no_grad into a rollout buffer,
  then four epochs of minibatch updates of an actor-critic MLP over the shuffled buffer, Adam.
"""

from __future__ import annotations

# Steps that do not repeat: no steady state for a plan to reach.
NO_REPEATED_ITERATION = frozenset({"layerdrop_enc", "sparse_rec"})


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


def _distill():
    import torch
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(1)
    teacher = None

    def make_student():
        nonlocal teacher
        teacher = torchvision.models.resnet34(num_classes=100).eval().requires_grad_(False)
        return torchvision.models.resnet18(num_classes=100)

    def loss(model, step):
        x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 100, (32,))
        with torch.no_grad():
            soft = F.softmax(teacher(x) / 4.0, dim=1)
        logits = model(x)
        kd = F.kl_div(F.log_softmax(logits / 4.0, dim=1), soft, reduction="batchmean") * 16.0
        return 0.9 * kd + 0.1 * F.cross_entropy(logits, y)
    return _loop(make_student, lambda p: torch.optim.AdamW(p, 1e-3), loss, 5)


def _multitask():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Shared(nn.Module):
        def __init__(self, width=256, vocab=8000, tags=50):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(width, 4, 1024, batch_first=True), 4)
            self.classify = nn.Linear(width, 20)
            self.tag = nn.Sequential(nn.Linear(width, 512), nn.GELU(), nn.Linear(512, tags))

    def loss(model, step):
        if step % 2 == 0:  # sentence classification
            ids = torch.randint(0, 8000, (16, 128))
            h = model.encoder(model.embed(ids))
            return F.cross_entropy(model.classify(h.mean(1)), torch.randint(0, 20, (16,)))
        ids = torch.randint(0, 8000, (16, 96))  # token tagging
        h = model.encoder(model.embed(ids))
        return F.cross_entropy(model.tag(h).flatten(0, 1), torch.randint(0, 50, (16 * 96,)))
    return _loop(Shared, lambda p: torch.optim.Adam(p, 1e-4), loss, 8)


def _wgan_gp():
    import torch
    import torch.nn as nn

    def run():
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(128, 4 * 4 * 256), nn.Unflatten(1, (256, 4, 4)),
                            nn.ConvTranspose2d(256, 128, 4, 2, 1), nn.BatchNorm2d(128), nn.ReLU(),
                            nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.ReLU(),
                            nn.ConvTranspose2d(64, 3, 4, 2, 1), nn.Tanh())
        critic = nn.Sequential(nn.Conv2d(3, 64, 4, 2, 1), nn.LeakyReLU(0.2),
                               nn.Conv2d(64, 128, 4, 2, 1), nn.LeakyReLU(0.2),
                               nn.Conv2d(128, 256, 4, 2, 1), nn.LeakyReLU(0.2),
                               nn.Flatten(), nn.Linear(4 * 4 * 256, 1))
        opt_g = torch.optim.Adam(gen.parameters(), 1e-4, betas=(0.5, 0.9))
        opt_c = torch.optim.Adam(critic.parameters(), 1e-4, betas=(0.5, 0.9))
        for _ in range(4):
            for _ in range(5):
                real = torch.randn(64, 3, 32, 32)
                with torch.no_grad():
                    fake = gen(torch.randn(64, 128))
                eps = torch.rand(64, 1, 1, 1)
                mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
                grad, = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
                penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
                loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
                loss.backward()
                del loss, grad, penalty, mixed
                opt_c.step()
                opt_c.zero_grad(set_to_none=True)
            loss = -critic(gen(torch.randn(64, 128))).mean()
            loss.backward()
            del loss
            opt_g.step()
            opt_g.zero_grad(set_to_none=True)
            critic.zero_grad(set_to_none=True)
    return run


def _sparse_rec():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def run():
        torch.manual_seed(0)
        items = nn.Embedding(200_000, 64, sparse=True)
        users = nn.Embedding(50_000, 64, sparse=True)
        mlp = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                            nn.Linear(256, 1))
        sparse_opt = torch.optim.SparseAdam(list(items.parameters()) + list(users.parameters()), 1e-3)
        dense_opt = torch.optim.Adam(mlp.parameters(), 1e-3)
        for _ in range(6):
            # Ids drawn from a skewed distribution: how many are distinct varies per step.
            item_ids = (torch.rand(4096) ** 3 * 200_000).long()
            user_ids = torch.randint(0, 50_000, (4096,))
            score = mlp(torch.cat([items(item_ids), users(user_ids)], dim=1)).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(score, torch.rand(4096).round())
            loss.backward()
            del loss, score
            sparse_opt.step()
            dense_opt.step()
            sparse_opt.zero_grad(set_to_none=True)
            dense_opt.zero_grad(set_to_none=True)
    return run


def _maml():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.func import functional_call

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        for _ in range(5):
            meta_loss = 0.0
            for _ in range(4):  # tasks
                params = dict(model.named_parameters())
                x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
                for _ in range(2):  # inner steps, kept in the graph
                    inner = F.cross_entropy(functional_call(model, params, (x,)), y)
                    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
                    params = {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads)}
                qx, qy = torch.randn(256, 64), torch.randint(0, 10, (256,))
                meta_loss = meta_loss + F.cross_entropy(functional_call(model, params, (qx,)), qy)
            meta_loss.backward()
            del meta_loss, params, grads, inner
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


def _sam():
    import torch
    import torch.nn.functional as F
    import torchvision

    def run():
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=100)
        params = [p for p in model.parameters()]
        opt = torch.optim.SGD(params, 0.05, momentum=0.9, weight_decay=5e-4)
        for _ in range(5):
            x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 100, (32,))
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
                moved = []
                for p in params:
                    e = p.grad * (0.05 / (norm + 1e-12))
                    p.add_(e)
                    moved.append(e)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(params, moved):
                    p.sub_(e)
            del moved, norm
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


def _gpt2_foreach():
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    def run():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=8000, n_positions=256, n_embd=384,
                                           n_layer=4, n_head=6, bos_token_id=0,
                                           eos_token_id=0))
        opt = torch.optim.AdamW(model.parameters(), 3e-4, foreach=True)
        for _ in range(5):
            ids = torch.randint(0, 8000, (8, 256))
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            del logits
            loss.backward()
            del loss
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


def _tbptt():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class LM(nn.Module):
        def __init__(self, vocab=8000, width=512):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
            self.out = nn.Linear(width, vocab)

    def run():
        torch.manual_seed(0)
        model = LM()
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        stream = torch.randint(0, 8000, (16, 35 * 8 + 1))
        state = None
        for k in range(8):
            chunk = stream[:, 35 * k:35 * (k + 1) + 1]
            h, state = model.lstm(model.embed(chunk[:, :-1]), state)
            state = tuple(s.detach() for s in state)
            loss = F.cross_entropy(model.out(h).flatten(0, 1), chunk[:, 1:].flatten())
            del h
            loss.backward()
            del loss
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


def _gpipe():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Embedding(8000, 256),
            nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4),
            nn.Linear(256, 8000))
        opt = torch.optim.Adam(model.parameters(), 1e-4)
        for _ in range(5):
            ids = torch.randint(0, 8000, (16, 128))
            losses = [F.cross_entropy(model(mb[:, :-1]).flatten(0, 1), mb[:, 1:].flatten())
                      for mb in ids.chunk(4)]
            total = torch.stack(losses).mean()
            del losses
            total.backward()
            del total
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


def _ppo():
    import torch
    import torch.nn as nn

    def run():
        torch.manual_seed(0)
        actor = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                              nn.Linear(1024, 18))
        critic = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                               nn.Linear(1024, 1))
        opt = torch.optim.Adam(list(actor.parameters()) + list(critic.parameters()), 3e-4)
        lengths = torch.randint(4096, 8192, (4,)).tolist()
        for length in lengths:
            obs, acts, logps, values = [], [], [], []
            with torch.no_grad():  # the rollout: one small step at a time, 32 environments
                for _ in range(length // 32):
                    o = torch.randn(32, 256)
                    dist = torch.distributions.Categorical(logits=actor(o))
                    a = dist.sample()
                    obs.append(o)
                    acts.append(a)
                    logps.append(dist.log_prob(a))
                    values.append(critic(o).squeeze(1))
            obs, acts, logps, values = (torch.cat(t) for t in (obs, acts, logps, values))
            returns = values + torch.randn_like(values)
            adv = (returns - values - (returns - values).mean()) / ((returns - values).std() + 1e-8)
            for _ in range(4):  # epochs over the shuffled buffer
                for idx in torch.randperm(len(obs)).split(512):
                    dist = torch.distributions.Categorical(logits=actor(obs[idx]))
                    ratio = (dist.log_prob(acts[idx]) - logps[idx]).exp()
                    clipped = torch.min(ratio * adv[idx], ratio.clamp(0.8, 1.2) * adv[idx])
                    loss = -clipped.mean() + 0.5 * (critic(obs[idx]).squeeze(1) - returns[idx]).pow(2).mean() \
                        - 0.01 * dist.entropy().mean()
                    loss.backward()
                    del loss, dist, ratio, clipped
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            del obs, acts, logps, values, returns, adv
    return run


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
        "distill_r18": _distill(),
        "multitask_alt": _multitask(),
        "wgan_gp": _wgan_gp(),
        "sparse_rec": _sparse_rec(),
        "maml_mlp": _maml(),
        "sam_r18": _sam(),
        "gpt2_foreach": _gpt2_foreach(),
        "tbptt_lstm": _tbptt(),
        "gpipe_enc": _gpipe(),
        "ppo_rollout": _ppo(),
    }
