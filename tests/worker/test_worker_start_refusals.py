"""What ``memsvc worker`` refuses at start, through the real command (issue 25 items 4, 7, 12): a flag
naming a path it cannot use is refused before the worker listens (no "listening on" line, then exit
2); a ``config.json`` value out of range is one line naming the key and its bound, exit 2 (it used to
load and then fail every GetWorkerStatus, or be a traceback); a checkpoint file that is not a regular
file (a FIFO, whose read never returns) is refused by name, at start and in ReloadWeights, and the
worker keeps serving its old weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from workerproc import WorkerProcess

from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker.model.config import PRESETS

MEMSVC = [sys.executable, "-m", "memsvc.cli"]
START_TIMEOUT = 120.0
"""Generous for a busy 2-core machine: each case ends in well under a second plus torch's import."""
CALL_TIMEOUT = 60.0


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [*MEMSVC, "worker", "--backend", "host", "--listen", "127.0.0.1:0", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT, stdin=subprocess.DEVNULL)


def refused(r: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a refused start (exit 2, no traceback), which is returned."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("memsvc worker: error: "), r.stderr[-3000:]
    return errors[0]


# ---- item 12: cheap checks before "listening on" ----
def _paths(tmp: Path) -> dict[str, Path]:
    a_file = tmp / "a-file"
    a_file.write_text("x")
    no_config = tmp / "no-config"
    no_config.mkdir()
    fifo_config = tmp / "fifo-config"
    fifo_config.mkdir()
    os.mkfifo(fifo_config / "config.json")
    return {"file": a_file, "missing": tmp / "missing", "no_config": no_config, "fifo_config": fifo_config}


@pytest.mark.parametrize(
    ("flag", "path", "says"),
    [
        ("--offload-dir", "missing", "does not exist"),
        ("--offload-dir", "file", "is not a directory"),
        ("--model", "missing", "checkpoint directory does not exist"),
        ("--model", "file", "is not a directory"),
        ("--model", "no_config", "no config.json"),
        ("--model", "fifo_config", "config.json is not a regular file"),
    ],
)
def test_a_path_flag_it_cannot_use_is_refused_before_listening(tmp_path: Path, flag: str, path: str, says: str) -> None:
    where = _paths(tmp_path)[path]
    r = worker(flag, str(where))
    line = refused(r)
    assert f"{flag} {where}" in line and says in line, line
    assert "listening on" not in r.stdout, r.stdout


def test_an_offload_dir_it_cannot_write_is_refused_before_listening(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    r = worker("--offload-dir", str(ro))
    assert "listening on" not in r.stdout
    assert "is not writable" in refused(r)


def test_every_path_refusal_comes_before_listening(tmp_path: Path) -> None:
    """The listen comes early on purpose (it answers LOADING while torch imports), so "listening on"
    means the flags were accepted: none of these refusals may follow it."""
    where = _paths(tmp_path)
    for args in (["--offload-dir", str(where["file"])], ["--model", str(where["no_config"])]):
        r = worker(*args)
        refused(r)
        assert "listening on" not in r.stdout, (args, r.stdout)


# ---- item 7: config.json values out of range ----
def _config(**changes: Any) -> dict[str, Any]:
    hf = PRESETS["tiny"].to_hf()
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    return hf


BAD_CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    ("context past int32", _config(max_position_embeddings=2**40), "'max_position_embeddings' must be an integer in"),
    ("no heads", _config(num_attention_heads=0), "'num_attention_heads' must be an integer in [1, 1024], got 0"),
    ("negative vocab", _config(vocab_size=-5), "'vocab_size' must be an integer in [1,"),
    ("huge vocab", _config(vocab_size=2**33), "'vocab_size' must be an integer in [1,"),
    ("no layers", _config(num_hidden_layers=0), "'num_hidden_layers' must be an integer in [1, 1024]"),
    ("zero kv heads", _config(num_key_value_heads=0), "'num_key_value_heads' must be an integer in [1, 1024]"),
    ("kv heads do not divide", _config(num_key_value_heads=3), "must be a multiple of 'num_key_value_heads' (3)"),
    ("hidden not divisible", _config(head_dim=None, hidden_size=66), "'hidden_size' (66) must be a multiple"),
    ("odd head_dim", _config(head_dim=15), "'head_dim' (15) must be even"),
    ("zero head_dim", _config(head_dim=0), "'head_dim' must be an integer in [2, 1024]"),
    ("huge intermediate", _config(intermediate_size=2**40), "'intermediate_size' must be an integer in [1,"),
    ("fractional hidden", _config(hidden_size=64.5), "'hidden_size' must be an integer in"),
    ("zero eps", _config(rms_norm_eps=0), "'rms_norm_eps' must be in (0, 1)"),
    ("huge eos id", _config(eos_token_id=2**40), "eos_token_id must be a token id (0 to 2147483647)"),
    (
        "zero rope factor",
        _config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 0}),
        "'rope_parameters.factor' must be > 0",
    ),
    (
        "zero llama3 low_freq_factor",
        _config(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            }
        ),
        "'rope_parameters.low_freq_factor' must be > 0",
    ),
]


