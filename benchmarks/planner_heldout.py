"""The planner on models it was not developed on: predicted peak vs. a real CPU step.

    python benchmarks/planner_heldout.py             # writes results/planner_heldout.json
    python benchmarks/planner_heldout.py --markdown  # also print the table of docs/planner.md

``benchmarks/planner_accuracy.py`` checks the models the planner was built against. These
are others, each with something those lack: a UNet (GroupNorm, SiLU, upsampling, skip
concatenations), a T5 encoder-decoder (relative position bias, cross-attention), ConvNeXt-T
(depthwise convolutions, LayerNorm over channels), Swin-T (shifted windows), a two-layer
LSTM language model (oneDNN workspaces), a GPT-2 under bf16 autocast (weights cast in
the forward pass), Mixtral and Qwen2-MoE (mixtures of experts run as grouped matrix
products), a mixture of experts whose router picks tokens with ``torch.nonzero`` (traced
with ``nonzero_density``), Mistral (sliding-window attention) and DeBERTa-v2 (disentangled
attention), Mamba (a state-space model's scan over time), and, added later, DenseNet-121
(dense blocks) under SGD with Nesterov momentum, OPT, a GRU encoder-decoder under RMSprop,
DistilBERT, RegNetY-400MF under Adagrad and ShuffleNetV2 under bf16 autocast, and, added last,
DeepLabV3 (segmentation, with a per-pixel target the loss closes over), GPT-NeoX with
Hugging Face's activation checkpointing, T5 under Adafactor and Llama under fp16 autocast
with a gradient scaler. Each is traced with
its optimizer, AdamW unless named (``pymemplan.trace(..., device="cpu")``, kernel probe on, the
CPU default), and its steady-state step is then run for real
(``pymemplan.planner.measure.measure_step``: the optimizer's state made by a warm-up step first).
Random weights; sizes chosen so a real CPU step takes seconds.

Exit status 0 when every prediction is within 0.5% of the measured peak.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "planner_heldout.json"
TARGET_ERROR = 0.005


def workloads():
    """name -> (description, build); build() returns (model, inputs, loss_fn, autocast) and,
    for some, a dict of further pymemplan.trace arguments."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Loss(nn.Module):
        # A Hugging Face model called with labels, returning its loss.
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args):
            ids, labels = args if len(args) == 2 else (args[0], args[0])
            return self.model(input_ids=ids, labels=labels).loss

    def unet():
        import heldout_models

        x = torch.randn(6, 3, 96, 96)
        return heldout_models.unet(), (x,), lambda out: F.mse_loss(out, x), None

    def t5():
        from transformers import T5Config, T5ForConditionalGeneration

        model = T5ForConditionalGeneration(T5Config(
            d_model=256, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4,
            vocab_size=8000, decoder_start_token_id=0, pad_token_id=0))
        return (Loss(model), (torch.randint(0, 8000, (8, 128)), torch.randint(0, 8000, (8, 64))),
                None, None)

    def convnext():
        import torchvision

        y = torch.randint(0, 100, (4,))
        return (torchvision.models.convnext_tiny(num_classes=100), (torch.randn(4, 3, 96, 96),),
                lambda out: F.cross_entropy(out, y), None)

    def swin():
        import torchvision

        y = torch.randint(0, 10, (2,))
        return (torchvision.models.swin_t(num_classes=10), (torch.randn(2, 3, 112, 112),),
                lambda out: F.cross_entropy(out, y), None)

    def lstm():
        model = nn.Sequential(nn.Embedding(5000, 256),
                              nn.LSTM(256, 512, num_layers=2, batch_first=True))
        return model, (torch.randint(0, 5000, (16, 64)),), lambda out: out[0].pow(2).mean(), None

    def gpt2_bf16():
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=384, n_head=6, vocab_size=8000,
                                           n_positions=256))
        return Loss(model), (torch.randint(0, 8000, (4, 256)),), None, torch.bfloat16

    def mixture_of_experts(config, model, **kw):
        # transformers' MoE decoders run their experts as torch._grouped_mm, in fp32 here.
        def build():
            import transformers

            cfg = getattr(transformers, config)(vocab_size=8000, hidden_size=256,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, **kw)
            return (Loss(getattr(transformers, model)(cfg)), (torch.randint(0, 8000, (4, 128)),),
                    None, None)
        return build

    def routed_moe():
        # Experts that pick their tokens with torch.nonzero: sizes that depend on values,
        # traced at the density of an even routing (1/8 for 8 experts).
        import heldout_models

        model = heldout_models.moe_lm(experts=8, top=2)
        return model, (torch.randint(0, 8000, (8, 128)),), None, None, {"nonzero_density": 1 / 8}

    def mamba():
        # A selective state-space model; without the mamba_ssm kernels transformers runs its
        # reference scan, a loop over time whose slices' gradients autograd sums in place.
        from transformers import MambaConfig, MambaForCausalLM

        model = MambaForCausalLM(MambaConfig(vocab_size=8000, hidden_size=256,
                                             num_hidden_layers=4, state_size=16))
        return Loss(model), (torch.randint(0, 8000, (4, 128)),), None, None

    def mistral():
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(
            vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, sliding_window=64))
        return Loss(model), (torch.randint(0, 8000, (4, 256)),), None, None

    def deberta():
        from transformers import DebertaV2Config, DebertaV2ForMaskedLM

        model = DebertaV2ForMaskedLM(DebertaV2Config(
            vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=4))
        return Loss(model), (torch.randint(0, 8000, (8, 128)),), None, None

    def classifier(name, batch, size, optimizer, autocast=None):
        # A torchvision classifier over 10 classes, trained by `optimizer`.
        def build():
            import torchvision

            model = getattr(torchvision.models, name)(num_classes=10)
            x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
            return model, (x,), lambda out: F.cross_entropy(out, y), autocast, {"optimizer": optimizer}
        return build

    def opt():
        from transformers import OPTConfig, OPTForCausalLM

        model = OPTForCausalLM(OPTConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4,
                                         ffn_dim=1024, num_attention_heads=4,
                                         max_position_embeddings=256, word_embed_proj_dim=256))
        return Loss(model), (torch.randint(0, 8000, (4, 128)),), None, None

    def distilbert():
        from transformers import DistilBertConfig, DistilBertForSequenceClassification

        model = DistilBertForSequenceClassification(DistilBertConfig(
            vocab_size=8000, dim=256, n_layers=4, n_heads=4, hidden_dim=1024))
        ids, labels = torch.randint(0, 8000, (8, 96)), torch.randint(0, 2, (8,))
        return Loss(model), (ids, labels), None, None

    def gru_seq2seq():
        import heldout_models

        src, tgt = torch.randint(0, 4000, (16, 40)), torch.randint(0, 4000, (16, 30))
        rmsprop = functools.partial(torch.optim.RMSprop, lr=1e-3)
        return heldout_models.gru_seq2seq(), (src, tgt), None, None, {"optimizer": rmsprop}

    def deeplab():
        import torchvision

        model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=8, aux_loss=True)
        y = torch.randint(0, 8, (4, 128, 128))
        return (model, (torch.randn(4, 3, 128, 128),),
                lambda out: F.cross_entropy(out["out"], y) + 0.4 * F.cross_entropy(out["aux"], y),
                None)

    def neox_checkpointed():
        # Hugging Face's own activation checkpointing (torch.utils.checkpoint, non-reentrant).
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        model = GPTNeoXForCausalLM(GPTNeoXConfig(
            vocab_size=8000, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
            intermediate_size=1024, max_position_embeddings=512))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return Loss(model), (torch.randint(0, 8000, (4, 256)),), None, None

    def t5_adafactor():
        from transformers.optimization import Adafactor

        model, inputs, *_ = t5()
        adafactor = functools.partial(Adafactor, lr=1e-3, relative_step=False,
                                      scale_parameter=False)
        return model, inputs, None, None, {"optimizer": adafactor}

    def llama_fp16():
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256))
        return (Loss(model), (torch.randint(0, 8000, (4, 128)),), None, torch.float16,
                {"grad_scaler": True})

    sgd_nesterov = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, nesterov=True)
    adagrad = functools.partial(torch.optim.Adagrad, lr=0.01)
    return {
        "unet": ("UNet (GroupNorm, skip concatenations), batch 6 at 96x96", unet),
        "t5": ("T5 encoder-decoder, 4 + 4 layers, batch 8, 128 -> 64 tokens", t5),
        "convnext_tiny": ("ConvNeXt-T, batch 4 at 96x96", convnext),
        "swin_t": ("Swin-T, batch 2 at 112x112", swin),
        "lstm_lm": ("embedding + 2-layer LSTM (512), batch 16 x 64", lstm),
        "gpt2_bf16": ("GPT-2, 4 layers of 384, batch 4 x 256, bf16 autocast", gpt2_bf16),
        "mixtral": ("Mixtral, 2 layers of 256, 8 experts (top 2), batch 4 x 128",
                    mixture_of_experts("MixtralConfig", "MixtralForCausalLM", intermediate_size=512,
                                       num_local_experts=8, num_experts_per_tok=2)),
        "qwen2_moe": ("Qwen2-MoE, 2 layers of 256, 8 experts (top 2) and a shared one, "
                      "batch 4 x 128",
                      mixture_of_experts("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                                         intermediate_size=512, moe_intermediate_size=256,
                                         shared_expert_intermediate_size=512, num_experts=8,
                                         num_experts_per_tok=2)),
        "moe_nonzero": ("4 layers of 256, 8 experts (top 2) picking tokens with nonzero, "
                        "batch 8 x 128, nonzero_density=1/8", routed_moe),
        "mamba": ("Mamba (reference scan), 4 layers of 256, state 16, batch 4 x 128", mamba),
        "mistral": ("Mistral, 4 layers of 256, sliding window 64, batch 4 x 256", mistral),
        "deberta_v2": ("DeBERTa-v2 (disentangled attention), 4 layers of 256, batch 8 x 128",
                       deberta),
        "densenet121": ("DenseNet-121, batch 4 at 96x96, SGD with Nesterov momentum",
                        classifier("densenet121", 4, 96, sgd_nesterov)),
        "opt": ("OPT, 4 layers of 256, batch 4 x 128", opt),
        "gru_seq2seq": ("GRU encoder-decoder, 2 + 2 layers of 256, batch 16, 40 -> 30 tokens, RMSprop",
                        gru_seq2seq),
        "distilbert": ("DistilBERT classifier, 4 layers of 256, batch 8 x 96", distilbert),
        "regnet_y_400mf": ("RegNetY-400MF, batch 8 at 96x96, Adagrad",
                           classifier("regnet_y_400mf", 8, 96, adagrad)),
        "shufflenet_v2": ("ShuffleNetV2, batch 32 at 128x128, bf16 autocast",
                          classifier("shufflenet_v2_x1_0", 32, 128, torch.optim.AdamW, torch.bfloat16)),
        "deeplab_v3": ("DeepLabV3 (MobileNetV3 backbone, auxiliary head), batch 4 at 128x128",
                       deeplab),
        "gpt_neox_ckpt": ("GPT-NeoX, 6 layers of 256, Hugging Face's activation checkpointing, "
                          "batch 4 x 256", neox_checkpointed),
        "t5_adafactor": ("the T5 above under Adafactor (factored second moments)", t5_adafactor),
        "llama_fp16": ("Llama, 4 layers of 256, batch 4 x 128, fp16 autocast with a gradient "
                       "scaler", llama_fp16),
    }


