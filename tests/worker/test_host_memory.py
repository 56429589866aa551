"""The default host reserve (worker/host_memory.py): how ``auto`` is sized, and the guard that gives
it back while the host is short and takes it again once it has recovered, applied to a real
host-backend allocator through the worker's HostRelease."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import AllocatorFactory
from workerproc import WorkerProcess

from memsvc.cli import build_parser
from memsvc.errors import InvalidArgument
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker import host_memory
from worker.config import WorkerConfig
from worker.device_loop import DeviceLoop
from worker.host_memory import (
    BackgroundPrepin,
    GiB,
    HostMemory,
    HostReserveGuard,
    auto_reserve,
    read_host_memory,
    short_threshold,
)
from worker.host_release import HostRelease


def test_meminfo_is_read_in_bytes(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 131072000 kB\nMemFree: 1 kB\nMemAvailable:   65536000 kB\nHugePages_Total: 0\n")
    assert read_host_memory(f) == HostMemory(131072000 * 1024, 65536000 * 1024)
    f.write_text("MemTotal: 5 kB\n")
    with pytest.raises(InvalidArgument, match="MemAvailable"):
        read_host_memory(f)
    real = read_host_memory()
    assert 0 < real.available <= real.total


def test_auto_is_the_weights_within_a_quarter_of_the_host_and_none_when_it_would_leave_the_host_short() -> None:
    assert short_threshold(128 * GiB) == int(12.8 * GiB) and short_threshold(8 * GiB) == 2 * GiB
    roomy = HostMemory(128 * GiB, 100 * GiB)
    assert auto_reserve(16 * GiB, roomy) == 16 * GiB
    assert auto_reserve(60 * GiB, roomy) == 32 * GiB  # a quarter of the host at most
    tight = HostMemory(128 * GiB, 20 * GiB)  # 20 - 16 < 12.8: holding it would leave the host short
    assert auto_reserve(16 * GiB, tight) == 0
    assert auto_reserve(4 * GiB, tight) == 4 * GiB


def test_the_flags_take_auto_and_refuse_what_is_neither_a_size_nor_auto() -> None:
    args = build_parser().parse_args(["worker"])
    assert args.host_reserve_bytes == "auto" and args.host_prepin == "auto"
    args = build_parser().parse_args(["worker", "--host-reserve", "1GiB", "--host-prepin", "weights"])
    assert args.host_reserve_bytes == 1 << 30 and args.host_prepin == "weights"
    assert WorkerConfig().host_reserve_bytes == "auto" and WorkerConfig().host_prepin == "auto"
    for bad in ({"host_reserve_bytes": "weights"}, {"host_reserve_bytes": -1}, {"host_prepin": "some"}):
        with pytest.raises(InvalidArgument):
            WorkerConfig(**bad)


@pytest.mark.asyncio
async def test_the_guard_gives_the_reserve_back_while_the_host_is_short_and_takes_it_again(
    make_allocator: AllocatorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    alloc = make_allocator("host")
    loop = asyncio.get_running_loop()
    device = DeviceLoop(loop)
    release = HostRelease(alloc, device, loop, lambda: 0.0)
    reserve = 64 << 20
    alloc.set_host_reserve(reserve)
    readings = [HostMemory(64 * GiB, 40 * GiB)]
    applied: list[int] = []

    def apply(nbytes: int) -> None:
        applied.append(nbytes)
        device.submit(release.set_base, nbytes)

    guard = HostReserveGuard(reserve, apply, read=lambda: readings[-1])
    caplog.set_level(logging.INFO, "memsvc.worker")
    try:
        guard.check()
        assert applied == [] and not guard.released  # room: nothing to do
        readings.append(HostMemory(64 * GiB, 5 * GiB))  # below the threshold (6.4 GiB)
        guard.check()
        guard.check()
        assert applied == [0] and guard.released
        await device.run(lambda: None)
        assert alloc.stats().counters["host_reserve_bytes"] == 0
        assert "host memory short" in caplog.text
        readings.append(HostMemory(64 * GiB, int(6.42 * GiB)))  # above the threshold, not by the reserve
        guard.check()
        assert applied == [0]
        readings.append(HostMemory(64 * GiB, 30 * GiB))
        guard.check()
        assert applied == [0, reserve] and not guard.released
        await device.run(lambda: None)
        assert alloc.stats().counters["host_reserve_bytes"] == reserve
        # while a wake holds its chunks, the new base is where the hold ends up
        await device.run(release.hold)
        readings.append(HostMemory(64 * GiB, 1 * GiB))
        guard.check()
        await device.run(lambda: None)
        await device.run(release.restore_reserve)
        assert alloc.stats().counters["host_reserve_bytes"] == 0
    finally:
        await guard.stop()
        device.shutdown()


def _pinned(wp: WorkerProcess) -> int:
    return int(wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.host_pinned_bytes)


def _pinned_until(wp: WorkerProcess, ok: Callable[[int], bool], what: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        got = _pinned(wp)
        if ok(got):
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for host_pinned_bytes {what}; last {got}")
        time.sleep(0.05)


def test_a_sleeper_on_disk_or_at_level_2_gives_its_reserve_back_and_takes_it_again_on_wake(tmp_path: Path) -> None:
    """Before, an 8B worker asleep with its weights on disk still held its 17 GB reserve: demoting
    sleepers to disk freed no host RAM for anyone. Now a sleep that leaves no tag awake gives the
    reserve back, and the wake takes it again in the background (worker/host_release.py)."""
    reserve = 32 << 20
    args = [
        "--model",
        "synthetic:tiny",
        "--host-capacity",
        "64MiB",
        "--offload-dir",
        str(tmp_path),
        "--host-reserve",
        str(reserve),
        "--host-prepin",
        str(reserve),
    ]
    with WorkerProcess(args) as wp:
        awake = _pinned_until(wp, lambda n: n >= reserve, "to hold the pre-pinned reserve")
        to_disk = {"weights": common_pb.TAG_ACTION_OFFLOAD_DISK, "kv_cache": common_pb.TAG_ACTION_DISCARD}
        for sleep in (
            worker_pb.SleepRequest(tag_actions=to_disk),
            worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_2),
        ):
            wp.stub.Sleep(sleep, timeout=60)
            _pinned_until(wp, lambda n: n <= awake - reserve, f"to drop by the reserve after {sleep}")
            wp.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)
            _pinned_until(wp, lambda n: n >= awake, "to come back after the wake")


class _SlowPrepin:
    """An allocator's prepin that waits for the test: where a sleep comes in the middle of it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.calls: list[int] = []

    def prepin_host(self, nbytes: int) -> None:
        self.calls.append(nbytes)
        self.started.set()
        assert self.go.wait(30)


