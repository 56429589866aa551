"""bench/thread_states.py on a real process: a thread blocked on a ``threading`` lock, and two threads
taking turns at the GIL, told apart from outside; and ``bench_startup --thread-states`` on a CPU start."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.thread_states import ThreadSampler, by_cpu, summarize

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import json, threading

    held = threading.Lock()
    held.acquire()

    def spin():
        x = 0
        while True:
            x += 1

    waiter = threading.Thread(target=held.acquire, daemon=True)
    spinner = threading.Thread(target=spin, daemon=True)
    waiter.start()
    spinner.start()
    print(json.dumps({"main": threading.get_native_id(), "waiter": waiter.native_id, "spinner": spinner.native_id}),
          flush=True)
    spin()
    """
)


@pytest.fixture
def sampled() -> Iterator[tuple[ThreadSampler, dict[str, int]]]:
    """The child above, its threads sampled until the lock's waiter has 100 samples in which it waits."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ids: dict[str, int] = json.loads(proc.stdout.readline())
        sampler = ThreadSampler(proc.pid).start()
        deadline = time.monotonic() + 60
        while sum(1 for s in sampler.samples if s.tid == ids["waiter"] and s.syscall is not None) < 100:
            assert time.monotonic() < deadline, "the sampler saw too little of the waiting thread"
            time.sleep(0.02)
        sampler.stop()
        yield sampler, ids
    finally:
        proc.kill()
        proc.wait()


def test_a_thread_blocked_on_a_lock_and_threads_taking_turns_at_the_gil_are_told_apart(
    sampled: tuple[ThreadSampler, dict[str, int]],
) -> None:
    sampler, ids = sampled
    end = max(s.at for s in sampler.samples)
    waiter = summarize(sampler, ids["waiter"], 0.0, end)
    # asleep throughout, on a lock the program allocated (not the interpreter's own)
    assert waiter["states"].get("S", 0) > 0.9
    assert max(waiter["waits"], key=waiter["waits"].get) in ("futex in [heap]", "futex in anonymous")
    assert any("python" in what for _, _, what in sampler.maps), "the interpreter's image is among the mappings"
    for name in ("main", "spinner"):
        turns = summarize(sampler, ids[name], 0.0, end)
        assert turns["states"].get("R", 0) > 0.1, turns  # it computes, in turns
        gil = sum(share for wait, share in turns["waits"].items() if wait.startswith("futex in") and "python" in wait)
        assert gil > 0.1, turns  # and waits for the GIL, a lock in the interpreter's image
    assert by_cpu(sampler.samples, 0.0, end)[0] in (ids["main"], ids["spinner"])


def test_bench_startup_reports_the_import_threads_states(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    tiny = ["--shape", "tiny", "--backend", "host", "--repeats", "1", "--warmup", "0"]
    only = ["--no-baseline", "--no-breakdown", "--thread-states", "--out", str(out)]
    argv = [sys.executable, "-m", "bench.bench_startup", *tiny, *only]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=600)
    [run] = json.loads(out.read_text())["worker"]["runs"]
    states = run["import_thread_states"]
    assert states["samples"] > 0 and states["tid"] != run["main_thread_states"]["tid"]
    assert all(other["tid"] != states["tid"] for other in run["other_busiest_threads"])
    # the busiest thread over the import: it gained more CPU than any other, and most of the window's
    assert states["cpu_s"] >= max((o.get("cpu_s", 0) for o in run["other_busiest_threads"]), default=0)
    assert states["cpu_s"] > 0.2 * (states["window_s"][1] - states["window_s"][0])
    assert abs(sum(states["states"].values()) - 1) < 0.01
    # the import computes most of its window on this host (no other thread of the worker imports beside it)
    assert states["states"].get("R", 0) > 0.5, states
