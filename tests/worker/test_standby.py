"""Standby workers (worker/standby.py): ``memsvc worker --standby`` prepared before it knows its
model, then handed its flags on stdin, serving exactly as a worker started with them; and ``memsvc
up --config`` with ``[workers] standby = true``, which keeps one per device and starts the next worker
there from it (a restart after a crash here), run as users run them, on the host backend.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from childproc import Proc
from hostproc import Host, awake, worker_pid
from upproc import wait_for
from workerproc import _LISTENING, _READY, READY_TIMEOUT, WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

STANDBY_READY = re.compile(r"^memsvc worker standby ready on (?P<where>\S+) in [\d.]+ s; waiting for its flags$")
FLAGS = ["--listen", "127.0.0.1:0", "--backend", "host", "--model", "synthetic:tiny", "--seed", "3"]
"""A worker's flags; the standby test hands them with ``--log-format json``, which must then apply."""
REQUEST = worker_pb.GenerateRequest(prompt_token_ids=[5, 9, 2, 7], max_new_tokens=8)


def standby(*args: str) -> Proc:
    """``memsvc worker --standby --backend host``, started, once it says it is ready."""
    proc = Proc(
        [sys.executable, "-m", "memsvc.cli", "worker", "--standby", "--backend", "host", *args],
        name="standby",
        new_session=False,
        stdin=True,
    )
    proc.start()
    (ready,) = proc.wait_lines([STANDBY_READY], READY_TIMEOUT)
    assert ready["where"] == "host"
    return proc


@pytest.fixture
def reference_tokens() -> Iterator[list[int]]:
    """The tokens a worker started with FLAGS on its command line answers REQUEST with."""
    with WorkerProcess(FLAGS) as wp:
        yield list(wp.stub.Generate(REQUEST, timeout=60).token_ids)


def fronts(parent: int) -> list[int]:
    """The pids of ``parent``'s RPC front processes (``python -m worker.rpc_front``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"worker.rpc_front" in argv:
            found.append(int(entry.name))
    return found


def test_a_standby_handed_its_flags_serves_as_the_worker_they_name(reference_tokens: list[int]) -> None:
    """...with the RPC front it started ahead (its process and imports done while it waited), and
    logging as the handed flags say."""
    proc = standby()
    try:
        assert not any(_LISTENING.match(line) for line in proc.lines), "a standby listens only once it has flags"
        ahead = fronts(proc.pid)
        assert len(ahead) == 1, ahead
        proc.write_stdin(json.dumps([*FLAGS, "--log-format", "json"]) + "\n")
        listening, _ = proc.wait_lines([_LISTENING, _READY], READY_TIMEOUT)
        assert fronts(proc.pid) == ahead, "the worker started a front of its own"
        wp = WorkerProcess(FLAGS)
        wp.address = listening["address"]
        try:
            assert (
                wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.state
                == common_pb.WORKER_STATE_AWAKE
            )
            assert list(wp.stub.Generate(REQUEST, timeout=60).token_ids) == reference_tokens
        finally:
            wp.close_channel()
        assert proc.signal_and_wait(signal.SIGTERM) == 0
        assert proc.lines[-1].endswith(" stopped"), proc.lines[-3:]
        logged = [line for line in proc.stderr_text().splitlines() if "weights:" in line]
        assert logged and json.loads(logged[0])["logger"], "the handed flags' --log-format did not apply"
    finally:
        proc.close()


def test_a_standby_reads_its_checkpoint_at_once_and_stages_none_of_it(tmp_path: Path) -> None:
    """The staging (worker/staging.py) fills a spawn's wait for the model layer's import, which a
    standby has done: there it would only stand between the load and the page cache. The tokens are a
    spawned worker's, whose load copies from the staging."""
    from bench.bench_gateway import write_checkpoint

    ckpt = tmp_path / "tiny"
    write_checkpoint(ckpt, "tiny", "cpu")
    flags = ["--listen", "127.0.0.1:0", "--backend", "host", "--model", str(ckpt)]
    with WorkerProcess(flags) as spawned:
        expected = list(spawned.stub.Generate(REQUEST, timeout=60).token_ids)
    proc = standby()
    try:
        proc.write_stdin(json.dumps(flags) + "\n")
        listening, _ = proc.wait_lines([_LISTENING, _READY], READY_TIMEOUT)
        wp = WorkerProcess(flags)
        wp.address = listening["address"]
        try:
            assert list(wp.stub.Generate(REQUEST, timeout=60).token_ids) == expected
        finally:
            wp.close_channel()
        err = proc.stderr_text()
        assert "checkpoint staging: none (the model layer was imported before this start)" in err, err
        assert "GB on the device" not in err and "weights:" in err
        assert proc.signal_and_wait(signal.SIGTERM) == 0
    finally:
        proc.close()


def test_a_standby_handed_an_inline_front_ends_the_front_it_started_ahead() -> None:
    proc = standby()
    try:
        (ahead,) = fronts(proc.pid)
        proc.write_stdin(json.dumps([*FLAGS, "--rpc-front", "inline"]) + "\n")
        proc.wait_lines([_LISTENING, _READY], READY_TIMEOUT)
        assert fronts(proc.pid) == [] and not Path(f"/proc/{ahead}").exists()
        assert proc.signal_and_wait(signal.SIGTERM) == 0
    finally:
        proc.close()


