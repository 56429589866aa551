"""bench/bench_serving.py end to end on the CPU (host backend, bench_gateway's tiny checkpoint): every
path (the worker's GenerateStream and Generate, the gateway through the OpenAI SDK) serves every
request of every level with the shape's token count, from several client processes; the first
request after ready is measured."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_serving


def test_bench_serving_smoke(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    rc = bench_serving.main(
        [
            "--shape",
            "tiny",
            "--backend",
            "host",
            "--shapes",
            "8x6",
            "--concurrency",
            "1,4",
            "--requests",
            "6",
            "--clients",
            "2",
            "--kv-blocks",
            "64",
            "--max-batch",
            "8",
            "--start-delay",
            "3",
            "--gateway-processes",
            "2",
            "--out",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 0 and r["first_request"]["first_s"] > 0
    rows = {(x["path"], x["concurrency"]): x for x in r["results"]}
    assert set(rows) == {(p, c) for p in ("worker", "unary", "gateway") for c in (1, 4)}
    for key, row in rows.items():
        assert (row["completed"], row["failed"]) == (6, 0), (key, row)
        assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] is not None, (key, row)
    assert rows[("worker", 4)]["itl_p50_ms"] is not None and rows[("gateway", 4)]["tpot_p50_ms"] is not None
