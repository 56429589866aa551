"""A service that ends while its event loop still runs (a worker refusing its model, a manager that
cannot open its store) exits without asyncio printing grpc's shutdown race as a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A real process: grpc's asyncio runtime is per process, and a test's own servers would keep it open.
_PROBE = textwrap.dedent(
    """
    import asyncio, gc, sys, threading

    from memsvc.runtime.serving import run_service, start_server

    def pollers() -> int:
        return sum("_poll_wrapper" in t.name for t in threading.enumerate())

    async def main() -> tuple[int, int]:
        srv = await start_server("127.0.0.1:0", [], [])
        with_server = pollers()
        await srv.stop(0)
        del srv  # the last server gone, as when a service returns early
        gc.collect()
        await asyncio.sleep(0)
        return with_server, pollers()

    print(*run_service(main()))
    """
)


def test_grpc_stays_open_until_the_services_event_loop_has_closed() -> None:
    """grpc.aio shuts its runtime down when its last server or channel is freed, closing the socket
    its poller wakes the loop through; inside a running loop, a wake-up already queued then reads
    the closed socket ("Exception in callback PollerCompletionQueue._handle_events ... Bad file
    descriptor", seen by chance on a loaded machine at a worker's exit 2). run_service keeps the
    runtime, and its poller thread, alive until the loop is closed."""
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with_server, after_drop = map(int, r.stdout.split())
    assert with_server == 1, f"grpc's poller thread was not found ({r.stdout!r}): the probe no longer sees it"
    assert after_drop == 1, "grpc shut down inside the running loop once the last server was freed"
    assert "Traceback" not in r.stderr and "Exception in callback" not in r.stderr, r.stderr
