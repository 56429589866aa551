"""Tensor shapes of real model families, for benchmarks that must move realistic weights."""

from __future__ import annotations


def llama3_8b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-8B parameter shapes (bf16: 16.06 GB, 14.96 GiB)."""
    hidden, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 1024
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed_tokens", (vocab, hidden))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "input_layernorm", (hidden,)),
            (p + "q_proj", (hidden, hidden)),
            (p + "k_proj", (kv, hidden)),
            (p + "v_proj", (kv, hidden)),
            (p + "o_proj", (hidden, hidden)),
            (p + "post_attention_layernorm", (hidden,)),
            (p + "gate_proj", (inter, hidden)),
            (p + "up_proj", (inter, hidden)),
            (p + "down_proj", (hidden, inter)),
        ]
    shapes += [("norm", (hidden,)), ("lm_head", (vocab, hidden))]
    return shapes
