"""Text for ``synthetic:<preset>`` models: a byte-level BPE tokenizer over the preset's whole
vocabulary and a plain chat template, built with the ``tokenizers`` library the first time a process
asks (a third of a second for the 128,256 tokens of the 1b and 8b presets).

Why: a synthetic model is what ``memsvc up`` serves where no checkpoint is named, and it is the model
of most tests and benchmarks. Without a tokenizer its completions came back as ``""``, chat was
refused, and a stream sent nothing until it ended. With this one, text goes in and comes out
(gibberish, from random weights, but text), and stop strings work.

The vocabulary: the 256 byte-level symbols first (so every byte, hence every string, encodes), then
letter n-grams grown one letter at a time (``th``, ``the``, ...; each one merge of a shorter token and a
letter), then the same after a space, until the preset's size. Every id decodes; the model has no
special tokens and no EOS, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from worker.model.text import ModelText

LETTERS = "etaoinshrdlucmfwypvbgkqjxz"
"""Grown in English frequency order: the first n-grams are the likely ones."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""``role: content`` lines, then ``assistant:`` (a synthetic model has no special tokens)."""


def _grown(starts: list[str]) -> Iterator[tuple[str, str]]:
    """(prefix, letter) pairs, breadth first: every token of a length before any longer one."""
    frontier = starts
    while frontier:
        longer = []
        for prefix in frontier:
            for letter in LETTERS:
                yield prefix, letter
                longer.append(prefix + letter)
        frontier = longer


@functools.cache
def synthetic_text(vocab_size: int) -> ModelText | None:
    """The tokenizer and chat template of a synthetic model of ``vocab_size`` tokens (None below 256:
    too few for the byte symbols)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet):
        return None
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    space = next(s for s in alphabet if s == "\u0120")  # byte-level's spelling of " "
    for prefix, letter in _grown([*LETTERS, space]):
        if len(vocab) >= vocab_size:
            break
        vocab[prefix + letter] = len(vocab)
        merges.append((prefix, letter))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return ModelText(tokenizer, {}, CHAT_TEMPLATE)


__all__ = ["CHAT_TEMPLATE", "synthetic_text"]
