"""How many SwapBlocks calls a worker serves, apart from what one Python client can send.

Each client is a process of its own that sends pre-encoded requests in turn, as bytes (no encode
or decode on the client side), keeping ``depth`` calls in flight; the clients wait for a common
start time and run for the same time. With one client this is the cheapest Python client there is;
with several it is the worker's capacity, the figure a scheduler in a faster language, or several
scheduler threads, would see. The rate counts every call over the union of the clients' windows
(first start to last end), so clients that start late lower it rather than raise it. The processes
are spawned: each imports the parent's main module again (torch, for bench_line_rate), which the
start time allows for.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque

SWAP_BLOCKS = "/memsvc.v1.ModelWorkerService/SwapBlocks"


def _client(
    address: str, bodies: list[bytes], first: int, depth: int, start: float, seconds: float
) -> tuple[int, float, float]:
    import grpc

    with grpc.insecure_channel(address) as channel:
        # no serializers: bytes in, bytes out
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(SWAP_BLOCKS)
        call(bodies[first], timeout=60)
        while time.time() < start:
            time.sleep(0.0005)
        began = time.time()
        t0 = time.perf_counter()
        end, done, sent = t0 + seconds, 0, first
        pending: deque[grpc.Future[bytes]] = deque()
        for _ in range(depth):
            sent += 1
            pending.append(call.future(bodies[sent % len(bodies)], timeout=60))
        while pending:
            pending.popleft().result()
            done += 1
            if time.perf_counter() < end:
                sent += 1
                pending.append(call.future(bodies[sent % len(bodies)], timeout=60))
        return done, began, began + time.perf_counter() - t0


def calls_per_second(address: str, bodies: list[bytes], clients: int, depth: int, seconds: float = 3.0) -> float:
    """Calls per second served to ``clients`` processes with ``depth`` calls in flight each, each
    client sending ``bodies`` in turn from its own starting point."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(clients) as pool:
        start = time.time() + 6.0  # every process imported its modules and connected by then
        jobs = [(address, bodies, k * len(bodies) // clients, depth, start, seconds) for k in range(clients)]
        runs = pool.starmap(_client, jobs)
    return sum(n for n, _, _ in runs) / (max(e for _, _, e in runs) - min(b for _, b, _ in runs))
