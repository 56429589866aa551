"""bench/bench_tiers.py end to end on the CPU (host backend, a tiny checkpoint; the GPU run uses the
same code with the 8B-shaped one): every phase runs through a real worker process's RPCs, and the
bytes each one moved are the weights'."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_tiers


def test_bench_tiers_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    rc = bench_tiers.main(
        ["--shape", "tiny", "--backend", "host", "--cycles", "1", "--workdir", str(tmp_path), "--out", str(out)]
    )
    r = json.loads(out.read_text())
    weights = r["weights_bytes"]
    assert rc == 0 and weights > 0
    assert r["level1"]["first_sleep"]["bytes"] == weights == r["level1"]["later"][0]["sleep"]["bytes"]
    assert r["level2"]["wake_warm"]["bytes"] == weights == r["level2"]["wake_cold"]["bytes"]
    disk = r["disk_tier"]
    assert disk["sleep"]["bytes"] == weights and disk["wake"]["verified_bytes"] == weights
    assert disk["demote"]["bytes"] == weights and disk["wake_after_demote"]["verified_bytes"] == weights
    assert set(r["passed"]) == {"first_sleep", "later_sleeps", "level2_wake_warm", "disk_sleep", "disk_wake"}
    assert r["floors"]["disk_write"]["bytes"] > 0 and r["summary"]["disk_wake_vs_read_floor"] > 0
    assert list((tmp_path / "offload").iterdir()) == []  # the tier's files and the probe are gone
