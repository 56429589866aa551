"""A step's tokens picked together (worker/model/sampling.py's pick_tokens): each row exactly as it would
be alone, drawn from its filtered distribution, one seeded stream per request. transformers' warpers
are the reference for the filtering itself (tests/worker/test_generation.py); here the batch is."""

from __future__ import annotations

import math

import pytest
import torch

from worker.model.sampling import Sampler, SamplingParams, filter_logits, filter_rows, pick_tokens

CPU = torch.device("cpu")
MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.6),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=300),  # the whole vocabulary: no top-k
]


def test_rows_filtered_together_are_each_what_they_are_alone() -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        logits = torch.randn(len(MIXED), 300, generator=g) * 4
        together = filter_rows(logits, MIXED)
        for i, params in enumerate(MIXED):
            assert torch.equal(together[i], filter_logits(logits[i], params)), params


def test_a_row_draws_from_its_filtered_distribution() -> None:
    """20,000 draws of one row against its probabilities (top-k 3 of 6 tokens, then temperature): every
    frequency within 5 standard deviations, and no filtered-out token ever drawn."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5, 1.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=3, seed=17)
    probs = filter_logits(logits[0], params).softmax(-1)
    sampler = Sampler(params, CPU)
    n = 20_000
    counts = torch.bincount(torch.tensor([pick_tokens(logits, [sampler])[0] for _ in range(n)]), minlength=6)
    assert counts[probs == 0].sum() == 0, counts
    for token in range(6):
        p = float(probs[token])
        assert abs(int(counts[token]) - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (token, counts, probs)


def test_a_seeded_row_draws_the_same_tokens_alone_or_beside_others() -> None:
    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(4, 300, generator=g) * 3 for _ in range(30)]
    seeded = SamplingParams(temperature=1.1, top_p=0.9, seed=2026)
    alone = Sampler(seeded, CPU)
    mixed = [Sampler(SamplingParams(), CPU), Sampler(seeded, CPU), Sampler(MIXED[1], CPU), Sampler(MIXED[3], CPU)]
    for logits in steps:
        together = pick_tokens(logits, mixed)
        assert together[1] == pick_tokens(logits[1:2], [alone])[0]
        assert together[0] == int(logits[0].argmax()), "a greedy row is its argmax"


@pytest.mark.parametrize("temperature", [1e-30, 1e-8])
def test_a_tiny_temperature_draws_the_most_likely_token(temperature: float) -> None:
    logits = torch.tensor([[1e4, -3.0, 9.5e3, 2.0], [0.0, 5.0, 1.0, 4.99]])
    samplers = [Sampler(SamplingParams(temperature=temperature, top_p=0.9, seed=s), CPU) for s in (1, 2)]
    for _ in range(50):
        assert pick_tokens(logits, samplers) == [0, 1]
