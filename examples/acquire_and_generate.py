"""A small service-side client: acquire a worker from the manager, run Generate on it, release it.

Needs only the generated stubs (``pip install memsvc``, no torch):

    python examples/acquire_and_generate.py --manager 127.0.0.1:50051 --worker gpu0 --prompt 1 2 3

The lease keeps the worker awake while we use it (the manager wakes it first if it sleeps) and is
released in ``finally``, so the idle clock starts as soon as we are done. A lease also expires on its
own (``--ttl``) if this process dies without releasing it.
"""

from __future__ import annotations

import argparse
import sys
import uuid

import grpc

from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc


def run(manager: str, worker: str, prompt: list[int], max_new_tokens: int, ttl_s: float) -> list[int]:
    with grpc.insecure_channel(manager) as mchan:
        mgr = manager_grpc.MemoryManagerServiceStub(mchan)
        req = manager_pb.AcquireWorkerRequest(
            name=f"workers/{worker}", holder="examples/acquire_and_generate", request_id=uuid.uuid4().hex
        )
        req.ttl.FromSeconds(int(ttl_s))
        acquired = mgr.AcquireWorker(req, timeout=300)  # waits while the worker wakes
        try:
            with grpc.insecure_channel(acquired.worker.address) as wchan:
                stub = worker_grpc.ModelWorkerServiceStub(wchan)
                reply = stub.Generate(
                    worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=max_new_tokens), timeout=120
                )
                return list(reply.token_ids)
        finally:
            mgr.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=acquired.lease.lease_id), timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manager", default="127.0.0.1:50051")
    ap.add_argument("--worker", required=True, help="worker id (as in `memsvc status`)")
    ap.add_argument("--prompt", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--ttl", type=float, default=60.0, help="lease lifetime in seconds")
    args = ap.parse_args()
    try:
        tokens = run(args.manager, args.worker, args.prompt, args.max_new_tokens, args.ttl)
    except grpc.RpcError as err:
        print(f"failed: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(" ".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
