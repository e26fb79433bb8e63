"""Built-in example workloads for ``pymemplan trace`` and the accuracy benchmark.

Each is built from code or a config with random weights (nothing is downloaded). A
recipe returns a :class:`Workload`: the model, the inputs, and a loss function. Built on
``device="meta"`` (the default for tracing) they cost no memory, whatever their size.
Losses draw their targets inside the step (zeros of the right shape): the memory is the
same as with real labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class Workload:
    name: str
    model: Any
    inputs: tuple
    loss_fn: Callable | None
    description: str = ""
    takes_batch: bool = False  # a file factory given batch= (it can build another batch)


def _class_loss(out):
    import torch
    import torch.nn.functional as F

    logits = out if isinstance(out, torch.Tensor) else out.logits
    logits = logits.reshape(-1, logits.shape[-1])
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, target)


def _torchvision(name: str, batch: int, device: str, image: int = 224) -> Workload:
    import torch
    import torchvision

    with torch.device(device):
        model = getattr(torchvision.models, name)(num_classes=1000)
        x = torch.randn(batch, 3, image, image)
    return Workload(name, model, (x,), _class_loss, f"torchvision {name}, {image}x{image} images")


def resnet50(batch: int = 32, seq_len: int | None = None, device: str = "meta") -> Workload:
    return _torchvision("resnet50", batch, device)


def vit_b_16(batch: int = 32, seq_len: int | None = None, device: str = "meta") -> Workload:
    return _torchvision("vit_b_16", batch, device)


def _ids(batch: int, seq: int, vocab: int, device: str):
    import torch

    with torch.device(device):
        return torch.randint(0, vocab, (batch, seq)) if device != "meta" else \
            torch.empty(batch, seq, dtype=torch.long)


def gpt2(batch: int = 8, seq_len: int = 1024, device: str = "meta", layers: int = 12) -> Workload:
    """GPT-2 small (124M) with its LM head; Hugging Face's default attention (SDPA)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_positions=max(1024, seq_len), n_layer=layers, use_cache=False)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    return Workload("gpt2", model, (_ids(batch, seq_len, cfg.vocab_size, device),), _class_loss,
                    f"GPT-2 small ({layers} layers), sequence {seq_len}")


def bert(batch: int = 16, seq_len: int = 512, device: str = "meta", layers: int = 12) -> Workload:
    """BERT-base with its masked-LM head."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=layers, max_position_embeddings=max(512, seq_len))
    with torch.device(device):
        model = BertForMaskedLM(cfg)
    return Workload("bert", model, (_ids(batch, seq_len, cfg.vocab_size, device),), _class_loss,
                    f"BERT-base ({layers} layers) masked LM, sequence {seq_len}")


def llama_7b(batch: int = 1, seq_len: int = 2048, device: str = "meta",
             layers: int = 32) -> Workload:
    """A LLaMA-style 7B decoder (LLaMA-2-7B's shapes: 32 layers, width 4096, MLP 11008,
    vocabulary 32000), fp32 weights. Built on the meta device, it takes no memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      max_position_embeddings=max(4096, seq_len), use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return Workload("llama-7b", model, (_ids(batch, seq_len, cfg.vocab_size, device),),
                    _class_loss, f"LLaMA-style 7B ({layers} layers), sequence {seq_len}")


