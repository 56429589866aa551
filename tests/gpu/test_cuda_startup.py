"""The worker's start on a GPU host: the import thread makes Triton's own hash beside the model
layer's imports at a short GIL switch interval, and puts the interval back once it is done."""

from __future__ import annotations

import sys

import pytest

from worker import _native
from worker import main as worker_main
from worker.config import WorkerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_native.cuda_device_count() == 0, reason="needs a CUDA device"),
]


def test_the_import_thread_hashes_triton_at_a_short_switch_interval_and_puts_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    from triton.runtime.cache import triton_key

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
    assert triton_key.cache_info().currsize == 1
