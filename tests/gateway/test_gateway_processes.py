"""``memsvc gateway --processes 2`` with real processes: a manager, a worker serving a tiny text model
(host backend) and the gateway's supervisor with its two children on one port, driven by the
``openai`` SDK. Every request gets the worker's own greedy tokens whichever child serves it;
``/metrics`` counts every child's requests; SIGTERM drains a stream in flight and stops every
child; a child that dies stops the gateway (exit 1, the port closed); a supervisor killed outright
takes its children with it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_env import MODEL, PROMPT, text_model_served, wait_for
from gatewayproc import GatewayProcess
from managerproc import ManagerProcess
from workerproc import WorkerProcess

from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

openai = pytest.importorskip("openai")


class Host:
    def __init__(self, manager: ManagerProcess, worker: WorkerProcess) -> None:
        self.manager, self.worker = manager, worker

    def leases(self) -> int:
        r = self.manager.stub.GetWorker(manager_pb.GetWorkerRequest(name="workers/gp0"), timeout=10)
        return int(r.worker.lease_count)

    def gateway(self) -> GatewayProcess:
        return GatewayProcess(self.manager.address, ["--processes", "2"]).start()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    with text_model_served(tmp_path_factory.mktemp("gateway-processes"), "gp0") as (mp, wp, _):
        yield Host(mp, wp)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (their parent, from each /proc/PID/stat)."""
    out: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def listening_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on: its sockets' inodes (/proc/PID/fd) matched with the
    listening entries of /proc/PID/net/tcp and tcp6."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def metric(url: str, name: str) -> float:
    """The sum of one metric's samples, from a fresh connection (any child may answer it)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(x) for x in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_every_child_serves_the_port_and_metrics_count_them_all(host: Host) -> None:
    gw = host.gateway()
    try:
        kids = children(gw.pid)
        assert len(kids) == 2, kids
        port = int(gw.url.rsplit(":", 1)[1])
        assert [listening_ports(k) for k in kids] == [{port}, {port}], "each child listens on the port"
        assert listening_ports(gw.pid) == set(), "the supervisor only holds the port"
        want = host.worker.stub.Generate(worker_pb.GenerateRequest(prompt=PROMPT, max_new_tokens=8), timeout=60)
        texts: list[str] = []
        errors: list[BaseException] = []

        def one(streamed: bool) -> None:
            # a client of its own: a connection of its own, which either child may take
            with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
                try:
                    if streamed:
                        s = client.completions.create(
                            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
                        )
                        texts.append("".join(ch.choices[0].text for ch in s if ch.choices))
                    else:
                        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
                        texts.append(r.choices[0].text)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

        threads = [threading.Thread(target=one, args=(k % 2 == 0,)) for k in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert texts == [want.text] * 12
        for _ in range(6):
            assert metric(gw.url, "memsvc_gateway_requests_total") == 12
            assert metric(gw.url, "memsvc_gateway_completion_tokens_total") == 12 * len(want.token_ids)
        wait_for(host.leases, lambda n: n == 0, "every lease back")
    finally:
        assert gw.stop() == 0
    assert not any(alive(k) for k in kids), "every child stopped with the supervisor"
    assert refused(gw.url)


def test_sigterm_lets_a_stream_in_flight_finish_and_stops_every_child(host: Host) -> None:
    gw = host.gateway()
    try:
        kids = children(gw.pid)
        want = host.worker.stub.Generate(
            worker_pb.GenerateRequest(prompt=PROMPT, max_new_tokens=64, ignore_eos=True), timeout=60
        )
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            stream = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            chunks = iter(stream)
            first = next(chunks)
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGTERM)
            text = first.choices[0].text + "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want.text, "the stream in flight ended whole"
        assert gw.wait(30) == 0
    finally:
        gw.kill()
    assert not any(alive(k) for k in kids)
    wait_for(host.leases, lambda n: n == 0, "the stream's lease back")


def test_a_child_that_dies_stops_the_gateway(host: Host) -> None:
    gw = host.gateway()
    kids = children(gw.pid)
    try:
        os.kill(kids[0], signal.SIGKILL)
        assert gw.wait(30) == 1
        assert "exited with -9: stopping the others" in gw.stderr_text()
        wait_for(lambda: [k for k in kids if alive(k)], lambda left: not left, "the other child to stop")
        assert refused(gw.url)
    finally:
        _kill_all(gw, kids)


def test_a_supervisor_killed_outright_takes_its_children_with_it(host: Host) -> None:
    gw = host.gateway()
    kids = children(gw.pid)
    try:
        gw.kill()
        # re-parented, each child sees its stdin end and stops
        wait_for(lambda: [k for k in kids if alive(k)], lambda left: not left, "the children to stop")
        wait_for(lambda: refused(gw.url), bool, "the port to close")
    finally:
        _kill_all(gw, kids)


def _kill_all(gw: GatewayProcess, kids: list[int]) -> None:
    """Whatever a failed test left running goes, so the next test's gateway starts clean."""
    gw.kill()
    for kid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(kid, signal.SIGKILL)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_port_that_is_taken_is_one_line_and_exit_1(processes: int) -> None:
    """One process or several: the port is bound before anything serves on it, so a taken one is
    one line naming it, not a server's traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        argv = [
            sys.executable,
            "-m",
            "memsvc.cli",
            "gateway",
            "--listen",
            listen,
            "--manager",
            "127.0.0.1:1",
            "--processes",
            str(processes),
        ]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"memsvc gateway: could not serve on {listen}: Address already in use" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
