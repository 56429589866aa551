"""A model's text side read ahead (worker/model/text.py's ``load_ahead``, from the start's import thread):
the load takes what was read where the files are still those that were read, reads again where one
changed, and reports a directory it cannot read as it always has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from memsvc.errors import InvalidArgument
from worker.model.text import TOKENIZER_CONFIG, TOKENIZER_FILE, ModelText

REPO_ROOT = Path(__file__).resolve().parents[2]


def _model_dir(root: Path, words: int = 64, template: str = "{{ bos_token }}{{ messages[0]['content'] }}") -> Path:
    vocab = {f"w{i}": i for i in range(words)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / TOKENIZER_FILE))
    (root / TOKENIZER_CONFIG).write_text(json.dumps({"bos_token": "w1", "chat_template": template}))
    return root


def test_the_load_takes_what_was_read_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _model_dir(tmp_path / "m")
    reads: list[Path] = []
    read = ModelText._read

    def counted(root: Path) -> ModelText | None:
        reads.append(root)
        return read(root)

    monkeypatch.setattr(ModelText, "_read", counted)
    ModelText.load_ahead(path)
    first = ModelText.load(path)
    assert len(reads) == 1, "the load read the files again"
    assert first is not None and first.encode("w3 w5") == [3, 5]
    assert first.render_chat([{"role": "user", "content": "w7"}]) == "w1w7"
    # taken once: the next load reads the files itself, with the same result
    second = ModelText.load(path)
    assert len(reads) == 2 and second is not None and second is not first and second.encode("w3 w5") == [3, 5]


def test_a_file_changed_after_the_read_ahead_is_read_again(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "m")
    ModelText.load_ahead(path)
    _model_dir(path, template="{{ messages[0]['content'] }}!")  # rewritten: another template
    os.utime(path / TOKENIZER_CONFIG, ns=(1, 1))  # a different mtime even on a coarse clock
    text = ModelText.load(path)
    assert text is not None and text.render_chat([{"role": "user", "content": "w7"}]) == "w7!"


def test_what_cannot_be_read_ahead_is_reported_by_the_load(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "m")
    (path / TOKENIZER_FILE).write_text("{not json")
    ModelText.load_ahead(path)  # nothing kept, nothing raised
    with pytest.raises(InvalidArgument, match="cannot read the tokenizer"):
        ModelText.load(path)
    ModelText.load_ahead(tmp_path / "absent")
    assert ModelText.load(tmp_path / "absent") is None  # no tokenizer.json: ids only, as without the read ahead


def test_what_was_read_ahead_of_another_directory_is_not_kept(tmp_path: Path) -> None:
    """A Hub snapshot read ahead that the load then replaces by a newer one: the first load drops it."""
    from worker.model import text as text_module

    old, new = _model_dir(tmp_path / "old"), _model_dir(tmp_path / "new", words=32)
    ModelText.load_ahead(old)
    loaded = ModelText.load(new)
    assert loaded is not None and loaded.vocab_size == 32
    assert text_module._ahead == {}


def test_the_start_reads_the_text_ahead_before_torch_is_in(tmp_path: Path) -> None:
    """worker/main.py's import thread reads the model's text before it waits for torch's libraries,
    and only where torch is not imported yet (a standby's start has it in: nothing to overlap)."""
    path = _model_dir(tmp_path / "m")
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from worker.config import WorkerConfig\n"
        "from worker.main import import_model_layer\n"
        f"config = WorkerConfig(model={str(path)!r}, backend='host')\n"
        "import_model_layer(config).join()\n"
        "print('--- again, torch in')\n"
        "import_model_layer(config).join()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    first, again = done.stdout.split("--- again, torch in")
    assert first.index("model text read ahead") < first.index("model layer imported"), first
    assert "model text read ahead" not in again, again
