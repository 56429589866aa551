"""The decoder as plain functions over the weights dict, reading K/V from the paged pool.

No ``nn.Module``: the weights are pool tensors the allocator owns, and keeping the computation a
function of (weights, config, cache blocks) means nothing here holds a tensor that could go stale
across sleep and wake. Numerics follow transformers' Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 3
operation for operation (RMSNorm in float32 then scaled in the model dtype, rotate-half RoPE with
float32 cos/sin cast to the model dtype, Qwen3's per-head q/k norm before RoPE, the same bias
placement, Phi-3's partial rotary and LongRoPE, Gemma 3's norms, GeGLU and per-layer windows and
RoPE) so real checkpoints produce their reference tokens; tests/worker/test_reference.py checks it against
transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from worker.model.config import FP8_BLOCK, ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 (bf16 squares lose too much), scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalised and scaled by ``1 + weight`` in float32, then rounded to the model
    dtype once (Llama's rounds before the scale)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding frequencies for one config, on one device."""

    inv_freq: torch.Tensor
    """``[rotary_dim // 2]`` float32 angular frequencies, RoPE scaling applied (LongRoPE: the short
    factors')."""
    long_inv_freq: torch.Tensor | None = None
    """LongRoPE: the long factors' frequencies, for the rows :func:`rope_long` marks."""
    attention_scaling: float = 1.0
    """cos and sin are multiplied by it (LongRoPE's attention factor)."""
    sliding: Rope | None = None
    """Gemma 3: the sliding layers' own RoPE (a base of their own, no scaling); None: every layer's is this."""

    @classmethod
    def build(cls, config: ModelConfig, device: torch.device) -> Rope:
        d = config.rotary_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
        s = config.rope_scaling
        if s is not None and s.rope_type == "longrope":
            # transformers' order: 1 / (factor * base ** (i / d)), each factor a float32; and its
            # devices: the short factors' at the model's construction (the CPU), the long ones' when a
            # call first reads past the original context, on the device it runs on (the last bits of
            # a power differ between the two)
            short = 1.0 / (torch.tensor(s.short_factor, dtype=torch.float32) * config.rope_theta**exponents)
            there = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
            long = 1.0 / (torch.tensor(s.long_factor, dtype=torch.float32, device=device) * config.rope_theta**there)
            return cls(short.to(device), long, s.attention_factor)
        inv = 1.0 / (config.rope_theta**exponents)
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
        if config.local_rope_theta is None:
            return cls(inv.to(device))
        # Gemma 3: the full layers' RoPE above, the sliding layers' the default one with their own base
        return cls(inv.to(device), sliding=cls((1.0 / (config.local_rope_theta**exponents)).to(device)))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, long: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, 1, rotary_dim]`` cos and sin for the positions, broadcasting over heads. ``long``:
        ``[n]`` bool, the rows that take LongRoPE's long frequencies (None: none)."""
        pos = positions.float()[:, None]
        freqs = pos * self.inv_freq[None, :]
        if self.long_inv_freq is not None and long is not None:
            freqs = torch.where(long[:, None], pos * self.long_inv_freq[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rope_long(after: int | None, positions: torch.Tensor | np.ndarray, extent: torch.Tensor | np.ndarray | int) -> Any:
    """LongRoPE's choice per row, as transformers makes it for the call that computes the row: the
    long frequencies where that call reads more positions than the original context ``after``
    (:attr:`ModelConfig.long_rope_after`; None: not LongRoPE, and then neither is the answer).
    ``extent``: per row (or for all), the length of its sequence when the row is computed — the whole
    prompt for a prompt row (transformers reads a prompt in one call, whatever chunks the engine cuts
    it into). A sequence that grows past ``after`` is read again whole with the long ones
    (worker/model/engine.py), as transformers' Phi-3 drops its cache there."""
    if after is None:
        return None
    return (positions + 1 > after) | (extent > after)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[n, heads, head_dim]`` by position (Hugging Face's rotate-half layout). With cos and
    sin narrower than the head (Phi-3's partial rotary), the first dimensions rotate and the rest
    pass through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = r // 2
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


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows in a step: ``length`` new tokens at positions ``start..``."""

    row: int
    """First row of its tokens in the step's flat token tensor."""
    start: int
    length: int
    blocks: torch.Tensor | None
    """Its block table (device, int64), read when it attends to K/V cached before this step."""


@dataclass(frozen=True)
class DecodeRows:
    """The step's leading rows that attend through a block table by a kernel: one-token decodes, and
    (where the engine plans paged rows) every row of a prompt chunk too, each with its own length."""

    count: int
    tables: torch.Tensor
    """``[count, width]`` int64 block ids, row ``i``'s table (or, with ``table_rows``, one table per
    sequence of the step); a row covers ``lengths[i]`` positions."""
    lengths: torch.Tensor
    """``[count]`` int64: positions each row attends to (its own included: its causal limit)."""
    table_rows: torch.Tensor | None = None
    """``[count]`` int64: the row of ``tables`` each row reads (None: row ``i`` reads row ``i``), so a
    prompt chunk's rows share their sequence's table instead of a copy each."""


@dataclass(frozen=True)
class StepInputs:
    """One model step over several sequences, as device tensors (see :func:`forward_step`).

    Rows ``[0, decode.count)`` are one-token decodes read through ``decode.tables``; every other row
    belongs to one of ``spans``, whose attention runs per sequence. A CUDA graph captures a step whose
    rows are all decodes, with these tensors in buffers it owns.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    write_blocks: torch.Tensor
    write_slots: torch.Tensor
    spans: tuple[SeqSpan, ...] = ()
    decode: DecodeRows | None = None
    last_rows: torch.Tensor | None = None
    """Rows whose logits are returned (None: every row)."""
    rope_long: torch.Tensor | None = None
    """``[rows]`` bool: LongRoPE's long frequencies (:func:`rope_long`); None: not LongRoPE."""


@dataclass(frozen=True)
class HostStep:
    """A step as the scheduler builds it, in host arrays; :meth:`to_device` makes the model's inputs
    (a CUDA-graph runner copies the arrays into buffers of its own instead)."""

    token_ids: np.ndarray
    """``[rows]`` int64: decodes first, then the prompt chunks."""
    positions: np.ndarray
    write_blocks: np.ndarray
    """``[rows]`` int64: the block each row's K/V goes to (slot: position % block_size)."""
    decode_tables: np.ndarray
    """``[decodes, width]`` int64 block tables of the decode rows (zero-padded)."""
    spans: tuple[tuple[int, int, int, np.ndarray | None], ...]
    """(row, start, length, block table or None) of each prompt chunk."""
    last_rows: np.ndarray
    """Rows whose logits the step returns."""
    row_tables: np.ndarray | None = None
    """Paged rows (see :meth:`decodes`): ``[rows]`` int64, the row of ``decode_tables`` each row reads;
    None: one table per row, the leading ``decode_tables.shape[0]`` rows."""
    rope_long: np.ndarray | None = None
    """``[rows]`` bool: LongRoPE's long frequencies (:func:`rope_long`); None: not LongRoPE (a CUDA
    graph's buffer has no room for it: LongRoPE models run eagerly, worker/model/paged_attention.py)."""
    device_tokens: torch.Tensor | None = None
    """``[k]`` int64 on the model's device: the tokens of rows ``0..k``, which the step before this
    one made and whose copy to the host has not been read yet (``token_ids`` holds placeholders
    there): whoever copies the inputs to the device writes these over them, after the copy and in
    the device's order, so the step runs right behind the one it follows (worker/model/engine.py)."""

    @property
    def decodes(self) -> int:
        """Rows read through the block tables (the leading ones): the decodes, or, for a step the
        engine planned as paged rows, every row (a prompt chunk's rows each up to its own position)."""
        return int(self.decode_tables.shape[0]) if self.row_tables is None else len(self.row_tables)

    @property
    def decode_only(self) -> bool:
        return not self.spans

    def fed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids`` (the step's row tokens, on the device) with :attr:`device_tokens` written over
        their placeholders."""
        if self.device_tokens is not None:
            token_ids[: len(self.device_tokens)].copy_(self.device_tokens)
        return token_ids

    def to_device(self, device: torch.device, block_size: int) -> StepInputs:
        """The model's inputs on ``device``. On CUDA each array goes through pinned memory without a
        wait: a plain copy from pageable memory waits for the device to finish everything queued, and
        the engine queues a step while the one before it still runs."""
        pinned = device.type == "cuda"

        def t(a: np.ndarray) -> torch.Tensor:
            host = torch.from_numpy(a)
            return host.pin_memory().to(device, non_blocking=True) if pinned else host.to(device)

        decode = None
        if self.decodes:
            rows = None if self.row_tables is None else t(self.row_tables)
            decode = DecodeRows(self.decodes, t(self.decode_tables), t(self.positions[: self.decodes] + 1), rows)
        return StepInputs(
            token_ids=self.fed(t(self.token_ids)),
            positions=t(self.positions),
            write_blocks=t(self.write_blocks),
            write_slots=t(self.positions % block_size),
            spans=tuple(SeqSpan(r, s, n, None if b is None else t(b)) for r, s, n, b in self.spans),
            decode=decode,
            last_rows=t(self.last_rows),
            rope_long=None if self.rope_long is None else t(self.rope_long),
        )


DecodeKernel = Callable[[torch.Tensor, torch.Tensor, DecodeRows, int | None, float | None], torch.Tensor]
"""``(q [n, heads, head_dim], layer K/V pool, decode rows, sliding window, score scale or None for
1/sqrt(head_dim)) -> [n, heads, head_dim]``."""


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's ``silu(gate) * up``, each op rounded to the model dtype as transformers does."""
    return F.silu(gate) * up


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding a sublayer's output, and its RMSNorm (the next sublayer's
    input): ``x + delta`` rounded to the model dtype, then :func:`rms_norm` of that."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: torch.Tensor,
    blocks: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the step's queries and keys (:func:`apply_rope`) and write the keys and the values into
    their slots of one layer's K/V pool (``[blocks, 2, block_size, kv_heads, head_dim]``); the rotated
    queries and keys."""
    k = apply_rope(k, cos, sin)
    layer[blocks, 0, slots] = k
    layer[blocks, 1, slots] = v
    return apply_rope(q, cos, sin), k


AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
"""``(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta))`` (:func:`add_rms_norm`)."""
RopeStore = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]
"""``(q, k, v, cos, sin, layer, blocks, slots) -> (rotated q, rotated k)``, k and v written to the layer
(:func:`rope_store`)."""


@dataclass(frozen=True)
class Kernels:
    """The step's element-wise operations and decode attention: these torch functions everywhere, or
    on CUDA the Triton kernels of worker/model/kernels.py, which do the same arithmetic (the same
    float32 intermediates, rounded to the model dtype at the same points) in one launch each instead
    of up to seven; a decode step is bound by launches, not bytes. ``add_rms_norm`` and
    ``rope_store`` are steps fused (a residual add with the norm after it; the queries' and keys'
    rotation with the K/V writes)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_mul
    decode_attention: DecodeKernel | None = None
    add_rms_norm: AddNorm = add_rms_norm
    rope_store: RopeStore = rope_store


@dataclass(frozen=True)
class FusedLayer:
    """One layer's projections that read the same input, as single matrices (views of the weights)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor | None
    """None in an MoE layer (its experts' are in the weights)."""
    qkv_scale: torch.Tensor | None = None
    """FP8: the scales of ``qkv`` (its rows', or each part's one)."""
    gate_up_scale: torch.Tensor | None = None


FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""The largest float8_e4m3fn: a token's activations are scaled so that its largest magnitude is this."""


def project(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    parts: Sequence[int] = (),
) -> torch.Tensor:
    """``x @ w.T (+ bias)``. With an FP8 ``w`` (``scale``: its scales, per output row or one per
    matrix, or one per part of a fused matrix whose row counts ``parts`` are), ``x`` is quantized to
    FP8 per row (scale: its largest magnitude / :data:`FP8_MAX`, as llm-compressor's dynamic
    per-token scheme). On CUDA the product is :func:`fp8_product`: the weights are never expanded to
    16 bits. The host backend computes the same quantization with the product over the dequantised
    operands in ``x``'s dtype: the scheme's reference, which transformers computes the same way (the
    FP8 steps make a model's tokens sensitive to the last bit of an activation, so the host path
    follows transformers' order of operations rather than the GPU's)."""
    if scale is None:
        return F.linear(x, w, bias)
    x32 = x.float()
    xs = x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    xq = (x32 / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if scale.dim() == 2 and scale.shape[0] != w.shape[0]:  # [row blocks, column blocks]
        return _block_product(x, w, bias, scale)
    ws = scale.reshape(1, -1).float()
    if ws.shape[1] == 1:  # one for the matrix (a fused checkpoint's too): one per row
        ws = ws.expand(1, w.shape[0]).contiguous()
    elif ws.shape[1] != w.shape[0]:  # one per part of a fused matrix
        ws = ws.repeat_interleave(torch.tensor(list(parts), device=ws.device), dim=1)
    if x.is_cuda:
        return fp8_product(xq, xs, w, ws, x.dtype, bias)
    return F.linear((xq.float() * xs).to(x.dtype), (w.float() * ws.reshape(-1, 1)).to(x.dtype), bias)


def _block_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    """:func:`project` for transformers' fine-grained FP8: ``w``'s scales one per 128 x 128 block,
    ``x`` quantized per token in groups of 128 columns (scale: the group's largest magnitude /
    :data:`FP8_MAX`), the product over the dequantised operands, on every backend. (cuBLAS' block-scaled
    FP8 product through ``torch._scaled_mm`` refused the layouts given it on the H200, torch 2.11:
    CUBLAS_STATUS_NOT_SUPPORTED; until a call it takes is found, block-scaled checkpoints run their
    products in 16 bits on CUDA too.)"""
    n, k = x.shape
    g = FP8_BLOCK
    x32 = x.float().view(n, k // g, g)
    xs = x32.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [n, k / g]
    xq = (x32 / xs[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(n, k)
    ws = scale.float()
    xd = (xq.float().view(n, k // g, g) * xs[..., None]).view(n, k).to(x.dtype)
    wd = (w.float() * ws.repeat_interleave(g, dim=0)[: w.shape[0]].repeat_interleave(g, dim=1)[:, :k]).to(x.dtype)
    return F.linear(xd, wd, bias)


def fp8_product(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 ``xq [n, k]`` (row scales ``xs [n, 1]``) times FP8 ``w [m, k]`` transposed (row scales
    ``ws [1, m]``), float32
    accumulation, in ``dtype`` (``torch._scaled_mm``: Hopper's FP8 tensor cores; the CPU build computes
    the row-scaled one, which is how that is tested without a GPU)."""
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=dtype)
    return y if bias is None else y + bias


def _joined(weights: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor | None:
    """The tensors as one ``[rows, ...]`` view when they are consecutive rows of one allocation."""
    parts = [weights.get(n) for n in names]
    if any(p is None or not p.is_contiguous() for p in parts):
        return None
    first = parts[0]
    assert first is not None
    end = first.data_ptr()
    for part in parts:
        assert part is not None
        if part.data_ptr() != end or part.shape[1:] != first.shape[1:]:
            return None
        end += part.numel() * part.element_size()
    return first.as_strided((sum(p.shape[0] for p in parts if p is not None), *first.shape[1:]), first.stride())


def checkpoint_fused(weights: Mapping[str, torch.Tensor], config: ModelConfig, i: int) -> FusedLayer | None:
    """Layer ``i``'s projections where the checkpoint itself fuses them (Phi-3); None elsewhere."""
    if not config.fused_checkpoint:
        return None
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    suffix = config.fp8.scale_suffix if config.fp8 is not None else "_scale"
    return FusedLayer(
        weights[a + "qkv_proj.weight"],
        None,
        weights[m + "gate_up_proj.weight"],
        weights.get(a + "qkv_proj.weight" + suffix),
        weights.get(m + "gate_up_proj.weight" + suffix),
    )


def fused_layers(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> tuple[FusedLayer, ...] | None:
    """Every layer's fused projections, or None unless the weights were allocated fused (by
    worker/model/weights.py's allocate_weights) or the checkpoint fuses them: then one product
    replaces three, and one two."""
    if config.fused_checkpoint:
        return tuple(checkpoint_fused(weights, config, i) for i in range(config.num_layers))  # type: ignore[misc]
    out = []
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = _joined(weights, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
        bias = _joined(weights, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
        gate_up = None if config.moe_layer(i) else _joined(weights, [m + "gate_proj.weight", m + "up_proj.weight"])
        if qkv is None or (gate_up is None and not config.moe_layer(i)) or (bias is None and config.attention_bias):
            return None
        suffix = config.fp8.scale_suffix if config.fp8 is not None else "_scale"
        scales = [
            _joined(weights, [a + f"{p}_proj.weight{suffix}" for p in "qkv"]),
            _joined(weights, [m + f"gate_proj.weight{suffix}", m + f"up_proj.weight{suffix}"]),
        ]
        if config.fp8 is not None and None in scales:
            return None
        out.append(FusedLayer(qkv, bias, gate_up, *scales))
    return tuple(out)


def _span_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: torch.Tensor,
    span: SeqSpan,
    config: ModelConfig,
    window: int | None,
) -> torch.Tensor:
    """Causal attention of one sequence's new rows over its cached and new K/V, ``[n, heads * head_dim]``.

    A prefill from position 0 attends to the K/V it just computed; a later chunk (or a decode on a
    backend without the kernel) reads the sequence's blocks back.
    """
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    a, n = span.row, span.length
    total = span.start + n
    if span.start == 0:
        keys, values = k[a : a + n], v[a : a + n]
    else:
        assert span.blocks is not None, "a span after position 0 reads its blocks"
        cached = layer[span.blocks[: -(-total // layer.shape[2])]]  # [blocks, 2, block_size, kv_heads, head_dim]
        keys = cached[:, 0].reshape(-1, nkv, hd)[:total]
        values = cached[:, 1].reshape(-1, nkv, hd)[:total]
    keys, values = keys.repeat_interleave(nh // nkv, dim=1), values.repeat_interleave(nh // nkv, dim=1)
    mask, causal = _attention_mask(span.start, n, window, q.device)
    # 4-D [batch, heads, tokens, head_dim]: the flash and memory-efficient kernels take nothing else (a
    # 3-D call falls back to the math kernel, which materialises the n x total scores of every head)
    out = F.scaled_dot_product_attention(
        q[None, a : a + n].transpose(1, 2),
        keys[None].transpose(1, 2),
        values[None].transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=config.attention_scale,
    )
    return out[0].transpose(0, 1).reshape(n, nh * hd)


def _weight(weights: Mapping[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """The projection ``name`` (``…q_proj``) of ``x``: its weight, bias and FP8 scales where it has them."""
    scale = weights.get(name + ".weight_scale", weights.get(name + ".weight_scale_inv"))
    return project(x, weights[name + ".weight"], weights.get(name + ".bias"), scale)


def _gate_up(
    weights: Mapping[str, torch.Tensor], config: ModelConfig, p: str, h: torch.Tensor, f: FusedLayer | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``p``'s MLP gate and up projections of ``h``: one product where they are fused."""
    inter = config.intermediate_size
    if f is not None and f.gate_up is not None:
        gate_up = project(h, f.gate_up, None, f.gate_up_scale, (inter, inter))
        return gate_up[:, :inter], gate_up[:, inter:]
    return _weight(weights, p + "mlp.gate_proj", h), _weight(weights, p + "mlp.up_proj", h)


def _experts(weights: Mapping[str, torch.Tensor], config: ModelConfig, layer: int, h: torch.Tensor) -> torch.Tensor:
    """An MoE layer's MLP, as transformers' Qwen3-MoE and Mixtral compute it: the router's softmax in
    float32, each token's top-k experts (their weights renormalised where the config says, and rounded
    to the model dtype unless Mixtral's), then expert by expert in ascending order, over the tokens
    routed to it, the SwiGLU times the token's weight, added into the output (so the sums are
    transformers' own, in its order). The loop asks the device which experts were hit (a CUDA graph
    cannot hold it): a grouped product is the fast way on the GPU, not written yet."""
    router, experts = config.experts(layer)
    logits = F.linear(h, weights[router])
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = torch.topk(probs, config.experts_per_token, dim=-1)
    if config.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if not config.routing_in_float32:
        top = top.to(logits.dtype)
    out = torch.zeros_like(h)
    mask = F.one_hot(chosen, num_classes=config.num_experts).permute(2, 1, 0)  # [experts, k, tokens]
    for e in (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist():
        slot, token = torch.where(mask[e])
        gate_name, up_name, down_name = experts[e]
        gate_up = _joined(weights, [gate_name, up_name])
        rows = h[token]
        if gate_up is not None:
            gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
        else:
            gate, up = F.linear(rows, weights[gate_name]), F.linear(rows, weights[up_name])
        y = F.linear(F.silu(gate) * up, weights[down_name]) * top[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _gemma_mlp(
    weights: Mapping[str, torch.Tensor],
    config: ModelConfig,
    p: str,
    x: torch.Tensor,
    h: torch.Tensor,
    f: FusedLayer | None,
) -> torch.Tensor:
    """Gemma 3's MLP half of a layer: ``x`` plus the post-MLP norm of GeGLU(``h``) (gelu with the tanh
    approximation times up, as transformers' gelu_pytorch_tanh)."""
    gate, up = _gate_up(weights, config, p, h, f)
    down = _weight(weights, p + "mlp.down_proj", F.gelu(gate, approximate="tanh") * up)
    return x + gemma_rms_norm(down, weights[p + "post_feedforward_layernorm.weight"], config.rms_norm_eps)


@torch.inference_mode()
def forward_step(
    weights: Mapping[str, torch.Tensor],
    config: ModelConfig,
    rope: Rope,
    kv: torch.Tensor,
    step: StepInputs,
    kernels: Kernels = Kernels(),
    fused: Sequence[FusedLayer] | None = None,
    layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """Run one step: write every row's K/V into its slot, attend, return float32 logits
    ``[len(last_rows), vocab]`` (every row's when ``last_rows`` is None). ``layers``: only these
    layers, in order, for a warm-up whose output is not used (:func:`layer_kinds`).

    ``kv`` is the device block pool (``[blocks, layers, 2, block_size, kv_heads, head_dim]``). The
    decode rows need ``kernels.decode_attention`` (through the block table, no copy of the cache);
    without one, give every row a span. Batching shares each weight matrix's read among all rows,
    which is what makes a decode step of 64 sequences cost little more than one. ``fused`` (from
    :func:`fused_layers`) runs q/k/v and gate/up as one product each.
    """
    dtype, eps = config.torch_dtype, config.rms_norm_eps
    n = step.token_ids.shape[0]
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    cos, sin = rope.cos_sin(step.positions, dtype, step.rope_long)
    sliding = None if rope.sliding is None else rope.sliding.cos_sin(step.positions, dtype)
    decode = step.decode
    decode_attention = kernels.decode_attention
    if decode is not None and decode_attention is None:
        raise ValueError("decode rows need a decode kernel")
    gemma = config.gemma
    norm = gemma_rms_norm if gemma else kernels.rms_norm

    x = F.embedding(step.token_ids, weights["model.embed_tokens.weight"])
    if gemma:  # scaled by sqrt(hidden_size), that number rounded to the model dtype first (as transformers)
        x = x * torch.tensor(config.hidden_size**0.5, dtype=torch.float32, device=x.device).to(dtype)
    h = norm(x, weights["model.layers.0.input_layernorm.weight"], eps)
    for i in range(config.num_layers) if layers is None else layers:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        f = fused[i] if fused is not None else checkpoint_fused(weights, config, i)
        if f is not None:
            qw, kw = nh * hd, nkv * hd
            qkv = project(h, f.qkv, f.qkv_bias, f.qkv_scale, (qw, kw, kw))
            q, k = qkv[:, :qw].view(n, nh, hd), qkv[:, qw : qw + kw].view(n, nkv, hd)
            v = qkv[:, qw + kw :].view(n, nkv, hd)
        else:
            q = _weight(weights, a + "q_proj", h).view(n, nh, hd)
            k = _weight(weights, a + "k_proj", h).view(n, nkv, hd)
            v = _weight(weights, a + "v_proj", h).view(n, nkv, hd)
        if config.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's head_dim, on q and k, before the rotation
            q, k = norm(q, weights[a + "q_norm.weight"], eps), norm(k, weights[a + "k_norm.weight"], eps)
        layer = kv[:, i]  # a view: [blocks, 2, block_size, kv_heads, head_dim]
        window = config.layer_window(i)
        local = sliding is not None and config.layer_types is not None and config.layer_types[i] == "sliding_attention"
        c, si = sliding if local and sliding is not None else (cos, sin)
        q, k = kernels.rope_store(q, k, v, c, si, layer, step.write_blocks, step.write_slots)
        parts = []
        if decode is not None:
            assert decode_attention is not None
            rows = decode_attention(q[: decode.count], layer, decode, window, config.attention_scale)
            parts.append(rows.reshape(-1, nh * hd))
        parts.extend(_span_attention(q, k, v, layer, span, config, window) for span in step.spans)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        attended = _weight(weights, a + "o_proj", out)
        if gemma:
            x = x + norm(attended, weights[p + "post_attention_layernorm.weight"], eps)
            x = _gemma_mlp(weights, config, p, x, norm(x, weights[p + "pre_feedforward_layernorm.weight"], eps), f)
            if i + 1 < config.num_layers:
                h = norm(x, weights[f"model.layers.{i + 1}.input_layernorm.weight"], eps)
            continue
        x, h = kernels.add_rms_norm(x, attended, weights[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        if config.moe_layer(i):
            down = _experts(weights, config, i, h)
        else:
            gate, up = _gate_up(weights, config, p, h, f)
            down = _weight(weights, m + "down_proj", kernels.silu_mul(gate, up))
        if i + 1 < config.num_layers:  # the next layer's input norm, with the add
            x, h = kernels.add_rms_norm(x, down, weights[f"model.layers.{i + 1}.input_layernorm.weight"], eps)
        else:
            x = x + down

    if step.last_rows is not None:
        x = x[step.last_rows]
    x = norm(x, weights["model.norm.weight"], eps)
    head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return F.linear(x, head).float()


def layer_kinds(config: ModelConfig) -> tuple[int, ...]:
    """The first layer of each kind :func:`forward_step` tells apart (its MLP dense or experts, its
    attention window and type) and the last layer: a step over these alone launches every kernel a
    whole step does, for a fraction of the time. A warm-up runs it where what it computes is not
    used (worker/model/graphs.py: a 32-layer 8B step reads 16 GB of weights, two of them 1 GB)."""
    first: dict[tuple[object, ...], int] = {}
    types = config.layer_types
    for i in range(config.num_layers):
        kind = (config.moe_layer(i), config.layer_window(i), types[i] if types is not None else None)
        first.setdefault(kind, i)
    return tuple(sorted({*first.values(), config.num_layers - 1}))


def single_sequence_step(
    block_ids: Sequence[int],
    token_ids: Sequence[int],
    start_pos: int,
    block_size: int,
    device: torch.device,
    all_logits: bool = False,
    config: ModelConfig | None = None,
) -> StepInputs:
    """The step that feeds ``token_ids`` at ``start_pos..`` of one sequence with this block table, as
    one call (LongRoPE, with ``config``: its rows choose their frequencies as one transformers call's)."""
    n = len(token_ids)
    positions = torch.arange(start_pos, start_pos + n, device=device)
    table = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    long = rope_long(config.long_rope_after, positions, start_pos + n) if config is not None else None
    return StepInputs(
        token_ids=torch.tensor(list(token_ids), dtype=torch.long, device=device),
        positions=positions,
        write_blocks=table[positions // block_size],
        write_slots=positions % block_size,
        spans=(SeqSpan(0, start_pos, n, table),),
        last_rows=None if all_logits else torch.tensor([n - 1], device=device),
        rope_long=long,
    )


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

    ``block_ids`` is the sequence's block table, covering at least ``start_pos + len(token_ids)``
    positions; everything before ``start_pos`` must already be in the cache. Returns ``[vocab]``
    logits of the last token, or ``[n, vocab]`` with ``all_logits``. The engine batches steps of
    many sequences with :func:`forward_step`; this is one sequence's (tests, references).
    """
    step = single_sequence_step(block_ids, token_ids, start_pos, kv.shape[3], kv.device, all_logits, config)
    logits = forward_step(weights, config, rope, kv, step)
    return logits if all_logits else logits[0]


__all__ = [
    "FP8_MAX",
    "DecodeKernel",
    "DecodeRows",
    "FusedLayer",
    "HostStep",
    "Kernels",
    "Rope",
    "SeqSpan",
    "StepInputs",
    "add_rms_norm",
    "apply_rope",
    "checkpoint_fused",
    "forward",
    "forward_step",
    "fused_layers",
    "gemma_rms_norm",
    "fp8_product",
    "layer_kinds",
    "project",
    "rms_norm",
    "rope_long",
    "rope_store",
    "silu_mul",
    "single_sequence_step",
]
