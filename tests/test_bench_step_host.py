"""bench/bench_step_host.py end to end (the same code the GPU machine would run; it needs none): every
row count is timed, over decode steps only, and its JSON says so."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_step_host


def test_bench_step_host_smoke(tmp_path: Path) -> None:
    out = tmp_path / "step_host.json"
    assert bench_step_host.main(["--rows", "1,8", "--steps", "20", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [level["rows"] for level in result["levels"]] == [1, 8]
    for level in result["levels"]:
        assert level["steps"] == 20
        assert 0 < level["step_ms_median"] <= level["step_ms_p90"], level
        assert (
            abs(level["per_row_us_median"] * level["rows"] / 1e3 - level["step_ms_median"])
            <= 0.01 * level["step_ms_median"] + 1e-3
        ), level
