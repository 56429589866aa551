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
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    from triton.runtime import cache

    seen: list[float] = []
    hash_triton = worker_main._hash_triton

    def observed() -> None:
        seen.append(sys.getswitchinterval())
        hash_triton()

    monkeypatch.setattr(worker_main, "_hash_triton", observed)
    before = sys.getswitchinterval()
    worker_main.import_model_layer(WorkerConfig(backend="cuda", model="synthetic:1b")).join()
    assert seen == [worker_main.STARTUP_SWITCH_INTERVAL_S]
    assert sys.getswitchinterval() == before
    assert getattr(cache.triton_key, "memsvc_kept", False)


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
    import logging

    import torch

    from worker.model import first_products
    from worker.model.config import PRESETS

    monkeypatch.setattr(first_products, "_thread", None)  # one start per process: this test's
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["1b"].to_hf()))
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    with caplog.at_level(logging.INFO, logger="memsvc.worker"):
        assert first_products.start(tmp_path, 0, (1, 4, 16))
        assert not first_products.start(tmp_path, 0, (1, 4, 16))  # the one running stays the only one
        first_products.settle()
    shapes = first_products.projection_shapes(PRESETS["1b"].to_hf())
    assert any(f"cuda: {3 * len(shapes)} first products made ahead in" in r.getMessage() for r in caplog.records)
    assert torch.cuda.memory_reserved() <= reserved  # its scratch back (and any block cached before)
