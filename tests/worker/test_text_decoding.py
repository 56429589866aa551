"""worker/model/text.py's ``Decoding.only``: a tokenizer without its BPE merges, which the RPC front
writes for the device process's engine (stop strings), decodes every id and every stream exactly as
the whole tokenizer does, for the decoders served models use: byte-level (Llama 3, Qwen, GPT-2), and
SentencePiece's with byte fallback (Llama 2, Mistral, Gemma: ``▁`` for spaces, ``<0x0A>`` for bytes,
the first space stripped)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_models import CORPUS, text_model
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from memsvc.errors import InvalidArgument
from worker import decoding_writer
from worker.model.synthetic_text import synthetic_text
from worker.model.text import Decoding, ModelText


def _sentencepiece() -> Tokenizer:
    """A BPE as Llama 2's tokenizer.json has it: ``▁`` for a space, byte tokens, the Llama 2 decoders."""
    trained = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(
        CORPUS * 3, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    )
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # in the model's vocabulary, as SentencePiece's byte pieces are (not added tokens)
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<|im_end|>"])
    tok.add_tokens(["<think>"])  # an added token that is not special: decoded as its text
    return tok


def _ids(tok: Tokenizer, *tokens: str) -> list[int]:
    ids = [tok.token_to_id(t) for t in tokens]
    assert None not in ids, (tokens, ids)
    return [i for i in ids if i is not None]


def _tokenizers(tmp_path: Path) -> Iterator[tuple[str, Tokenizer]]:
    path, _ = text_model(tmp_path)
    text = ModelText.load(path)
    assert text is not None
    yield "byte-level BPE with special tokens", text.tokenizer
    synthetic = synthetic_text(4096)
    assert synthetic is not None
    yield "the synthetic models' byte-level BPE", synthetic.tokenizer
    yield "SentencePiece BPE with byte fallback", _sentencepiece()


def _sequences(vocab: int, rng: random.Random) -> Iterator[list[int]]:
    yield list(range(vocab))
    for _ in range(40):
        yield [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]


def test_the_decoding_alone_decodes_ids_and_streams_as_the_whole_tokenizer(tmp_path: Path) -> None:
    rng = random.Random(0)
    for name, whole in _tokenizers(tmp_path):
        spec = json.loads(whole.to_str())
        only = Decoding.only(Decoding(whole))
        assert spec["model"]["merges"], name  # there was something to leave out
        assert json.loads(only)["model"]["merges"] == [], name
        file = tmp_path / "decoding.json"
        file.write_text(only)
        alone, full = Decoding.read(file), Decoding(whole)
        vocab = whole.get_vocab_size(with_added_tokens=True)
        assert alone.tokenizer.get_vocab_size(with_added_tokens=True) == vocab, name
        for i in range(vocab):
            assert alone.decode([i]) == full.decode([i]), (name, i)
        for ids in _sequences(vocab, rng):
            assert alone.decode(ids) == full.decode(ids), (name, ids)
            a, b = alone.stream(), full.stream()
            assert [a.step(i) for i in ids] == [b.step(i) for i in ids], (name, ids)


def test_a_decoding_file_that_does_not_read_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "decoding.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="cannot read the tokenizer"):
        Decoding.read(bad)
    with pytest.raises(InvalidArgument, match="cannot read the tokenizer"):
        Decoding.read(tmp_path / "absent.json")


def test_a_byte_run_that_is_not_utf8_starts_the_stream_again_instead_of_failing() -> None:
    """A newline given out as ``<0x0A>``, then ``<0x80>``: the byte fallback decodes the two as one
    run, which is not UTF-8, and re-decodes the newline as U+FFFD. tokenizers 0.23's own stream raises
    there (the engine failed its whole batch with it); ours starts again at the token."""
    tok = _sentencepiece()
    ids = _ids(tok, "h", "<0x0A>", "<0x80>", "<think>", "h")
    ours = Decoding(tok).stream()
    assert [ours.step(i) for i in ids] == ["h", "\n", "", "<think>", "h"]
    assert Decoding(tok).decode(ids) == "h\ufffd\ufffd <think>h"  # the whole answer's text, as ever
    clean = _ids(tok, "h", "<0x0A>", "<think>", "h")
    ours = Decoding(tok).stream()
    assert "".join(ours.step(i) for i in clean) == Decoding(tok).decode(clean) == "h\n <think>h"


def test_the_writer_process_writes_the_decoding_whole_or_not_at_all(tmp_path: Path) -> None:
    """worker/decoding_writer.py, as the RPC front runs it: a model's decoding into a file (from a
    checkpoint's tokenizer.json as JSON, or a synthetic model's tokenizer), which reads back and
    decodes every id as the model's text does; a model without a tokenizer gets no file, and says
    so apart from a failure."""
    path, _ = text_model(tmp_path)
    synthetic = synthetic_text(4096)
    assert synthetic is not None
    loaded = ModelText.load(path)
    assert loaded is not None
    for source, text in (({"directory": str(path)}, loaded), ({"synthetic_vocab": 4096}, synthetic)):
        file = tmp_path / "decoding.json"
        assert decoding_writer.main([json.dumps(source), str(file)]) == 0
        ids = list(range(text.vocab_size))
        assert Decoding.read(file).decode(ids) == text.decode(ids), source
        assert [Decoding.read(file).decode([i]) for i in ids] == [text.decode([i]) for i in ids], source
        assert not file.with_suffix(".part").exists()
    (tmp_path / "no-tokenizer").mkdir()
    other = tmp_path / "other.json"
    no_tokenizer = json.dumps({"directory": str(tmp_path / "no-tokenizer")})
    assert decoding_writer.main([no_tokenizer, str(other)]) == decoding_writer.NO_TOKENIZER
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("[1, 2]")
    assert decoding_writer.main([json.dumps({"directory": str(tmp_path / "bad")}), str(other)]) == 1
    assert not other.exists()
