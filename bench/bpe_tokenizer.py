"""A byte-level BPE tokenizer of a real model's size, for the checkpoints the benches write.

Why: bench/bench_gateway.py's checkpoints carry a word-level tokenizer (token i is the word ``t<i>``),
which the gateway's benches need (a prompt of n words is n tokens) and which reads fast. A worker
reads its tokenizer on the way to its first token, holding the GIL all the while
(docs/benchmarks.md, "what the part after the import waits for"), so a start measured with the
word-level one is shorter than a real checkpoint's. Llama 3's tokenizer is a byte-level BPE of
128,000 tokens and about 280,000 merges; on the development machine ``Tokenizer.from_file`` took
0.054 s for the word-level one of 128,256 words and 0.27 s for this one at Llama 3's size (the
fastest of five reads).

This one has that shape: the 256 characters byte-level BPE stands bytes for, every pair of the first
few dozen of them, then seeded three- and four-character tokens over those, each the result of two
or three merges (as a real vocabulary's longer tokens are): 128,000 tokens come with 279,831 merges.
Every merge's parts and result are in the vocabulary, as ``tokenizers`` requires. Its text is not
Llama 3's: any text encodes and decodes back (byte-level), in more tokens than a trained vocabulary
would use.

``bench_startup --tokenizer bpe`` writes its checkpoint with it. For a checkpoint written otherwise
(one that a side-by-side run's older tree must be given with ``--model``), this puts it in place of
the checkpoint's tokenizer, at the size its ``config.json`` says::

    python -m bench.bpe_tokenizer /tmp/ck8b
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

FOUR_GRAM_SHARE = 0.23
"""Of the tokens past the characters and pairs: four-character ones (three merges each), the rest three."""
MAX_WIDTH = 64
"""Pairs of the first 64 byte characters at most (4,096): Llama 3's size then has its merges per token."""
MIN_TOKENS = 256 + 16
"""The byte characters and the pairs of four of them."""
MAX_TOKENS = 256 + MAX_WIDTH**2 + MAX_WIDTH**3
"""As many as there are three-character tokens over the pairs' characters, beside those (266,496)."""


def bpe_vocabulary(vocab_size: int, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary (exactly ``vocab_size`` tokens, from :data:`MIN_TOKENS` to :data:`MAX_TOKENS`) and
    merges (about 2.2 per token at Llama 3's size) of :func:`bpe_tokenizer`. ValueError outside them."""
    if not MIN_TOKENS <= vocab_size <= MAX_TOKENS:
        raise ValueError(f"a byte-level BPE here has {MIN_TOKENS} to {MAX_TOKENS} tokens, not {vocab_size}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # pairs of the first `width` characters: a quarter of the rest at most, 16 to 4,096 of them
    width = max(4, min(MAX_WIDTH, math.isqrt((vocab_size - len(alphabet)) // 4)))
    common = alphabet[:width]
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []

    def add(token: str, splits: list[tuple[str, str]]) -> None:
        vocab[token] = len(vocab)
        merges.extend(splits)

    for a in common:
        for b in common:
            add(a + b, [(a, b)])
    rng = random.Random(seed)
    left = vocab_size - len(vocab)
    fours = int(left * FOUR_GRAM_SHARE)
    threes: list[str] = []
    by_prefix: dict[str, list[str]] = {}

    def add_three() -> None:
        while True:
            token = "".join(rng.choice(common) for _ in range(3))
            if token not in vocab:
                add(token, [(token[0], token[1:]), (token[:2], token[2])])
                threes.append(token)
                by_prefix.setdefault(token[:2], []).append(token)
                return

    while len(threes) < left - fours:
        add_three()
    # four characters abcd where abc and bcd are tokens: a | bcd, ab | cd, abc | d. Drawn at random;
    # where draws keep missing (a small vocabulary has few such), three-character ones fill up instead.
    misses = 0
    while len(vocab) < vocab_size:
        abc = rng.choice(threes)
        bcds = by_prefix.get(abc[1:], [])
        token = abc + rng.choice(bcds)[2] if bcds else ""
        if token and token not in vocab:
            add(token, [(token[0], token[1:]), (token[:2], token[2:]), (token[:3], token[3])])
        elif (misses := misses + 1) > 1000:
            add_three()
    return vocab, merges


def bpe_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE of :func:`bpe_vocabulary`'s tokens and merges (see the module's docstring)."""
    return _byte_level(*bpe_vocabulary(vocab_size, seed))


def write_bpe_tokenizer(directory: Path, vocab_size: int, seed: int = 0) -> dict[str, int]:
    """:func:`bpe_tokenizer` as ``directory/tokenizer.json`` (in place of what is there); its tokens
    and merges."""
    vocab, merges = bpe_vocabulary(vocab_size, seed)
    _byte_level(vocab, merges).save(str(directory / "tokenizer.json"))
    return {"tokens": len(vocab), "merges": len(merges)}


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a checkpoint directory: its tokenizer.json is replaced")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = args.checkpoint / "config.json"
    if not config.is_file():
        ap.error(f"{args.checkpoint} has no config.json: not a checkpoint")
    print(json.dumps(write_bpe_tokenizer(args.checkpoint, json.loads(config.read_text())["vocab_size"], args.seed)))
    return 0


__all__ = ["bpe_tokenizer", "bpe_vocabulary", "main", "write_bpe_tokenizer"]


if __name__ == "__main__":
    sys.exit(main())
