# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (a Triton kernel's parameters take no annotations: Triton reads them as type hints)
"""The step's element-wise operations as Triton kernels, and which kernel set a device gets.

A decode step of an 8B model in torch launches ~38 kernels per layer; RMSNorm alone is seven
(upcast, square, mean, add, rsqrt, multiply, downcast, scale). Inside a CUDA graph each still costs
its fixed ~2 microseconds, which for 32 layers is more than the weights take to read. These kernels
do each operation in one launch with worker/model/decoder.py's arithmetic: float32 where
transformers computes in float32, rounded to the model dtype at the same points (RMSNorm, SiLU-mul:
the torch path's bf16 results in all but a few elements), except RoPE, which rounds its
multiply-add once where torch rounds each of its three operations (one rounding step apart in about
a quarter of the elements, never more). Two fuse a pair of steps, for launches and a round trip of
the intermediate through memory: the residual add with the RMSNorm after it (the sum rounded where
torch rounds it), and the queries' and keys' rotation with the writes of the keys and values into
their cache slots (RoPE's arithmetic above). tests/gpu/test_cuda_engine.py measures them all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from worker.model.config import ModelConfig
from worker.model.decoder import Kernels
from worker.model.kept_kernels import kernels_path, preload
from worker.model.paged_attention import graphs_supported, next_pow2, torch_paged_decode, triton_paged_decode
from worker.triton_key import keep_triton_key

log = logging.getLogger("memsvc.worker")

_compiled: dict[str, Any] = {}
_building = threading.Lock()
_hashing = threading.Lock()
"""Held while :func:`hash_ahead` hashes: a second caller waits for the first one's hashes."""


