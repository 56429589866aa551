"""What a caller reaches without credentials, with real processes (``memsvc worker``, ``memsvc manager``):

* ``grpc.health.v1.Health/Watch``: exempt from the token like Check, and it must *work*: its handler
  (grpcio-health-checking's aio servicer) is a coroutine that writes with ``context.write()``, not an
  async generator, and the error mapping used to iterate it (INTERNAL, "'async for' requires an
  object with __aiter__"). Checked with the grpc client and with grpcurl.
* unknown methods: with a token configured they answer ``UNAUTHENTICATED`` to a caller without a
  valid token, exactly like known ones, so method names cannot be probed; with a valid token (or no
  token configured) ``UNIMPLEMENTED``. Every call type, including a client stream that never sends.
* the manager's HTTP port (``--metrics-listen``): ``/metrics`` needs ``Authorization: Bearer <token>``
  when the manager has a token (401 with ``WWW-Authenticate: Bearer`` otherwise), ``/healthz`` answers
  ``ok`` without one, anything else is 404. Checked with urllib and with curl.

The error mapping of coroutine-style streaming handlers (status + ErrorInfo, undecodable requests)
is checked in process at the end, since no real handler fails that way on purpose.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import yaml
from google.protobuf import descriptor_pb2, duration_pb2, empty_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from managerproc import ManagerProcess
from prometheus_client.parser import text_string_to_metric_families
from upproc import grpcurl_binary, json_messages
from upproc import health_protoset as write_health_protoset
from workerproc import REPO_ROOT, WorkerProcess

from memsvc import DOMAIN, error_info
from memsvc.errors import WrongState
from memsvc.runtime.auth import Security, channel
from memsvc.runtime.rpc_errors import Context, ErrorMappingInterceptor
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

TOKEN = "surface-token-for-tests"
CALL_TIMEOUT = 10.0
GRPCURL_EXIT = {code: 64 + code.value[0] for code in grpc.StatusCode}
"""grpcurl's exit status for a call that ended with a status: 64 + the code."""
SERVICE = {
    "worker": worker_pb.DESCRIPTOR.services_by_name["ModelWorkerService"].full_name,
    "manager": manager_pb.DESCRIPTOR.services_by_name["MemoryManagerService"].full_name,
}
KINDS = ("worker", "manager")
CELLS = {"open": None, "no token": None, "wrong token": "not-the-token", "right token": TOKEN}
"""open: a server without a token; the others: a server with TOKEN, called with that token (or none)."""


@dataclass
class Target:
    address: str
    metrics_url: str = ""

    @property
    def http(self) -> str:
        """``http://host:port`` of the manager's HTTP port."""
        return self.metrics_url.removesuffix("/metrics")


# ---- fixtures ----
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("surface")


@pytest.fixture(scope="module")
def token_file(base: Path) -> Path:
    path = base / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def servers(base: Path, token_file: Path) -> Iterator[dict[tuple[str, bool], Target]]:
    """{(kind, with token): target}: a worker and a manager (with --metrics-listen), each without and with a token."""
    procs: dict[tuple[str, bool], WorkerProcess | ManagerProcess] = {}
    for tokened in (False, True):
        flags = ["--token-file", str(token_file)] if tokened else []
        suffix = "token" if tokened else "open"
        procs[("worker", tokened)] = WorkerProcess([*flags, "--worker-id", f"surface-{suffix}"])
        procs[("manager", tokened)] = ManagerProcess(base / f"manager-{suffix}.db", flags, metrics=True)
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            for f in [pool.submit(p.start) for p in procs.values()]:
                f.result()
        yield {
            key: Target(p.address, p.metrics_url if isinstance(p, ManagerProcess) else "") for key, p in procs.items()
        }
    finally:
        for p in procs.values():
            p.close()


def target_for(servers: dict[tuple[str, bool], Target], kind: str, cell: str) -> Target:
    return servers[(kind, cell != "open")]


@pytest.fixture(scope="module")
def grpcurl() -> str:
    try:
        return grpcurl_binary()
    except AssertionError as exc:
        pytest.skip(str(exc))


def run_grpcurl(grpcurl: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl, *args], capture_output=True, text=True, timeout=60, check=False)


def assert_refused(err: grpc.RpcError, code: grpc.StatusCode) -> None:
    assert err.code() == code, f"{err.code()}: {err.details()}"
    info = error_info(err)
    assert info is not None, "the refusal carries no ErrorInfo"
    assert (info.reason, info.domain) == (code.name, DOMAIN)