@pytest.mark.parametrize(("case", "hf", "says"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_a_config_value_out_of_range_is_one_line_naming_the_key_and_exit_2(
    tmp_path: Path, case: str, hf: dict[str, Any], says: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    line = refused(worker("--model", str(tmp_path)))
    assert says in line and str(tmp_path) in line, (case, line)


def test_a_config_nested_100000_deep_is_one_line_and_exit_2(tmp_path: Path) -> None:
    depth = 100_000
    (tmp_path / "config.json").write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    line = refused(worker("--model", str(tmp_path)))
    assert "config.json: JSON nested deeper than 32 levels" in line, line


def _nested_tokenizer_config(path: Path) -> str:
    """tokenizer_config.json is read with the same bounds as config.json (it was a plain json.loads)."""
    depth = 100_000
    (path / "tokenizer_config.json").write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    return "tokenizer_config.json: JSON nested deeper than 32 levels"


def _unreadable_tokenizer(path: Path) -> str:
    (path / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    return f"{path / 'tokenizer.json'}: cannot read the tokenizer"


def _tokenizer_bigger_than_the_model(path: Path) -> str:
    """Its extra ids would index past the embedding: refused at start, not at the first prompt."""
    from worker.model.synthetic_text import synthetic_text

    model_vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    bigger = synthetic_text(model_vocab + 100)
    assert bigger is not None
    bigger.tokenizer.save(str(path / "tokenizer.json"))
    return f"the tokenizer has {model_vocab + 100} tokens, the model only {model_vocab}"


BAD_TEXT: list[Callable[[Path], str]] = [
    _nested_tokenizer_config,
    _unreadable_tokenizer,
    _tokenizer_bigger_than_the_model,
]
"""A text checkpoint spoiled one way each (each returns what the refusal must say)."""


@pytest.mark.parametrize("front", ["process", "inline"])  # a bad text side is the same refused start either way
@pytest.mark.parametrize("spoil", BAD_TEXT, ids=[f.__name__.strip("_") for f in BAD_TEXT])
def test_a_text_side_it_cannot_use_is_one_line_and_exit_2(
    tmp_path: Path, spoil: Callable[[Path], str], front: str
) -> None:
    from hf_models import text_model

    path, _ = text_model(tmp_path)
    says = spoil(path)
    line = refused(worker("--model", str(path), "--rpc-front", front))
    assert says in line, line


# ---- item 4 (the up-front check): a shard that is not a regular file ----
def write_checkpoint(path: Path, seed: int) -> None:
    """A Hugging Face-layout checkpoint of the tiny preset with seeded weights."""
    import torch

    from worker.model.weights import fill_synthetic, save_checkpoint, weight_shapes

    config = PRESETS["tiny"]
    weights = {name: torch.empty(shape, dtype=config.torch_dtype) for name, shape in weight_shapes(config).items()}
    fill_synthetic(weights, config, seed)
    save_checkpoint(path, weights, config)


def fifo_checkpoint(path: Path) -> Path:
    """A checkpoint whose only shard is a FIFO no one writes: a read of it never returns (as one on a
    hung NFS or FUSE mount), and without O_NONBLOCK even its open blocks."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf()))
    os.mkfifo(path / "model.safetensors")
    return path


def test_a_fifo_shard_at_start_is_refused_by_name(tmp_path: Path) -> None:
    ckpt = fifo_checkpoint(tmp_path / "ckpt")
    line = refused(worker("--model", str(ckpt)))
    assert f"{ckpt / 'model.safetensors'} is not a regular file (a FIFO)" in line, line


def test_reload_from_a_fifo_shard_fails_and_the_worker_serves_its_old_weights(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=11)
    other = fifo_checkpoint(tmp_path / "hung")
    prompt = [3, 1, 4, 1, 5]

    def generate(stub: Any) -> list[int]:
        r = stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=8), timeout=CALL_TIMEOUT)
        return list(r.token_ids)

    with WorkerProcess(["--model", str(ckpt)]) as wp:
        before = generate(wp.stub)
        with pytest.raises(grpc.RpcError) as ei:
            wp.stub.ReloadWeights(worker_pb.ReloadWeightsRequest(model_path=str(other)), timeout=CALL_TIMEOUT)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert "model.safetensors is not a regular file (a FIFO)" in (ei.value.details() or ""), ei.value
        st = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT).status
        assert not st.transition_in_progress and st.model.source == str(ckpt)
        assert generate(wp.stub) == before
        wp.stop()