def measure(name, build) -> dict:
    import torch

    import pymemplan
    from pymemplan.planner.measure import measure_step

    torch.manual_seed(0)
    model, inputs, loss_fn, autocast, *extra = build()
    options = dict(extra[0]) if extra else {}
    optimizer = options.pop("optimizer", torch.optim.AdamW)
    t0 = time.perf_counter()
    t = pymemplan.trace(model, inputs, loss_fn=loss_fn, optimizer=optimizer,
                        device="cpu", autocast=autocast, **options)
    trace_seconds = time.perf_counter() - t0
    measured = measure_step(model, inputs, loss_fn=loss_fn, optimizer=optimizer, autocast=autocast,
                            grad_scaler=options.get("grad_scaler", False)).peak_bytes
    error = t.peak_bytes - measured
    return {"model": name, "predicted_bytes": t.peak_bytes, "measured_bytes": measured,
            "error_bytes": error, "relative_error": error / measured,
            "trace_seconds": trace_seconds}


def markdown(rows, descriptions) -> str:
    from pymemplan.units import format_bytes

    lines = ["| model | step (AdamW unless named) | measured peak | pymemplan | error |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {descriptions[r['model']]} | "
                     f"{format_bytes(r['measured_bytes'])} | {format_bytes(r['predicted_bytes'])} | "
                     f"{r['error_bytes']:+,} B ({100 * r['relative_error']:+.4f}%) |")
    return "\n".join(lines)


def parse_args(doc: str, names, out: Path, argv=None):
    """--models (a subset of names), --markdown, --out: the options of the planner's
    model benchmarks (this one and planner_sweep.py)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(names), choices=list(names))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=out)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import torch

    known = workloads()
    args = parse_args(__doc__, known, RESULT, argv)

    rows = []
    for name in args.models:
        r = measure(name, known[name][1])
        print(f"{name}: predicted {r['predicted_bytes']:,} B, measured {r['measured_bytes']:,} B "
              f"({100 * r['relative_error']:+.4f}%)", flush=True)
        rows.append(r)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/planner_heldout.py",
        "torch": torch.__version__, "machine": platform.machine(),
        "target_relative_error": TARGET_ERROR,
        "descriptions": {n: known[n][0] for n in args.models},
        "results": rows,
    }, indent=2) + "\n")
    if args.markdown:
        print(markdown(rows, {n: known[n][0] for n in args.models}))
    print(f"-> {args.out}")
    return 0 if all(abs(r["relative_error"]) <= TARGET_ERROR for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
