"""Tiny random models made with transformers itself, for the tests that hold the worker to it."""

from __future__ import annotations

import math
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


__all__ = ["init_weights"]
