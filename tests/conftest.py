"""Shared fixtures for the allocator tests.

``alloc`` is a fresh allocator per test, parametrized by ``backend``: ``host`` always runs (the real
allocator over CPU memory), ``cuda`` carries the ``gpu`` marker and is skipped where the driver
reports no device, so the same test bodies serve both. Tests whose assertions only hold on the host
backend (its simulated capacity, SIGSEGV on a slept page) use ``host_alloc`` instead.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from pgserver import pg_url, postgres_server  # noqa: F401  (fixtures: a real PostgreSQL, for the manager's store)

from worker import _native
from worker.allocator import AllocatorConfig, MemoryAllocator

if TYPE_CHECKING:  # torch is imported by the fixtures that need it, not by every test session
    import torch

MiB = 1 << 20
HOST_CAPACITY = 256 * MiB
"""The host backend's simulated device size: large enough for every test, small enough to exhaust."""
HOST_CHUNK = 4 * MiB
"""A small offload chunk, so tensors of a few MiB already cross chunk boundaries."""

CUDA_DEVICES = _native.cuda_device_count()

AllocatorFactory = Callable[..., MemoryAllocator]


@pytest.fixture(
    params=[
        "host",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(CUDA_DEVICES == 0, reason="needs a CUDA device"),
            ],
        ),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend a test runs on: ``host`` everywhere, ``cuda`` where a device is present."""
    return str(request.param)


@pytest.fixture
def make_allocator() -> Iterator[AllocatorFactory]:
    """Build allocators with the test configuration (overridable per call); all are closed at teardown."""
    made: list[MemoryAllocator] = []

    def make(backend: str = "host", **overrides: Any) -> MemoryAllocator:
        settings: dict[str, Any] = {
            "backend": backend,
            "host_capacity_bytes": HOST_CAPACITY,
            "host_chunk_bytes": HOST_CHUNK,
        }
        settings.update(overrides)
        a = MemoryAllocator(AllocatorConfig(**settings))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()
    gc.collect()


@pytest.fixture
def alloc(backend: str, make_allocator: AllocatorFactory) -> MemoryAllocator:
    """A fresh allocator on ``backend`` (host here; cuda too where a GPU is present)."""
    return make_allocator(backend)


@pytest.fixture
def host_alloc(make_allocator: AllocatorFactory) -> MemoryAllocator:
    """A fresh host-backend allocator, for assertions specific to the host backend."""
    return make_allocator("host")


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: every random byte in the suite is reproducible."""
    import torch

    return torch.Generator().manual_seed(1234)
