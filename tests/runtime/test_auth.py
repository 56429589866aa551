"""Authentication with real processes: bearer token, TLS and mutual TLS on ``memsvc worker`` and
``memsvc manager`` (memsvc.runtime.auth), checked with the generated stubs and with the real grpcurl.

The matrix (worker, GetWorkerStatus and StreamTelemetry; the manager takes the same flags):

==========  ==============  ==============  ==============
transport   no token        wrong token     right token
==========  ==============  ==============  ==============
plaintext   UNAUTHENTICATED UNAUTHENTICATED OK
TLS         UNAUTHENTICATED UNAUTHENTICATED OK
mTLS        UNAUTHENTICATED UNAUTHENTICATED OK
==========  ==============  ==============  ==============

grpc.health.v1.Health answers in every cell (no token needed). A client that does not speak the
server's transport (plaintext to TLS, TLS to plaintext, no or a foreign client certificate to mTLS)
fails the connection: UNAVAILABLE. On the mTLS worker with ``--allowed-client manager``, the
transitions (Sleep, WakeUp, ReloadWeights, SwapBlocks, FreeSequence) answer PERMISSION_DENIED to any
other certificate; reads and Generate do not. Certificates: a throwaway CA made per module with the
``openssl`` command (tests/certs.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from certs import Certs, have_openssl, make_certs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from managerproc import ManagerProcess
from upproc import grpcurl_binary
from upproc import health_protoset as write_health_protoset
from workerproc import REPO_ROOT, WorkerProcess

from memsvc import DOMAIN, error_info
from memsvc.runtime.auth import Security, channel
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

pytestmark = pytest.mark.skipif(not have_openssl(), reason="the openssl command makes the test certificates")

TOKEN = "s3cret-token-for-tests"
MODES = ("plain", "tls", "mtls")
TOKENS = {"no token": None, "wrong token": "not-the-token", "right token": TOKEN}
CALL_TIMEOUT = 10.0
GRPCURL_EXIT = {code: 64 + code.value[0] for code in grpc.StatusCode}
"""grpcurl's exit status for a call that ended with a status: 64 + the code."""


# ---- fixtures ----
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("auth")


@pytest.fixture(scope="module")
def certs(base: Path) -> Certs:
    """certs/ca.pem and certs/{manager,worker,ops}.{pem,key} (CN = the name): the README's file names."""
    return make_certs(base / "certs", ["manager", "worker", "ops"])


@pytest.fixture(scope="module")
def rogue(base: Path) -> Certs:
    """A certificate named ``manager`` from another CA: must not pass the mTLS handshake."""
    return make_certs(base / "rogue", ["manager"], ca_name="rogue-ca")


@pytest.fixture(scope="module")
def token_file(base: Path) -> Path:
    path = base / "token"
    path.write_text(TOKEN + "\n")
    return path


def server_flags(mode: str, certs: Certs, token_file: Path, name: str = "worker") -> list[str]:
    flags = ["--token-file", str(token_file)]
    if mode in ("tls", "mtls"):
        flags += ["--tls-cert", str(certs.cert(name)), "--tls-key", str(certs.key(name))]
    if mode == "mtls":
        flags += ["--tls-client-ca", str(certs.ca)]
    return flags


@pytest.fixture(scope="module")
def workers(certs: Certs, token_file: Path) -> Iterator[dict[str, WorkerProcess]]:
    """One worker per transport, all with the token; the mTLS one only obeys the ``manager`` certificate."""
    procs: dict[str, WorkerProcess] = {}
    try:
        for mode in MODES:
            extra = ["--allowed-client", "manager"] if mode == "mtls" else []
            procs[mode] = WorkerProcess([*server_flags(mode, certs, token_file), *extra, "--worker-id", mode])
            procs[mode].start()
        yield procs
    finally:
        for wp in procs.values():
            wp.close()