def test_a_standby_that_is_not_needed_exits_0_at_the_end_of_its_input_or_a_signal() -> None:
    """...and the front it started ahead ends with it (its input ends)."""
    for end in (None, signal.SIGTERM, signal.SIGINT):
        proc = standby()
        try:
            (ahead,) = fronts(proc.pid)
            if end is None:
                proc.write_stdin("")
                assert proc.wait() == 0, proc.failure("exit code at the end of its input")
            else:
                assert proc.signal_and_wait(end) == 0, proc.failure(f"exit code after {end.name}")
            assert "Traceback" not in proc.stderr_text()
            gone = Path(f"/proc/{ahead}/cmdline")
            wait_for(gone.exists, lambda alive: not alive, what="the front started ahead to end")
        finally:
            proc.close()


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (
            json.dumps([*FLAGS, "--device", "1"]),
            "prepared for --backend host --device 0; its flags name --backend host --device 1",
        ),
        (json.dumps(["--listen", "127.0.0.1:0", "--model", "synthetic:tiny"]), "its flags name --backend auto"),
        ("--model synthetic:tiny", "the standby's flags line is not JSON"),
        (json.dumps({"model": "synthetic:tiny"}), "must be a JSON list of strings"),
        (json.dumps([*FLAGS, "--standby"]), "cannot ask for another standby"),
        (json.dumps([*FLAGS, "--kv-blocks", "0"]), "--kv-blocks"),
    ],
)
def test_flags_a_standby_cannot_serve_are_one_error_line_and_exit_2(line: str, error: str) -> None:
    proc = standby()
    try:
        proc.write_stdin(line + "\n")
        assert proc.wait() == 2, proc.failure("exit code")
        err = proc.stderr_text()
        assert error in err and "Traceback" not in err, err
        assert not any(_LISTENING.match(x) for x in proc.lines)
    finally:
        proc.close()


def test_memsvc_up_keeps_a_standby_and_restarts_a_dead_worker_from_it(tmp_path: Path) -> None:
    """Two models on one simulated device with ``[workers] standby = true``: a standby is kept beside
    them; a worker killed outright is started again from it (its flags on the standby's stdin), put to
    sleep once loaded beside the one awake, and serves; a new standby takes its place; Ctrl-C stops
    every process, the standby included."""
    h = Host(tmp_path, ("alpha", "beta"), workers="standby = true")
    h.proc.start()
    try:
        wait_for(lambda: h.listed(), lambda ids: ids == ["alpha", "beta"], what="both models listed", timeout=120)
        assert h.proc.proc is not None
        up = h.proc.proc.pid
        h.proc.wait_lines([STANDBY_READY], READY_TIMEOUT)
        assert h.text("alpha")
        wait_for(lambda: awake(h), lambda names: names == ["alpha"], what="alpha awake and only it")
        # beta, the second model of the device, started from the standby kept since alpha started
        started = re.compile(r"^memsvc up: worker beta started from the standby \(pid (?P<pid>\d+)\)$")

        def from_standby() -> list[int]:
            return [int(mt["pid"]) for line in list(h.proc.lines) if (mt := started.match(line))]

        (pid,) = from_standby()
        assert worker_pid(up, "beta") is None, "beta started as a process of its own"
        before = h.workers()["beta"].address
        standbys = len([line for line in h.proc.lines if STANDBY_READY.match(line)])
        os.kill(pid, signal.SIGKILL)
        pids = wait_for(from_standby, lambda ps: len(ps) == 2, what="beta started again from the standby")
        new_pid = pids[1]
        assert new_pid != pid and Path(f"/proc/{new_pid}").exists()
        wait_for(
            lambda: h.workers()["beta"],
            lambda wk: wk.address != before and wk.state == common_pb.WORKER_STATE_ASLEEP,
            what="beta registered again from the standby, then put to sleep",
            timeout=120,
        )
        assert h.text("beta")
        wait_for(
            lambda: len([line for line in h.proc.lines if STANDBY_READY.match(line)]),
            lambda n: n > standbys,
            what="a new standby in its place",
            timeout=READY_TIMEOUT,
        )
        # (a worker started from a standby keeps the standby's command line)
        kept = [
            p for p in Path("/proc").iterdir() if p.name.isdigit() and p.name != str(new_pid) and _standby_of(p, up)
        ]
        assert len(kept) == 1, f"memsvc up keeps one standby per device, not {len(kept)}"
        assert h.proc.signal_and_wait(signal.SIGINT) == 0
        assert not Path(f"/proc/{new_pid}").exists(), "the worker started from the standby outlived memsvc up"
        assert not kept[0].exists(), "the standby outlived memsvc up"
    finally:
        h.channel.close()
        h.proc.kill()


def _standby_of(entry: Path, parent: int) -> bool:
    """Whether /proc's ``entry`` is a standby worker that ``parent`` started."""
    try:
        ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        return ppid == parent and b"--standby" in (entry / "cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False
