"""Where a model's text side (worker/model/text.py) is read, and by which process.

Reading a tokenizer of Llama 3's size takes 0.42 s on an H100 host with the GIL held (``tokenizers``
parses its 9 MB of JSON without letting go of it), and a start-up is bound by the GIL up to its first
token (docs/benchmarks.md). So the text is read by the process that serves the public RPC: the RPC front's
process by default (worker/rpc_front.py), whose GIL is not the model's and which is idle while the
model loads. :class:`TextSource` names it there, as plain values the device process hands over;
:class:`TextInfo` is what the front found, which the device checks and reports; :class:`TextOnce` is
the device process's own copy, read only where it must be: to serve text itself (``--rpc-front
inline``), or to match a request's stop strings on the engine's thread, for which the decoding alone
the front wrote is enough.

No tokenizer or jinja2 here: the device process imports this with its model layer and reads the
text only when asked.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memsvc.errors import InvalidArgument
from worker.model.generation import read_eos_token_ids

if TYPE_CHECKING:
    from worker.model.text import Decoding, ModelText

log = logging.getLogger("memsvc.worker")


@dataclass(frozen=True)
class TextInfo:
    """What a model's text side is: for status, and for the load's check against the model."""

    has_tokenizer: bool = False
    has_chat_template: bool = False
    vocab_size: int = 0
    """The tokenizer's tokens, added ones included (0 without a tokenizer)."""

    @classmethod
    def of(cls, text: ModelText | None) -> TextInfo:
        if text is None:
            return cls()
        return cls(True, text.has_chat_template, text.vocab_size)

    def check(self, model_vocab: int, where: str) -> None:
        """InvalidArgument where the tokenizer has ids the model has no embedding for."""
        if self.vocab_size > model_vocab:
            raise InvalidArgument(f"{where}: the tokenizer has {self.vocab_size} tokens, the model only {model_vocab}")


@dataclass(frozen=True)
class TextSource:
    """A checkpoint directory, or a synthetic model's vocabulary size (worker/model/synthetic_text.py)."""

    directory: str = ""
    synthetic_vocab: int = 0

    def load(self) -> ModelText | None:
        """The tokenizer and chat template (None: the directory has no tokenizer); InvalidArgument
        for a file that does not read."""
        if self.directory:
            from worker.model.text import ModelText

            return ModelText.load(self.directory)
        from worker.model.synthetic_text import synthetic_text

        return synthetic_text(self.synthetic_vocab)

    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokens that end a generation (a synthetic model has none)."""
        return read_eos_token_ids(self.directory) if self.directory else ()


class TextOnce:
    """A model's text side, read the first time it is asked for, then kept (any thread: a second
    caller waits for the first one's read; a read that failed is tried again by the next caller).

    The engine asks only for its :meth:`decoding`, to match stop strings: with the text in the RPC
    front, that is the decoding alone the front wrote (:meth:`decode_with`), a quarter of the whole
    text's read, which the worker reads while its engine idles after the load (WorkerCore)."""

    def __init__(self, source: TextSource) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._read = False
        self._text: ModelText | None = None
        self._decoding_file = ""
        self._decoding: Decoding | None = None

    def get(self) -> ModelText | None:
        with self._lock:
            return self._whole()

    def _whole(self) -> ModelText | None:
        """(With the lock held.)"""
        if not self._read:
            self._text = self.source.load()
            self._read = True
        return self._text

    def decode_with(self, file: str) -> None:
        """The model's decoding alone is in ``file`` (worker/model/text.py's ``decoding_only``):
        :meth:`decoding` reads that, not the whole text."""
        with self._lock:
            self._decoding_file = file

    def decoding(self) -> Decoding | None:
        """How the model's tokens become text (None: it has no tokenizer): the decoding file's, read
        the first time, else the whole text's."""
        with self._lock:
            if self._decoding is None and self._decoding_file and not self._read:
                from worker.model.text import Decoding

                t0 = time.perf_counter()
                try:
                    self._decoding = Decoding.read(self._decoding_file)
                    log.info("model text: its decoding read for stop strings in %.2f s", time.perf_counter() - t0)
                except InvalidArgument as exc:  # the front's file is gone: the whole text decodes as well
                    log.warning("the model's decoding did not read, the whole text is read instead: %s", exc)
                    self._decoding_file = ""
            if self._decoding is not None:
                return self._decoding
            if self._read:
                return self._text
            t0 = time.perf_counter()
            text = self._whole()
            log.info("model text: read whole for stop strings in %.2f s", time.perf_counter() - t0)
            return text


__all__ = ["TextInfo", "TextOnce", "TextSource"]
