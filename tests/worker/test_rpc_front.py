"""``memsvc worker --rpc-front process``: the public gRPC server in a child process (worker/rpc_front.py)
gives the same answers as the worker's own (``inline``), and its life is the worker's.

Real workers on the host backend: the same requests to one of each, compared message for message
(tokens, text, ends, statuses with their ErrorInfo); a stream whose client leaves gives its blocks
back; SIGTERM drains a stream in flight through the front, then both processes are gone; a killed
worker takes its front along, and a lost front stops the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from managerproc import wait_for
from workerproc import WorkerProcess

from memsvc.runtime.auth import Security
from memsvc.runtime.rpc_errors import error_info
from memsvc.runtime.serving import start_server
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc
from worker.rpc_front import SERVICE, FrontConfig, FrontProcess

PROCESS = ["--rpc-front", "process"]


def _front_pid(worker: WorkerProcess) -> int:
    """The front: the worker's one child process running worker.rpc_front."""
    assert worker.proc is not None
    children = Path(f"/proc/{worker.proc.pid}/task/{worker.proc.pid}/children").read_text().split()
    fronts = [int(p) for p in children if b"worker.rpc_front" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(fronts) == 1, children
    return fronts[0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie until its parent reaps it (the worker, or init once the worker is gone) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.fixture(scope="module")
def fronts() -> Iterator[dict[str, WorkerProcess]]:
    """One worker of each kind, same model and seed."""
    with (
        WorkerProcess(["--seed", "5", "--rpc-front", "inline"]) as inline,
        WorkerProcess(["--seed", "5", *PROCESS]) as process,
    ):
        yield {"inline": inline, "process": process}


def _requests() -> list[worker_pb.GenerateRequest]:
    return [
        worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4], max_new_tokens=40, ignore_eos=True),
        worker_pb.GenerateRequest(
            prompt_token_ids=list(range(5, 60)),
            max_new_tokens=25,
            sampling=worker_pb.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7),
        ),
        worker_pb.GenerateRequest(
            prompt_token_ids=[9, 8, 7], max_new_tokens=30, stop_token_ids=[3, 11, 17], ignore_eos=True
        ),
        # text: the front encodes and decodes it in its own process, the inline worker in its own
        worker_pb.GenerateRequest(prompt="the front reads the text", max_new_tokens=30, ignore_eos=True),
        worker_pb.GenerateRequest(
            messages=[worker_pb.ChatMessage(role="user", content="héllo 😀")], max_new_tokens=20, ignore_eos=True
        ),
        worker_pb.GenerateRequest(
            prompt="stop strings", max_new_tokens=60, stop=["e", "th"], sampling=worker_pb.SamplingParams(seed=3)
        ),
        worker_pb.GenerateRequest(prompt_token_ids=[300, 301], max_new_tokens=40, stop_token_ids=[352, 12]),
    ]


Answer = tuple[list[int], str, worker_pb.GenerateResponse]


def _stream(stub: worker_grpc.ModelWorkerServiceStub, request: worker_pb.GenerateRequest) -> Answer:
    messages = list(stub.GenerateStream(worker_pb.GenerateStreamRequest(request=request), timeout=60))
    assert messages[-1].HasField("done") and not any(m.HasField("done") for m in messages[:-1])
    done = messages[-1].done
    assert messages[0].prompt_token_count == done.prompt_token_count > 0
    if request.prompt_token_ids:
        assert done.prompt_token_count == len(request.prompt_token_ids)
    assert all(m.prompt_token_count == 0 for m in messages[1:])
    done.ClearField("duration")
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages), done


def test_streams_and_unary_answers_are_the_same_through_either_front(fronts: dict[str, WorkerProcess]) -> None:
    for request in _requests():
        answers = {}
        for kind, worker in fronts.items():
            tokens, text, done = _stream(worker.stub, request)
            unary = worker.stub.Generate(request, timeout=60)
            unary.ClearField("duration")
            assert tokens == list(done.token_ids) == list(unary.token_ids), kind
            assert text == done.text == unary.text, kind
            assert done == unary, kind
            answers[kind] = (tokens, text, done)
        assert answers["inline"] == answers["process"]
        assert len(answers["process"][0]) > 0
        if request.prompt or request.messages:
            assert answers["process"][1], "no text came back"
        if request.stop:
            assert answers["process"][2].matched_stop, "the stop strings never matched: the case tests nothing"
        if 352 in request.stop_token_ids:  # its text is left out, at once in the stream too
            assert answers["process"][2].finish_reason == common_pb.FINISH_REASON_STOP, "the case tests nothing"


