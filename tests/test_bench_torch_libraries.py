"""bench/bench_torch_libraries.py on the CPU: every variant runs and the JSON says what it measured
(its numbers are the GPU machine's to give)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_torch_libraries


def test_the_torch_libraries_bench_runs_its_variants_and_lists_what_is_mapped(tmp_path: Path) -> None:
    out = tmp_path / "torch_libraries.json"
    argv = ["--rounds", "1", "--variants", "plain,libtorch_cpu,libtorch", "--out", str(out)]
    assert bench_torch_libraries.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and set(res["runs"]) == {"plain", "libtorch_cpu", "libtorch"}
    for variant, (run,) in res["runs"].items():
        assert "error" not in run, run
        assert run["import_torch_s"] > 0
        assert ("ahead_s" in run) == (variant != "plain")
    # both variants loaded something ahead; the inventory (one more plain import) lists what torch
    # maps, libtorch_cpu among it, and no name mapped from two files
    assert res["medians"]["libtorch"]["ahead_s"] > 0 and res["medians"]["libtorch_cpu"]["ahead_s"] > 0
    assert res["inventory"]["mapped_twice"] == []
    assert any(Path(p).name == "libtorch_cpu.so" for p in res["inventory"]["mapped"])
