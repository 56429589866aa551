"""How a worker is built: the ``memsvc worker`` flags as one frozen value."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from memsvc.errors import InvalidArgument, NotFound
from memsvc.vocabulary import RPC_FRONTS
from worker.checkpoint_files import CONFIG_FILE
from worker.host_memory import AUTO, parse_prepin, parse_reserve
from worker.model.hub import is_hub_id


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker is built (the ``memsvc worker`` flags)."""

    model: str = "synthetic:tiny"
    """A Hugging Face-layout checkpoint directory, or ``synthetic:<preset>``."""
    backend: str = "auto"
    device: int = 0
    worker_id: str = ""
    """Name under which the worker registers; default ``<hostname>-<device>``."""
    kv_blocks: int = 256
    """Device KV cache blocks."""
    host_kv_blocks: int = 256
    """Host KV cache blocks (swap space)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_batch: int = 64
    """Requests one engine step runs at most; more wait their turn (worker/model/engine.py)."""
    max_step_tokens: int | None = None
    """Tokens one step feeds at most: long prompts are read in chunks of what is left. None: 512 or
    max_batch, whichever is more (worker/model/engine.py's DEFAULT_MAX_STEP_TOKENS says why)."""
    cuda_graphs: bool = True
    """Capture the decode step in CUDA graphs (cuda backend with Triton; ignored on host)."""
    host_capacity_bytes: int = 8 << 30
    """Host backend only: size of the simulated device."""
    checksum: bool = True
    """Verify offloaded bytes on wake; a mismatch fails the wake with DATA_LOSS naming the allocation."""
    host_reserve_bytes: int | str = AUTO
    """Page-locked host memory kept between sleeps, so later sleeps skip pinning: a byte count, or
    ``"auto"`` (worker/host_memory.py: the weights pool's size within a share of host RAM, given
    back while the host is short; 0 on the host backend)."""
    host_prepin: int | str = AUTO
    """Host memory to page-lock in the background once the model is loaded, so the first sleep
    runs at line rate: a byte count, ``"weights"`` for the size of the weights pool, or ``"auto"``
    (the automatic reserve's size)."""
    huge_pages: bool = True
    offload_dir: str = ""
    """The disk tier: a directory for sleeping tags' backups (tag action ``offload_disk``, and the
    manager's host-budget demotion); empty: none."""
    seed: int = 0
    served_model_name: str = ""
    """The OpenAI-style model name clients use (see :meth:`resolved_served_model_name`)."""
    host_name: str = ""
    """Host reported to the manager, whose host budgets group workers by it; default: hostname."""
    drain_seconds: float = 30.0
    """On SIGTERM, calls in flight get this long to finish; then they are cancelled (a Generate stops
    at its next step) and the worker exits, within :data:`~worker.main.EXIT_GRACE_S` more at most."""
    rpc_front: str = "process"
    """Where the public gRPC server runs: ``inline``, in the worker's process, or ``process``, in a
    child process of its own (worker/rpc_front.py), so that writing the streams' messages takes no
    host time from the device loop."""
    read_timeout: float = 60.0
    """A checkpoint load (start-up, level-2 wake, ReloadWeights) whose reads make no progress this
    long fails (worker/model/loader.py: a hung network mount)."""

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
        if self.model.startswith("synthetic:"):
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
        if self.model.startswith("synthetic:"):
            return self.model
        if not Path(self.model).exists() and is_hub_id(self.model):
            return self.model.partition("@")[0]
        return Path(self.model).resolve().name or self.model

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{self.device}"


__all__ = ["WorkerConfig"]
