"""The worker's start on a GPU host: the import thread has Triton's key of its own files made (or read
back where an earlier start kept it) beside the model layer's imports at a short GIL switch interval,
and puts the interval back once it is done; the key read back is Triton's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker import _native
from worker import main as worker_main
from worker.config import WorkerConfig
from worker.triton_key import KEPT_PREFIX

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_native.cuda_device_count() == 0, reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_thread_keeps_tritons_key_at_a_short_switch_interval_and_puts_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    from triton.runtime import cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the key kept there, not in the user's cache
    # Triton's own function for this test (an earlier test's warm-up may have kept the key in this
    # process), and whatever was there back after it
    monkeypatch.setattr(cache, "triton_key", getattr(cache.triton_key, "memsvc_made", cache.triton_key))
    seen: list[float] = []
    hash_triton = worker_main._hash_triton

    def observed() -> None:
        seen.append(sys.getswitchinterval())
        hash_triton()

    monkeypatch.setattr(worker_main, "_hash_triton", observed)
    before = sys.getswitchinterval()
    worker_main.import_model_layer(WorkerConfig(model="synthetic:1b")).join()  # auto: cuda here
    assert seen == [worker_main.STARTUP_SWITCH_INTERVAL_S]
    assert sys.getswitchinterval() == before
    assert hasattr(cache.triton_key, "memsvc_read")
    assert [p.name.startswith(KEPT_PREFIX) for p in tmp_path.iterdir()] == [True]


_PROBE = """
import json, sys
from triton.runtime import cache
own = cache.triton_key
from worker.triton_key import keep_triton_key
read = keep_triton_key()
print(json.dumps({"read": read, "kept": cache.triton_key(), "own": own() if read else None}))
"""


def _probe(cache_dir: Path) -> dict[str, object]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    answer: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return answer


def test_tritons_key_is_made_and_kept_once_then_read_back_as_triton_makes_it(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    first = _probe(tmp_path)
    assert first["read"] is False
    [kept] = [p for p in tmp_path.iterdir() if p.name.startswith(KEPT_PREFIX)]
    assert kept.read_text() == first["kept"]
    second = _probe(tmp_path)
    assert second["read"] is True
    assert second["kept"] == first["kept"] == second["own"]  # Triton's own function, made in that process


def test_the_first_products_are_made_on_a_thread_and_their_scratch_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With no --backend (auto, cuda here), as a user's start: the thread runs each projection at each
    graph bucket's row count and gives its scratch back (what stays is cuBLAS's workspace, a few MB)."""
    import logging

    import torch

    from worker.model import first_products
    from worker.model.config import PRESETS
    from worker.model.step_limits import bucket_sizes

    monkeypatch.setattr(first_products, "_thread", None)  # one start per process: this test's
    hf = PRESETS["1b"].to_hf()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shapes = first_products.projection_shapes(PRESETS["1b"])
    scratch = (max(n * k for n, k in shapes) + 512 * max(k for _, k in shapes)) * 2  # bf16
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    config = WorkerConfig(model=str(tmp_path), max_batch=64)
    assert config.backend == "auto"
    with caplog.at_level(logging.INFO, logger="memsvc.worker"):
        worker_main._first_products(config)
        assert first_products._thread is not None
        assert not first_products.start(tmp_path, 0, (1, 4, 16))  # the one running stays the only one
        first_products.settle()
    made = len(bucket_sizes(64, 512)) * len(shapes)
    assert any(f"cuda: {made} first products made ahead in" in r.getMessage() for r in caplog.records)
    assert torch.cuda.memory_reserved() - reserved < scratch / 2


_KEPT_KERNELS_PROBE = """
import json, sys
from pathlib import Path
from worker.allocator import AllocatorConfig, MemoryAllocator
from worker.model import kept_kernels, kernels
from worker.model.runner import ModelRunner

folder = Path(sys.argv[1])
alloc = MemoryAllocator(AllocatorConfig(backend="cuda", host_chunk_bytes=64 << 20))  # first, as a worker's
kernels.load_ahead(b"synthetic:small", 0, folder=folder)
ahead = {f"{k.fn.__name__}: {key}" for k in kernels._ours() for c in k.device_caches.values() for key in c[0]}
runner = ModelRunner(
    alloc, "synthetic:small", 512, 16, block_size=16, max_batch=16, cuda_graphs=True, defer_graph_capture=True
)
runner.warm_up()
used = {f"{k.fn.__name__}: {key}" for k in kernels._ours() for c in k.device_caches.values() for key in c[0]}
print(json.dumps({"ahead": sorted(ahead), "used": sorted(used), "compiled_after": kept_kernels.compiled_after()}))
"""


def _kept_kernels_probe(folder: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _KEPT_KERNELS_PROBE, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    answer: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return answer


def test_a_start_loads_ahead_every_kernel_the_last_start_of_the_model_compiled(tmp_path: Path) -> None:
    """worker/model/kept_kernels.py, in two fresh processes: the first has nothing kept, compiles its
    kernels in the warm-up and keeps their specialisations; the second loads them all ahead, before any
    launch, and its warm-up then compiles nothing (each launch finds its kernel loaded)."""
    pytest.importorskip("triton")
    from worker.model.kept_kernels import KEPT_PREFIX as KERNELS_PREFIX
    from worker.model.kept_kernels import read_specs

    first = _kept_kernels_probe(tmp_path)
    assert first["ahead"] == []
    assert first["used"] and first["compiled_after"] == len(first["used"])  # type: ignore[arg-type]
    [kept] = [p for p in tmp_path.iterdir() if p.name.startswith(KERNELS_PREFIX)]
    assert len(read_specs(kept)) == len(first["used"])  # type: ignore[arg-type]
    written = kept.stat().st_mtime_ns
    second = _kept_kernels_probe(tmp_path)
    assert second["ahead"] == second["used"] == first["used"]
    assert second["compiled_after"] == 0
    # nothing new to keep: the file is not written again
    assert [p.name for p in tmp_path.iterdir()] == [kept.name] and kept.stat().st_mtime_ns == written
