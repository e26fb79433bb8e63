"""The planner across many architectures: predicted peak vs. a real CPU step, tiny configs.

    python benchmarks/planner_sweep.py             # writes results/planner_sweep.json
    python benchmarks/planner_sweep.py --markdown  # also print the summary of docs/planner.md

``planner_accuracy.py`` and ``planner_heldout.py`` measure a few models at realistic sizes.
This measures breadth: 41 architectures from Hugging Face transformers (decoders, encoders,
encoder-decoders, mixtures of experts, state-space, vision and audio models) and
torchvision, each built from a tiny config with random weights, traced with AdamW
(``pymemplan.trace(..., device="cpu")``, kernel probe on) and run for real
(``measure_step``). A model whose forward needs tensor values (LayerDrop's random draw,
Longformer's padding to its window) cannot be traced; it is reported with the error the
planner gives. Models whose code is missing from the installed transformers are skipped.

Exit status 0 when every model that traces is within 0.5% of its measured peak.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "planner_sweep.json"
TARGET_ERROR = 0.005
VOCAB = 1000


def _hf(config, model, **kw):
    def build():
        import transformers

        if not hasattr(transformers, config) or not hasattr(transformers, model):
            raise ModuleNotFoundError(f"transformers {transformers.__version__} has no {model}")
        return getattr(transformers, model)(getattr(transformers, config)(**kw))
    return build


def _tv(name, **kw):
    def build():
        import torchvision

        for module in (torchvision.models, torchvision.models.video):
            if hasattr(module, name):
                return getattr(module, name)(num_classes=10, **kw)
        raise ModuleNotFoundError(f"torchvision has no {name}")
    return build


# Small shapes shared by the language models.
LM = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
DEC = dict(LM, hidden_size=128, intermediate_size=256)


def models() -> dict:
    """name -> (build, inputs kind)."""
    return {
        # decoders
        "mistral": (_hf("MistralConfig", "MistralForCausalLM", **DEC, num_key_value_heads=2,
                        sliding_window=16), "tokens"),
        "qwen2": (_hf("Qwen2Config", "Qwen2ForCausalLM", **DEC, num_key_value_heads=2), "tokens"),
        "gemma": (_hf("GemmaConfig", "GemmaForCausalLM", **DEC, num_key_value_heads=1,
                      head_dim=32), "tokens"),
        "phi": (_hf("PhiConfig", "PhiForCausalLM", **DEC), "tokens"),
        "gpt_neox": (_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **DEC), "tokens"),
        "bloom": (_hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=128,
                      n_layer=2, n_head=4), "tokens"),
        "falcon": (_hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=128,
                       num_hidden_layers=2, num_attention_heads=4), "tokens"),
        "opt": (_hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=128, ffn_dim=256,
                    num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=128), "tokens"),
        "xlnet": (_hf("XLNetConfig", "XLNetLMHeadModel", vocab_size=VOCAB, d_model=128, n_layer=2,
                      n_head=4, d_inner=256), "tokens"),
        "reformer": (_hf("ReformerConfig", "ReformerModelWithLMHead", vocab_size=VOCAB,
                         hidden_size=128, attention_head_size=32, num_attention_heads=4,
                         feed_forward_size=256, attn_layers=["local", "lsh"],
                         axial_pos_embds=False, is_decoder=True, local_attn_chunk_length=16,
                         lsh_attn_chunk_length=16, num_buckets=4, max_position_embeddings=32),
                     "tokens"),
        # mixtures of experts and state-space models
        "mixtral": (_hf("MixtralConfig", "MixtralForCausalLM", **DEC, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2), "tokens"),
        "qwen2_moe": (_hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **DEC, num_key_value_heads=2,
                          moe_intermediate_size=64, shared_expert_intermediate_size=128,
                          num_experts=4, num_experts_per_tok=2), "tokens"),
        "olmoe": (_hf("OlmoeConfig", "OlmoeForCausalLM", **dict(DEC, intermediate_size=64),
                      num_experts=4, num_experts_per_tok=2), "tokens"),
        "gpt_oss": (_hf("GptOssConfig", "GptOssForCausalLM", **dict(DEC, intermediate_size=128),
                        num_key_value_heads=2, head_dim=32, num_local_experts=4,
                        num_experts_per_tok=2), "tokens"),
        "deepseek_v3": (_hf("DeepseekV3Config", "DeepseekV3ForCausalLM", **DEC,
                            num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=4,
                            num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32), "tokens"),
        "mamba": (_hf("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=128,
                      num_hidden_layers=2, state_size=8), "tokens"),
        # encoders and encoder-decoders
        "roberta": (_hf("RobertaConfig", "RobertaForMaskedLM", **DEC), "tokens"),
        "distilbert": (_hf("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=VOCAB, dim=128,
                           hidden_dim=256, n_layers=2, n_heads=4), "tokens"),
        "deberta_v2": (_hf("DebertaV2Config", "DebertaV2ForMaskedLM", **DEC), "tokens"),
        "albert": (_hf("AlbertConfig", "AlbertForMaskedLM", **DEC, embedding_size=64), "tokens"),
        "electra": (_hf("ElectraConfig", "ElectraForMaskedLM", **DEC, embedding_size=64), "tokens"),
        "funnel": (_hf("FunnelConfig", "FunnelForMaskedLM", vocab_size=VOCAB, d_model=128,
                       block_sizes=[1, 1], n_head=4, d_head=32, d_inner=256), "tokens"),
        "bigbird": (_hf("BigBirdConfig", "BigBirdForMaskedLM", **DEC,
                        attention_type="original_full"), "tokens"),
        "bart": (_hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=128,
                     encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256),
                 "tokens"),
        "led": (_hf("LEDConfig", "LEDForConditionalGeneration", vocab_size=VOCAB, d_model=128,
                    encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                    attention_window=[16]), "tokens"),
        # vision and audio
        "clip_vision": (_hf("CLIPVisionConfig", "CLIPVisionModel", hidden_size=128,
                            intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            image_size=64, patch_size=16), "image64"),
        "dinov2": (_hf("Dinov2Config", "Dinov2Model", hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16),
                   "image64"),
        "vitmae": (_hf("ViTMAEConfig", "ViTMAEForPreTraining", hidden_size=128,
                       intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       image_size=64, patch_size=16, decoder_hidden_size=64,
                       decoder_num_hidden_layers=1, decoder_intermediate_size=128), "image64"),
        "beit": (_hf("BeitConfig", "BeitForMaskedImageModeling", hidden_size=128,
                     intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     image_size=64, patch_size=16, vocab_size=VOCAB), "image64"),
        "swin_hf": (_hf("SwinConfig", "SwinModel", image_size=64, patch_size=4, embed_dim=32,
                        depths=[1, 1], num_heads=[2, 4], window_size=4), "image64"),
        "segformer": (_hf("SegformerConfig", "SegformerForSemanticSegmentation", num_labels=4,
                          hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                          decoder_hidden_size=64), "image64"),
        "mobilevit": (_hf("MobileViTConfig", "MobileViTModel", image_size=64), "image64"),
        "wav2vec2": (_hf("Wav2Vec2Config", "Wav2Vec2Model", hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, conv_dim=(32, 32),
                         conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2),
                     "audio"),
        "regnet_y_400mf": (_tv("regnet_y_400mf"), "image96"),
        "efficientnet_v2_s": (_tv("efficientnet_v2_s"), "image96"),
        "shufflenet_v2_x1_0": (_tv("shufflenet_v2_x1_0"), "image96"),
        "squeezenet1_1": (_tv("squeezenet1_1"), "image96"),
        "densenet121": (_tv("densenet121"), "image96"),
        "maxvit_t": (_tv("maxvit_t"), "image224"),
        "swin_v2_t": (_tv("swin_v2_t"), "image96"),
        "r3d_18": (_tv("r3d_18"), "video"),
    }


def make_inputs(kind):
    import torch

    return {"tokens": lambda: (torch.randint(0, VOCAB, (2, 32)),),
            "audio": lambda: (torch.randn(2, 4000),),
            "image64": lambda: (torch.randn(2, 3, 64, 64),),
            "image96": lambda: (torch.randn(2, 3, 96, 96),),
            "image224": lambda: (torch.randn(1, 3, 224, 224),),
            "video": lambda: (torch.randn(1, 3, 8, 64, 64),)}[kind]()


def loss_fn(out):
    """A scalar from whatever the model returns: logits, hidden states, or a tensor."""
    for name in ("logits", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name).float().mean()
    return out.float().mean()


def measure(name, build, kind) -> dict:
    import torch

    import pymemplan
    from pymemplan.planner import PlannerError
    from pymemplan.planner.measure import measure_step

    torch.manual_seed(0)
    try:
        model = build()
    except (ModuleNotFoundError, ImportError) as e:
        return {"model": name, "status": "skipped", "reason": str(e)}
    inputs = make_inputs(kind)
    t0 = time.perf_counter()
    try:
        t = pymemplan.trace(model, inputs, loss_fn=loss_fn, optimizer=torch.optim.AdamW,
                            device="cpu")
    except PlannerError as e:
        return {"model": name, "status": "untraceable", "error": str(e).split(". ")[0]}
    seconds = time.perf_counter() - t0
    measured = measure_step(model, inputs, loss_fn=loss_fn, optimizer=torch.optim.AdamW).peak_bytes
    error = t.peak_bytes - measured
    return {"model": name, "status": "traced", "predicted_bytes": t.peak_bytes,
            "measured_bytes": measured, "error_bytes": error,
            "relative_error": error / measured, "trace_seconds": seconds}


def summary(rows) -> str:
    traced = [r for r in rows if r["status"] == "traced"]
    errors = sorted(traced, key=lambda r: -abs(r["relative_error"]))
    exact = sum(1 for r in traced if abs(r["relative_error"]) < 1e-4)
    lines = [f"{len(traced)} of {len(rows)} models traced; {exact} within 0.01% of the measured "
             f"peak; the largest errors: " + ", ".join(
                 f"{r['model']} {100 * r['relative_error']:+.2f}%" for r in errors[:4]) + "."]
    for r in rows:
        if r["status"] != "traced":
            lines.append(f"- {r['model']}: {r['status']}: {r.get('error') or r.get('reason')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    from planner_heldout import parse_args

    known = models()
    args = parse_args(__doc__, known, RESULT, argv)

    rows = []
    for name in args.models:
        build, kind = known[name]
        r = measure(name, build, kind)
        rows.append(r)
        if r["status"] == "traced":
            print(f"{name}: predicted {r['predicted_bytes']:,} B, measured "
                  f"{r['measured_bytes']:,} B ({100 * r['relative_error']:+.4f}%)", flush=True)
        else:
            print(f"{name}: {r['status']}", flush=True)
    traced = [r for r in rows if r["status"] == "traced"]
    within = all(abs(r["relative_error"]) <= TARGET_ERROR for r in traced)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/planner_sweep.py", "torch": torch.__version__,
        "machine": platform.machine(), "target_relative_error": TARGET_ERROR,
        "within_target": within, "results": rows}, indent=2) + "\n")
    if args.markdown:
        print(summary(rows))
    print(f"-> {args.out}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
