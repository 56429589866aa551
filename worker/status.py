"""The worker's value types: what a transition moved, what Generate made, and a status snapshot.

Plain frozen values, built on the device loop and read anywhere (the servicer turns them into
protos, telemetry carries them), so nothing here refers to the allocator or the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memsvc.vocabulary import FinishReason, TransitionKind, WorkerState

if TYPE_CHECKING:
    from worker.allocator import AllocatorStats
    from worker.model.kv_cache import KvStats


@dataclass(frozen=True)
class Transition:
    """What one finished transition moved, and how fast."""

    kind: TransitionKind
    moved_bytes: int
    seconds: float
    verified_bytes: int = 0
    end_time: float = field(default_factory=time.time)

    @property
    def gigabytes_per_second(self) -> float:
        return self.moved_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Generation:
    """What Generate returns: new tokens, why they ended, the kept sequence's KV blocks, the time."""

    tokens: list[int]
    block_ids: list[int]
    seconds: float
    finish_reason: FinishReason
    prompt_tokens: int
    """Tokens the call fed as its prompt."""
    matched_stop: str = ""
    """The request's stop string that ended it (empty: none did)."""


@dataclass(frozen=True)
class DeviceInfo:
    """The device the worker serves on (the proto's ``DeviceInfo``, less the sizes, which the
    allocator's snapshot has)."""

    backend: str
    """``cuda`` or ``host``."""
    index: int
    name: str
    """The card's name (``host memory`` on the host backend)."""
    uuid: str = ""
    """The card's UUID; empty on the host backend."""


@dataclass(frozen=True)
class ServedModel:
    """What the worker serves (the proto's ``ModelInfo``): until the load, the spec and the name
    alone; the rest from the loaded model (:meth:`ModelRunner.info`)."""

    source: str
    """The model spec: ``synthetic:<preset>`` or the checkpoint directory."""
    served_model_name: str
    family: str = ""
    parameter_count: int = 0
    weights_bytes: int = 0
    vocab_size: int = 0
    layer_count: int = 0
    context_length: int = 0
    eos_token_ids: tuple[int, ...] = ()
    has_tokenizer: bool = False
    has_chat_template: bool = False


@dataclass(frozen=True)
class Status:
    """A snapshot of the worker for GetWorkerStatus and telemetry."""

    worker_id: str
    state: WorkerState
    sleep_level: int
    device: DeviceInfo | None
    """None until the model is loaded."""
    model: ServedModel
    memory: AllocatorStats | None
    kv_cache: KvStats | None
    """None before the model is loaded."""
    last_transition: Transition | None
    time: float
    last_activity: float
    transition_in_progress: bool = False
    """A transition holds the lock (it may still wait behind a Generate)."""
    offload_dir: str = ""
    """The disk tier's directory; empty without one."""
    paused_generations: int = 0
    """Generate calls a Sleep paused, waiting for the next whole wake."""
    recomputed_tokens: int = 0
    """Tokens read again because their request lost its KV blocks, since the worker started."""


__all__ = ["DeviceInfo", "Generation", "ServedModel", "Status", "Transition"]
