"""The engine's size defaults, in a module of their own: the worker's settings (worker/config.py),
which must not import torch, take their defaults from here, and the engine, the runner and the KV
cache take the same ones, so a default is written once."""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block."""
DEFAULT_MAX_BATCH = 64
"""Requests in one step at most (the largest CUDA-graph bucket)."""
MIXED_ROWS = 512
"""The most rows a step that mixes decodes and prompt chunks is captured for and planned as paged rows
for (the engine's ``paged_rows``): past it a chunk's flash-attention span reads its prefix once per
tile of rows where the decode kernel reads it once per row, and the step's kernels run longer than
its launches take (an 8B model's 512-row step is ~10 ms of matrix work)."""
DEFAULT_MAX_STEP_TOKENS = MIXED_ROWS
"""Tokens one step feeds at most, unless max_batch is more (then max_batch): the decodes, then prompt
chunks up to this budget; as many as a mixed step replays from a CUDA graph, so with graphs every
step replays. On the
H200 (8B bf16, 512-token prompts, 128 out, C=64 streams) it served 4,036 output tok/s with an ITL
p99 of 20 ms, where 2,048 gave 2,611 tok/s and 199 ms: a 2,048-row step ran eagerly for 60-170 ms
while every decode waited (docs/benchmarks.md)."""

WARM_UP_PROMPT = (0, 1, 2)
"""The prompt of the warm-up's short generation (worker/model/runner.py's ``warm_up``): its first step
has as many rows, the decodes after it one each (the start's first products use both counts)."""
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512)
"""Row counts the CUDA graphs are captured for, up to the largest step they take (:func:`graph_rows`);
the largest is ``MIXED_ROWS``."""


def step_tokens(max_batch: int, max_step_tokens: int | None) -> int:
    """The tokens one step feeds at most: as set, else ``DEFAULT_MAX_STEP_TOKENS`` or max_batch if more."""
    return max(DEFAULT_MAX_STEP_TOKENS, max_batch) if max_step_tokens is None else max_step_tokens


def graph_rows(max_batch: int, max_step_tokens: int) -> int:
    """The most rows a step replayed from a CUDA graph has: the model runner's graphs take the steps
    that mix decodes and prompt chunks, up to ``MIXED_ROWS`` (or max_batch, if more) and at most the
    step's token budget."""
    return min(max_step_tokens, max(MIXED_ROWS, max_batch))


def bucket_sizes(max_batch: int, max_rows: int) -> tuple[int, ...]:
    """The row counts captured for steps of up to ``max_rows`` rows (at least ``max_batch``): every
    bucket below it, max_batch and max_rows themselves."""
    rows = max(max_rows, max_batch)
    return tuple(sorted({b for b in BUCKETS if b < rows} | {max_batch, rows}))


__all__ = [
    "BUCKETS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_STEP_TOKENS",
    "MIXED_ROWS",
    "WARM_UP_PROMPT",
    "bucket_sizes",
    "graph_rows",
    "step_tokens",
]
