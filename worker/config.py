"""How a worker is built: the ``memsvc worker`` flags as one frozen value."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from memsvc.errors import InvalidArgument, NotFound
from memsvc.runtime.flags import (
    count_or_auto,
    int_at_least,
    parse_bytes,
    prepin_size,
    reserve_size,
    seconds_up_to_an_hour,
    setting,
    some_seconds_up_to_an_hour,
)
from memsvc.vocabulary import RPC_FRONTS
from worker.checkpoint_files import CONFIG_FILE, SYNTHETIC_PREFIX
from worker.host_memory import AUTO, parse_prepin, parse_reserve
from worker.model.hub import is_hub_id
from worker.model.step_limits import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH, DEFAULT_MAX_STEP_TOKENS


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker is built (the ``memsvc worker`` flags)."""

    # Each field is a ``memsvc worker`` flag and a MEMSVC_* variable (memsvc/runtime/flags.py): this is
    # their one definition, default and help included; the README's flag table is checked against it.
    model: str = setting(
        "synthetic:tiny",
        "HF-layout checkpoint dir, Hugging Face Hub id (org/name[@revision]), or synthetic:<preset>",
    )
    backend: str = setting(
        "auto",
        "cuda, host (CPU memory: the allocator without a GPU), or auto: cuda when a GPU is present",
        choices=("auto", "cuda", "host"),
    )
    device: int = setting(0, "CUDA device ordinal", parse=int_at_least(0))
    worker_id: str = setting("", "registration name (default: <hostname>-<device>)")
    kv_blocks: int = setting(256, "device KV cache blocks", parse=int_at_least(1))
    host_kv_blocks: int = setting(256, "host KV blocks (swap)", parse=int_at_least(1))
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "tokens per KV block", parse=int_at_least(1))
    max_batch: int = setting(DEFAULT_MAX_BATCH, "requests one engine step runs at most", parse=int_at_least(1))
    """More wait their turn (worker/model/engine.py)."""
    max_step_tokens: int | None = setting(
        None,
        f"tokens one engine step feeds at most (long prompts are read in chunks); auto: {DEFAULT_MAX_STEP_TOKENS} "
        f"or --max-batch, whichever is more (a step of up to {DEFAULT_MAX_STEP_TOKENS} rows replays a CUDA graph)",
        parse=count_or_auto,
        text="auto",
    )
    """worker/model/step_limits.py's DEFAULT_MAX_STEP_TOKENS says why."""
    cuda_graphs: bool = setting(
        True,
        "capture the decode step in CUDA graphs (cuda backend; their memory sleeps in the cuda_graphs tag)",
        on_off=True,
    )
    """Ignored on the host backend, and for models the Triton kernels do not suit."""
    checkpoint_staging: bool = setting(
        True,
        "copy the checkpoint into device memory while torch is imported, when the page cache holds it and the "
        "device has room for it beside the weights; the load then copies on the device",
        on_off=True,
    )
    """worker/staging.py says why and when; off, the load reads the files after the imports."""
    host_capacity_bytes: int = setting(
        8 << 30, "host backend: device size", parse=parse_bytes, flag="--host-capacity", text="8GiB"
    )
    checksum: bool = setting(
        True,
        "checksum offloaded data at sleep and verify it on wake (default on: 1.5-2%% of wake time on an H200)",
        on_off=True,
    )
    """A mismatch fails the wake with DATA_LOSS naming the allocation."""
    host_reserve_bytes: int | str = setting(
        AUTO,
        "page-locked host memory kept between sleeps, so later sleeps skip pinning: a size, or 'auto' (the "
        "weights pool, at most a quarter of host RAM, given back while the host is short; 0 on the host backend)",
        parse=reserve_size,
        flag="--host-reserve",
    )
    """worker/host_memory.py sizes ``auto``."""
    host_prepin: int | str = setting(
        AUTO,
        "page-lock this much host memory right after the load, in the background, so the first sleep runs "
        "at line rate: a size, 'weights' for the weights pool, or 'auto' (the automatic reserve's size); raises "
        "the reserve to it; held while awake",
        parse=prepin_size,
    )
    huge_pages: bool = setting(
        True,
        "transparent huge pages for host chunks (faster first sleep; --no-huge-pages if THP compaction stalls)",
        on_off=True,
    )
    offload_dir: str = setting(
        "",
        "the disk tier: a directory for sleeping tags' backups (tag action offload_disk; the manager's host "
        "budget moves sleepers there instead of discarding their weights); empty: none",
    )
    seed: int = setting(0, "seed of synthetic weights", parse=int)
    served_model_name: str = setting(
        "", "the name clients ask for the model by (default: the checkpoint directory's name, or the synthetic spec)"
    )
    """See :meth:`resolved_served_model_name`."""
    host_name: str = setting("", "host the worker reports to the manager (host budgets group by it; default: hostname)")
    drain_seconds: float = setting(
        30.0,
        "seconds calls in flight get on SIGTERM before they are cancelled",
        parse=seconds_up_to_an_hour,
        flag="--drain-timeout",
        text="30",
    )
    """Then they are cancelled (a Generate stops at its next step) and the worker exits, within
    :data:`~worker.main.EXIT_GRACE_S` more at most."""
    read_timeout: float = setting(
        60.0,
        "seconds a checkpoint load may read nothing before it fails (a hung network mount)",
        parse=some_seconds_up_to_an_hour,
        text="60",
    )
    """For start-up, a level-2 wake and ReloadWeights (worker/model/loader.py)."""
    rpc_front: str = setting(
        "process",
        "where the gRPC server runs: process (the default), in a child process of its own, so that streaming "
        "many answers takes no host time from the model's steps, or inline, in the worker's process (one process "
        "fewer; a single stream's tokens arrive a few percent sooner)",
        choices=RPC_FRONTS,
    )
    """worker/rpc_front.py."""

    def __post_init__(self) -> None:
        parse_reserve(self.host_reserve_bytes, "host_reserve_bytes")
        parse_prepin(self.host_prepin)
        if not 0 <= self.drain_seconds <= 3600:
            raise InvalidArgument(f"drain_seconds must be in [0, 3600], got {self.drain_seconds}")
        if self.rpc_front not in RPC_FRONTS:
            raise InvalidArgument(f"rpc_front must be one of {', '.join(RPC_FRONTS)}, got {self.rpc_front!r}")
        if not 0 < self.read_timeout <= 3600:
            raise InvalidArgument(f"read_timeout must be in (0, 3600], got {self.read_timeout}")

    def check_paths(self) -> None:
        """The flags that name files, checked before the worker listens (cheap: a few ``stat`` calls,
        no torch): ``--offload-dir`` an existing, writable directory, ``--model`` a directory with a
        ``config.json`` that is a regular file. A script waiting for "listening on" then never sees a
        worker that exits 2 over a flag a moment later; what needs the model layer (the config's
        values, the shards) is the load's, while the worker answers LOADING."""
        if self.offload_dir:
            where = Path(self.offload_dir)
            if not where.exists():
                raise InvalidArgument(f"--offload-dir {self.offload_dir} does not exist")
            if not where.is_dir():
                raise InvalidArgument(f"--offload-dir {self.offload_dir} is not a directory")
            if not os.access(where, os.W_OK | os.X_OK):
                raise InvalidArgument(f"--offload-dir {self.offload_dir} is not writable")
        if self.model.startswith(SYNTHETIC_PREFIX):
            return
        root = Path(self.model)
        if not root.exists() and is_hub_id(self.model):
            return  # a Hub id: resolved (downloaded if need be) by the load, worker/model/hub.py
        if not root.exists():
            raise NotFound(f"--model {self.model}: checkpoint directory does not exist")
        if not root.is_dir():
            raise InvalidArgument(f"--model {self.model} is not a directory (a checkpoint is one)")
        config = root / CONFIG_FILE
        if not config.exists():
            raise NotFound(f"--model {self.model}: no {CONFIG_FILE} in the checkpoint directory")
        if not config.is_file():
            raise InvalidArgument(f"--model {self.model}: {CONFIG_FILE} is not a regular file")

    def resolved_served_model_name(self) -> str:
        """The name clients ask for the model by: ``served_model_name``, else the synthetic spec, else
        the Hub id (without ``@revision``), else the checkpoint directory's name."""
        if self.served_model_name:
            return self.served_model_name
        if self.model.startswith(SYNTHETIC_PREFIX):
            return self.model
        if not Path(self.model).exists() and is_hub_id(self.model):
            return self.model.partition("@")[0]
        return Path(self.model).resolve().name or self.model

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{self.device}"


__all__ = ["WorkerConfig"]