# ---- A. Health/Watch ----
@pytest.mark.parametrize("tokened", [False, True], ids=["open", "token"])
@pytest.mark.parametrize("kind", KINDS)
def test_health_watch_streams_the_status(servers: dict[tuple[str, bool], Target], kind: str, tokened: bool) -> None:
    """Watch answers its first message at once: SERVING for the server and the service, SERVICE_UNKNOWN for
    another name. No token is sent, also to the tokened servers: health is exempt."""
    want = {
        "": health_pb2.HealthCheckResponse.SERVING,
        SERVICE[kind]: health_pb2.HealthCheckResponse.SERVING,
        "no.such.Service": health_pb2.HealthCheckResponse.SERVICE_UNKNOWN,
    }
    with grpc.insecure_channel(servers[(kind, tokened)].address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service, status in want.items():
            stream = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
            try:
                first = next(stream)
            except grpc.RpcError as err:
                pytest.fail(f"Watch({service!r}) on the {kind}: {err.code()}: {err.details()}")
            finally:
                stream.cancel()
            assert first.status == status, f"Watch({service!r}) on the {kind}"
        # the server is unharmed: a cancelled watcher leaves Check (and a new Watch) working
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT).status == want[""]


@pytest.fixture(scope="module")
def health_protoset(base: Path) -> Path:
    return write_health_protoset(base)


@pytest.mark.parametrize("tokened", [False, True], ids=["open", "token"])
@pytest.mark.parametrize("kind", KINDS)
def test_grpcurl_health_watch(
    servers: dict[tuple[str, bool], Target], grpcurl: str, health_protoset: Path, kind: str, tokened: bool
) -> None:
    """The stream prints SERVING and stays open until ``-max-time`` ends it (DEADLINE_EXCEEDED)."""
    r = run_grpcurl(
        grpcurl,
        [
            "-plaintext",
            "-protoset",
            str(health_protoset),
            "-max-time",
            "2",
            "-d",
            f'{{"service": "{SERVICE[kind]}"}}',
            servers[(kind, tokened)].address,
            "grpc.health.v1.Health/Watch",
        ],
    )
    assert "Internal" not in r.stderr, r.stderr
    assert r.returncode in (0, GRPCURL_EXIT[grpc.StatusCode.DEADLINE_EXCEEDED]), r.stdout + r.stderr
    assert json_messages(r.stdout)[:1] == [{"status": "SERVING"}], r.stdout + r.stderr


# ---- B. unknown methods ----
UNKNOWN_METHODS = ("/memsvc.v1.ModelWorkerService/Nope", "/memsvc.v1.MemoryManagerService/Nope", "/no.such.Service/M")


def raw(data: bytes) -> bytes:
    """The identity (de)serialiser: calls without a schema, as for a method nobody defines."""
    return data


CALL_TYPES = ("unary_unary", "unary_stream", "stream_unary", "stream_stream", "stream, none sent", "stream, silent")


