# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (a Triton kernel's parameters take no annotations: Triton reads them as type hints)
"""The Triton kernels of worker/model/paged_attention.py (one row per program; a tile of a prompt
chunk's rows per program), in a module of their own: it imports Triton, which only a CUDA host that
serves a model needs, and :func:`paged_attention.triton_paged_decode` imports it on first use. (At
module level because a kernel calls its helper ``@triton.jit`` functions by their global names.)"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend(
    q,
    m_i,
    l_i,
    acc,
    KV,
    TABLES,
    table,
    table_row,
    lines,
    lengths,
    lo,
    hi,
    scale,
    kv_block,
    kv_half,
    kv_slot,
    kv_head,
    kvh,
    d,
    BLOCK_SIZE: tl.constexpr,
    KEYS: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The online softmax of query lines ``q`` (``lines`` of them live, each over its keys
    ``< lengths``) over keys ``lo..hi`` of one block table, from the state it was left in."""
    for t0 in range((lo // KEYS) * KEYS, hi, KEYS):
        t = t0 + tl.arange(0, KEYS)
        inside = t < hi
        block = tl.load(TABLES + table * table_row + t // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        base = block * kv_block + (t % BLOCK_SIZE) * kv_slot + kvh * kv_head
        k = tl.load(KV + base[:, None] + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(KV + kv_half + base[:, None] + d[None, :], mask=inside[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        valid = lines[:, None] & (t[None, :] < lengths[:, None])
        if WINDOW > 0:
            valid &= t[None, :] >= lengths[:, None] - WINDOW
        qk = tl.where(valid, qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a line with no key here yet
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _row(
    pid,
    Q,
    KV,
    TABLES,
    LENGTHS,
    ROWS,
    OUT,
    scale,
    q_row,
    q_head,
    kv_block,
    kv_half,
    kv_slot,
    kv_head,
    table_row,
    out_row,
    out_head,
    n_rows,
    tiled,
    kvh,
    d,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEYS: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One row, its GROUP query heads as the lines of one product, over its own table. With tiles
    (``tiled``), a row whose table a neighbour row shares (a prompt chunk's) is left to its tile."""
    s = pid.to(tl.int64)
    length = tl.load(LENGTHS + s)
    table = s
    if tiled != 0:
        table = tl.load(ROWS + s)
        before = tl.load(ROWS + s - 1, mask=s > 0, other=-1)
        after = tl.load(ROWS + s + 1, mask=s + 1 < n_rows, other=-1)
        length = tl.where((before == table) | (after == table), 0, length)
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    lengths = tl.zeros([GROUP_PAD], tl.int32) + length
    lines = (g < GROUP) & (lengths > 0)
    q = tl.load(Q + s * q_row + heads[:, None] * q_head + d[None, :], mask=lines[:, None], other=0.0)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(length - WINDOW, 0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, d.shape[0]], tl.float32)
    m_i, l_i, acc = _attend(
        q,
        m_i,
        l_i,
        acc,
        KV,
        TABLES,
        table,
        table_row,
        lines,
        lengths,
        lo,
        length,
        scale,
        kv_block,
        kv_half,
        kv_slot,
        kv_head,
        kvh,
        d,
        BLOCK_SIZE,
        KEYS,
        WINDOW,
        PRECISION,
    )
    out = acc / l_i[:, None]
    tl.store(
        OUT + s * out_row + heads[:, None] * out_head + d[None, :], out.to(OUT.dtype.element_ty), mask=lines[:, None]
    )


@triton.jit
def _tile(
    pid,
    Q,
    KV,
    TABLES,
    LENGTHS,
    ROWS,
    OUT,
    scale,
    q_row,
    q_head,
    kv_block,
    kv_half,
    kv_slot,
    kv_head,
    table_row,
    out_row,
    out_head,
    n_rows,
    kvh,
    d,
    GROUP: tl.constexpr,
    LINE_GROUP: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEYS: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A tile of TILE_ROWS consecutive rows: those that share their table with a neighbour (prompt
    chunks), every row's GROUP heads lines of one TILE_ROWS * LINE_GROUP-line product, so a chunk's
    keys are read once per tile instead of once per row. A tile may hold the ends of several chunks:
    one pass over the keys per table."""
    lane = tl.arange(0, TILE_PAD)
    r = (pid * TILE_ROWS + lane // LINE_GROUP).to(tl.int64)
    g = lane % LINE_GROUP
    real = r < n_rows
    table_of = tl.load(ROWS + r, mask=real, other=-1)
    before = tl.load(ROWS + r - 1, mask=real & (r > 0), other=-2)
    after = tl.load(ROWS + r + 1, mask=r + 1 < n_rows, other=-3)
    todo = real & (g < GROUP) & ((before == table_of) | (after == table_of))
    lengths = tl.load(LENGTHS + r, mask=todo, other=0).to(tl.int32)
    heads = kvh * GROUP + g
    q = tl.load(Q + r[:, None] * q_row + heads[:, None] * q_head + d[None, :], mask=todo[:, None], other=0.0)
    m_i = tl.full([TILE_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_PAD], tl.float32)
    acc = tl.zeros([TILE_PAD, d.shape[0]], tl.float32)
    done = ~todo
    while tl.min(done.to(tl.int32), 0) == 0:
        first = tl.min(tl.where(done, TILE_PAD, lane), 0)
        table = tl.sum(tl.where(lane == first, table_of, 0), 0)
        lines = (~done) & (table_of == table)
        hi = tl.max(tl.where(lines, lengths, 0), 0)
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(tl.min(tl.where(lines, lengths, hi), 0) - WINDOW, 0)
        m_i, l_i, acc = _attend(
            q,
            m_i,
            l_i,
            acc,
            KV,
            TABLES,
            table,
            table_row,
            lines,
            lengths,
            lo,
            hi,
            scale,
            kv_block,
            kv_half,
            kv_slot,
            kv_head,
            kvh,
            d,
            BLOCK_SIZE,
            KEYS,
            WINDOW,
            PRECISION,
        )
        done = done | lines
    out = acc / l_i[:, None]
    tl.store(
        OUT + r[:, None] * out_row + heads[:, None] * out_head + d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=todo[:, None],
    )


# Neither the block tables' row stride (the step's widest table, in blocks) nor the row count nor
# whether tiles run beside is a compile-time value: Triton would compile a variant for a stride of 1,
# one for multiples of 16, one for steps of paged rows and one for longer steps, so the first request
# after ready whose step differed from the warm-up's in any of them paid a compile (about a second).
@triton.jit(do_not_specialize=["table_row", "n_rows", "tiled"])
def paged_decode_kernel(  # noqa: PLR0913
    Q,
    KV,
    TABLES,
    LENGTHS,
    ROWS,
    OUT,
    scale,
    q_row,
    q_head,
    kv_block,
    kv_half,
    kv_slot,
    kv_head,
    table_row,
    out_row,
    out_head,
    n_rows,
    tiled,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KEYS: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
) -> None:
    """One program per (row, KV head): :func:`_row`. ``tiled``: :func:`paged_tile_kernel` runs beside
    (the rows name their tables in ``ROWS``, as a graph's and a paged step's do)."""
    _row(
        tl.program_id(0),
        Q,
        KV,
        TABLES,
        LENGTHS,
        ROWS,
        OUT,
        scale,
        q_row,
        q_head,
        kv_block,
        kv_half,
        kv_slot,
        kv_head,
        table_row,
        out_row,
        out_head,
        n_rows,
        tiled,
        tl.program_id(1),
        tl.arange(0, HEAD_DIM),
        GROUP,
        GROUP_PAD,
        BLOCK_SIZE,
        KEYS,
        WINDOW,
        PRECISION,
    )


@triton.jit(do_not_specialize=["table_row", "n_rows"])
def paged_tile_kernel(  # noqa: PLR0913
    Q,
    KV,
    TABLES,
    LENGTHS,
    ROWS,
    OUT,
    scale,
    q_row,
    q_head,
    kv_block,
    kv_half,
    kv_slot,
    kv_head,
    table_row,
    out_row,
    out_head,
    n_rows,
    GROUP: tl.constexpr,
    LINE_GROUP: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KEYS: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
) -> None:
    """One program per (tile of rows, KV head): :func:`_tile`."""
    _tile(
        tl.program_id(0),
        Q,
        KV,
        TABLES,
        LENGTHS,
        ROWS,
        OUT,
        scale,
        q_row,
        q_head,
        kv_block,
        kv_half,
        kv_slot,
        kv_head,
        table_row,
        out_row,
        out_head,
        n_rows,
        tl.program_id(1),
        tl.arange(0, HEAD_DIM),
        GROUP,
        LINE_GROUP,
        TILE_ROWS,
        TILE_PAD,
        BLOCK_SIZE,
        KEYS,
        WINDOW,
        PRECISION,
    )
