"""The ``memsvc`` command: ``memsvc worker`` serves a model; the manager and operator commands
build on the same entry point."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512MiB``, ``1.5G`` or a plain byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB, 8GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _worker_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("worker", help="serve one model on one device (ModelWorkerService)")
    p.add_argument("--listen", default="127.0.0.1:50061", help="host:port to serve on (port 0 picks one)")
    p.add_argument("--model", default="synthetic:tiny", help="checkpoint directory (HF layout) or synthetic:<preset>")
    p.add_argument("--backend", choices=["auto", "cuda", "host"], default="auto")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    p.add_argument("--worker-id", default="", help="registration name (default: <hostname>-<device>)")
    p.add_argument("--kv-blocks", type=int, default=256, help="device KV cache blocks")
    p.add_argument("--host-kv-blocks", type=int, default=256, help="host KV cache blocks (swap space)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--host-capacity", type=parse_bytes, default=8 << 30, help="host backend: simulated device size")
    p.add_argument("--checksum", action="store_true", help="verify offloaded data with checksums on wake")
    p.add_argument(
        "--host-reserve",
        type=parse_bytes,
        default=0,
        help="page-locked host memory kept between sleeps (faster later sleeps)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic weights")
    p.add_argument("--manager", default=None, help="manager address to register with (host:port)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memsvc", description="Sleep and wake LLM model workers.")
    sub = parser.add_subparsers(dest="command", required=True)
    _worker_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "worker":
        from worker.core import WorkerConfig
        from worker.main import run

        for name in ("kv_blocks", "host_kv_blocks", "block_size"):
            if getattr(args, name) <= 0:
                parser.error(f"--{name.replace('_', '-')} must be > 0")
        config = WorkerConfig(
            model=args.model,
            backend=args.backend,
            device=args.device,
            worker_id=args.worker_id,
            kv_blocks=args.kv_blocks,
            host_kv_blocks=args.host_kv_blocks,
            block_size=args.block_size,
            host_capacity_bytes=args.host_capacity,
            checksum=args.checksum,
            host_reserve_bytes=args.host_reserve,
            seed=args.seed,
        )
        return run(config, args.listen, args.manager)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
