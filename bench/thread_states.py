"""What a process's threads are doing, sampled from outside: on the CPU, or waiting, and on what.

Why: a worker's spawn on a GPU host is bound by its import thread (``import torch`` and the model
layer), and that thread spends a fifth of its wall time neither on a core nor in a runqueue
(docs/benchmarks.md, "Start-up: Triton's own hash after torch's import"). Is it the GIL, glibc's
loader lock (``dlopen`` of torch's libraries beside the CUDA driver's start), a Python import lock,
the address space's lock, or a read? Nothing inside the process can say without changing what it
measures (a Python sampler needs the GIL itself), so this reads, from another process, each of the
target's threads' state every few milliseconds:

- ``/proc/<pid>/task/<tid>/stat``: the scheduler's state (``R`` on a core or ready, ``S`` asleep,
  ``D`` in an uninterruptible wait: a disk read, a page fault behind the address space's lock) and
  the thread's CPU so far;
- ``/proc/<pid>/task/<tid>/syscall``: the system call it waits in, with its first argument: for a
  ``futex``, the lock's address. The addresses are named afterwards by ``/proc/<pid>/maps``: a lock
  in ``ld-linux`` is the loader's, one in the interpreter's own image (``python3``, ``libpython``) is
  the GIL or another lock of the runtime, one in the heap or an anonymous mapping a lock Python or a
  library allocated (``threading``'s, the import system's per-module locks).

Reading another process's ``syscall`` file needs the right to trace it (a parent may, its child; root
may): where it cannot be read, only the state is kept.

:class:`ThreadSampler` samples; :func:`summarize` says, for one thread and a window, which share of the
samples was which. ``bench_startup --thread-states`` uses them for the import thread of each start.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

INTERVAL_S = 0.002
"""Between two rounds of samples (each round reads every thread's two files: about 0.1 ms a thread)."""
SYSCALLS_X86_64 = {
    0: "read",
    1: "write",
    3: "close",
    7: "poll",
    9: "mmap",
    10: "mprotect",
    11: "munmap",
    16: "ioctl",
    17: "pread64",
    35: "nanosleep",
    202: "futex",
    230: "clock_nanosleep",
    232: "epoll_wait",
    257: "openat",
    262: "newfstatat",
    281: "epoll_pwait",
    332: "statx",
}
"""The calls a start waits in most, by their x86-64 numbers; others are named by number."""
FUTEX = 202


@dataclass(frozen=True)
class Sample:
    """One thread at one moment."""

    at: float
    """Seconds since the sampler's origin (the spawn, for ``bench_startup``)."""
    tid: int
    state: str
    """The scheduler's state letter: R, S, D, ..."""
    cpu_ticks: int
    """User and system time so far, in clock ticks."""
    syscall: int | None
    """The call it is in; None where it runs, or the file could not be read."""
    arg0: int | None
    """That call's first argument (a futex's address)."""


@dataclass
class ThreadSampler:
    """Samples every thread of ``pid`` on a thread of this process until :meth:`stop`."""

    pid: int
    origin: float = field(default_factory=time.perf_counter)
    """The ``perf_counter`` reading that samples' ``at`` count from."""
    interval: float = INTERVAL_S
    samples: list[Sample] = field(default_factory=list)
    maps: list[tuple[int, int, str]] = field(default_factory=list)
    """The target's mappings (start, end, what), read at :meth:`stop`: what names a lock's address."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ThreadSampler:
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling, and read the target's mappings (before it exits: call this first); once."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.maps = read_maps(self.pid)

    def _run(self) -> None:
        task = f"/proc/{self.pid}/task"
        while not self._stop.is_set():
            try:
                tids = os.listdir(task)
            except OSError:
                return  # it exited
            for name in tids:
                sample = read_sample(self.pid, int(name), time.perf_counter() - self.origin)
                if sample is not None:
                    self.samples.append(sample)
            self._stop.wait(self.interval)


def read_sample(pid: int, tid: int, at: float) -> Sample | None:
    """Thread ``tid`` of ``pid`` now; None where it has ended."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    syscall = arg0 = None
    try:
        with open(f"{base}/syscall") as f:
            words = f.read().split()
        if words and words[0] not in ("running", "-1"):
            syscall, arg0 = int(words[0]), int(words[1], 16)
    except (OSError, ValueError, IndexError):  # not ours to trace, or it ended
        pass
    return Sample(at, tid, fields[0], int(fields[11]) + int(fields[12]), syscall, arg0)


def read_maps(pid: int) -> list[tuple[int, int, str]]:
    """``/proc/<pid>/maps`` as (start, end, the file's name, or ``[heap]``, or ``anonymous``), sorted."""
    out: list[tuple[int, int, str]] = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                what = parts[5].strip() if len(parts) > 5 else ""
                out.append((lo, hi, os.path.basename(what) if what.startswith("/") else (what or "anonymous")))
    except (OSError, ValueError, IndexError):
        return []
    return sorted(out)


def where(address: int, maps: list[tuple[int, int, str]]) -> str:
    """The mapping ``address`` lies in (see :func:`read_maps`), or ``unknown``."""
    i = bisect.bisect_right(maps, address, key=lambda m: m[0]) - 1
    if i >= 0 and maps[i][0] <= address < maps[i][1]:
        return maps[i][2]
    return "unknown"


def by_cpu(samples: list[Sample], start: float, end: float) -> list[int]:
    """The threads seen between ``start`` and ``end``, those that gained the most CPU meanwhile first
    (over a start's import, its import thread first)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for s in samples:
        if start <= s.at <= end:
            first.setdefault(s.tid, s.cpu_ticks)
            last[s.tid] = s.cpu_ticks
    return sorted(last, key=lambda tid: first[tid] - last[tid])


def summarize(sampler: ThreadSampler, tid: int, start: float, end: float) -> dict[str, Any]:
    """Thread ``tid``'s samples between ``start`` and ``end``: the CPU it gained, the share in each
    state, and the share spent waiting in each call; a ``futex`` is named by the mapping its lock
    lies in (``futex in libpython3.12.so``: the GIL, or another lock of the runtime; ``futex in
    ld-linux-x86-64.so.2``: the loader's; ``futex in [heap]``: a lock Python or a library allocated)."""
    mine = [s for s in sampler.samples if s.tid == tid and start <= s.at <= end]
    n = len(mine)
    out: dict[str, Any] = {"tid": tid, "samples": n, "window_s": [round(start, 3), round(end, 3)]}
    if not n:
        return out
    out["cpu_s"] = round((mine[-1].cpu_ticks - mine[0].cpu_ticks) / os.sysconf("SC_CLK_TCK"), 3)
    out["states"] = {k: round(v / n, 3) for k, v in Counter(s.state for s in mine).most_common()}
    waits: Counter[str] = Counter()
    for s in mine:
        if s.state == "R" or s.syscall is None:
            continue
        if s.syscall == FUTEX and s.arg0 is not None:
            waits[f"futex in {where(s.arg0, sampler.maps)}"] += 1
        else:
            waits[SYSCALLS_X86_64.get(s.syscall, f"syscall {s.syscall}")] += 1
    out["waits"] = {k: round(v / n, 3) for k, v in waits.most_common(8)}
    return out


__all__ = ["Sample", "ThreadSampler", "by_cpu", "read_maps", "read_sample", "summarize", "where"]
