"""bench/bench_loader.py end to end on the CPU with a tiny checkpoint (the GPU run uses the same code
with the 8B-shaped one): every phase runs, the loader's weights equal the old path's, and the cold
phase really read the files with O_DIRECT where the file system allows it."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_loader


def test_bench_loader_smoke(tmp_path: Path) -> None:
    out = tmp_path / "loader.json"
    rc = bench_loader.main(
        [
            "--size",
            "tiny",
            "--cpu",
            "--cold",
            "--repeat",
            "1",
            "--hf-repeat",
            "1",
            "--threads",
            "2",
            "--chunk-mib",
            "1",
            "--dir",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and result["passed"] and result["streaming_equals_old_path"], result
    assert result["checkpoint"]["files"] > 1, "a sharded checkpoint"
    warm, cold = result["warm"], result["cold"]
    for name in ("streaming", "streaming_torch_pinned_ring", "old_path", "transformers_from_pretrained"):
        assert warm[name]["best_s"] > 0, name
    assert warm["streaming"]["runs"][0]["bytes"] == result["checkpoint"]["weight_bytes"]
    assert warm["streaming"]["staging_bytes"] == 2 * 2 * (1 << 20)
    read = cold["o_direct_read"]
    if "error" not in read:
        assert read["bytes"] == result["checkpoint"]["file_bytes"]
        assert cold["streaming"]["first"]["direct_bytes"] > 0, cold["streaming"]
    assert cold["streaming_buffered"]["first"]["buffered_bytes"] > 0
    assert "streaming" in bench_loader.format_table(result)