def client(mode: str, certs: Certs, token: str | None, identity: str = "ops") -> Security:
    """What a client of a ``mode`` server uses: the CA for TLS, a client certificate for mTLS."""
    sec = Security(token=token or "")
    if mode in ("tls", "mtls"):
        sec = Security(token=token or "", tls_ca=str(certs.ca))
    if mode == "mtls":
        sec = Security(
            token=token or "",
            tls_ca=str(certs.ca),
            tls_client_cert=str(certs.cert(identity)),
            tls_client_key=str(certs.key(identity)),
        )
    return sec


def assert_refused(err: grpc.RpcError, code: grpc.StatusCode) -> None:
    assert err.code() == code, f"{err.code()}: {err.details()}"
    info = error_info(err)
    assert info is not None, "the refusal carries no ErrorInfo"
    assert (info.reason, info.domain) == (code.name, DOMAIN)


def worker_state(address: str, certs: Certs, mode: str) -> int:
    with channel(address, client(mode, certs, TOKEN, "manager")) as ch:
        status = (
            worker_grpc.ModelWorkerServiceStub(ch)
            .GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10)
            .status
        )
        return int(status.state)


# ---- the matrix, generated stubs ----
@pytest.mark.parametrize("token_name", list(TOKENS))
@pytest.mark.parametrize("mode", MODES)
def test_matrix_with_stubs(workers: dict[str, WorkerProcess], certs: Certs, mode: str, token_name: str) -> None:
    token = TOKENS[token_name]
    with channel(workers[mode].address, client(mode, certs, token)) as ch:
        stub = worker_grpc.ModelWorkerServiceStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        # health is readable with or without a token
        r = health.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        request = worker_pb.StreamTelemetryRequest()
        request.interval.FromMilliseconds(100)
        if token == TOKEN:
            assert (
                stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT).status.worker_id == mode
            )
            stream = stub.StreamTelemetry(request, timeout=CALL_TIMEOUT)
            assert next(iter(stream)).snapshot.worker_id == mode
            stream.cancel()
            return
        with pytest.raises(grpc.RpcError) as unary:
            stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT)
        assert_refused(unary.value, grpc.StatusCode.UNAUTHENTICATED)
        assert ("missing" if token is None else "invalid") in (unary.value.details() or "")
        with pytest.raises(grpc.RpcError) as streaming:
            next(iter(stub.StreamTelemetry(request, timeout=CALL_TIMEOUT)))
        assert_refused(streaming.value, grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize(
    ("server", "client_mode", "identity"),
    [
        ("tls", "plain", "ops"),  # plaintext to a TLS port
        ("plain", "tls", "ops"),  # TLS to a plaintext port
        ("mtls", "tls", "ops"),  # no client certificate
        ("mtls", "mtls", "rogue"),  # a certificate from another CA, even one named "manager"
    ],
)
def test_wrong_transport_fails_the_connection(
    workers: dict[str, WorkerProcess], certs: Certs, rogue: Certs, server: str, client_mode: str, identity: str
) -> None:
    sec = client(client_mode, certs, TOKEN)
    if identity == "rogue":
        sec = Security(
            token=TOKEN,
            tls_ca=str(certs.ca),
            tls_client_cert=str(rogue.cert("manager")),
            tls_client_key=str(rogue.key("manager")),
        )
    with channel(workers[server].address, sec) as ch:
        for call in (
            lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5),
            lambda: worker_grpc.ModelWorkerServiceStub(ch).GetWorkerStatus(
                worker_pb.GetWorkerStatusRequest(), timeout=5
            ),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# ---- only the manager's certificate changes the mTLS worker ----
TRANSITION_CALLS = {
    "Sleep": worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1),
    "WakeUp": worker_pb.WakeUpRequest(),
    "ReloadWeights": worker_pb.ReloadWeightsRequest(),
    "SwapBlocks": worker_pb.SwapBlocksRequest(),
    "FreeSequence": worker_pb.FreeSequenceRequest(sequence_id="nope"),
}


