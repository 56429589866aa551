"""``memsvc up --config host.toml``: a host's models from one file (memsvc/_host.py), run as a user
runs it, with three host-backend models on one simulated device that holds one awake model at a time:

- all three are listed by the gateway's /v1/models, and a request for each gets text through the
  OpenAI SDK, each wake putting the one awake before it to sleep;
- a worker killed outright (SIGKILL) is started again, put to sleep once loaded (the device holds
  one: the other was awake), and serves again;
- SIGHUP reads the file again: a model taken out of it stops and leaves the manager's list (once the
  lease a client held on it ends), a model put in starts and serves, the others are not restarted;
- with ``[workers] stop_after``, a model asleep that long has no process, and a request for it
  starts one (from the standby) and gets the same text as before;
- Ctrl-C (SIGINT) stops every child and exits 0;
- a file that does not load is one error line naming what is wrong, exit 2.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from childproc import Proc
from hostproc import MODELS, Host, awake, children, host_file, worker_pid
from upproc import free_port, wait_for

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path)
    h.proc.start()
    try:
        yield h
    finally:
        h.channel.close()
        h.proc.kill()


def test_three_models_from_one_file_serve_text_take_turns_restart_reload_and_stop(host: Host) -> None:
    h = host
    wait_for(lambda: h.listed(), lambda ids: ids == list(MODELS), what="the three models listed", timeout=120)
    for model in (*MODELS, "alpha"):
        assert h.text(model), f"{model} answered no text"
        wait_for(
            lambda: awake(h),
            lambda names, model=model: names == [model],  # type: ignore[misc]
            what=f"{model} awake and only it (the device holds one)",
        )

    # a worker killed outright is started again, and serves again
    assert h.proc.proc is not None
    pid = worker_pid(h.proc.proc.pid, "beta")
    assert pid is not None, "no worker process for beta"
    before = h.workers()["beta"].address
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: worker_pid(h.proc.proc.pid, "beta"),  # type: ignore[union-attr]
        lambda p: p not in (None, pid),
        what="beta's worker started again",
    )
    # it loads awake beside the one awake before: memsvc up puts it to sleep once it has registered
    wait_for(
        lambda: h.workers()["beta"],
        lambda wk: wk.address != before and wk.state == common_pb.WORKER_STATE_ASLEEP,
        what="beta registered again (its new port), then put to sleep",
        timeout=120,
    )
    assert awake(h) == ["alpha"]
    assert h.text("beta")
    assert "worker beta exited with -9" in h.proc.stderr_text()

    # SIGHUP: gamma out (while a client holds a lease on it), delta in, alpha and beta untouched
    alpha = worker_pid(h.proc.proc.pid, "alpha")
    lease = h.stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name="workers/gamma", holder="test"), timeout=60).lease
    host_file(h.file, h.manager, h.gateway, ("alpha", "beta", "delta"))
    h.proc.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: h.listed(), lambda ids: "delta" in ids, what="delta listed after the reload", timeout=120)
    assert worker_pid(h.proc.proc.pid, "gamma") is None
    assert "gamma" in h.workers(), "a leased worker was deregistered under its lease"
    h.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)
    wait_for(lambda: h.workers(), lambda ws: "gamma" not in ws, what="gamma deregistered once its lease ended")
    assert h.listed() == ["alpha", "beta", "delta"]
    assert worker_pid(h.proc.proc.pid, "gamma") is None
    assert worker_pid(h.proc.proc.pid, "alpha") == alpha, "an unchanged model was restarted"
    assert h.text("delta")

    # Ctrl-C stops everything
    children = [p for n in ("alpha", "beta", "delta") if (p := worker_pid(h.proc.proc.pid, n)) is not None]
    assert h.proc.signal_and_wait(signal.SIGINT) == 0
    assert all(not Path(f"/proc/{p}").exists() for p in children), "a worker outlived memsvc up"


def test_a_model_asleep_for_stop_after_has_no_process_and_a_request_starts_it_from_the_standby(
    tmp_path: Path,
) -> None:
    """``[workers] stop_after``: no process is the deepest sleep level. Both models, asleep (idle for a
    second) for a second, are stopped; their policy's start_timeout is memsvc up's. A chat request
    for one, through the OpenAI SDK, waits while memsvc up starts it from the standby, and gets the
    text it got before; an AcquireWorker for the other, as another service sends it, starts that
    one too. Ctrl-C stops everything, the standby included."""
    h = Host(tmp_path, ("alpha", "beta"), idle_sleep=1, workers="stop_after = 1\nstandby = true")
    h.proc.start()

    def said() -> str:
        return "\n".join(h.proc.lines)

    try:
        assert h.proc.proc is not None
        wait_for(lambda: h.listed(), lambda ids: ids == ["alpha", "beta"], what="both models listed", timeout=120)
        # alpha slept before beta loaded: its stop may come with this request, which then waits for its
        # start (or, in the moment of the stop, is refused with 503 and asked again)
        before = wait_for(lambda: h.text_or_503("alpha"), lambda t: t is not None, what="alpha's text", timeout=120)
        for wid in ("alpha", "beta"):
            wait_for(
                said,
                lambda t, wid=wid: f"worker {wid} stopped after 1 s asleep" in t,  # type: ignore[misc]
                what=f"{wid} stopped once asleep for stop_after",
                timeout=120,
            )
        wait_for(
            lambda: h.workers(),
            lambda ws: all(w.state == common_pb.WORKER_STATE_UNAVAILABLE for w in ws.values()),
            what="both unavailable at the manager",
        )
        wait_for(  # the manager sees a stream end before its process has exited
            lambda: [argv for argv in children(h.proc.proc.pid).values() if b"worker" in argv],  # type: ignore[union-attr]
            lambda running: len(running) == 1 and b"--standby" in running[0],
            what="no worker process but the standby that waits",
        )
        policy = h.stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/alpha"), timeout=10).policy
        assert policy.start_timeout.seconds == 300

        assert h.text("alpha") == before
        log = said()
        assert "worker alpha started on demand (1 acquire(s) waiting)" in log
        assert "worker alpha started from the standby" in log.split("worker alpha started on demand")[1]

        lease = h.stub.AcquireWorker(
            manager_pb.AcquireWorkerRequest(name="workers/beta", holder="a service"), timeout=120
        )
        assert lease.worker.state == common_pb.WORKER_STATE_AWAKE
        assert "worker beta started on demand" in said()
        h.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease.lease_id), timeout=10)

        kids = list(children(h.proc.proc.pid))
        assert h.proc.signal_and_wait(signal.SIGINT) == 0
        assert all(not Path(f"/proc/{p}").exists() for p in kids), "a child outlived memsvc up"
    finally:
        h.channel.close()
        h.proc.kill()


def test_a_host_file_that_does_not_load_is_one_error_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "host.toml"
    bad.write_text('[[models]]\nmodel = "synthetic:tiny"\ndevcie = 1\n')
    r = subprocess.run(
        [sys.executable, "-m", "memsvc.cli", "up", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "models[0]: unknown key(s) ['devcie']" in errors[0], r.stderr


def test_the_readmes_host_file_loads_as_written(tmp_path: Path) -> None:
    import re

    from upproc import REPO_ROOT

    from memsvc._host import load_host_config

    (block,) = re.findall(r"^```toml\n(.*?)^```", (REPO_ROOT / "README.md").read_text(), re.S | re.M)
    path = tmp_path / "host.toml"
    path.write_text(block)
    cfg = load_host_config(path)
    assert [(x.model, x.name) for x in cfg.models] == [
        ("Qwen/Qwen2.5-0.5B-Instruct", ""),
        ("/models/Llama-3.1-8B-Instruct", "llama"),
    ]
    assert cfg.policy["device_budget_bytes"] == 20_000_000_000


def test_the_files_policy_is_checked_as_the_manager_would(tmp_path: Path) -> None:
    """A tier-1 timeout past memsvc up's own tier-2 default (3600 s) drops that default (it would
    come first); a file that itself orders the tiers wrongly is its own error, before anything starts."""
    from memsvc._host import load_host_config
    from memsvc.errors import InvalidArgument

    path = tmp_path / "host.toml"
    path.write_text('[policy]\nidle_sleep_timeout = 7200\n\n[[models]]\nmodel = "synthetic:tiny"\n')
    assert load_host_config(path).policy["idle_deep_sleep_timeout"] == 0.0
    path.write_text(
        '[policy]\nidle_sleep_timeout = 7200\nidle_deep_sleep_timeout = 60\n\n[[models]]\nmodel = "synthetic:tiny"\n'
    )
    with pytest.raises(InvalidArgument, match=r"\[policy\]: idle_deep_sleep_timeout must be at least"):
        load_host_config(path)


def test_stop_after_gives_the_policy_a_start_timeout_unless_the_file_sets_one(tmp_path: Path) -> None:
    from memsvc._host import START_TIMEOUT_S, load_host_config
    from memsvc.errors import InvalidArgument

    path = tmp_path / "host.toml"
    model = '[[models]]\nmodel = "synthetic:tiny"\n'
    path.write_text(model)
    assert load_host_config(path).stop_after == 0 and "start_timeout" not in load_host_config(path).policy
    path.write_text(f"[workers]\nstop_after = 600\n\n{model}")
    cfg = load_host_config(path)
    assert cfg.stop_after == 600 and cfg.policy["start_timeout"] == START_TIMEOUT_S
    path.write_text(f"[workers]\nstop_after = 600\n\n[policy]\nstart_timeout = 45\n\n{model}")
    assert load_host_config(path).policy["start_timeout"] == 45
    path.write_text(f"[workers]\nstop_after = 600\n\n[policy]\nstart_timeout = 0\n\n{model}")
    with pytest.raises(InvalidArgument, match="stop_after needs a start_timeout above 0"):
        load_host_config(path)
    path.write_text(f"[workers]\nstop_after = 600\n\n{model}policy = {{ start_timeout = 0 }}\n")
    with pytest.raises(InvalidArgument, match="the policy of synthetic-tiny has 0"):
        load_host_config(path)
    for bad in ("-1", '"10m"', "true"):
        path.write_text(f"[workers]\nstop_after = {bad}\n\n{model}")
        with pytest.raises(InvalidArgument, match="workers.stop_after must be a number of seconds"):
            load_host_config(path)


def test_ctrl_c_while_it_starts_stops_everything_and_exits_0(tmp_path: Path) -> None:
    h = Host(tmp_path)
    h.proc.start()
    try:
        assert h.proc.proc is not None
        wait_for(
            lambda: worker_pid(h.proc.proc.pid, "alpha"),  # type: ignore[union-attr]
            lambda p: p is not None,
            what="the first worker to start",
        )
        assert h.proc.signal_and_wait(signal.SIGINT) == 0, h.proc.stderr_text()[-3000:]
    finally:
        h.channel.close()
        h.proc.kill()


def test_a_worker_that_refuses_its_start_is_not_restarted(tmp_path: Path) -> None:
    """A model the Hub cache does not hold, offline: its worker exits 2 at start, and memsvc up says so
    once and does not start it again (the same flags would be refused again); Ctrl-C still exits 0."""
    manager, gateway = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    file = tmp_path / "host.toml"
    models = '[[models]]\nmodel = "acme/absent"\nbackend = "host"\n'
    file.write_text(
        f'[manager]\nlisten = "{manager}"\nmetrics_listen = ""\nstate_dir = "{tmp_path / "state"}"\n\n'
        f'[gateway]\nlisten = "{gateway}"\n\n{models}'
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = Proc([sys.executable, "-m", "memsvc.cli", "up", "--config", str(file)], env=env, name="memsvc up")
    proc.start()
    try:
        wait_for(proc.stderr_text, lambda t: "refused its start" in t, what="the refusal to be reported")
        assert proc.proc is not None and proc.proc.poll() is None, "memsvc up stopped with the worker"
        assert proc.signal_and_wait(signal.SIGINT) == 0
        assert proc.stderr_text().count("acme-absent refused its start") == 1
        assert "not in the Hub cache" in proc.stderr_text()
    finally:
        proc.kill()


def test_a_file_with_a_manager_elsewhere_runs_its_workers_only_each_at_its_port_and_prefixed(tmp_path: Path) -> None:
    """The Kubernetes form (deploy/kubernetes/overlays/many-models): ``[manager] address`` is a manager
    that runs elsewhere, ``[gateway] listen = ""`` starts none, ``[workers] listen`` gives the first
    model's port and the next ones follow; the pod's IP and name come from the environment as the
    advertised host and the id prefix. ``[policy]`` becomes each worker's overrides, and the manager's
    own default is left alone. SIGTERM stops the workers; the manager runs on."""
    from managerproc import ManagerProcess

    manager = ManagerProcess(tmp_path / "manager.db").start()
    first = next(p for p in range(20000 + os.getpid() % 20000, 65000, 7) if _free(p) and _free(p + 1))
    path = tmp_path / "host.toml"
    entries = "".join(
        f'[[models]]\nmodel = "synthetic:tiny"\nname = "{n}"\nbackend = "host"\nargs = ["--host-capacity", "16MiB"]\n\n'
        for n in ("alpha", "beta")
    )
    path.write_text(
        f'[manager]\naddress = "{manager.address}"\n\n[gateway]\nlisten = ""\n\n'
        f'[workers]\nlisten = "127.0.0.1:{first}"\n\n[policy]\nidle_sleep_timeout = 600\n\n{entries}'
    )
    default_before = manager.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    env = {**os.environ, "MEMSVC_ADVERTISE_HOST": "127.0.0.1", "MEMSVC_WORKER_ID_PREFIX": "pod-0"}
    proc = Proc([sys.executable, "-m", "memsvc.cli", "up", "--config", str(path)], env=env, name="memsvc up")
    proc.start()
    try:
        want = {"pod-0-alpha": f"127.0.0.1:{first}", "pod-0-beta": f"127.0.0.1:{first + 1}"}

        def registered() -> dict[str, str]:
            ws = manager.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers
            return {
                w.name.removeprefix("workers/"): w.address for w in ws if w.state != common_pb.WORKER_STATE_UNAVAILABLE
            }

        wait_for(registered, lambda r: r == want, what="both workers registered at their ports", timeout=120)

        def overrides(wid: str) -> manager_pb.Policy:
            return manager.stub.GetPolicy(manager_pb.GetPolicyRequest(name=f"workers/{wid}"), timeout=10).policy

        for wid in want:  # [policy] is each worker's override; the manager's default stays as it was
            wait_for(
                functools.partial(overrides, wid),
                lambda p: p.idle_sleep_timeout.seconds == 600,
                what=f"{wid}'s override",
                timeout=60,
            )
        assert manager.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy == default_before
        started = [argv[3] for argv in children(proc.pid).values() if argv[1:3] == [b"-m", b"memsvc.cli"]]
        assert sorted(started) == [b"worker", b"worker"], "no manager or gateway of its own"
        assert proc.signal_and_wait(signal.SIGTERM, 60) == 0
        wait_for(registered, lambda r: r == {}, what="the workers gone (unreachable at the manager)", timeout=60)
        assert manager.running, "the manager elsewhere runs on"
    finally:
        proc.kill()
        manager.kill()


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