def _status(call: object) -> tuple[grpc.StatusCode, str, str, dict[str, str]]:
    assert isinstance(call, grpc.RpcError)
    info = error_info(call)
    assert info is not None, call
    return call.code(), call.details() or "", info.reason, dict(info.metadata)


def test_errors_keep_their_status_and_error_info(fronts: dict[str, WorkerProcess]) -> None:
    bad_token = worker_pb.GenerateRequest(prompt_token_ids=[10**9], max_new_tokens=3)
    two_forms = worker_pb.GenerateRequest(prompt_token_ids=[1], prompt="hi", max_new_tokens=3)
    empty_stop = worker_pb.GenerateRequest(prompt="hi", max_new_tokens=3, stop=[""])  # the front's check
    got: dict[str, list[tuple[grpc.StatusCode, str, str, dict[str, str]]]] = {}
    for kind, worker in fronts.items():
        out = []
        for request in (bad_token, two_forms, empty_stop):
            with pytest.raises(grpc.RpcError) as streamed:
                list(worker.stub.GenerateStream(worker_pb.GenerateStreamRequest(request=request), timeout=30))
            out.append(_status(streamed.value))
            with pytest.raises(grpc.RpcError) as unary:
                worker.stub.Generate(request, timeout=30)
            out.append(_status(unary.value))
        with pytest.raises(grpc.RpcError) as sleep:
            worker.stub.Sleep(worker_pb.SleepRequest(level=7), timeout=30)  # type: ignore[arg-type]
        out.append(_status(sleep.value))
        with pytest.raises(grpc.RpcError) as free:
            worker.stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="never-made"), timeout=30)
        out.append(_status(free.value))
        got[kind] = out
    assert got["inline"] == got["process"]
    assert [code for code, *_ in got["process"]] == [grpc.StatusCode.INVALID_ARGUMENT] * 7 + [grpc.StatusCode.NOT_FOUND]


def test_a_client_that_leaves_mid_stream_gives_its_blocks_back(fronts: dict[str, WorkerProcess]) -> None:
    worker = fronts["process"]
    total = worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.kv_cache.device_block_count
    long = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=2000, ignore_eos=True)
    channel = worker.new_channel()
    try:
        call = worker_grpc.ModelWorkerServiceStub(channel).GenerateStream(
            worker_pb.GenerateStreamRequest(request=long), timeout=120
        )
        first = next(call)
        assert first.token_ids
        held = worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.kv_cache.device_free_block_count
        assert held < total
        call.cancel()
    finally:
        channel.close()

    def freed() -> bool:
        kv = worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.kv_cache
        return kv.device_free_block_count == total and kv.sequence_count == 0

    wait_for(freed, bool, timeout=60, what="the blocks of the stream whose client left")
    tokens, _, _ = _stream(worker.stub, _requests()[0])
    assert len(tokens) == 40