@pytest.mark.parametrize("method", list(TRANSITION_CALLS))
def test_transitions_refused_from_another_certificate(
    workers: dict[str, WorkerProcess], certs: Certs, method: str
) -> None:
    address = workers["mtls"].address
    with channel(address, client("mtls", certs, TOKEN, "ops")) as ch, pytest.raises(grpc.RpcError) as exc:
        getattr(worker_grpc.ModelWorkerServiceStub(ch), method)(TRANSITION_CALLS[method], timeout=CALL_TIMEOUT)
    assert_refused(exc.value, grpc.StatusCode.PERMISSION_DENIED)
    info = error_info(exc.value)
    assert info is not None and info.metadata["client"] == "ops"
    assert info.metadata["method"] == f"/memsvc.v1.ModelWorkerService/{method}"
    assert worker_state(address, certs, "mtls") == common_pb.WORKER_STATE_AWAKE, "a refused call changed nothing"


def test_reads_and_generate_open_to_any_authenticated_certificate(
    workers: dict[str, WorkerProcess], certs: Certs
) -> None:
    with channel(workers["mtls"].address, client("mtls", certs, TOKEN, "ops")) as ch:
        stub = worker_grpc.ModelWorkerServiceStub(ch)
        assert stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT).status.worker_id == "mtls"
        r = stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=2), timeout=60)
        assert len(r.token_ids) == 2


def test_manager_certificate_may_sleep_and_wake(workers: dict[str, WorkerProcess], certs: Certs) -> None:
    address = workers["mtls"].address
    with channel(address, client("mtls", certs, None, "manager")) as ch:
        with pytest.raises(grpc.RpcError) as exc:  # the right certificate does not replace the token
            worker_grpc.ModelWorkerServiceStub(ch).Sleep(
                worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=CALL_TIMEOUT
            )
        assert_refused(exc.value, grpc.StatusCode.UNAUTHENTICATED)
    with channel(address, client("mtls", certs, TOKEN, "manager")) as ch:
        stub = worker_grpc.ModelWorkerServiceStub(ch)
        assert (
            stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=60).status.state
            == common_pb.WORKER_STATE_ASLEEP
        )
        assert stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60).status.state == common_pb.WORKER_STATE_AWAKE


def test_tls_worker_without_allowed_client_takes_transitions_from_token_holders(
    workers: dict[str, WorkerProcess], certs: Certs
) -> None:
    with channel(workers["tls"].address, client("tls", certs, TOKEN)) as ch:
        stub = worker_grpc.ModelWorkerServiceStub(ch)
        assert (
            stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=60).status.state
            == common_pb.WORKER_STATE_ASLEEP
        )
        assert stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60).status.state == common_pb.WORKER_STATE_AWAKE


# ---- the same with the real grpcurl ----
@pytest.fixture(scope="module")
def grpcurl() -> str:
    return grpcurl_binary()


@pytest.fixture(scope="module")
def health_protoset(base: Path) -> Path:
    return write_health_protoset(base)


def grpcurl_flags(mode: str, certs: Certs, identity: str = "ops") -> list[str]:
    if mode == "plain":
        return ["-plaintext"]
    flags = ["-cacert", str(certs.ca)]
    if mode == "mtls":
        flags += ["-cert", str(certs.cert(identity)), "-key", str(certs.key(identity))]
    return flags


