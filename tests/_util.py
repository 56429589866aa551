"""Helpers shared by the allocator tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from worker.allocator import Fence, MemoryAllocator

MiB = 1 << 20


def random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random bytes as a CPU uint8 tensor."""
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def fill_random(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill a pool tensor (any device, any dtype) with random bytes; returns a CPU copy of them."""
    data = random_bytes(t.numel() * t.element_size(), gen)
    t.view(-1).view(torch.uint8).copy_(data)
    return data


def as_cpu_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a CPU uint8 tensor, for torch.equal against what was written."""
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def busy_copy_stream(alloc: MemoryAllocator, mib: int = 512) -> tuple[torch.Tensor, torch.Tensor, Fence | None] | None:
    """On cuda, a large copy enqueued without waiting on the allocator's own stream: the copies a test
    enqueues next queue behind it for milliseconds, so a missing wait or a reused buffer shows in the
    data instead of hiding behind copies that finish before Python takes its next step. Keep the
    returned object until those copies are checked. None on the host backend (its copies finish
    before they return)."""
    if alloc.backend != "cuda":
        return None
    n = mib // 4
    dev = alloc.empty((n, 4 << 20), torch.uint8, tag="busy")
    host = alloc.host_empty((n, 4 << 20), torch.uint8)
    ids = np.arange(n, dtype=np.int64)
    return dev, host, alloc.copy_block_ids(dev, host, ids, ids, "batch", wait=False)


def host_held_once_trimmed(alloc: MemoryAllocator, expected: int) -> int:
    """host_held_bytes once the pool's reaper thread has trimmed it (wake releases chunks off its path).

    Polls for at most 10 s: the value is what is asserted, never how long it took."""
    deadline = time.monotonic() + 10.0
    held = int(alloc.stats().counters["host_held_bytes"])
    while held != expected and time.monotonic() < deadline:
        time.sleep(0.005)
        held = int(alloc.stats().counters["host_held_bytes"])
    return held
