"""A checkpoint directory whose reads hang in a worker process while a gate file exists: a hung
network mount, or a load held open so that a test can act while the worker is LOADING. The hang is an
``os.preadv`` wrapper installed through a ``sitecustomize`` module on the worker process's path (the
loader's reads), and a ``pread`` of the C library's preloaded into it (tests/hang_shim.c: the reads
the native layer makes itself, the start-up staging's), so the worker runs with its default flags."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
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


SHIM_SOURCE = Path(__file__).with_name("hang_shim.c")


def hang_shim() -> Path:
    """tests/hang_shim.c built (once per source: a shared object named for its hash, in the temporary
    directory, written under another name and renamed into place)."""
    source = SHIM_SOURCE.read_bytes()
    built = Path(tempfile.gettempdir()) / f"memsvc-hang-shim-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not built.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        assert cc, "a C compiler (cc) builds tests/hang_shim.c, as it builds the native extension"
        partial = built.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SHIM_SOURCE), "-ldl"], check=True)
        partial.replace(built)
    return built


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
        """A worker's flags to load this checkpoint (the defaults otherwise)."""
        return ["--model", str(self.root)]

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.site), os.environ.get("PYTHONPATH", "")) if p)
        preload = " ".join(p for p in (str(hang_shim()), os.environ.get("LD_PRELOAD", "")) if p)
        return {
            "PYTHONPATH": path,
            "LD_PRELOAD": preload,
            "TEST_HANG_UNDER": str(self.root),
            "TEST_HANG_SEEN": str(self.seen),
        }
