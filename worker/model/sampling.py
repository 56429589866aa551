"""How the next token is picked: greedy, or sampled after temperature, top-k and top-p.

The order and the rules are transformers' (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, then a multinomial draw), so a request asks for the same distribution it would get
there; tests compare the filtered distributions with transformers' own warpers. Each request draws
from its own ``torch.Generator`` on the model's device, seeded from the request: the same seed gives
the same tokens on the same device and model (the stream of numbers differs between CPU and CUDA).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memsvc.errors import InvalidArgument

if TYPE_CHECKING:  # imported where tokens are drawn: the servicer checks SamplingParams before torch is loaded
    import torch

MAX_TEMPERATURE = 100.0
MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; the default is greedy."""

    temperature: float = 0.0
    """Divides the logits; 0 means greedy (and the other fields are unused)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities add up to top_p, in (0, 1]."""
    seed: int | None = None
    """The generator's seed; None draws a fresh one."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
                metadata={"field": "temperature"},
            )
        if not self.top_k >= 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}", metadata={"field": "top_k"})
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}", metadata={"field": "top_p"})
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, 2**64), got {self.seed}", metadata={"field": "seed"})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 ``[vocab]`` logits after temperature, top-k and top-p (removed tokens at -inf)."""
    import torch

    x = logits.float()
    x = (x - x.max()) / params.temperature  # the same softmax, but a tiny temperature makes -inf, not inf - inf
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        # transformers' rule: sort ascending, drop the tokens whose cumulative probability is at most
        # 1 - top_p, always keep the most likely one.
        sorted_x, order = torch.sort(x, descending=False)
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1.0 - params.top_p)
        drop_sorted[-1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    return x


class Sampler:
    """Picks the tokens of one request: argmax when greedy, else a draw from its own generator."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        import torch

        self.params = params
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from float32 ``[vocab]`` logits."""
        if self._generator is None:
            return int(logits.argmax())
        import torch

        probs = filter_logits(logits, self.params).softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))


__all__ = ["GREEDY", "MAX_SEED", "MAX_TEMPERATURE", "Sampler", "SamplingParams", "filter_logits"]
