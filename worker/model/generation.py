"""What one Generate asks for and what it gets: the request (prompt, length, sampling, stop rules),
the result (tokens, finish reason, counts), and the model's end-of-sequence tokens.

A request stops at the model's EOS tokens unless it says ``ignore_eos``, and at its own
``stop_token_ids`` always; the token that stops it is the last one returned (as transformers'
``generate`` returns it). The model's EOS tokens are ``generation_config.json``'s ``eos_token_id``
when that file has one (transformers' ``generate`` uses it), else ``config.json``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memsvc.errors import InvalidArgument
from memsvc.runtime.limits import INT32_MAX
from memsvc.vocabulary import FinishReason
from worker.checkpoint_files import read_json
from worker.model.sampling import GREEDY, SamplingParams

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationRequest:
    """One Generate, its prompt already tokens."""

    prompt: list[int]
    """Tokens to feed first (after a kept sequence's own, when continuing it)."""
    max_new_tokens: int
    sequence_id: str | None = None
    """Keep the sequence under this id; None: a temporary one."""
    sampling: SamplingParams = GREEDY
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    stop_at_context: bool = False
    """``max_new_tokens`` is an upper bound: end at the model's context length instead of refusing."""
    stop_strings: tuple[str, ...] = ()
    """End once the generated text holds one of these (worker/stop_strings.py)."""

    def stop_set(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Every token that ends this request."""
        return self.stop_token_ids if self.ignore_eos else self.stop_token_ids | frozenset(eos_token_ids)


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    """The generated tokens, with the stop token when one ended the generation."""
    finish_reason: FinishReason
    prompt_tokens: int
    """Tokens this call fed as its prompt."""
    block_ids: list[int] = field(default_factory=list)
    """A kept sequence's KV blocks after the call (empty for a temporary one)."""
    matched_stop: str = ""
    """The stop string that ended it (finish reason STOP); empty when none did."""


def read_eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """A checkpoint directory's EOS tokens (see the module), as a sorted tuple (empty: none)."""
    root = Path(path)
    for name in (GENERATION_CONFIG, "config.json"):
        file = root / name
        if not file.exists():
            continue
        raw = read_json(file)
        if isinstance(raw, dict) and raw.get("eos_token_id") is not None:
            return _token_ids(raw["eos_token_id"], file)
    return ()


def _token_ids(value: Any, file: Path) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT32_MAX for v in values):
        raise InvalidArgument(
            f"{file}: eos_token_id must be a token id (0 to {INT32_MAX}) or a list of them, got {value!r}"
        )
    return tuple(sorted(set(values)))


__all__ = ["GENERATION_CONFIG", "GenerationRequest", "GenerationResult", "read_eos_token_ids"]
