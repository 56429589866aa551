"""bench/bench_stop_stall.py end to end on the CPU (host backend, bench_gateway's tiny checkpoint with
a byte-level BPE): both cases run real workers, every stream gets its tokens, and the worker says it
read the decoding alone for the stop strings (while idle, or at the request when it never idled)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bench_stop_stall
from bench.bench_gateway import write_checkpoint
from bench.bpe_tokenizer import main as bpe_tokenizer


def test_bench_stop_stall_smoke(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    write_checkpoint(model, "tiny", "cpu")
    assert bpe_tokenizer([str(model)]) == 0
    out = tmp_path / "stall.json"
    argv = ["--model", str(model), "--backend", "host", "--streams", "2", "--tokens", "200", "--after", "5"]
    rc = bench_stop_stall.main([*argv, "--repeats", "1", "--idle", "1", "--kv-blocks", "64", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["case"] for r in res["runs"]] == ["idle", "busy"]
    for r in res["runs"]:
        assert r["exit_code"] == 0 and r["stop_request_tokens"] == 8
        assert r["worker_read"] is not None and r["worker_read"]["what"] == "its decoding read", r
        assert r["median_gap_s"] > 0
