"""A slept range is really gone: touching it faults (host backend: the range is PROT_NONE again).

Each touch happens in a forked child, so the SIGSEGV kills the child and the test process goes on.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import signal
import sys
import time
from collections.abc import Callable

import pytest
import torch
from _util import MiB, fill_random

from worker.allocator import MemoryAllocator

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="host backend is Linux-only"),
    # Python 3.12+ warns on fork() with threads alive (torch's, the allocator's); the children here
    # only read memory, never take a lock another thread could hold, and are killed if they hang.
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

OK, WRONG, RAISED = 0, 3, 4


def run_in_child(body: Callable[[], bool], timeout_s: float = 60.0) -> int:
    """Run ``body`` in a forked child; return its raw wait status.

    The child exits 0 when ``body`` returns True, 3 when it returns False, 4 when it raises, and dies
    by a signal if it faults. Bodies avoid torch's intra-op thread pool (small tensors, or ctypes),
    which does not survive fork. A child still running after ``timeout_s`` is killed and the test
    fails, so a hang cannot stall the suite.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = RAISED
        try:
            faulthandler.disable()  # die by the signal itself, quietly
            code = OK if body() else WRONG
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"forked child did not finish within {timeout_s} s")
        time.sleep(0.002)


def assert_segfaulted(status: int) -> None:
    assert os.WIFSIGNALED(status), f"child exited normally with {os.WEXITSTATUS(status)}, expected SIGSEGV"
    assert os.WTERMSIG(status) == signal.SIGSEGV


def assert_exited_ok(status: int) -> None:
    assert os.WIFEXITED(status), f"child died by signal {os.WTERMSIG(status)}"
    assert os.WEXITSTATUS(status) == OK


@pytest.mark.parametrize("action", ["offload", "discard"])
def test_reading_a_slept_tensor_kills_only_the_child(host_alloc: MemoryAllocator, action: str) -> None:
    t = host_alloc.empty((1024,), torch.float32, tag="weights")
    t.fill_(1.0)
    host_alloc.sleep({"weights": action})

    assert_segfaulted(run_in_child(lambda: float(t.sum().item()) == 1024.0))

    # the parent is unharmed and the tag wakes as usual
    host_alloc.wake_up()
    t.fill_(2.0)
    assert float(t.sum().item()) == 2048.0


def test_writing_a_slept_tensor_faults(host_alloc: MemoryAllocator) -> None:
    t = host_alloc.empty((3 * MiB,), torch.uint8, tag="kv_cache")
    host_alloc.sleep({"kv_cache": "discard"})

    def write() -> bool:
        t[-1] = 7  # the last byte: the whole range, not just its start, is unmapped
        return True

    assert_segfaulted(run_in_child(write))


def test_woken_tensor_is_readable_in_a_child(host_alloc: MemoryAllocator, gen: torch.Generator) -> None:
    t = host_alloc.empty((5 * MiB,), torch.uint8, tag="weights")
    data = fill_random(t, gen)
    host_alloc.sleep({"weights": "offload"})
    host_alloc.wake_up()
    expected = data.numpy().tobytes()
    ptr, n = t.data_ptr(), t.numel()
    # control: the same kind of read in a child succeeds once the tag is awake, and sees the restored bytes
    assert_exited_ok(run_in_child(lambda: ctypes.string_at(ptr, n) == expected))
    assert_exited_ok(run_in_child(lambda: int(t[:4096].sum().item()) == int(data[:4096].sum().item())))


def test_only_the_sleeping_tag_faults_after_a_partial_wake(host_alloc: MemoryAllocator) -> None:
    w = host_alloc.empty((4096,), torch.int32, tag="weights")
    kv = host_alloc.empty((4096,), torch.int32, tag="kv_cache")
    w.fill_(5)
    kv.fill_(6)
    host_alloc.sleep({"weights": "offload", "kv_cache": "discard"})
    host_alloc.wake_up(["weights"])

    assert_exited_ok(run_in_child(lambda: int(w.sum().item()) == 5 * 4096))
    assert_segfaulted(run_in_child(lambda: int(kv.sum().item()) >= 0))


def test_memory_returned_by_a_free_faults(host_alloc: MemoryAllocator) -> None:
    small = host_alloc.empty((1000,), torch.uint8, tag="weights")
    big = host_alloc.empty((9 * MiB,), torch.uint8, tag="weights")
    last_byte = big.data_ptr() + big.numel() - 1
    big.fill_(1)
    del big  # its trailing extents go back to the device
    gc.collect()
    small.fill_(2)

    assert_segfaulted(run_in_child(lambda: ctypes.c_uint8.from_address(last_byte).value == 1))
    assert int(small.sum().item()) == 2000
