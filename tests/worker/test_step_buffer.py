"""The CUDA-graph buckets' input buffer (worker/model/graphs.py's StepBuffer), on the host: a step
written over an earlier one leaves exactly what the step alone would, though each fill clears only
what the fill before it wrote (the graphs that read it need a GPU; the buffer does not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.model.decoder import HostStep
from worker.model.graphs import StepBuffer

SIZE, OUTPUTS, WIDTH, SCRATCH, BLOCK = 8, 4, 6, 99, 16


def _buffer() -> StepBuffer:
    b = StepBuffer(
        torch.full((StepBuffer.numel(SIZE, OUTPUTS, WIDTH),), -7, dtype=torch.int64),
        SIZE,
        OUTPUTS,
        WIDTH,
        SCRATCH,
        BLOCK,
    )
    b.clear()
    return b


def _step(rng: np.random.Generator, rows: int, seqs: int, width: int, paged: bool) -> HostStep:
    """``rows`` rows over ``seqs`` block tables of ``width`` columns (paged: rows share tables)."""
    positions = rng.integers(0, width * BLOCK, rows)
    return HostStep(
        token_ids=rng.integers(1, 1000, rows),
        positions=positions,
        write_blocks=rng.integers(1, 50, rows),
        decode_tables=rng.integers(1, 50, (seqs, width)),
        spans=(),
        last_rows=np.arange(min(rows, seqs)),
        row_tables=np.sort(rng.integers(0, seqs, rows)) if paged else None,
    )


# (rows, seqs, width, paged) in turn: fewer rows and tables, narrower; more tables but narrower; wider
STEPS = [(8, 4, 6, True), (3, 2, 2, True), (4, 4, 1, False), (1, 1, 6, False), (8, 4, 3, True), (2, 1, 1, True)]


@pytest.mark.parametrize("start", range(len(STEPS)))
def test_a_fill_over_earlier_steps_leaves_what_the_step_alone_leaves(start: int) -> None:
    rng = np.random.default_rng(start)
    steps = [_step(rng, *shape) for shape in STEPS[start:] + STEPS[:start]]
    reused = _buffer()
    for step in steps:
        m = reused.fill(step)
        fresh = _buffer()
        assert fresh.fill(step) == m == len(step.last_rows)
        assert torch.equal(reused.buf, fresh.buf), step.decode_tables.shape
        seqs, width = step.decode_tables.shape
        assert torch.equal(reused.tables[:seqs, :width], torch.from_numpy(step.decode_tables))
        assert not reused.tables[:seqs, width:].any() and not reused.tables[seqs:OUTPUTS].any()


def test_padding_rows_read_the_scratch_block_through_their_own_table() -> None:
    buf = _buffer()
    buf.fill(_step(np.random.default_rng(1), 3, 2, 2, True))
    assert buf.blocks[3:].eq(SCRATCH).all() and buf.lengths[3:].eq(1).all()
    assert buf.table_rows[3:].eq(OUTPUTS).all() and buf.tables[OUTPUTS].tolist() == [SCRATCH] + [0] * (WIDTH - 1)
    assert buf.slots[:3].tolist() == (buf.positions[:3] % BLOCK).tolist()
    assert buf.lengths[:3].tolist() == (buf.positions[:3] + 1).tolist()
    assert buf.last[2:].eq(0).all()
