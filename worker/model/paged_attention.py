# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (a Triton kernel's parameters take no annotations: Triton reads them as type hints)
"""Decode attention through the block table: one query row over its sequence's cached K/V blocks.

The engine's decode rows attend here, so a step of 64 sequences reads each sequence's K/V in place
instead of gathering its blocks into a dense copy per layer. On CUDA a prompt chunk's rows attend here
too, each over its sequence's positions up to its own (the causal mask is the row's length, and the
chunk's K/V are written before any row attends), so a step that mixes decodes and prefill is one
launch per layer and a CUDA graph can capture it. Two implementations, one meaning:

- :func:`torch_paged_decode`: plain torch (a gather, a mask, scaled_dot_product_attention). The host
  backend runs it, so CI tests the engine's scheduling with the same semantics; it is also the
  reference the Triton kernel is tested against on the GPU.
- :func:`triton_paged_decode`: a Triton kernel, one program per (sequence, KV head) that walks the
  sequence's keys in tiles with an online softmax; the query heads sharing a KV head (GQA) are the
  rows of one tensor-core product, so each K/V byte is read once per step. It reads only device
  tensors (the lengths too), so a CUDA graph can capture it.

:func:`worker.model.kernels.kernels_for` picks one for a device and model.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.decoder import DecodeRows

KEYS_PER_TILE = 64
"""Keys each kernel iteration scores (spanning 64 / block_size blocks)."""


def torch_paged_decode(q: torch.Tensor, layer: torch.Tensor, rows: DecodeRows, window: int | None) -> torch.Tensor:
    """``q [n, heads, head_dim]`` of one token per sequence over ``layer`` (``[blocks, 2, block_size,
    kv_heads, head_dim]``) through ``rows.tables``; returns ``[n, heads, head_dim]``."""
    n, nh, hd = q.shape
    block_size, nkv = layer.shape[2], layer.shape[3]
    tables = rows.tables if rows.table_rows is None else rows.tables[rows.table_rows]
    cached = layer[tables]  # [n, width, 2, block_size, kv_heads, head_dim]
    span = cached.shape[1] * block_size
    keys = cached[:, :, 0].reshape(n, span, nkv, hd).repeat_interleave(nh // nkv, dim=2)
    values = cached[:, :, 1].reshape(n, span, nkv, hd).repeat_interleave(nh // nkv, dim=2)
    pos = torch.arange(span, device=q.device)[None, :]
    lengths = rows.lengths[:, None]
    valid = pos < lengths
    if window is not None:
        valid &= pos >= lengths - window
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=valid[:, None, None, :]
    )
    return out[:, :, 0, :]


_kernel: Any = None


def _build_kernel() -> Any:
    """Compile-on-first-use: Triton is imported only where a CUDA device serves the model."""
    import triton
    import triton.language as tl

    # Neither the block tables' row stride (the step's widest table, in blocks) nor whether the rows
    # share tables is a compile-time value: Triton would compile a variant for a stride of 1, one for
    # multiples of 16, one for steps of paged rows and one for longer steps, so the first request after
    # ready whose step differed from the warm-up's in any of them paid a compile (about a second).
    @triton.jit(do_not_specialize=["table_row", "shared_tables"])
    def paged_decode_kernel(  # noqa: PLR0913
        Q, KV, TABLES, LENGTHS, ROWS, OUT, scale,
        q_row, q_head, kv_block, kv_half, kv_slot, kv_head, table_row, out_row, out_head, shared_tables,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        KEYS: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    ) -> None:  # fmt: skip
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        length = tl.load(LENGTHS + s)
        table = s.to(tl.int64)
        if shared_tables != 0:  # the rows of a prompt chunk read their sequence's one table
            table = tl.load(ROWS + s)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        rows = g < GROUP
        q = tl.load(Q + s * q_row + heads[:, None] * q_head + d[None, :], mask=rows[:, None], other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        first = 0
        if WINDOW > 0:
            first = tl.maximum(length - WINDOW, 0)
        for t0 in range((first // KEYS) * KEYS, length, KEYS):
            t = t0 + tl.arange(0, KEYS)
            valid = (t < length) & (t >= first)
            block = tl.load(TABLES + table * table_row + t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            base = block * kv_block + (t % BLOCK_SIZE) * kv_slot + kvh * kv_head
            k = tl.load(KV + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(KV + kv_half + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            qk = tl.where(valid[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        dst = OUT + s * out_row + heads[:, None] * out_head + d[None, :]
        tl.store(dst, out.to(OUT.dtype.element_ty), mask=rows[:, None])

    return paged_decode_kernel


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (a Triton tile dimension)."""
    return 1 << (n - 1).bit_length()


def triton_paged_decode(q: torch.Tensor, layer: torch.Tensor, rows: DecodeRows, window: int | None) -> torch.Tensor:
    """:func:`torch_paged_decode`'s result, computed by the Triton kernel (float32 accumulation; a
    float32 model's products in IEEE precision, not TF32)."""
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    n, nh, hd = q.shape
    nkv = layer.shape[3]
    group = nh // nkv
    out = torch.empty_like(q)
    shared = rows.table_rows is not None
    _kernel[(n, nkv)](
        q, layer, rows.tables, rows.lengths, rows.table_rows if shared else rows.lengths, out, 1.0 / math.sqrt(hd),
        q.stride(0), q.stride(1), layer.stride(0), layer.stride(1), layer.stride(2), layer.stride(3),
        rows.tables.stride(0), out.stride(0), out.stride(1), int(shared),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), BLOCK_SIZE=layer.shape[2], HEAD_DIM=hd,
        KEYS=KEYS_PER_TILE, WINDOW=window or 0, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def triton_supports(config: ModelConfig) -> bool:
    """The kernel's shape rules: a power-of-two head_dim of at least 16 (a tile dimension)."""
    hd = config.head_dim
    return hd >= 16 and hd & (hd - 1) == 0


def graphs_supported(config: ModelConfig) -> bool:
    """CUDA graphs capture the Triton kernel (the torch path's gather would need a worst-case buffer).

    Triton is looked up, not imported: its import (a fraction of a second on a GPU host) runs on
    worker/main.py's import thread while the model loads, and the first kernel launch waits for it."""
    if not triton_supports(config):
        return False
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken package
        return False


__all__ = [
    "KEYS_PER_TILE", "graphs_supported", "next_pow2", "torch_paged_decode", "triton_paged_decode",
    "triton_supports",
]  # fmt: skip
