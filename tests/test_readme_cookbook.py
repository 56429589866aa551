"""The README, run as a user runs it: ``memsvc up``, then every ``grpcurl`` line of its cookbook (both
services) and its CLI lines, in README order, against the pair it started.

``memsvc up`` is started as the README's ``make up`` does (``memsvc up``), with ``--backend host
--model synthetic:tiny`` (no GPU here) and its state in tmp_path; it gets the README's ports
(50051/50061/9400) when they are free, else free ports. Every command is then run exactly as written
with one substitution: those addresses. Each line must exit 0 and have its effect, checked in grpcurl's
JSON output and in the manager's view (GetWorker). A line runs in bash as written (``grpcurl`` the
real binary and ``jq`` on PATH): ``LEASE_ID=$(grpcurl … AcquireWorker | jq -r .lease.lease_id)`` keeps
the lease id in a shell variable that the later ReleaseWorker line reads, as a user's shell would, so
the cookbook leaves no lease behind before it sleeps the worker directly, and its last UpdatePolicy
puts the default policy back as it found it (the policy persists in the manager's database). The one
documented exception is a streaming line cut off by ``-max-time``, which ends with DeadlineExceeded
(grpcurl exits 64 + the status code) after printing at least one message. A README line this file
has no check for fails, so new cookbook lines cannot go untested. Finally ``memsvc up`` gets SIGINT
(Ctrl-C) and must exit 0 after stopping both children.

Everything runs once, in a module fixture (the lines depend on each other); the tests then report
on what each step did.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from childproc import STOP_TIMEOUT
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families
from upproc import (
    MEMSVC,
    REPO_ROOT,
    Up,
    get_worker,
    grpcurl_binary,
    json_messages,
    memsvc_script,
    pick_ports,
    readme_code_lines,
    run,
    tag_states,
    wait_for,
)

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

README = REPO_ROOT / "README.md"
README_MANAGER, README_WORKER, README_METRICS = "127.0.0.1:50051", "127.0.0.1:50061", "127.0.0.1:9400"
MANAGER_SERVICE = manager_pb.DESCRIPTOR.services_by_name["MemoryManagerService"]
WORKER_SERVICE = worker_pb.DESCRIPTOR.services_by_name["ModelWorkerService"]
WORKER = "workers/local0"
DEADLINE_EXIT = 64 + grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
"""grpcurl's exit status for a call that ended with a status: 64 + the code (DEADLINE_EXCEEDED = 4)."""
LINE_TIMEOUT = 60.0

_UPDATE_POLICY_LINE = (
    """grpcurl -plaintext -d '{"policy": {"idle_sleep_timeout": "120s"}, "update_mask": "idleSleepTimeout"}' """
    "127.0.0.1:50051 memsvc.v1.MemoryManagerService/UpdatePolicy"
)
KNOWN_BUGS: dict[str, str] = {}
"""README lines that fail today because of a reported bug: checked by their own strict-xfail test."""


_CAPTURE = re.compile(r"(?P<var>[A-Z_]+)=\$\((?P<call>grpcurl .*?) \| jq -r (?P<path>\S+)\)")
"""A cookbook line that keeps a field of grpcurl's answer in a shell variable (``LEASE_ID=$(…)``)."""


def grpcurl_lines() -> list[str]:
    return [line for line in readme_code_lines(README) if line.startswith("grpcurl ") or _CAPTURE.fullmatch(line)]


def grpcurl_call(line: str) -> str:
    """The grpcurl command of a cookbook line (inside ``$(…)`` for a capturing one)."""
    match = _CAPTURE.fullmatch(line)
    return match.group("call") if match else line


def cli_lines() -> list[str]:
    """The README's operator CLI lines (``.venv/bin/memsvc status|sleep|wake|watch``)."""
    out = []
    for line in readme_code_lines(README):
        if line.startswith(".venv/bin/memsvc "):
            argv = shlex.split(line, comments=True)
            if argv[1] in ("status", "sleep", "wake", "watch"):
                out.append(line)
    return out


