"""A Llama-family decoder as plain functions over the weights dict, reading K/V from the paged pool.

No ``nn.Module``: the weights are pool tensors the allocator owns, and keeping the computation a
function of (weights, config, cache blocks) means nothing here holds a tensor that could go stale
across sleep and wake. Numerics follow transformers' Llama, Mistral, Qwen2 and Qwen3 operation for
operation (RMSNorm in float32 then scaled in the model dtype, rotate-half RoPE with float32 cos/sin
cast to the model dtype, Qwen3's per-head q/k norm before RoPE, the same bias placement) so real
checkpoints produce their reference tokens; tests/test_reference.py checks it against transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 (bf16 squares lose too much), scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding frequencies for one config, on one device."""

    inv_freq: torch.Tensor
    """``[head_dim // 2]`` float32 angular frequencies, RoPE scaling applied."""

    @classmethod
    def build(cls, config: ModelConfig, device: torch.device) -> Rope:
        d = config.head_dim
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        s = config.rope_scaling
        if s is not None and s.rope_type == "linear":
            inv = inv / s.factor
        elif s is not None and s.rope_type == "llama3":
            # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
            old = s.original_max_position_embeddings
            low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
            smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            blended = (1 - smooth) * scaled / s.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = torch.where(medium, blended, scaled)
        return cls(inv.to(device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, 1, head_dim]`` cos and sin for the positions, broadcasting over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[n, heads, head_dim]`` by position (Hugging Face's rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention_mask(
    start_pos: int, n: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for ``n`` queries at ``start_pos..`` over keys ``0..start_pos+n``.

    The common cases need no materialised mask: a prefill from position 0 is plain causal, and a
    single decode query sees every cached key.
    """
    total = start_pos + n
    if window is None or total <= window:
        if start_pos == 0:
            return None, n > 1
        if n == 1:
            return None, False
    q_pos = torch.arange(start_pos, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask, False


@torch.inference_mode()
def forward(
    weights: Mapping[str, torch.Tensor],
    config: ModelConfig,
    rope: Rope,
    kv: torch.Tensor,
    block_ids: Sequence[int],
    token_ids: Sequence[int],
    start_pos: int,
    all_logits: bool = False,
) -> torch.Tensor:
    """Run ``token_ids`` at positions ``start_pos..`` of one sequence; return float32 logits.

    ``kv`` is the device block pool (``[blocks, layers, 2, block_size, kv_heads, head_dim]``) and
    ``block_ids`` the sequence's block table, covering at least ``start_pos + len(token_ids)``
    positions. K and V of the new tokens are written into their slots; attention reads the
    sequence's blocks back, so everything before ``start_pos`` must already be in the cache.
    Returns ``[vocab]`` logits of the last token, or ``[n, vocab]`` with ``all_logits``.
    """
    device, dtype = kv.device, config.torch_dtype
    n, block_size = len(token_ids), kv.shape[3]
    total = start_pos + n
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    positions = torch.arange(start_pos, total, device=device)
    table = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    write_blocks, write_slots = table[positions // block_size], positions % block_size
    read_blocks = table[: -(-total // block_size)]
    cos, sin = rope.cos_sin(positions, dtype)
    mask, causal = _attention_mask(start_pos, n, config.sliding_window, device)
    eps = config.rms_norm_eps

    x = F.embedding(
        torch.tensor(list(token_ids), dtype=torch.long, device=device), weights["model.embed_tokens.weight"]
    )
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, weights[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        q = F.linear(h, weights[a + "q_proj.weight"], weights.get(a + "q_proj.bias")).view(n, nh, hd)
        k = F.linear(h, weights[a + "k_proj.weight"], weights.get(a + "k_proj.bias")).view(n, nkv, hd)
        v = F.linear(h, weights[a + "v_proj.weight"], weights.get(a + "v_proj.bias")).view(n, nkv, hd)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's head_dim, on q and k, before the rotation
            q, k = rms_norm(q, weights[a + "q_norm.weight"], eps), rms_norm(k, weights[a + "k_norm.weight"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        layer = kv[:, i]  # a view: [blocks, 2, block_size, kv_heads, head_dim]
        layer[write_blocks, 0, write_slots] = k
        layer[write_blocks, 1, write_slots] = v
        cached = layer[read_blocks]  # gathered: [seq blocks, 2, block_size, kv_heads, head_dim]
        keys = cached[:, 0].reshape(-1, nkv, hd)[:total].repeat_interleave(nh // nkv, dim=1)
        values = cached[:, 1].reshape(-1, nkv, hd)[:total].repeat_interleave(nh // nkv, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, is_causal=causal
        )
        out = out.transpose(0, 1).reshape(n, nh * hd)
        x = x + F.linear(out, weights[a + "o_proj.weight"], weights.get(a + "o_proj.bias"))

        h = rms_norm(x, weights[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        gate = F.silu(F.linear(h, weights[m + "gate_proj.weight"]))
        x = x + F.linear(gate * F.linear(h, weights[m + "up_proj.weight"]), weights[m + "down_proj.weight"])

    if not all_logits:
        x = x[-1]
    x = rms_norm(x, weights["model.norm.weight"], eps)
    head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return F.linear(x, head).float()


__all__ = ["Rope", "apply_rope", "forward", "rms_norm"]