def _build() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(X, W, Y, heads, x_token, x_head, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        src = X + (row // heads) * x_token + (row % heads) * x_head
        x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        normed = (x * scale).to(Y.dtype.element_ty)
        w = tl.load(W + cols, mask=inside, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + row * n_cols + cols, y, mask=inside)

    @triton.jit
    def silu_mul_kernel(G, U, Y, g_row, u_row, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        g = tl.load(G + row * g_row + cols, mask=inside, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty)
        u = tl.load(U + row * u_row + cols, mask=inside, other=0.0)
        y = (act.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + row * n_cols + cols, y, mask=inside)

    @triton.jit
    def add_rms_norm_kernel(X, D, S, W, Y, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(X + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        d = tl.load(D + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        s = (x + d).to(S.dtype.element_ty)  # torch's add: in float32, rounded once
        tl.store(S + row * n_cols + cols, s, mask=inside)
        s32 = s.to(tl.float32)
        scale = tl.rsqrt(tl.sum(s32 * s32, 0) / n_cols + eps)
        normed = (s32 * scale).to(Y.dtype.element_ty)
        w = tl.load(W + cols, mask=inside, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + row * n_cols + cols, y, mask=inside)

    @triton.jit
    def rope_store_kernel(
        Q,
        K,
        V,
        COS,
        SIN,
        QR,
        KR,
        CACHE,
        BLOCKS,
        SLOTS,
        q_token,
        q_head,
        k_token,
        k_head,
        v_token,
        v_head,
        c_block,
        c_kind,
        c_slot,
        c_head,
        Q_HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEADS: tl.constexpr,
        HALF: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HEADS)  # the query heads, then the key heads, then padding
        d = tl.arange(0, HEAD_DIM)
        is_q = h < Q_HEADS
        kh = h - Q_HEADS
        is_k = (kh >= 0) & (kh < KV_HEADS)
        turned = (d + HALF) % HEAD_DIM
        q_src = Q + token * q_token + h[:, None] * q_head
        k_src = K + token * k_token + kh[:, None] * k_head
        x = tl.where(
            is_q[:, None],
            tl.load(q_src + d[None, :], mask=is_q[:, None], other=0.0),
            tl.load(k_src + d[None, :], mask=is_k[:, None], other=0.0),
        )
        partner = tl.where(
            is_q[:, None],
            tl.load(q_src + turned[None, :], mask=is_q[:, None], other=0.0),
            tl.load(k_src + turned[None, :], mask=is_k[:, None], other=0.0),
        )
        rotated = tl.where(d[None, :] < HALF, -partner, partner)
        c = tl.load(COS + token * HEAD_DIM + d).to(tl.float32)
        s = tl.load(SIN + token * HEAD_DIM + d).to(tl.float32)
        # rounded once (torch: after each of its three operations)
        y = (x.to(tl.float32) * c[None, :] + rotated.to(tl.float32) * s[None, :]).to(QR.dtype.element_ty)
        tl.store(QR + token * Q_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], y, mask=is_q[:, None])
        tl.store(KR + token * KV_HEADS * HEAD_DIM + kh[:, None] * HEAD_DIM + d[None, :], y, mask=is_k[:, None])
        block = tl.load(BLOCKS + token).to(tl.int64)
        slot = tl.load(SLOTS + token).to(tl.int64)
        dst = CACHE + block * c_block + slot * c_slot + kh[:, None] * c_head + d[None, :]
        tl.store(dst, y, mask=is_k[:, None])
        value = tl.load(V + token * v_token + kh[:, None] * v_head + d[None, :], mask=is_k[:, None], other=0.0)
        tl.store(dst + c_kind, value, mask=is_k[:, None])

    return {
        "rms_norm": rms_norm_kernel,
        "silu_mul": silu_mul_kernel,
        "add_rms_norm": add_rms_norm_kernel,
        "rope_store": rope_store_kernel,
    }


def _kernel(name: str) -> Any:
    if not _compiled:
        with _building:  # the device thread, or the import thread's hash_ahead
            if not _compiled:
                _compiled.update(_build())
    return _compiled[name]


def hash_ahead() -> None:
    """Make the hashes Triton makes before a process's first launch of each kernel, even one its disk
    cache holds: of Triton's own files (its shared library is over a hundred MB) and of each kernel's
    source with the functions it calls. On an H100 host they were 0.5-0.7 s of the warm-up's first
    step, on the device thread, before any kernel ran (py-spy, 2026-12-05); a thread that starts
    before the model is loaded makes them meanwhile. Both are memoised in the process; a launch that
    asks while this thread still hashes may make the same hash again (Triton's own is a plain
    ``lru_cache``), which costs time, never correctness. ``triton_key`` is Triton's internal
    (``triton.runtime.cache`` since 3.x): where it has moved, the first launch makes it. Triton's own
    is read back where an earlier start kept it (worker/triton_key.py).

    A second call waits for the first and then finds every hash made: the warm-up calls it before
    its first launch (worker/model/runner.py), so that it waits for the import thread's hashes
    (and its :func:`load_ahead`) rather than making them a second time beside it, both on the GIL."""
    with _hashing:
        _hash()


def load_ahead(model: bytes | None, device: int, waited: float = 0.0, folder: Path | None = None) -> None:
    """:func:`hash_ahead`, then the kernels an earlier start of the model (``model``: its key, e.g. its
    ``config.json``; None: none) compiled, loaded on CUDA ``device`` (worker/model/kept_kernels.py),
    kept in ``folder`` (default: Triton's cache directory). Under the hashing lock: the warm-up's
    :func:`hash_ahead` waits for both, so that no launch compiles what is being loaded. An error is
    logged: the launches compile as before. ``waited``: the seconds the caller waited for Triton's own
    hash before (logged with the hashes')."""
    with _hashing:
        t0 = time.perf_counter()
        _hash()
        log.info(
            "triton: kernel hashes made in %.2f s (%.2f s of it waiting for Triton's own)",
            waited + time.perf_counter() - t0,
            waited,
        )
        if model is None:
            return
        try:
            import triton
            from triton.runtime.jit import get_full_name

            from worker.triton_key import cache_dir

            folder = folder or cache_dir(triton)
            if folder is None:
                return
            ours = {get_full_name(k.fn): k for k in _ours()}
            with torch.cuda.device(device):
                capability = torch.cuda.get_device_capability(device)
                path = kernels_path(folder, triton.__version__, capability, (k.cache_key for k in ours.values()), model)
                preload(ours, path)
        except Exception as exc:  # noqa: BLE001 - the warm-up compiles them, as it did before
            log.info("triton: no kept kernels loaded ahead: %s", exc)


def _ours() -> list[Any]:
    """Our kernels (JITFunctions), made."""
    from worker.model.paged_kernel import paged_decode_kernel, paged_tile_kernel

    _kernel("rms_norm")  # builds them all
    return [*_compiled.values(), paged_decode_kernel, paged_tile_kernel]


def _hash() -> None:
    with contextlib.suppress(ImportError):
        keep_triton_key()  # Triton's own, kept between starts (worker/triton_key.py)
    for kernel in _ours():
        kernel.cache_key  # noqa: B018 - a memoised property: the hash is the point


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, token stride, head stride) of ``[tokens, dim]`` or ``[tokens, heads, dim]`` whose
    last dimension is contiguous (a column slice of a fused projection's output is fine)."""
    if x.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    heads = x.shape[1] if x.dim() == 3 else 1
    return x.shape[0] * heads, heads, x.stride(0), x.stride(1) if x.dim() == 3 else 0


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`worker.model.decoder.rms_norm` over the last dimension, one program per row."""
    rows, heads, x_token, x_head = _rows(x)
    n_cols = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        _kernel("rms_norm")[(rows,)](x, weight, y, heads, x_token, x_head, n_cols, eps, BLOCK=next_pow2(n_cols))
    return y


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`worker.model.decoder.silu_mul` of ``[tokens, n]`` halves (e.g. of one fused product)."""
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    rows, n_cols = gate.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    if rows and n_cols:
        _kernel("silu_mul")[(rows, -(-n_cols // block))](gate, up, y, gate.stride(0), up.stride(0), n_cols, BLOCK=block)
    return y


def triton_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`worker.model.decoder.add_rms_norm` of contiguous ``[tokens, hidden]`` rows in one launch
    (a residual add and the norm after it were two, and the sum's round trip through memory)."""
    if not (x.is_contiguous() and delta.is_contiguous()) or x.shape != delta.shape or x.dim() != 2:
        raise ValueError("x and delta must be contiguous [tokens, hidden] of one shape")
    rows, n_cols = x.shape
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        _kernel("add_rms_norm")[(rows,)](x, delta, s, weight, y, n_cols, eps, BLOCK=next_pow2(n_cols))
    return s, y


def triton_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: torch.Tensor,
    blocks: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`worker.model.decoder.rope_store` in one launch, one program per token: the queries and
    keys rotated, the keys written with the values straight into their slots (three launches and
    two indexed writes per layer before)."""
    assert cos.is_contiguous() and sin.is_contiguous()
    _, q_heads, q_token, q_head = _rows(q)
    _, kv_heads, k_token, k_head = _rows(k)
    _, _, v_token, v_head = _rows(v)
    if layer.stride(-1) != 1 or v.shape != k.shape or q.dim() != 3 or q.shape[::2] != k.shape[::2]:
        raise ValueError("the K/V pool's last dimension must be contiguous, k and v of one shape, q of k's tokens")
    tokens, hd = k.shape[0], k.shape[-1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        _kernel("rope_store")[(tokens,)](
            q,
            k,
            v,
            cos,
            sin,
            q_out,
            k_out,
            layer,
            blocks,
            slots,
            q_token,
            q_head,
            k_token,
            k_head,
            v_token,
            v_head,
            layer.stride(0),
            layer.stride(1),
            layer.stride(2),
            layer.stride(3),
            Q_HEADS=q_heads,
            KV_HEADS=kv_heads,
            HEADS=next_pow2(q_heads + kv_heads),
            HALF=hd // 2,
            HEAD_DIM=hd,
        )
    return q_out, k_out


TRITON_KERNELS = Kernels(triton_rms_norm, triton_silu_mul, triton_paged_decode, triton_add_rms_norm, triton_rope_store)
TORCH_KERNELS = Kernels(decode_attention=torch_paged_decode)


def kernels_for(device: torch.device, config: ModelConfig) -> Kernels:
    """The Triton set on CUDA where Triton is installed and the shapes suit it, else torch."""
    return TRITON_KERNELS if device.type == "cuda" and graphs_supported(config) else TORCH_KERNELS


__all__ = [
    "TORCH_KERNELS",
    "TRITON_KERNELS",
    "kernels_for",
    "load_ahead",
    "triton_add_rms_norm",
    "triton_rms_norm",
    "triton_rope_store",
    "triton_silu_mul",
]