def test_status_telemetry_and_health_pass_through(fronts: dict[str, WorkerProcess]) -> None:
    from grpc_health.v1 import health_pb2

    worker = fronts["process"]
    status = worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30).status
    assert status.worker_id == worker.worker_id and status.model.vocab_size > 0
    telemetry = worker.stub.StreamTelemetry(worker_pb.StreamTelemetryRequest(), timeout=30)
    first = next(telemetry)
    assert first.snapshot.worker_id == worker.worker_id
    telemetry.cancel()
    for service in ("", "memsvc.v1.ModelWorkerService"):
        answer = worker.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_drains_a_stream_through_the_front_then_both_exit() -> None:
    # a drain as long as the stream may take on a loaded machine (the default 30 s cancelled it there)
    with WorkerProcess([*PROCESS, "--drain-timeout", "600"]) as worker:
        front = _front_pid(worker)
        request = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=600, ignore_eos=True)
        stream = worker.stub.GenerateStream(worker_pb.GenerateStreamRequest(request=request), timeout=600)
        first = next(stream)
        result: dict[str, object] = {}

        def read() -> None:
            try:
                rest = list(stream)
                result["tokens"] = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
                result["done"] = rest[-1].HasField("done")
            except grpc.RpcError as exc:
                result["error"] = exc

        reader = threading.Thread(target=read)
        reader.start()
        worker.terminate()  # the drain lets the stream end
        reader.join(timeout=600)
        assert result == {"tokens": 600, "done": True}
        assert worker.wait(timeout=60) == 0
        assert "stopped" in worker.lines[-1]
        wait_for(lambda: _gone(front), bool, timeout=30, what="the front's exit")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR of its own for a worker, short: a unix socket's path has at most 107 bytes, and a
    worker's socket is <TMPDIR>/memsvc-worker-XXXXXXXX/device.sock."""
    path = Path(tempfile.mkdtemp(prefix="ms", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_killed_worker_takes_its_front_along_and_leaves_no_socket_directory(short_tmp: Path) -> None:
    """SIGKILL leaves the worker no time to remove its socket's directory (one per start: the suite's
    killed workers left hundreds in /tmp); its front, which outlives it briefly, removes it."""
    with WorkerProcess(PROCESS, env={"TMPDIR": str(short_tmp)}) as worker:
        (sockets,) = short_tmp.glob("memsvc-worker-*")
        assert (sockets / "device.sock").is_socket()
        front = _front_pid(worker)
        worker.kill()
        # (the front removes the directory once it sees the worker gone, then exits)
        wait_for(lambda: _gone(front), bool, timeout=90, what="the front's exit after the worker's")
    assert not sockets.exists()


def test_a_lost_front_stops_the_worker(short_tmp: Path) -> None:
    with WorkerProcess(PROCESS, env={"TMPDIR": str(short_tmp)}) as worker:
        os.kill(_front_pid(worker), signal.SIGKILL)
        assert worker.wait(timeout=60) == 1
        assert "the RPC front exited" in worker.stderr_text()
    assert list(short_tmp.glob("memsvc-worker-*")) == [], "the worker removed its socket's directory"


@pytest.mark.parametrize("front", ["inline", "process"])
def test_a_taken_port_is_a_usage_error(front: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "memsvc.cli",
                "worker",
                "--backend",
                "host",
                "--listen",
                f"127.0.0.1:{port}",
                "--rpc-front",
                front,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"cannot listen on '127.0.0.1:{port}'" in r.stderr, r.stderr


def test_a_front_whose_worker_left_before_it_listened_exits_quietly(tmp_path: Path) -> None:
    """A worker stopped while its front starts (``memsvc up`` stopping everything because a sibling
    failed) is gone before the front says where it listens: the front then stops at once, exit 0, no
    traceback (a BrokenPipeError one was printed). The read end of its stdout is closed before it can
    write, so the pipe is broken whatever the timing."""
    config = FrontConfig("127.0.0.1:0", f"unix:{tmp_path / 'no-device.sock'}", 0.0, dataclasses.asdict(Security()))
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "worker.rpc_front"],
            input=json.dumps(dataclasses.asdict(config)),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_a_front_whose_worker_left_before_it_sent_the_configuration_exits_quietly() -> None:
    """The earlier window of the same race: the worker is gone before it wrote the front's one line
    of configuration (its stdin ends at once); the front exits 0 without a traceback."""
    r = subprocess.run([sys.executable, "-m", "worker.rpc_front"], input="", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_the_front_says_it_serves_once_its_own_health_answers_serving(tmp_path: Path) -> None:
    """The worker says "ready" when its front tells it that it serves (worker/main.py), so a client
    that checks the front's health on the word finds SERVING. It found NOT_SERVING once in ~25 loaded
    runs of test_worker_service's health test, when "ready" followed the device process's own health
    and the front mirrored it a moment later. Here a real front before a device-side server whose
    health is set by hand: NOT_SERVING mirrored and not told; SERVING told only once the front's own
    Check answers it."""

    async def scenario() -> None:
        device = f"unix:{tmp_path / 'device.sock'}"
        inner = await start_server(device, [], [SERVICE.full_name])
        for name in ("", SERVICE.full_name):
            await inner.set_serving(False, name)
        front: FrontProcess | None = None
        told: asyncio.Future[bool] | None = None
        try:
            front = await FrontProcess.start(FrontConfig("127.0.0.1:0", device, 0.0, dataclasses.asdict(Security())))
            told = asyncio.ensure_future(front.serving())
            async with grpc.aio.insecure_channel(front.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE.full_name))
                first = await watch.read()  # the front's own state before the device process's is mirrored
                assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert not told.done(), "NOT_SERVING is not told"
                for name in ("", SERVICE.full_name):
                    await inner.set_serving(True, name)
                assert await asyncio.wait_for(told, 60)
                for name in ("", SERVICE.full_name):
                    answer = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
                    assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
                watch.cancel()
        finally:
            if told is not None:
                told.cancel()
            if front is not None:
                await front.stop(0)
            await inner.stop(0)

    asyncio.run(scenario())
