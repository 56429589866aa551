"""Decode attention through the block table: one query row over its sequence's cached K/V blocks.

The engine's decode rows attend here, so a step of 64 sequences reads each sequence's K/V in place
instead of gathering its blocks into a dense copy per layer. On CUDA a prompt chunk's rows attend here
too, each over its sequence's positions up to its own (the causal mask is the row's length, and the
chunk's K/V are written before any row attends), so a step that mixes decodes and prefill is two
launches per layer and a CUDA graph can capture it. Two implementations, one meaning:

- :func:`torch_paged_decode`: plain torch (a gather, a mask, scaled_dot_product_attention). The host
  backend runs it, so CI tests the engine's scheduling with the same semantics; it is also the
  reference the Triton kernel is tested against on the GPU.
- :func:`triton_paged_decode`: Triton kernels (worker/model/paged_kernel.py). One program per (row,
  KV head) walks the row's keys in tiles with an online softmax; the query heads sharing a KV head
  (GQA) are the lines of one tensor-core product, so each K/V byte is read once per row. A prompt
  chunk's rows are read by a second kernel in tiles of rows, the chunk's keys once per tile (a
  448-row chunk beside 64 decodes: 239 us a layer read row by row, 97 us in tiles, on the H200).
  They read only device tensors (the lengths too), so a CUDA graph can capture them.

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

ROW_KEYS = 64
"""Keys each iteration of the per-row kernel scores (spanning 64 / block_size blocks). On the H200
(8B shapes, 124 registers a thread at 64): 32 keys took 30 instead of 32 us a layer for 256 rows of
41-104 tokens but 40 instead of 37 for 64 rows of 500, and 16 keys was slower on both."""
TILE_KEYS = 64
"""Keys each iteration of the tile kernel scores."""
TILE_LINES = 64
"""Query lines (rows x query heads of one KV head) of a prompt chunk's tile, scored as one product."""
TILE_WARPS = 4
"""The tile kernel's warps: 4 beat 8 on the H200 (22 vs 35 us for a 448-row chunk beside 64 decodes),
though its 64 x head_dim float32 accumulator then spills a few registers."""


def torch_paged_decode(
    q: torch.Tensor, layer: torch.Tensor, rows: DecodeRows, window: int | None, scale: float | None = None
) -> torch.Tensor:
    """``q [n, heads, head_dim]`` of one token per sequence over ``layer`` (``[blocks, 2, block_size,
    kv_heads, head_dim]``) through ``rows.tables``; returns ``[n, heads, head_dim]``. ``scale``: the
    scores' (None: 1/sqrt(head_dim))."""
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
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale
    )
    return out[:, :, 0, :]


_kernels: tuple[Any, Any] | None = None


def _build_kernels() -> tuple[Any, Any]:
    """Compile-on-first-use: Triton is imported only where a CUDA device serves the model."""
    from worker.model.paged_kernel import paged_decode_kernel, paged_tile_kernel

    return paged_decode_kernel, paged_tile_kernel


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (a Triton tile dimension)."""
    return 1 << (n - 1).bit_length()


def triton_paged_decode(
    q: torch.Tensor, layer: torch.Tensor, rows: DecodeRows, window: int | None, scale: float | None = None
) -> torch.Tensor:
    """:func:`torch_paged_decode`'s result, computed by the Triton kernels (float32 accumulation; a
    float32 model's products in IEEE precision, not TF32). Rows that name their tables (a graph's, a
    paged step's) and share one with a neighbour row (a prompt chunk's) are read in tiles of rows by
    a second kernel, which reads a chunk's keys once per tile instead of once per row."""
    global _kernels
    if _kernels is None:
        _kernels = _build_kernels()
    row_kernel, tile_kernel = _kernels
    n, nh, hd = q.shape
    nkv = layer.shape[3]
    group = nh // nkv
    out = torch.empty_like(q)
    shared = rows.table_rows is not None
    tiled = shared and n > 1
    common = (
        q,
        layer,
        rows.tables,
        rows.lengths,
        rows.table_rows if shared else rows.lengths,
        out,
        1.0 / math.sqrt(hd) if scale is None else scale,
        q.stride(0),
        q.stride(1),
        layer.stride(0),
        layer.stride(1),
        layer.stride(2),
        layer.stride(3),
        rows.tables.stride(0),
        out.stride(0),
        out.stride(1),
        n,
    )
    shapes = {"BLOCK_SIZE": layer.shape[2], "HEAD_DIM": hd, "WINDOW": window or 0}
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if tiled:
        line_group = next_pow2(group)
        tile_rows = max(1, TILE_LINES // line_group)
        tile_kernel[(-(-n // tile_rows), nkv)](
            *common,
            GROUP=group,
            LINE_GROUP=line_group,
            TILE_ROWS=tile_rows,
            TILE_PAD=tile_rows * line_group,
            KEYS=TILE_KEYS,
            **shapes,
            PRECISION=precision,
            num_warps=TILE_WARPS,
        )
    row_kernel[(n, nkv)](
        *common,
        int(tiled),
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        KEYS=ROW_KEYS,
        **shapes,
        PRECISION=precision,
    )
    return out


def triton_supports(config: ModelConfig) -> bool:
    """The Triton set's rules: a power-of-two head_dim of at least 16 (a tile dimension), RoPE over the
    whole head (its fused rotation rotates all of it; Phi-3's partial rotary runs the torch one), no
    per-row choice of RoPE frequencies (a CUDA graph's step buffer has no field for LongRoPE's),
    Llama's RMSNorm and SwiGLU (its fused norm and activation; Gemma 3's differ), and no experts (their
    loop asks the device which were hit, which a graph cannot hold)."""
    hd = config.head_dim
    plain = config.rotary_dim == hd and config.long_rope_after is None and not config.gemma and not config.moe
    return hd >= 16 and hd & (hd - 1) == 0 and plain


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
    "ROW_KEYS",
    "TILE_KEYS",
    "graphs_supported",
    "next_pow2",
    "torch_paged_decode",
    "triton_paged_decode",
    "triton_supports",
]
