"""How the next token is picked: greedy, or sampled after temperature, top-k and top-p.

The order and the rules are transformers' (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, then a draw from what is left), so a request asks for the same distribution it
would get there; tests compare the filtered distributions with transformers' own warpers. A step's
rows are picked together (:func:`pick_tokens`): one copy of its tokens to the host, not one wait per
sampled row. Each request draws one number per token from its own ``torch.Generator`` on the
model's device, seeded from the request: the same seed gives the same tokens on the same device and
model, alone or in any batch (the stream of numbers differs between CPU and CUDA).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
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
    return filter_rows(logits[None], [params])[0]


def filter_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 ``[rows, vocab]`` logits after each row's temperature, top-k and top-p (removed tokens
    at -inf), every row exactly as it would be alone: the rows of one step are filtered together."""
    import torch

    x = logits.float()
    device, vocab = x.device, x.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device)[:, None]

    # the same softmax, but a tiny temperature makes -inf, not inf - inf
    x = (x - x.max(dim=-1, keepdim=True).values) / column([p.temperature for p in params])
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(-1, to_device([max(k - 1, 0) for k in ks], torch.int64, device)[:, None])
        kth = torch.where(column([1.0 if k else 0.0 for k in ks]) > 0, kth, -math.inf)
        x = x.masked_fill(x < kth, -math.inf)
    if any(p.top_p < 1.0 for p in params):
        # transformers' rule: sort ascending, drop the tokens whose cumulative probability is at most
        # 1 - top_p, always keep the most likely one (a row without top-p: a limit nothing is under).
        # stable: tied logits (common in bf16) keep their order, whatever algorithm a shape gets
        sorted_x, order = torch.sort(x, dim=-1, descending=False, stable=True)
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= column([1.0 - p.top_p if p.top_p < 1.0 else -1.0 for p in params])
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    return x


class Sampler:
    """One request's sampling: its parameters and, unless greedy, its own random generator."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        import torch

        self.params = params
        self._device = device
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    @property
    def greedy(self) -> bool:
        return self._generator is None

    def uniform(self) -> torch.Tensor:
        """The request's next random number in [0, 1), ``[1]`` on the device (no copy to the host)."""
        import torch

        assert self._generator is not None, "a greedy request draws nothing"
        return torch.rand(1, generator=self._generator, device=self._device)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from float32 ``[vocab]`` logits (one row of :func:`pick_tokens`)."""
        return pick_tokens(logits[None], [self])[0]


def to_device(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without waiting for the device: on CUDA through
    pinned memory (a copy from pageable memory first waits for all the work queued on the stream,
    and the engine queues a step's sampling while the step before it still runs)."""
    import torch

    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def pick_tokens(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """:func:`sample_tokens` on the host."""
    return [int(t) for t in sample_tokens(logits, samplers).tolist()]


def sample_tokens(logits: torch.Tensor, samplers: Sequence[Sampler]) -> torch.Tensor:
    """One token per row of float32 ``[rows, vocab]`` logits, row ``i`` picked by ``samplers[i]``, as
    an int64 ``[rows]`` tensor on the logits' device, queued there without a wait: the argmax for a
    greedy row; a sampled row is filtered (:func:`filter_rows`, all of them together) and draws from
    its distribution with one number of its own generator (the inverse of its cumulative
    distribution). The step's tokens reach the host in one copy, whatever the mix: drawing row by row
    waited for the device once per sampled row."""
    import torch

    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(samplers) if not s.greedy]
    if rows:
        index = to_device(rows, torch.int64, logits.device)
        probs = filter_rows(logits.index_select(0, index), [samplers[i].params for i in rows]).softmax(dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.cat([samplers[i].uniform() for i in rows])
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens = tokens.index_copy(0, index, drawn.clamp_(max=logits.shape[-1] - 1))
    return tokens


__all__ = [
    "GREEDY",
    "MAX_SEED",
    "MAX_TEMPERATURE",
    "Sampler",
    "SamplingParams",
    "filter_logits",
    "filter_rows",
    "pick_tokens",
    "sample_tokens",
    "to_device",
]
