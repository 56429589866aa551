"""A dense reference decoder for tests: no paging, no cache, float64, written independently of
worker.model.decoder so that a paging or RoPE bug there cannot hide behind shared code."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from worker.model.config import ModelConfig


def dense_logits(weights: Mapping[str, torch.Tensor], config: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` logits of a whole sequence, recomputed from scratch."""
    assert config.rope_scaling is None, "the reference implements unscaled RoPE only"
    w = {name: t.detach().to("cpu", torch.float64) for name, t in weights.items()}
    n, nh, nkv, d = len(tokens), config.num_heads, config.num_kv_heads, config.head_dim

    def norm(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return scale * x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps)

    half = d // 2
    angles = torch.tensor(
        [[pos * config.rope_theta ** (-2 * i / d) for i in range(half)] for pos in range(n)], dtype=torch.float64
    )
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # pairs (j, j + d/2) rotate by the position's angle
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if config.sliding_window is not None:
        allowed &= torch.ones(n, n, dtype=torch.bool).triu(-(config.sliding_window - 1))

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])

        q, k, v = (
            h @ w[p + f"self_attn.{name}.weight"].T
            + (w[p + f"self_attn.{name}.bias"] if config.attention_bias else 0.0)
            for name in ("q_proj", "k_proj", "v_proj")
        )
        q, k, v = rotate(q.view(n, nh, d)), rotate(k.view(n, nkv, d)), v.view(n, nkv, d)
        heads = []
        for head in range(nh):
            kv_head = head // (nh // nkv)
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(d)
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v[:, kv_head])
        x = x + torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head_w = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return x @ head_w.T


def dense_greedy(weights: Mapping[str, torch.Tensor], config: ModelConfig, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(dense_logits(weights, config, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
