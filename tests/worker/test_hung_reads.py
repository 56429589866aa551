"""A checkpoint read that never returns (issue 25 item 4: a shard on a network mount that hangs) no
longer wedges the worker: the loader's reads run on threads it waits for with a bound (``stall_s``,
the worker's ``--read-timeout``), so the load fails naming the file, and a stop cancels it at once;
SIGTERM ends a worker whose load hangs. A hung read is simulated by holding ``os.preadv`` on the
checkpoint's files while a gate is closed: in this process for the loader, through a
``sitecustomize`` module on the worker process's path for the real command."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from childproc import Proc
from hungmount import HungMount, tiny_checkpoint
from safetensors.torch import save_file
from workerproc import WorkerProcess

from memsvc.errors import Cancelled, Unavailable
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker.main import EXIT_GRACE_S
from worker.model.loader import StreamingLoader

WAIT_S = 60.0
"""How long a test waits for a condition (a busy 2-core machine is slow, never this slow)."""


def eventually(ok: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---- the loader, in process ----
class Gate:
    """``os.preadv`` of files under ``root`` waits while the gate is closed (a hung mount)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = str(root)
        self.open = threading.Event()
        self.waiting = 0
        real = os.preadv

        def preadv(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = ""
            if path.startswith(self.root):
                self.waiting += 1
                self.open.wait()
            return real(fd, buffers, offset, *rest)

        monkeypatch.setattr(os, "preadv", preadv)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(64, 256, generator=g) for i in range(8)}  # 8 x 64 KiB
    save_file(tensors, str(tmp_path / "model.safetensors"))
    yield tmp_path, tensors


def _load(loader: StreamingLoader, root: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dst = {n: torch.zeros_like(t) for n, t in tensors.items()}
    loader.load(root, dst, {n: t.shape for n, t in tensors.items()})
    return dst


def test_a_read_that_never_returns_fails_the_load_after_the_bound_and_blocks_loads_until_it_returns(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tensors = checkpoint
    gate = Gate(root, monkeypatch)
    loader = StreamingLoader(threads=2, chunk_bytes=64 << 10, stall_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="no progress for 0.5 s") as err:
        _load(loader, root, tensors)
    assert str(root / "model.safetensors") in str(err.value)
    assert time.monotonic() - t0 < WAIT_S
    with pytest.raises(Unavailable, match="has not returned"):
        _load(loader, root, tensors)  # the stuck readers are still inside their reads
    gate.open.set()  # the mount recovers: once those reads return, loads work again

    def loads() -> bool:
        try:
            got = _load(loader, root, tensors)
        except Unavailable:
            return False
        assert all(torch.equal(got[n], tensors[n]) for n in tensors)
        return True

    eventually(loads, "a load after the hung reads returned")


def test_cancel_ends_a_load_stuck_in_a_read_at_once(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tensors = checkpoint
    gate = Gate(root, monkeypatch)
    loader = StreamingLoader(threads=2, chunk_bytes=64 << 10, stall_s=3600)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            _load(loader, root, tensors)
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        eventually(lambda: gate.waiting > 0, "a read to hang")
        loader.cancel()
        thread.join(WAIT_S)
        assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Cancelled), outcome
        with pytest.raises(Cancelled):
            loader.check(root, {n: t.shape for n, t in tensors.items()})  # and every later one
    finally:
        gate.open.set()
        thread.join(WAIT_S)


# ---- the worker process ----
def test_a_worker_whose_checkpoint_read_hangs_at_start_exits_2_naming_it(tmp_path: Path) -> None:
    mount = HungMount(tmp_path, "ckpt")
    mount.hang()
    wp = WorkerProcess([*mount.worker_args, "--read-timeout", "1"], env=mount.env())
    try:
        Proc.start(wp)  # not WorkerProcess.start: no 'ready' is coming
        rc = wp.wait(WAIT_S + 30)
    finally:
        wp.kill()
    assert rc == 2, wp.failure(f"exit code {rc}")
    err = wp.stderr_text()
    assert "no progress for 1 s" in err and str(mount.root) in err and "Traceback" not in err, err[-3000:]
    assert mount.hung


def test_sigterm_stops_a_worker_whose_load_hangs(tmp_path: Path) -> None:
    mount = HungMount(tmp_path, "ckpt")
    mount.hang()
    wp = WorkerProcess(mount.worker_args, env=mount.env())  # the default 60 s bound
    try:
        Proc.start(wp)  # not WorkerProcess.start: no 'ready' is coming
        eventually(lambda: mount.hung, "the load's read to hang")
        t0 = time.monotonic()
        rc = wp.signal_and_wait(signal.SIGTERM, EXIT_GRACE_S + 30)
        took = time.monotonic() - t0
    finally:
        wp.kill()
        mount.recover()
    assert rc == 0, wp.failure(f"exit code {rc}")
    assert took < EXIT_GRACE_S + 20, took
    assert any(line.endswith(" stopped") for line in wp.lines), wp.lines


def test_reload_weights_from_a_hung_mount_fails_after_the_bound_and_changes_nothing(tmp_path: Path) -> None:
    """A ReloadWeights whose reads hang from the start fails after --read-timeout having written
    nothing: the worker serves its weights on (it used to discard them), its own checkpoint still
    reloads at a level-2 wake, a second ReloadWeights from the hung mount is refused at once naming
    the read still stuck, and once the mount recovers the reload goes through."""
    mount = HungMount(tmp_path, "other", seed=8)
    served = tiny_checkpoint(tmp_path / "served", seed=7)
    reload = worker_pb.ReloadWeightsRequest(model_path=str(mount.root))
    with WorkerProcess(["--model", str(served), "--read-timeout", "5"], env=mount.env()) as wp:
        prompt = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4, ignore_eos=True)

        def generate() -> list[int]:
            return list(wp.stub.Generate(prompt, timeout=WAIT_S).token_ids)

        before = generate()
        mount.hang()
        with pytest.raises(grpc.RpcError) as err:
            wp.stub.ReloadWeights(reload, timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
        assert "no progress for 5 s" in (err.value.details() or "") and "unchanged" in (err.value.details() or "")
        status = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=WAIT_S).status
        assert status.state == common_pb.WORKER_STATE_AWAKE and not status.transition_in_progress
        assert generate() == before
        wp.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_2), timeout=WAIT_S)
        wp.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=WAIT_S)  # its own checkpoint, on a mount that works
        assert generate() == before
        with pytest.raises(grpc.RpcError) as err:
            wp.stub.ReloadWeights(reload, timeout=WAIT_S)
        assert "has not returned" in (err.value.details() or ""), err.value.details()
        mount.recover()  # the mount comes back: once the stuck read returns, the reload goes through

        def reloaded() -> bool:
            try:
                wp.stub.ReloadWeights(reload, timeout=WAIT_S)
            except grpc.RpcError as exc:
                assert "has not returned" in (exc.details() or ""), exc.details()
                return False
            return True

        eventually(reloaded, "a reload once the hung read returned")
        assert generate() != before, "the other checkpoint's weights serve now"
        wp.stop()
