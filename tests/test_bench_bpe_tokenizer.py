"""bench/bpe_tokenizer.py: a byte-level BPE of a real model's size, for the start-up bench's checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench.bpe_tokenizer import MAX_TOKENS, MIN_TOKENS, bpe_tokenizer, bpe_vocabulary, main, write_bpe_tokenizer


@pytest.mark.parametrize("size", [MIN_TOKENS, 280, 512, 5000])
def test_the_vocabulary_has_exactly_the_size_asked_and_every_merge_joins_two_of_its_tokens(size: int) -> None:
    vocab, merges = bpe_vocabulary(size)
    assert len(vocab) == size and sorted(vocab.values()) == list(range(size))
    assert merges and all(a in vocab and b in vocab and a + b in vocab for a, b in merges)
    assert len(set(merges)) == len(merges)
    assert bpe_vocabulary(size) == (vocab, merges)  # seeded: the same checkpoint every run
    if size > MIN_TOKENS:  # past the characters and their pairs, the seed picks the tokens
        assert bpe_vocabulary(size, seed=1)[0] != vocab


def test_llama_3s_size_has_llama_3s_merges_per_token(tmp_path: Path) -> None:
    """128,000 tokens and about 280,000 merges, as Llama 3's tokenizer; written, it reads back as much."""
    info = write_bpe_tokenizer(tmp_path, 128_000)
    assert info["tokens"] == 128_000 and 260_000 <= info["merges"] <= 300_000
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size() == 128_000


def test_any_text_encodes_and_decodes_back() -> None:
    tokenizer = bpe_tokenizer(4096)
    for text in ["plain words", "naïve café, 你好, emoji 🙂", "tabs\tand\nnewlines  ", "\x00\x7f bytes"]:
        ids = tokenizer.encode(text).ids
        assert ids and max(ids) < 4096 and tokenizer.decode(ids) == text


@pytest.mark.parametrize("size", [MIN_TOKENS - 1, MAX_TOKENS + 1])
def test_a_vocabulary_it_cannot_make_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match=f"has 272 to 266496 tokens, not {size}"):
        bpe_vocabulary(size)


def test_the_command_replaces_a_checkpoints_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.bpe_tokenizer DIR``: the size from DIR's config.json; a directory without one is refused."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    (tmp_path / "tokenizer.json").write_text("a word-level one")
    assert main([str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"tokens": 1000, "merges": len(bpe_vocabulary(1000)[1])}
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size() == 1000
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing")])