def run_grpcurl(grpcurl: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("token_name", list(TOKENS))
@pytest.mark.parametrize("mode", MODES)
def test_matrix_with_grpcurl(
    workers: dict[str, WorkerProcess], certs: Certs, grpcurl: str, mode: str, token_name: str
) -> None:
    token = TOKENS[token_name]
    header = ["-H", f"authorization: Bearer {token}"] if token else []
    r = run_grpcurl(
        grpcurl,
        [*grpcurl_flags(mode, certs), *header, workers[mode].address, "memsvc.v1.ModelWorkerService/GetWorkerStatus"],
    )
    if token == TOKEN:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["status"]["worker_id"] == mode
    else:
        # grpcurl asks reflection first, which is behind the token too
        assert r.returncode in (1, GRPCURL_EXIT[grpc.StatusCode.UNAUTHENTICATED]), r.stderr
        assert "Unauthenticated" in r.stderr


@pytest.mark.parametrize("mode", MODES)
def test_grpcurl_health_without_token(
    workers: dict[str, WorkerProcess], certs: Certs, grpcurl: str, health_protoset: Path, mode: str
) -> None:
    r = run_grpcurl(
        grpcurl,
        [
            *grpcurl_flags(mode, certs),
            "-protoset",
            str(health_protoset),
            workers[mode].address,
            "grpc.health.v1.Health/Check",
        ],
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "SERVING"


def test_grpcurl_sleep_from_another_certificate_is_permission_denied(
    workers: dict[str, WorkerProcess], certs: Certs, grpcurl: str
) -> None:
    r = run_grpcurl(
        grpcurl,
        [
            *grpcurl_flags("mtls", certs, "ops"),
            "-H",
            f"authorization: Bearer {TOKEN}",
            "-d",
            '{"level": 1}',
            workers["mtls"].address,
            "memsvc.v1.ModelWorkerService/Sleep",
        ],
    )
    assert r.returncode == GRPCURL_EXIT[grpc.StatusCode.PERMISSION_DENIED], r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "PermissionDenied" in out and '"reason":"PERMISSION_DENIED"' in out.replace(" ", "")
    assert worker_state(workers["mtls"].address, certs, "mtls") == common_pb.WORKER_STATE_AWAKE


def readme_auth_lines() -> list[str]:
    """The ``$ grpcurl`` lines of the README's "Auth and TLS" section."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("\n## Auth and TLS\n", 1)[1].split("\n## ", 1)[0]
    return [ln.strip()[2:] for ln in section.splitlines() if ln.strip().startswith("$ grpcurl ")]


def test_readme_auth_grpcurl_lines_work_as_written(
    workers: dict[str, WorkerProcess], certs: Certs, grpcurl: str, base: Path
) -> None:
    lines = readme_auth_lines()
    assert len(lines) >= 3
    for line in lines:
        words = shlex.split(line)
        mode = "mtls" if "-cert" in words else "tls" if "-cacert" in words else "plain"
        command = line.replace("127.0.0.1:50061", workers[mode].address)
        command = re.sub(r"^grpcurl ", shlex.quote(grpcurl) + " ", command)
        r = subprocess.run(
            ["bash", "-c", command],
            cwd=base,
            env={**os.environ, "MEMSVC_TOKEN": TOKEN},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, f"README line: {line}\n{r.stdout}\n{r.stderr}"
        if words[-1].endswith("/Sleep"):
            assert json.loads(r.stdout)["status"]["state"] == "WORKER_STATE_ASLEEP"
    assert worker_state(workers["mtls"].address, certs, "mtls") == common_pb.WORKER_STATE_AWAKE


# ---- a manager and a worker that authenticate to each other ----
def memsvc_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMSVC_")}
    env = {**clean, **(env or {}), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "memsvc.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def wait_state(
    stub: manager_grpc.MemoryManagerServiceStub,
    worker_id: str,
    state: common_pb.WorkerState.ValueType,
    timeout: float = 60.0,
) -> manager_pb.Worker:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            wk = stub.GetWorker(manager_pb.GetWorkerRequest(name=f"workers/{worker_id}"), timeout=5).worker
            if wk.state == state:
                return wk
            last = common_pb.WorkerState.Name(wk.state)
        except grpc.RpcError as err:
            last = f"{err.code().name}: {err.details()}"
        time.sleep(0.1)
    raise AssertionError(
        f"workers/{worker_id} not {common_pb.WorkerState.Name(state)} within {timeout} s; last: {last}"
    )


@pytest.mark.parametrize("mode", ["plain", "mtls"])
def test_manager_and_worker_pair(certs: Certs, token_file: Path, tmp_path: Path, mode: str) -> None:
    """Token (+ mTLS, worker obeying only the manager's certificate): the worker registers, the manager
    follows its telemetry, and ``memsvc sleep/wake`` through the manager work; without a token they don't."""
    manager_flags = server_flags(mode, certs, token_file, "manager")
    worker_flags = [*server_flags(mode, certs, token_file, "worker"), "--worker-id", "auth0"]
    if mode == "mtls":
        manager_flags += ["--tls-ca", str(certs.ca)]
        worker_flags += ["--tls-ca", str(certs.ca), "--allowed-client", "manager"]
    ops = ["--token-file", str(token_file)]
    if mode == "mtls":
        ops += [
            "--tls-ca",
            str(certs.ca),
            "--tls-client-cert",
            str(certs.cert("ops")),
            "--tls-client-key",
            str(certs.key("ops")),
        ]
    mp = ManagerProcess(tmp_path / "manager.db", manager_flags)
    wp = None
    try:
        mp.start()
        wp = WorkerProcess([*worker_flags, "--manager", mp.address])
        wp.start()
        with channel(mp.address, client(mode, certs, TOKEN)) as ch:
            stub = manager_grpc.MemoryManagerServiceStub(ch)
            wk = wait_state(stub, "auth0", common_pb.WORKER_STATE_AWAKE)
            assert wk.address == wp.address
            r = memsvc_cli("sleep", "auth0", "--level", "1", "--manager", mp.address, *ops)
            assert r.returncode == 0, r.stdout + r.stderr
            wait_state(stub, "auth0", common_pb.WORKER_STATE_ASLEEP)
            r = memsvc_cli("wake", "auth0", "--manager", mp.address, *ops)
            assert r.returncode == 0, r.stdout + r.stderr
            wait_state(stub, "auth0", common_pb.WORKER_STATE_AWAKE)
        # the same settings from the environment, as in a container
        env = {"MEMSVC_MANAGER": mp.address, "MEMSVC_TOKEN": TOKEN}
        if mode == "mtls":
            env |= {
                "MEMSVC_TLS_CA": str(certs.ca),
                "MEMSVC_TLS_CLIENT_CERT": str(certs.cert("ops")),
                "MEMSVC_TLS_CLIENT_KEY": str(certs.key("ops")),
            }
        r = memsvc_cli("status", env=env)
        assert r.returncode == 0 and "auth0" in r.stdout, r.stdout + r.stderr
        # no token: the CLI reports UNAUTHENTICATED; health needs none
        no_token = [a for a in ops if a not in ("--token-file", str(token_file))]
        r = memsvc_cli("status", "--manager", mp.address, *no_token)
        assert r.returncode == 1 and "UNAUTHENTICATED" in r.stdout, r.stdout + r.stderr
        r = memsvc_cli("health", mp.address, "--service", "memsvc.v1.MemoryManagerService", *no_token)
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
        r = memsvc_cli("health", wp.address, *no_token)
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
        if mode == "mtls":  # deploy/kubernetes/overlays/mtls's probe: localhost, the certificate from the environment
            tls = {k: v for k, v in env.items() if k.startswith("MEMSVC_TLS_")}
            port = mp.address.rsplit(":", 1)[1]
            r = memsvc_cli("health", f"localhost:{port}", "--service", "memsvc.v1.MemoryManagerService", env=tls)
            assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
    finally:
        if wp is not None:
            wp.close()
        mp.close()


def test_allowed_client_without_mtls_is_a_usage_error(certs: Certs, token_file: Path) -> None:
    r = memsvc_cli(
        "worker",
        "--backend",
        "host",
        "--listen",
        "127.0.0.1:0",
        "--allowed-client",
        "manager",
        *server_flags("tls", certs, token_file),
    )
    assert r.returncode == 2 and "--allowed-client needs mTLS" in r.stderr, r.stderr
    r = memsvc_cli("manager", "--listen", "127.0.0.1:0", "--token-file", str(certs.dir / "missing"))
    assert r.returncode == 2 and "cannot read token file" in r.stderr, r.stderr
