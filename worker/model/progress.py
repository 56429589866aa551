"""A progress bar for a model's first load, on stderr where stderr is a terminal (tqdm's rule: none
in a log file or under a supervisor that pipes it). A cold 16 GB checkpoint takes seconds to minutes
to read; the log line after the load says how long it took, the bar says how far it is meanwhile.
A Hub download shows huggingface_hub's own bars before this one."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from worker.model.loader import Progress


@contextmanager
def load_bar(what: str, stream: TextIO | None = None) -> Iterator[Progress]:
    """A :data:`~worker.model.loader.Progress` that draws a bar of bytes read from its first call
    (a load that reads nothing, a synthetic model's, draws none), closed on exit. Without tqdm (it
    comes with huggingface_hub and transformers), nothing is drawn."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - an install without the worker extra's dependencies
        yield lambda _done, _total: None
        return
    bars: list[tqdm[None]] = []

    def update(done: int, total: int) -> None:
        if not bars:
            out = stream or sys.stderr
            bars.append(
                tqdm(desc=what, total=total, unit="B", unit_scale=True, unit_divisor=1024, file=out, disable=None)
            )
        bars[0].update(done - bars[0].n)

    try:
        yield update
    finally:
        for bar in bars:
            bar.close()


__all__ = ["load_bar"]
