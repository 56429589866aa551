"""``memsvc up --config host.toml`` for tests: a host file of tiny synthetic models on one simulated
device that holds one awake model at a time, the process started as a user starts it, and what the
tests ask it (the manager's workers, the gateway's models and text, a child worker's pid).
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest
from childproc import Proc
from upproc import free_port

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc

openai = pytest.importorskip("openai")

MODELS = ("alpha", "beta", "gamma")


def host_file(
    path: Path, manager: str, gateway: str, names: tuple[str, ...], idle_sleep: float = 0, workers: str = ""
) -> Path:
    """Each model a tiny synthetic one on a 6 MiB simulated device (one awake fits), named as given;
    ``idle_sleep``: the policy's idle_sleep_timeout; ``workers``: the ``[workers]`` table's lines."""
    entries = "".join(
        f'[[models]]\nmodel = "synthetic:tiny"\nname = "{n}"\nbackend = "host"\nargs = ["--host-capacity", "6MiB"]\n\n'
        for n in names
    )
    path.write_text(
        f'[manager]\nlisten = "{manager}"\nmetrics_listen = ""\nstate_dir = "{path.parent / "state"}"\n\n'
        f'[gateway]\nlisten = "{gateway}"\n\n[workers]\n{workers}\n\n[policy]\nidle_sleep_timeout = {idle_sleep}\n\n'
        f"{entries}"
    )
    return path


def children(parent: int) -> dict[int, list[bytes]]:
    """``parent``'s child processes (from /proc): pid -> command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            out[int(entry.name)] = argv
    return out


def worker_pid(parent: int, worker_id: str) -> int | None:
    """The pid of ``memsvc up``'s child worker ``worker_id``, or None."""
    return next(
        (pid for pid, argv in children(parent).items() if b"worker" in argv and worker_id.encode() in argv), None
    )


class Host:
    def __init__(self, tmp: Path, names: tuple[str, ...] = MODELS, idle_sleep: float = 0, workers: str = "") -> None:
        self.manager, self.gateway = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.file = host_file(tmp / "host.toml", self.manager, self.gateway, names, idle_sleep, workers)
        # a session of its own: kill() at the end takes the children with it, whatever the test left
        self.proc = Proc([sys.executable, "-m", "memsvc.cli", "up", "--config", str(self.file)], name="memsvc up")
        self.channel = grpc.insecure_channel(self.manager)
        self.stub = manager_grpc.MemoryManagerServiceStub(self.channel)
        self.client = openai.OpenAI(base_url=f"http://{self.gateway}/v1", api_key="unused", max_retries=0, timeout=120)

    def workers(self) -> dict[str, manager_pb.Worker]:
        return {
            w.name.removeprefix("workers/"): w
            for w in self.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers
        }

    def listed(self) -> list[str]:
        """The gateway's model ids ([] while it does not answer yet)."""
        try:
            return sorted(x.id for x in self.client.models.list().data)
        except (openai.APIConnectionError, openai.InternalServerError):
            return []

    def text_or_503(self, model: str) -> str | None:
        """:meth:`text`, or None where the gateway answered 503 (to be asked again)."""
        try:
            return self.text(model)
        except openai.InternalServerError as exc:
            if exc.status_code != 503:
                raise
            return None

    def text(self, model: str) -> str:
        r = self.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
        )
        return str(r.choices[0].message.content)


def awake(h: Host) -> list[str]:
    return sorted(n for n, w in h.workers().items() if w.state == common_pb.WORKER_STATE_AWAKE)


__all__ = ["MODELS", "Host", "awake", "children", "host_file", "worker_pid"]
