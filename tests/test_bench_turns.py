"""bench/bench_turns.py end to end on the CPU (host backend, bench_gateway's tiny checkpoint): three
models behind one gateway on a device whose budget fits one, loaded closed loop and open loop from
client processes; every request of every phase is served with the shape's token count and no
paused request reads its tokens again."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_turns


def test_bench_turns_smoke(tmp_path: Path) -> None:
    out = tmp_path / "turns.json"
    rc = bench_turns.main(
        [
            "--shape",
            "tiny",
            "--backend",
            "host",
            "--io",
            "8x16",
            "--requests",
            "2",
            "--slots",
            "2",
            "--skew",
            "2,1,1",
            "--clients",
            "4",
            "--start-delay",
            "3",
            "--time-slice",
            "0.3",
            "--kv-blocks",
            "64",
            "--worker-args",
            "",
            "--rate",
            "2",
            "--out",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 0
    phases = ("alone_closed", "two_busy_closed", "alone_open", "two_busy_open", "skewed")
    for phase in phases:
        row = r[phase]
        for name, part in row.items():
            if name == "counters":
                assert all(c["recomputed_tokens"] == 0 for c in part.values()), (phase, part)
                continue
            assert part["failed"] == 0 and part["completed"] == part["requests"] > 0, (phase, name, part)
    assert set(r["skewed"]) == {"all", "alpha", "beta", "gamma", "counters"}
    assert r["two_busy_vs_alone_closed"] > 0 and r["two_busy_vs_alone_open"] > 0
