"""What worker/model/first_products.py makes ahead: the decode step's projections as the runner fuses
them, read from a checkpoint's config.json; nothing for a model whose config is not there. The products
themselves are cuBLAS's (tests/gpu/test_cuda_startup.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from worker.model import first_products
from worker.model.config import PRESETS
from worker.model.step_limits import BUCKETS, bucket_sizes, graph_rows, step_tokens


def test_an_8b_llamas_projections_are_fused_qkv_o_fused_gate_up_and_down() -> None:
    assert first_products.projection_shapes(PRESETS["8b"]) == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def test_a_model_whose_every_mlp_is_experts_has_its_attention_projections_only() -> None:
    c = replace(PRESETS["tiny"], family="qwen3_moe", num_experts=4, experts_per_token=2, moe_intermediate_size=32)
    attention = [
        ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        (c.hidden_size, c.num_heads * c.head_dim),
    ]
    assert first_products.projection_shapes(c) == attention


def test_no_directory_or_no_config_starts_nothing(tmp_path: Path) -> None:
    assert first_products.start(None, 0, (1, 2)) is False
    assert first_products.start(tmp_path, 0, (1, 2)) is False  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # not a model's config
    assert first_products.start(tmp_path, 0, (1, 2)) is False
    first_products.settle()  # nothing started: returns at once


def test_the_row_counts_are_the_graph_buckets_the_runner_captures() -> None:
    rows = graph_rows(64, step_tokens(64, None))
    assert rows == 512
    assert bucket_sizes(64, rows) == BUCKETS  # the defaults: every bucket
    assert bucket_sizes(8, graph_rows(8, 8)) == (1, 2, 4, 8)
    assert bucket_sizes(600, graph_rows(600, step_tokens(600, None))) == (*BUCKETS, 600)


def test_auto_on_a_host_without_a_gpu_makes_no_products(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import _native
    from worker import main as worker_main
    from worker.config import WorkerConfig

    if _native.cuda_device_count():
        pytest.skip("a GPU host: auto is cuda there (tests/gpu/test_cuda_startup.py)")
    monkeypatch.setattr(first_products, "_thread", None)
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf()))
    worker_main._first_products(WorkerConfig(model=str(tmp_path)))  # backend auto
    assert first_products._thread is None
