"""Tiny random models made with transformers itself, for the tests that hold the worker to it."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import torch


@torch.no_grad()
def init_weights(model: Any, seed: int) -> None:
    """Weights with enough scale that greedy decoding varies. transformers' own init (std 0.02
    everywhere) makes every greedy token the same, which would prove nothing: matrices
    normal(0, 1/sqrt(fan_in)), so each layer moves the residual stream by about its own size;
    embeddings normal(0, 0.1), small beside that (an embedding of std 1 dominates these two-layer
    models, and tied ones then echo their last token forever); norm scales 1 + normal(0, 0.1); biases
    normal(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # a tied lm_head is the embedding, listed once
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias") or "embed_tokens" in name:
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[-1]))  # fan-in: the last dim (experts stack matrices on a first)


def _transformers() -> Any:
    """transformers, imported where a model is made (it is slow to import), untyped as its calls are."""
    return importlib.import_module("transformers")


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "hello world, héllo wörld, naïve café 😀 🚀",
    "日本語のテキストと emoji 🎉 mixed with ascii text",
    "the quick brown fox jumps over the lazy dog",
] * 40


def tiny_llama(vocab: int = 256, seed: int = 0, **overrides: Any) -> Any:
    """A transformers Llama with weights scaled so greedy decoding varies (hf_models.init_weights)."""
    fields: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    transformers = _transformers()
    config = transformers.LlamaConfig(**{**fields, **overrides})
    model = transformers.LlamaForCausalLM(config).float().eval()
    init_weights(model, seed)
    return model


def save(model: Any, path: Path, eos: int | list[int] | None = None, generation_eos: Any = None) -> Path:
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(cfg))
    gen = path / "generation_config.json"
    if generation_eos is not None:
        gen.write_text(json.dumps({"eos_token_id": generation_eos}))
    elif gen.exists():
        gen.unlink()
    return path


def text_model(tmp_path: Path) -> tuple[Path, Any]:
    """A random Llama whose vocabulary is a byte-level BPE trained here, saved with a chat template."""
    transformers = _transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path / "text-model"
    save(tiny_llama(vocab=tok.get_vocab_size(), seed=1), path, eos=tok.token_to_id("</s>"))
    fast.save_pretrained(path)
    return path, transformers.AutoTokenizer.from_pretrained(path)


__all__ = ["CHAT_TEMPLATE", "CORPUS", "init_weights", "save", "text_model", "tiny_llama"]