def test_a_prepin_the_reserve_was_given_back_during_gives_back_what_it_pinned_and_queued_ones_skip() -> None:
    """A wake queues the re-pin of a reserve its sleep gave back; a sleep with nothing awake that
    comes before the prepin ends gives the reserve back again: the running prepin's chunks are given
    back when it ends (``unwanted``), and one still queued does not start (review of 4bdfc4b)."""
    alloc = _SlowPrepin()
    prepin = BackgroundPrepin(alloc)  # type: ignore[arg-type]  # only prepin_host is used
    parked = threading.Event()
    given_back = threading.Event()
    try:
        prepin.request(1 << 20, lambda: not parked.is_set(), given_back.set)
        prepin.request(2 << 20, lambda: not parked.is_set(), given_back.set)
        assert alloc.started.wait(30)
        parked.set()  # the sleep parks the reserve while the first prepin runs
        alloc.go.set()
        assert given_back.wait(30)
    finally:
        prepin.stop()
        assert prepin.join(30)
    assert alloc.calls == [1 << 20], "the queued prepin ran after the reserve was given back"


class _Pieces:
    """An allocator's prepin that records each call; the call ``busy_at`` (1-based) marks the worker
    busy, as a request arriving during it would."""

    def __init__(self, busy: threading.Event, busy_at: int = 0) -> None:
        self.calls: list[int] = []
        self.busy = busy
        self.busy_at = busy_at

    def prepin_host(self, nbytes: int) -> None:
        self.calls.append(nbytes)
        if len(self.calls) == self.busy_at:
            self.busy.set()


def test_the_prepin_pins_a_piece_at_a_time_and_only_while_no_generate_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page-locking holds up the steps beside it (an 8B model's first request after ready: 0.54 s
    instead of 0.11 s while its weights' size was pinned at once), so the prepin waits for the worker
    to idle and pins STEP_BYTES at a time, pausing when a request comes."""
    monkeypatch.setattr(host_memory, "IDLE_S", 0.05)
    piece = host_memory.STEP_BYTES
    busy = threading.Event()
    last = [time.monotonic()]

    def last_busy() -> float:
        if busy.is_set():
            last[0] = time.monotonic()
        return last[0]

    busy.set()  # requests are running when the load ends
    alloc = _Pieces(busy, busy_at=2)
    prepin = BackgroundPrepin(alloc, last_busy)  # type: ignore[arg-type]  # only prepin_host is used
    try:
        prepin.request(3 * piece + (piece >> 1))
        time.sleep(20 * host_memory.IDLE_S)
        assert alloc.calls == [], "it pinned while Generates ran"
        busy.clear()
        end = time.monotonic() + 30
        while len(alloc.calls) < 2:  # the second piece marks the worker busy again
            assert time.monotonic() < end, alloc.calls
            time.sleep(0.01)
        time.sleep(20 * host_memory.IDLE_S)
        assert alloc.calls == [piece, 2 * piece], "it went on while a request ran"
        busy.clear()
        while len(alloc.calls) < 4:
            assert time.monotonic() < end, alloc.calls
            time.sleep(0.01)
    finally:
        prepin.stop()
        assert prepin.join(30)
    assert alloc.calls == [piece, 2 * piece, 3 * piece, 3 * piece + (piece >> 1)], "each call: the total so far"


def test_the_prepin_starts_no_sooner_than_idle_s_after_it_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request a client sends as soon as the worker is ready (or awake again) must not meet a
    piece being page-locked: a worker idle since long before still waits IDLE_S from the ask."""
    monkeypatch.setattr(host_memory, "IDLE_S", 0.2)
    alloc = _Pieces(threading.Event())
    pinned_at: list[float] = []
    record = alloc.prepin_host

    def timed(nbytes: int) -> None:
        pinned_at.append(time.monotonic())
        record(nbytes)

    alloc.prepin_host = timed  # type: ignore[method-assign]
    prepin = BackgroundPrepin(alloc, lambda: time.monotonic() - 100.0)  # type: ignore[arg-type]  # only prepin_host
    try:
        asked = time.monotonic()
        prepin.request(host_memory.STEP_BYTES)
        end = time.monotonic() + 30
        while not pinned_at:
            assert time.monotonic() < end, "it never pinned"
            time.sleep(0.01)
    finally:
        prepin.stop()
        assert prepin.join(30)
    assert pinned_at[0] - asked >= 0.2, "it pinned before IDLE_S had passed since it was asked"
