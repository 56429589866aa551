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