# ---- what one step did ----
@dataclass
class Step:
    line: str
    argv: list[str]
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    problems: list[str] = field(default_factory=list)

    def report(self) -> str:
        return (
            f"README line: {self.line}\nran: {shlex.join(self.argv)}\nexit status: {self.rc}\n"
            f"problems: {self.problems}\n--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"
        )


@dataclass
class Session:
    up: Up
    lease_id: str = ""
    """The shell's $LEASE_ID: what the README's capturing AcquireWorker line put there."""
    policy_before: bytes = b""
    policy_after: bytes = b""
    """The default policy before the first cookbook line and after the last one (serialized)."""
    leases_at_direct_sleep: list[int] = field(default_factory=list)
    """The manager's lease count on local0 whenever a line put the worker to sleep directly."""
    vocab_size: int = 0
    before_tags: dict[str, str] = field(default_factory=dict)
    """Tag states at the manager before the current line ran."""
    steps: list[Step] = field(default_factory=list)
    cli: list[Step] = field(default_factory=list)
    metrics: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    up_exit: int | None = None
    up_output: str = ""
    openai_snippet: subprocess.CompletedProcess[str] | None = None
    """The README's OpenAI Python block, run against the gateway ``memsvc up`` started."""


def request_json(argv: list[str]) -> dict[str, Any]:
    """The ``-d`` request body of a grpcurl command ({} without one)."""
    return json.loads(argv[argv.index("-d") + 1]) if "-d" in argv else {}


def target(argv: list[str]) -> tuple[str, str]:
    """(address, rpc-or-verb) of a grpcurl command: the first non-flag argument is the address."""
    args, i = [], 1
    while i < len(argv):
        if argv[i] in ("-d", "-max-time"):
            i += 2
            continue
        if not argv[i].startswith("-"):
            args.append(argv[i])
        i += 1
    return args[0], " ".join(args[1:])


# ---- checks, one per kind of README line ----
Check = Callable[[Session, Step, list[dict[str, Any]]], None]


def _manager(s: Session) -> manager_pb.Worker:
    assert s.up.stub is not None
    return get_worker(s.up.stub, "local0")


def _converges(
    s: Session, state: common_pb.WorkerState.ValueType, tags: dict[str, str] | None = None
) -> manager_pb.Worker:
    """The manager's view once it shows ``state`` (and these tag states): telemetry takes a moment."""
    assert s.up.stub is not None
    return wait_for(
        lambda: _manager(s),
        lambda wk: wk.state == state and (tags is None or tag_states(wk).items() >= tags.items()),
        what=f"the manager to show {common_pb.WorkerState.Name(state)} {tags or ''}",
        timeout=30,
    )


