"""A checkpoint directory whose reads hang in a worker process while a gate file exists: a hung
network mount, or a load held open so that a test can act while the worker is LOADING. The hang is an
``os.preadv`` wrapper installed through a ``sitecustomize`` module on the worker process's path."""

from __future__ import annotations

import os
from pathlib import Path

from worker.allocator import AllocatorConfig, MemoryAllocator
from worker.model import PRESETS, allocate_weights, fill_synthetic, save_checkpoint

SITECUSTOMIZE = """
import os, time
_real = os.preadv

def _preadv(fd, buffers, offset, *rest):
    root = os.environ.get("TEST_HANG_UNDER", "")
    if root:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        gate = os.path.join(root, "HANG")
        if path.startswith(root) and os.path.exists(gate):
            open(os.path.join(os.environ["TEST_HANG_SEEN"], "hung"), "w").close()
            while os.path.exists(gate):
                time.sleep(0.02)
    return _real(fd, buffers, offset, *rest)

os.preadv = _preadv
"""


def tiny_checkpoint(root: Path, seed: int) -> Path:
    """``synthetic:tiny``'s config with seeded weights, saved as a checkpoint directory."""
    config = PRESETS["tiny"]
    alloc = MemoryAllocator(AllocatorConfig(backend="host", host_capacity_bytes=64 << 20))
    try:
        weights = allocate_weights(config, alloc)
        fill_synthetic(weights, config, seed=seed)
        save_checkpoint(root, weights, config)
    finally:
        del weights
        alloc.close()
    return root


class HungMount:
    """A checkpoint directory whose data reads hang in a worker process while ``HANG`` exists in it."""

    def __init__(self, tmp: Path, name: str, seed: int = 7) -> None:
        self.root = tiny_checkpoint(tmp / name, seed=seed)
        self.site = tmp / f"site-{name}"
        self.site.mkdir()
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.seen = tmp / f"seen-{name}"
        self.seen.mkdir()

    def hang(self) -> None:
        (self.root / "HANG").touch()

    def recover(self) -> None:
        (self.root / "HANG").unlink()

    @property
    def hung(self) -> bool:
        return (self.seen / "hung").exists()

    @property
    def worker_args(self) -> list[str]:
        """A worker's flags to load this checkpoint: without the start-up staging, whose reads are
        native (worker/staging.py) and so never meet the ``os.preadv`` wrapper that hangs."""
        return ["--model", str(self.root), "--no-checkpoint-staging"]

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.site), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, "TEST_HANG_UNDER": str(self.root), "TEST_HANG_SEEN": str(self.seen)}
