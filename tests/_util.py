"""Helpers shared by the allocator tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import torch

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