def _services_listed(expected: str) -> Check:
    def check(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
        listed = set(step.stdout.split())
        want = {expected, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        assert want <= listed, f"list shows {sorted(listed)}, expected {sorted(want)}"

    return check


def _described(service: Any) -> Check:
    def check(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
        assert f"{service.full_name} is a service" in step.stdout
        missing = [md.name for md in service.methods if f"rpc {md.name} (" not in step.stdout]
        assert not missing, f"describe lacks {missing}"

    return check


def _expected_after_sleep(req: dict[str, Any]) -> dict[str, str]:
    if req.get("tag_actions"):
        names = {
            "TAG_ACTION_OFFLOAD": "TAG_STATE_OFFLOADED",
            "TAG_ACTION_DISCARD": "TAG_STATE_DISCARDED",
            "TAG_ACTION_KEEP": "TAG_STATE_AWAKE",
        }
        return {tag: names[a] for tag, a in req["tag_actions"].items()}
    if req.get("level") == "SLEEP_LEVEL_2":
        return {"weights": "TAG_STATE_DISCARDED", "kv_cache": "TAG_STATE_DISCARDED"}
    return {"weights": "TAG_STATE_OFFLOADED", "kv_cache": "TAG_STATE_DISCARDED"}


def _json_tags(status: dict[str, Any]) -> dict[str, str]:
    return {t["tag"]: t.get("state", "TAG_STATE_UNSPECIFIED") for t in status.get("tags", [])}


def check_list_workers(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    mine = [wk for wk in resp["workers"] if wk["name"] == WORKER]
    assert mine, f"{WORKER} not listed"
    assert mine[0]["address"] == s.up.worker_address
    assert mine[0]["state"] == "WORKER_STATE_AWAKE"


def check_get_worker(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    assert resp["worker"]["name"] == WORKER
    assert resp["worker"]["state"] == "WORKER_STATE_AWAKE"
    s.vocab_size = int(resp["worker"]["status"]["model"]["vocab_size"])


def check_sleep_worker(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    tags = _expected_after_sleep(request_json(step.argv))
    assert resp["worker"]["state"] == "WORKER_STATE_ASLEEP"
    assert _json_tags(resp["worker"]["status"]).items() >= tags.items()
    wk = _converges(s, common_pb.WORKER_STATE_ASLEEP, tags)
    level = request_json(step.argv).get("level")
    if level:
        assert common_pb.SleepLevel.Name(wk.status.sleep_level) == level


def _wake_expectation(
    s: Session, req_tags: list[str], before: dict[str, str]
) -> tuple[common_pb.WorkerState.ValueType, dict[str, str]]:
    after = {t: ("TAG_STATE_AWAKE" if not req_tags or t in req_tags else st) for t, st in before.items()}
    awake = all(st == "TAG_STATE_AWAKE" for st in after.values())
    return (common_pb.WORKER_STATE_AWAKE if awake else common_pb.WORKER_STATE_PARTIALLY_AWAKE), after


def check_wake_worker(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    state, tags = _wake_expectation(s, request_json(step.argv).get("tags", []), s.before_tags)
    assert resp["worker"]["state"] == common_pb.WorkerState.Name(state)
    assert _json_tags(resp["worker"]["status"]) == tags
    _converges(s, state, tags)


def check_acquire(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    req = request_json(step.argv)
    if _CAPTURE.fullmatch(step.line):  # jq kept only the id, in $LEASE_ID: the manager holds the rest
        assert not msgs and s.lease_id, f"$LEASE_ID is {s.lease_id!r}"
        assert s.up.stub is not None
        leases = s.up.stub.ListLeases(manager_pb.ListLeasesRequest(), timeout=10).leases
        lease = json_format.MessageToDict(
            next(x for x in leases if x.lease_id == s.lease_id), preserving_proto_field_name=True
        )
    else:
        (resp,) = msgs
        lease = resp["lease"]
        assert resp["worker"]["state"] == "WORKER_STATE_AWAKE"
        s.lease_id = lease["lease_id"]
    assert lease["lease_id"] and lease["worker"] == WORKER and lease["holder"] == req.get("holder", "")
    wk = _manager(s)
    assert wk.lease_count == 1 and wk.state == common_pb.WORKER_STATE_AWAKE


def check_release(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    assert resp["worker"]["name"] == WORKER
    assert int(resp["worker"].get("lease_count", 0)) == 0
    assert _manager(s).lease_count == 0


def check_get_policy(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    p = resp["policy"]
    assert p["tag_actions"] == {"weights": "TAG_ACTION_OFFLOAD", "kv_cache": "TAG_ACTION_DISCARD"}
    # memsvc up's documented defaults: tier 1 after 300 s, tier 2 after 3600 s
    assert p["idle_sleep_timeout"] == "300s" and p["idle_deep_sleep_timeout"] == "3600s"


def check_update_policy(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    want = request_json(step.argv)["policy"]["idle_sleep_timeout"]
    assert resp["policy"]["idle_sleep_timeout"] == want
    assert s.up.stub is not None
    now = s.up.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    assert f"{now.idle_sleep_timeout.ToNanoseconds() // 10**9}s" == want
    assert now.idle_deep_sleep_timeout.ToSeconds() == 3600, "fields outside the mask must not change"


def check_watch(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    assert msgs, "WatchWorkers printed no message before -max-time"
    assert any(msg.get("worker", {}).get("name") == WORKER for msg in msgs)
    assert "snapshot" in msgs[0], "the first message of a watch is a snapshot"


def check_health(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    assert resp == {"status": "SERVING"}


def check_worker_status(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    assert resp["status"]["worker_id"] == "local0"
    assert resp["status"]["state"] == "WORKER_STATE_AWAKE"


def check_generate(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    tokens = resp["token_ids"]
    assert len(tokens) == request_json(step.argv)["max_new_tokens"]
    assert all(isinstance(t, int) and 0 <= t < (s.vocab_size or 1 << 31) for t in tokens)


def check_generate_stream(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    *chunks, last = msgs
    assert chunks and "done" in last, "GenerateStream sent no token before its final answer"
    tokens = [t for chunk in chunks for t in chunk["token_ids"]]
    assert tokens == last["done"]["token_ids"]
    assert len(tokens) == request_json(step.argv)["request"]["max_new_tokens"]
    assert last["done"]["finish_reason"] == "FINISH_REASON_LENGTH"


def check_sleep(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    tags = _expected_after_sleep(request_json(step.argv))
    assert resp["status"]["state"] == "WORKER_STATE_ASLEEP"
    assert _json_tags(resp["status"]).items() >= tags.items()
    assert resp["transition"]["kind"] == "sleep"
    _converges(s, common_pb.WORKER_STATE_ASLEEP, tags)


def check_wake_up(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    (resp,) = msgs
    state, tags = _wake_expectation(s, request_json(step.argv).get("tags", []), s.before_tags)
    assert resp["status"]["state"] == common_pb.WorkerState.Name(state)
    assert _json_tags(resp["status"]) == tags
    assert resp["transition"]["kind"] == "wake"
    _converges(s, state, tags)


def check_telemetry(s: Session, step: Step, msgs: list[dict[str, Any]]) -> None:
    assert msgs, "StreamTelemetry printed no message before -max-time"
    assert msgs[0]["snapshot"]["worker_id"] == "local0", "the first telemetry message is a snapshot"
    seq = [int(msg["sequence_number"]) for msg in msgs]
    assert seq == list(range(1, len(msgs) + 1))


CHECKS: dict[tuple[str, str], Check] = {
    ("manager", "list"): _services_listed(MANAGER_SERVICE.full_name),
    ("manager", f"describe {MANAGER_SERVICE.full_name}"): _described(MANAGER_SERVICE),
    ("manager", "ListWorkers"): check_list_workers,
    ("manager", "GetWorker"): check_get_worker,
    ("manager", "SleepWorker"): check_sleep_worker,
    ("manager", "WakeWorker"): check_wake_worker,
    ("manager", "AcquireWorker"): check_acquire,
    ("manager", "ReleaseWorker"): check_release,
    ("manager", "GetPolicy"): check_get_policy,
    ("manager", "UpdatePolicy"): check_update_policy,
    ("manager", "WatchWorkers"): check_watch,
    ("manager", "Check"): check_health,
    ("worker", "list"): _services_listed(WORKER_SERVICE.full_name),
    ("worker", f"describe {WORKER_SERVICE.full_name}"): _described(WORKER_SERVICE),
    ("worker", "GetWorkerStatus"): check_worker_status,
    ("worker", "Generate"): check_generate,
    ("worker", "GenerateStream"): check_generate_stream,
    ("worker", "Sleep"): check_sleep,
    ("worker", "WakeUp"): check_wake_up,
    ("worker", "StreamTelemetry"): check_telemetry,
    ("worker", "Check"): check_health,
}


def check_key(argv: list[str]) -> tuple[str, str]:
    address, what = target(argv)
    who = {README_MANAGER: "manager", README_WORKER: "worker"}.get(address, address)
    return who, (what.rsplit("/", 1)[-1] if "/" in what else what)


# ---- the session ----
def substitute(line: str, s: Session) -> str:
    return line.replace(README_MANAGER, s.up.manager_address).replace(README_WORKER, s.up.worker_address)


def run_grpcurl_line(s: Session, line: str, tools: Path) -> Step:
    """The line in bash, as a user's shell runs it (``$LEASE_ID`` carried from line to line)."""
    argv = shlex.split(substitute(grpcurl_call(line), s))
    step = Step(line, argv)
    key = check_key(shlex.split(grpcurl_call(line)))
    check = CHECKS.get(key)
    if check is None:
        step.problems.append(f"no check for this README line ({key}): add one to CHECKS")
    s.before_tags = tag_states(_manager(s))
    if key == ("worker", "Sleep"):
        s.leases_at_direct_sleep.append(_manager(s).lease_count)
    script = (
        f"set -o pipefail\nLEASE_ID={shlex.quote(s.lease_id)}\n{substitute(line, s)}\nrc=$?\n"
        f'printf %s "$LEASE_ID" > {shlex.quote(str(tools / "LEASE_ID"))}\nexit $rc\n'
    )
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        r = run(["bash", "-c", script], env=env, timeout=LINE_TIMEOUT)
    except subprocess.TimeoutExpired:
        step.problems.append(f"did not finish within {LINE_TIMEOUT:.0f} s")
        return step
    step.rc, step.stdout, step.stderr = r.returncode, r.stdout, r.stderr
    s.lease_id = (tools / "LEASE_ID").read_text()
    streaming = "-max-time" in argv
    if streaming:
        # The README: "-max-time 3 ends the streaming calls after three seconds; grpcurl then exits
        # non-zero by design". That, and only that, is accepted: DeadlineExceeded after the messages.
        if r.returncode != DEADLINE_EXIT or "DeadlineExceeded" not in r.stderr:
            step.problems.append(f"a -max-time stream must end with DeadlineExceeded (exit {DEADLINE_EXIT})")
    elif r.returncode != 0:
        step.problems.append("exit status is not 0")
    if step.problems:
        return step
    try:
        msgs = json_messages(r.stdout) if key[1] not in ("list",) and not key[1].startswith("describe") else []
        if check is not None:
            check(s, step, msgs)
    except (AssertionError, ValueError, KeyError, IndexError, TypeError) as exc:
        step.problems.append(f"{type(exc).__name__}: {exc}")
    return step


def cli_argv(line: str, s: Session) -> list[str]:
    argv = shlex.split(line, comments=True)
    assert argv[0] == ".venv/bin/memsvc"
    return [*memsvc_script(), *argv[1:]]


def cli_env(s: Session, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMSVC_MANAGER"}
    env.update(COLUMNS="200", **extra)  # a wide table: rich truncates cells to the terminal width
    return env


def run_cli_line(s: Session, line: str) -> Step:
    argv = cli_argv(line, s)
    step = Step(line, argv)
    words = shlex.split(line, comments=True)[1:]
    if words[0] == "watch":
        return run_watch(s, step)
    before = tag_states(_manager(s))
    r = run(argv, env=cli_env(s, MEMSVC_MANAGER=s.up.manager_address), timeout=LINE_TIMEOUT)
    step.rc, step.stdout, step.stderr = r.returncode, r.stdout, r.stderr
    if r.returncode != 0:
        step.problems.append("exit status is not 0")
        return step
    try:
        if words[0] == "status":
            wk = _manager(s)
            row = [ln for ln in r.stdout.splitlines() if "local0" in ln]
            assert row, "status does not list local0"
            assert common_pb.WorkerState.Name(wk.state).removeprefix("WORKER_STATE_").lower() in row[0]
            assert s.up.worker_address in row[0]
        elif words[0] == "sleep":
            level = int(words[words.index("--level") + 1]) if "--level" in words else 0
            assert f"{WORKER}: asleep" in r.stdout
            slept = _expected_after_sleep({"level": f"SLEEP_LEVEL_{level}"} if level else {})
            wk = _converges(s, common_pb.WORKER_STATE_ASLEEP, slept)
            if level:
                assert wk.status.sleep_level == level
        elif words[0] == "wake":
            tags = words[words.index("--tags") + 1 :] if "--tags" in words else []
            state, after = _wake_expectation(s, tags, before)
            assert f"{WORKER}: {common_pb.WorkerState.Name(state).removeprefix('WORKER_STATE_').lower()}" in r.stdout
            _converges(s, state, after)
    except AssertionError as exc:
        step.problems.append(f"AssertionError: {exc}")
    return step


def run_watch(s: Session, step: Step) -> Step:
    """``memsvc watch`` on a terminal (a pty, so the table renders live) until it shows local0, then
    Ctrl-C (SIGINT): the README says that is how to leave, so it must exit 0."""
    master, slave = pty.openpty()
    env = cli_env(s, MEMSVC_MANAGER=s.up.manager_address, TERM="xterm")
    proc = subprocess.Popen(step.argv, cwd=REPO_ROOT, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + LINE_TIMEOUT
        while b"local0" not in out and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    break
        if b"local0" not in out:
            step.problems.append("watch never showed local0")
        proc.send_signal(signal.SIGINT)
        # read on while it exits, as a terminal does: a full pty blocks the table's last redraws, and
        # the exit waits for them (it failed this way on a loaded machine)
        deadline = time.monotonic() + STOP_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the other side closed: it is exiting
                    chunk = b""
                out += chunk
        try:
            step.rc = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            step.problems.append("watch did not exit after Ctrl-C")
        if step.rc != 0:
            step.problems.append("exit status after Ctrl-C is not 0")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        os.close(master)
    step.stdout = out.decode(errors="replace")
    return step


def scrape(address: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (smp.name, frozenset(smp.labels.items())): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    }


def default_policy(up: Up) -> bytes:
    assert up.stub is not None
    return up.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy.SerializeToString(deterministic=True)


README_GATEWAY = "http://127.0.0.1:8000"


def run_openai_snippet(gateway_url: str) -> subprocess.CompletedProcess[str]:
    """The README's Python block that uses the OpenAI SDK, as written but for the gateway's address."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "from openai import OpenAI" in b]
    assert README_GATEWAY in block, "the snippet no longer names the gateway's default address"
    return run([sys.executable, "-c", block.replace(README_GATEWAY, gateway_url)], timeout=LINE_TIMEOUT)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    lines = grpcurl_lines()
    assert lines, "the README has no grpcurl lines"
    jq = shutil.which("jq")
    if jq is None:
        pytest.skip("the README's cookbook keeps the lease id with jq, and jq is not installed")
    tools = tmp_path_factory.mktemp("tools")  # `grpcurl` and `jq` as the README's shell finds them
    (tools / "grpcurl").symlink_to(grpcurl_binary())
    (tools / "jq").symlink_to(jq)
    ports = pick_ports([int(a.rsplit(":", 1)[1]) for a in (README_MANAGER, README_WORKER, README_METRICS)])
    up = Up(tmp_path_factory.mktemp("memsvc-up") / ".memsvc", ports).start()
    s = Session(up)
    try:
        assert up.stub is not None
        s.policy_before = default_policy(up)
        for line in lines:
            s.steps.append(run_grpcurl_line(s, line, tools))
        s.policy_after = default_policy(up)
        for line in cli_lines():
            s.cli.append(run_cli_line(s, line))
        # the flag form of the same CLI (no $MEMSVC_MANAGER at all)
        flag = Step("memsvc status --manager ADDRESS", [*memsvc_script(), "status", "--manager", up.manager_address])
        r = run(flag.argv, env=cli_env(s), timeout=LINE_TIMEOUT)
        flag.rc, flag.stdout, flag.stderr = r.returncode, r.stdout, r.stderr
        if r.returncode != 0 or "local0" not in r.stdout:
            flag.problems.append("status --manager did not list local0")
        s.cli.append(flag)
        s.metrics = scrape(up.metrics_address)
        s.openai_snippet = run_openai_snippet(up.gateway_url)  # after the scrape: its lease is not the cookbook's
        up.close_channel()
        s.up_exit = up.proc.signal_and_wait(signal.SIGINT)  # Ctrl-C
        s.up_output = "\n".join(up.proc.lines)
        yield s
    finally:
        up.close()


# ---- the tests ----
def test_the_readme_has_a_cookbook_for_both_services_and_a_lease_round_trip() -> None:
    lines = grpcurl_lines()
    keys = [check_key(shlex.split(grpcurl_call(line))) for line in lines]
    assert {who for who, _ in keys} == {"manager", "worker"}, (
        f"every line addresses {README_MANAGER} or {README_WORKER}"
    )
    acquire = next(i for i, k in enumerate(keys) if k == ("manager", "AcquireWorker"))
    capture = _CAPTURE.fullmatch(lines[acquire])
    assert capture and capture.group("var") == "LEASE_ID", "the AcquireWorker line keeps the id in $LEASE_ID"
    release = next(i for i, k in enumerate(keys) if k == ("manager", "ReleaseWorker"))
    assert release > acquire and "$LEASE_ID" in lines[release], "ReleaseWorker must use the $LEASE_ID kept"


def test_the_cookbook_cleans_up_after_itself(session: Session) -> None:
    """It used to leave its lease (a LEASE_ID placeholder) and then sleep the leased worker directly,
    and its UpdatePolicy changed the user's default for good (the policy persists in the store)."""
    assert session.leases_at_direct_sleep and set(session.leases_at_direct_sleep) == {0}, (
        f"the worker was leased when the cookbook slept it directly: {session.leases_at_direct_sleep}"
    )
    assert session.policy_after == session.policy_before, "the cookbook must put the default policy back"


def test_every_grpcurl_line_runs_as_written_and_has_its_effect(session: Session) -> None:
    bad = [st for st in session.steps if st.problems and st.line not in KNOWN_BUGS]
    assert not bad, "\n\n".join(st.report() for st in bad)
    assert len(session.steps) == len(grpcurl_lines())


def test_cli_lines_operate_the_running_pair(session: Session) -> None:
    ran = [st.line for st in session.cli]
    for sub in ("status", "sleep", "wake", "watch"):
        assert any(f"memsvc {sub}" in line for line in ran), f"the README has no `memsvc {sub}` line"
    bad = [st for st in session.cli if st.problems]
    assert not bad, "\n\n".join(st.report() for st in bad)


def test_the_openai_snippet_prints_the_default_models_text(session: Session) -> None:
    """Run as written against ``memsvc up``'s gateway (its synthetic model, which has a tokenizer and
    a chat template), the README's OpenAI block prints text."""
    r = session.openai_snippet
    assert r is not None and r.returncode == 0, r
    assert r.stdout.strip(), f"no text printed: {r.stdout!r} {r.stderr!r}"


def test_metrics_endpoint_reports_the_worker(session: Session) -> None:
    assert session.metrics.get(("memsvc_worker_up", frozenset({("worker", "local0")}))) == 1.0
    assert session.metrics.get(("memsvc_leases_granted_total", frozenset())) == 1.0


def test_ctrl_c_stops_both_and_exits_0(session: Session) -> None:
    assert session.up_exit == 0, session.up.proc.failure(f"memsvc up exited {session.up_exit} after SIGINT")
    assert "memsvc manager stopped" in session.up_output
    assert "memsvc worker local0 stopped" in session.up_output


def test_state_dir_holds_the_manager_database(session: Session) -> None:
    argv = session.up.proc.argv
    assert argv[: len(MEMSVC) + 1] == [*MEMSVC, "up"]
    assert (Path(argv[argv.index("--state-dir") + 1]) / "manager.db").is_file()