def call_raw(ch: grpc.Channel, method: str, call_type: str) -> grpc.RpcError | None:
    """Call ``method`` as ``call_type`` with raw bytes; the error it ends with (None if it succeeded).

    "none sent": a client stream closed without a message; "silent": one that sends nothing and keeps
    its side open. A refusal that waited for a request message would end both as DEADLINE_EXCEEDED.
    """
    hold = threading.Event()

    def silent() -> Iterator[bytes]:
        hold.wait(CALL_TIMEOUT)
        yield from ()

    try:
        if call_type == "unary_unary":
            ch.unary_unary(method, raw, raw)(b"", timeout=CALL_TIMEOUT)
        elif call_type == "unary_stream":
            list(ch.unary_stream(method, raw, raw)(b"", timeout=CALL_TIMEOUT))
        elif call_type == "stream_unary":
            ch.stream_unary(method, raw, raw)(iter([b"", b""]), timeout=CALL_TIMEOUT)
        elif call_type == "stream_stream":
            list(ch.stream_stream(method, raw, raw)(iter([b"", b""]), timeout=CALL_TIMEOUT))
        elif call_type == "stream, none sent":
            list(ch.stream_stream(method, raw, raw)(iter([]), timeout=CALL_TIMEOUT))
        else:
            list(ch.stream_stream(method, raw, raw)(silent(), timeout=CALL_TIMEOUT))
    except grpc.RpcError as err:
        return err
    finally:
        hold.set()
    return None


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("kind", KINDS)
def test_unknown_methods(servers: dict[tuple[str, bool], Target], kind: str, cell: str) -> None:
    """Without a valid token an unknown method is as UNAUTHENTICATED as a known one; with one, UNIMPLEMENTED."""
    refused = cell in ("no token", "wrong token")
    problems = []
    with channel(target_for(servers, kind, cell).address, Security(token=CELLS[cell] or "")) as ch:
        for method in UNKNOWN_METHODS:
            for call_type in CALL_TYPES:
                err = call_raw(ch, method, call_type)
                got = err.code() if err is not None else "OK"
                want = grpc.StatusCode.UNAUTHENTICATED if refused else grpc.StatusCode.UNIMPLEMENTED
                if got != want:
                    problems.append(f"{method} as {call_type}: {got} ({err.details() if err else ''}), want {want}")
                    continue
                if refused:
                    assert err is not None
                    info = error_info(err)
                    seen = (info.reason, info.domain, info.metadata.get("method")) if info else None
                    if seen != ("UNAUTHENTICATED", DOMAIN, method):
                        problems.append(f"{method} as {call_type}: ErrorInfo {seen}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_health_method_stays_exempt(servers: dict[tuple[str, bool], Target], kind: str) -> None:
    """The health service is exempt as a whole: a method it lacks is UNIMPLEMENTED even without a token."""
    with grpc.insecure_channel(servers[(kind, True)].address) as ch:
        err = call_raw(ch, "/grpc.health.v1.Health/Nope", "unary_unary")
    assert err is not None and err.code() == grpc.StatusCode.UNIMPLEMENTED, err


@pytest.mark.parametrize("kind", KINDS)
def test_known_methods_still_refused_and_served(servers: dict[tuple[str, bool], Target], kind: str) -> None:
    """Known methods as before: refused without the token (called as any call type), served with it."""
    method = {
        "worker": "/memsvc.v1.ModelWorkerService/GetWorkerStatus",
        "manager": "/memsvc.v1.MemoryManagerService/ListWorkers",
    }[kind]
    with grpc.insecure_channel(servers[(kind, True)].address) as ch:
        for call_type in CALL_TYPES:
            err = call_raw(ch, method, call_type)
            assert err is not None, call_type
            assert_refused(err, grpc.StatusCode.UNAUTHENTICATED)
    with channel(servers[(kind, True)].address, Security(token=TOKEN)) as ch:
        assert call_raw(ch, method, "unary_unary") is None


@pytest.fixture(scope="module")
def probe_protoset(base: Path) -> Path:
    """A service no server has (``probe.v1.Probe``: a unary and a server-streaming method), for grpcurl;
    with google.rpc.ErrorInfo, so grpcurl prints the refusal's details."""
    fds = descriptor_pb2.FileDescriptorSet()
    for file in (empty_pb2.DESCRIPTOR, duration_pb2.DESCRIPTOR, error_details_pb2.DESCRIPTOR):
        file.CopyToProto(fds.file.add())
    f = fds.file.add(name="probe.proto", package="probe.v1", dependency=["google/protobuf/empty.proto"])
    svc = f.service.add(name="Probe")
    svc.method.add(name="Unary", input_type=".google.protobuf.Empty", output_type=".google.protobuf.Empty")
    svc.method.add(
        name="Stream", input_type=".google.protobuf.Empty", output_type=".google.protobuf.Empty", server_streaming=True
    )
    path = base / "probe.protoset"
    path.write_bytes(fds.SerializeToString())
    return path


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("kind", KINDS)
def test_grpcurl_unknown_methods(
    servers: dict[tuple[str, bool], Target], grpcurl: str, probe_protoset: Path, kind: str, cell: str
) -> None:
    token = CELLS[cell]
    header = ["-H", f"authorization: Bearer {token}"] if token else []
    refused = cell in ("no token", "wrong token")
    for method in ("probe.v1.Probe/Unary", "probe.v1.Probe/Stream"):
        r = run_grpcurl(
            grpcurl,
            [
                "-plaintext",
                "-protoset",
                str(probe_protoset),
                *header,
                "-d",
                "{}",
                target_for(servers, kind, cell).address,
                method,
            ],
        )
        out = r.stdout + r.stderr
        if refused:
            assert r.returncode == GRPCURL_EXIT[grpc.StatusCode.UNAUTHENTICATED], f"{method}: {out}"
            assert "Code: Unauthenticated" in out and '"reason":"UNAUTHENTICATED"' in out.replace(" ", ""), out
        else:
            assert r.returncode == GRPCURL_EXIT[grpc.StatusCode.UNIMPLEMENTED], f"{method}: {out}"
            assert "Code: Unimplemented" in out, out


# ---- C. the manager's HTTP port ----
def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Message, str]:
    """(status, headers, body) of a GET, whatever the status."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=CALL_TIMEOUT) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, err.read().decode()


def is_metrics_text(body: str) -> bool:
    names = {f.name for f in text_string_to_metric_families(body)}
    return {"memsvc_leases_granted", "memsvc_worker_up"} <= names


BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({}, "no Authorization header"),
        ({"Authorization": "Bearer not-the-token"}, "wrong token"),
        ({"Authorization": f"Bearer {TOKEN}x"}, "token with a suffix"),
        ({"Authorization": f"Basic {TOKEN}"}, "another scheme"),
        ({"Authorization": "Bearer"}, "scheme without a token"),
    ],
)
def test_metrics_need_the_token(servers: dict[tuple[str, bool], Target], headers: dict[str, str], why: str) -> None:
    status, resp_headers, body = http_get(servers[("manager", True)].metrics_url, headers)
    assert status == 401, f"{why}: {status}\n{body[:300]}"
    assert (resp_headers.get("WWW-Authenticate") or "").startswith("Bearer"), resp_headers
    assert "memsvc_" not in body, "a refusal must not carry metrics"


def test_metrics_with_the_token(servers: dict[tuple[str, bool], Target]) -> None:
    for headers in (BEARER, {"Authorization": f"bearer   {TOKEN} "}):  # the scheme is case-insensitive
        status, resp_headers, body = http_get(servers[("manager", True)].metrics_url, headers)
        assert status == 200, f"{headers}: {status}"
        assert (resp_headers.get("Content-Type") or "").startswith("text/plain"), resp_headers
        assert is_metrics_text(body), body[:500]


@pytest.mark.parametrize("tokened", [False, True], ids=["open", "token"])
def test_healthz_and_unknown_paths(servers: dict[tuple[str, bool], Target], tokened: bool) -> None:
    http = servers[("manager", tokened)].http
    assert http_get(f"{http}/healthz")[::2] == (200, "ok\n")
    for path in ("/", "/nope", "/metrics/x", "/healthz/x", "/metricsx"):
        status, _, body = http_get(f"{http}{path}", BEARER)
        assert status == 404, f"{path}: {status}"
        assert "memsvc_" not in body, path


def test_metrics_open_without_a_manager_token(servers: dict[tuple[str, bool], Target]) -> None:
    status, _, body = http_get(servers[("manager", False)].metrics_url)
    assert status == 200 and is_metrics_text(body), f"{status}\n{body[:300]}"


def curl(tmp: Path, *args: str) -> tuple[int, str, str]:
    """(HTTP status, response headers, body) of ``curl -sS`` with ``args``."""
    exe = shutil.which("curl")
    if exe is None:
        pytest.skip("no curl binary")
    head, body = tmp / "curl.head", tmp / "curl.body"
    r = subprocess.run(
        [exe, "-sS", "-D", str(head), "-o", str(body), "-w", "%{http_code}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return int(r.stdout), head.read_text(), body.read_text()


def test_curl(servers: dict[tuple[str, bool], Target], tmp_path: Path) -> None:
    tokened = servers[("manager", True)]
    code, head, _ = curl(tmp_path, tokened.metrics_url)
    assert code == 401 and "www-authenticate: bearer" in head.lower(), head
    code, _, body = curl(tmp_path, "-H", f"Authorization: Bearer {TOKEN}", tokened.metrics_url)
    assert code == 200 and is_metrics_text(body), body[:300]
    code, _, body = curl(tmp_path, "--oauth2-bearer", TOKEN, tokened.metrics_url)
    assert code == 200 and is_metrics_text(body), body[:300]
    assert curl(tmp_path, f"{tokened.http}/healthz")[::2] == (200, "ok\n")
    assert curl(tmp_path, f"{tokened.http}/nope")[0] == 404
    code, _, body = curl(tmp_path, servers[("manager", False)].metrics_url)
    assert code == 200 and is_metrics_text(body), body[:300]


# ---- the error mapping of coroutine-style streaming handlers, in process ----
Behaviour = Callable[[health_pb2.HealthCheckRequest, Context], Any]
SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def gen_then_fail(request: health_pb2.HealthCheckRequest, context: Context) -> AsyncIterator[Any]:
    yield SERVING
    raise WrongState("not now", metadata={"service": request.service})


async def write_then_fail(request: health_pb2.HealthCheckRequest, context: Context) -> None:
    await context.write(SERVING)
    raise WrongState("not now", metadata={"service": request.service})


async def write_then_bug(request: health_pb2.HealthCheckRequest, context: Context) -> None:
    await context.write(SERVING)
    raise RuntimeError("a bug")


async def write_twice(request: health_pb2.HealthCheckRequest, context: Context) -> None:
    await context.write(SERVING)
    await context.write(SERVING)


async def write_then_abort(request: health_pb2.HealthCheckRequest, context: Context) -> None:
    await context.write(SERVING)
    await context.abort(grpc.StatusCode.NOT_FOUND, "gone")


def returns_generator(request: health_pb2.HealthCheckRequest, context: Context) -> AsyncIterator[Any]:
    """A plain function that returns an async iterator (as a wrapper or a partial might)."""
    return gen_then_fail(request, context)


BEHAVIOURS: dict[str, Behaviour] = {
    "GenThenFail": gen_then_fail,
    "WriteThenFail": write_then_fail,
    "WriteThenBug": write_then_bug,
    "WriteTwice": write_twice,
    "WriteThenAbort": write_then_abort,
    "ReturnsGenerator": returns_generator,
}


@pytest_asyncio.fixture
async def mapped_server() -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    handlers = {
        name: grpc.unary_stream_rpc_method_handler(
            fn, health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString
        )
        for name, fn in BEHAVIOURS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Streams", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def collect(address: str, method: str, request: bytes) -> tuple[list[bytes], grpc.aio.AioRpcError | None]:
    async with grpc.aio.insecure_channel(address) as ch:
        got: list[bytes] = []
        try:
            async for item in ch.unary_stream(f"/t.Streams/{method}", raw, raw)(request, timeout=CALL_TIMEOUT):
                got.append(item)
        except grpc.aio.AioRpcError as err:
            return got, err
        return got, None


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["GenThenFail", "WriteThenFail", "ReturnsGenerator"])
async def test_streaming_errors_mapped_for_both_kinds(mapped_server: str, method: str) -> None:
    got, err = await collect(mapped_server, method, health_pb2.HealthCheckRequest(service="s").SerializeToString())
    assert got == [SERVING.SerializeToString()]
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    info = error_info(err)
    assert info is not None and (info.reason, info.domain, dict(info.metadata)) == (
        "WRONG_STATE",
        DOMAIN,
        {"service": "s"},
    )


@pytest.mark.asyncio
async def test_coroutine_streams_bug_abort_and_success(mapped_server: str) -> None:
    request = health_pb2.HealthCheckRequest().SerializeToString()
    got, err = await collect(mapped_server, "WriteThenBug", request)
    assert len(got) == 1 and err is not None and err.code() == grpc.StatusCode.INTERNAL
    assert "a bug" not in (err.details() or ""), "no internals leak"
    info = error_info(err)
    assert info is not None and info.reason == "INTERNAL"
    got, err = await collect(mapped_server, "WriteThenAbort", request)
    assert len(got) == 1 and err is not None and (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "gone")
    got, err = await collect(mapped_server, "WriteTwice", request)
    assert err is None and len(got) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("method", list(BEHAVIOURS))
async def test_undecodable_request_is_invalid_argument(mapped_server: str, method: str) -> None:
    got, err = await collect(mapped_server, method, b"\xff\xff\xff")
    assert got == [] and err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    info = error_info(err)
    assert info is not None and info.reason == "INVALID_ARGUMENT"


def test_documented_prometheus_scrape_config(servers: dict[tuple[str, bool], Target], token_file: Path) -> None:
    """docs/operations.md's scrape config, done as Prometheus does it: ``<type> <credentials_file's content>``
    in the Authorization header (Prometheus trims the file's trailing newline) to ``metrics_path``."""
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    (block,) = [b for b in re.findall(r"^```yml\n(.*?)^```", section, re.S | re.M) if "scrape_configs" in b]
    (job,) = yaml.safe_load(block)["scrape_configs"]
    auth = job["authorization"]
    assert auth["credentials_file"] and job["metrics_path"] == "/metrics"
    credentials = token_file.read_text().strip()  # the deployment puts the manager's --token-file there
    url = servers[("manager", True)].http + job["metrics_path"]
    status, _, body = http_get(url, {"Authorization": f"{auth.get('type', 'Bearer')} {credentials}"})
    assert status == 200 and is_metrics_text(body), f"{status}\n{body[:300]}"
    assert http_get(url)[0] == 401