def llama3_8b(batch: int = 1, seq_len: int = 2048, device: str = "meta",
              layers: int = 32) -> Workload:
    """A LLaMA-3-8B-shaped decoder (8.0B parameters: width 4096, MLP 14336, grouped-query
    attention with 8 key/value heads, vocabulary 128256), fp32 weights, on the meta device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=max(8192, seq_len), rope_theta=500000.0,
                      use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return Workload("llama3-8b", model, (_ids(batch, seq_len, cfg.vocab_size, device),),
                    _class_loss, f"LLaMA-3-style 8B ({layers} layers), sequence {seq_len}")


def mlp(batch: int = 256, seq_len: int | None = None, device: str = "meta", layers: int = 24,
        width: int = 2048) -> Workload:
    """A deep MLP: `layers` x (Linear, GELU), then a 1000-way classifier."""
    import torch
    from torch import nn

    with torch.device(device):
        blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]
        model = nn.Sequential(*blocks, nn.Linear(width, 1000))
        x = torch.randn(batch, width)
    return Workload("mlp", model, (x,), _class_loss, f"{layers}-layer MLP, width {width}")


BUILTIN = {
    "gpt2": gpt2,
    "bert": bert,
    "resnet50": resnet50,
    "vit_b_16": vit_b_16,
    "llama-7b": llama_7b,
    "llama3-8b": llama3_8b,
    "mlp": mlp,
}
DEFAULT_MODEL = "gpt2"
_NO_SEQUENCE = ("resnet50", "vit_b_16", "mlp")  # built-ins whose inputs have no length


def _user_code_error(what: str, exc: Exception, path) -> ValueError:
    """The user's model file failed: say where in it (its innermost frame there), so the
    command-line error needs no traceback."""
    where = ""
    tb = exc.__traceback__
    target = path.resolve()
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == target:
            where = f" (at {path}:{tb.tb_lineno}, in {tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    return ValueError(f"{what} failed{where}: {type(exc).__name__}: {exc}")


def load_workload(spec: str, *, batch: int | None = None, seq_len: int | None = None,
                  device: str = "meta") -> Workload:
    """A built-in name, or ``path/to/file.py:factory``.

    A factory returns ``(model, inputs)`` or ``(model, inputs, loss_fn)``; it is given
    ``batch=`` and ``seq_len=`` when it accepts them and they were set.
    """
    import inspect

    kwargs = {k: v for k, v in (("batch", batch), ("seq_len", seq_len)) if v is not None}
    if spec in BUILTIN:
        if seq_len is not None and spec in _NO_SEQUENCE:
            # A figure for another shape than the one asked for would be read as the answer.
            raise ValueError(f"--seq-len {seq_len}: the built-in {spec!r} has no sequence "
                             f"(it takes --batch only); leave the option out")
        return BUILTIN[spec](device=device, **kwargs)
    path, sep, fname = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ValueError(f"unknown model {spec!r}: use one of {', '.join(BUILTIN)} or "
                         f"path/to/file.py:factory")
    import importlib.util
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"model file {path!r} does not exist")
    mod_spec = importlib.util.spec_from_file_location(f"_pymemplan_user_{p.stem}", p)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        raise _user_code_error(f"running {path}", e, p) from e
    factory = getattr(module, fname, None)
    if not callable(factory):
        raise ValueError(f"{path} has no callable {fname!r}; define def {fname}(): return "
                         f"model, inputs")
    params = inspect.signature(factory).parameters
    accepts_all = any(q.kind == q.VAR_KEYWORD for q in params.values())
    ignored = [k for k in kwargs if not accepts_all and k not in params]
    if ignored:
        # A figure for another batch than the one asked for would be read as the answer.
        flags = ", ".join(f"--{k.replace('_', '-')} {kwargs[k]}" for k in ignored)
        raise ValueError(f"{flags} cannot reach {path}:{fname}(), which takes no "
                         f"{', '.join(k + '=' for k in ignored)} argument: add it to "
                         f"def {fname}(...) and build the inputs with it, or leave the "
                         "option out")
    try:
        out = factory(**{k: v for k, v in kwargs.items() if accepts_all or k in params})
    except Exception as e:
        raise _user_code_error(f"{path}:{fname}()", e, p) from e
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise ValueError(f"{spec} must return (model, inputs) or (model, inputs, loss_fn), "
                         f"got {type(out).__name__}")
    model, inputs, *rest = out
    return Workload(fname, model, inputs, rest[0] if rest else None, f"{path}:{fname}",
                    takes_batch=accepts_all or "batch" in params)
