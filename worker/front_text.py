"""The model's text in the RPC front's process (worker/rpc_front.py): prompts encoded and answers
decoded there, so that the device process deals in token ids.

Why: the device process's GIL is the model's. Reading a tokenizer of Llama 3's size holds it
throughout (0.42 s on an H100 host), on the path to a start's first token: there it put ``SERVING``
0.40 s later (docs/benchmarks.md). And each stream's text, a piece per token per stream, held it at
every step. The front's process has its own GIL and is idle while the model loads: it reads the text as
soon as the device process says where it is (worker/model/text_source.py), and tells what it found,
which the load checks before the worker serves.

A Generate or GenerateStream that reaches the front once the text is read is checked as the device
process checks it (worker/generate_messages.py's check_request, then the prompt encoded; the same
errors, from the same place), and goes on with its prompt as token ids and a mark that the device
sends no text; its answer's text is made here as the device process would make it (StreamedText,
answer_text). Before the text is read (the model still loading), and for a model without a
tokenizer, a request goes on as it came and the device process answers it as it always has.

Stop strings are still matched by the device process's engine, at the token that completes one, so
the generation ends exactly there. It decodes with the tokenizer's decoding alone (the tokenizer
without its BPE merges: a quarter of the whole one's read), which a process of the front's own
writes beside the device process's socket while the front reads the text
(worker/decoding_writer.py); the front says where after it told the text, which the load waits for,
and the device process reads it while its engine idles after the load
(worker/model/text_source.py's TextOnce).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf.message import DecodeError, Message

from memsvc.errors import MemsvcError, Overloaded
from memsvc.runtime.limits import MAX_QUEUED_GENERATES
from memsvc.runtime.rpc_errors import undecodable
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker import decoding_writer
from worker.background import in_background
from worker.generate_messages import StreamedText, answer_text, check_request, generation_request
from worker.model.text_source import TextInfo, TextSource

if TYPE_CHECKING:  # tokenizers and jinja2 are imported with the text, on a thread
    from worker.model.text import ModelText

M = TypeVar("M", bound=Message)
log = logging.getLogger("memsvc.worker.front")


class FrontText:
    """The model's text as the front holds it: None until read (or when the model has none)."""

    DECODING_FILE = "decoding.json"

    def __init__(self, directory: str = "") -> None:
        """``directory``: where to write the model's decoding for the device process (the device
        process's socket directory, which it removes as it exits; "": it reads the whole text)."""
        self._directory = directory
        self._writer: subprocess.Popen[bytes] | None = None
        self._writer_lock = threading.Lock()
        self._stop_writing = False
        self._text: ModelText | None = None
        self._eos: frozenset[int] = frozenset()
        self._encoding = 0
        """Requests whose prompts are being encoded (bounded: each holds its prompt and a thread)."""

    async def read(self, where: TextSource) -> dict[str, Any]:
        """Read the text where the device process said it is, on a thread below the start's priority
        (worker/background.py: told as the load begins, this runs beside torch's import); what was
        found, as the line the front tells the device process: ``{"info": TextInfo's fields}`` or
        ``{"error": why}``."""
        try:
            text, eos = await in_background(lambda: (where.load(), where.eos_token_ids()), "memsvc-front-text")
        except MemsvcError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - told to the device process, whose load fails with it
            return {"error": f"{where.directory or 'the model'}: cannot read the model's text ({exc!r})"}
        self._text, self._eos = text, frozenset(eos)
        return {"info": dataclasses.asdict(TextInfo.of(text))}

    async def write_decoding(self, where: TextSource) -> str:
        """Beside :meth:`read`: the model's decoding alone, written by a process of its own
        (worker/decoding_writer.py says why) for the device process's engine, which matches stop
        strings with it (worker/model/text_source.py). Where, or "" where the model has no
        tokenizer, it was not written, or :meth:`stop_writing` came first (the engine then reads
        the whole text). The process is started and waited for on a thread below the start's
        priority, which it inherits (worker/background.py); a thread, as a loop's child watcher
        would outlive a front that stops while it runs."""
        if not self._directory:
            return ""
        file = Path(self._directory, self.DECODING_FILE)
        argv = [sys.executable, "-m", "worker.decoding_writer", json.dumps(dataclasses.asdict(where)), str(file)]

        def write() -> tuple[int, bytes]:
            with self._writer_lock:
                if self._stop_writing:
                    return -1, b""
                try:
                    writer = self._writer = subprocess.Popen(
                        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
                    )
                except OSError as exc:  # no process to be had (EAGAIN, ENOMEM): the whole text it is
                    return 1, f"the decoding's writer did not start: {exc}".encode()
            with writer:
                _, err = writer.communicate()
            return writer.returncode, err

        rc, err = await in_background(write, "memsvc-decoding")  # the writer has its priority
        if rc in (decoding_writer.NO_TOKENIZER, -1) or self._stop_writing:
            return ""
        if rc != 0:
            log.warning("%s", err.decode(errors="replace").strip() or f"the decoding's writer exited {rc}")
            return ""
        return str(file)

    def stop_writing(self) -> None:
        """No decoding now: the writer, if it runs, is killed (this process stops, or the text did
        not read), and none starts after this."""
        with self._writer_lock:
            self._stop_writing = True
            writer = self._writer
        if writer is not None and writer.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                writer.kill()

    @property
    def serves(self) -> bool:
        """Whether requests take their text here (else they go on as they came)."""
        return self._text is not None

    async def unary(self, raw: bytes) -> bytes:
        """A Generate's request as the device process takes it from the front (see :meth:`_encode`)."""
        request = _parse(worker_pb.GenerateRequest, raw)
        await self._encode(request)
        return request.SerializeToString()

    async def stream(self, raw: bytes) -> tuple[bytes, StreamedText]:
        """A GenerateStream's request as the device process takes it from the front, and its
        stream's text to come."""
        outer = _parse(worker_pb.GenerateStreamRequest, raw)
        streamed = await self._encode(outer.request)
        return outer.SerializeToString(), streamed

    async def _encode(self, request: worker_pb.GenerateRequest) -> StreamedText:
        """Check ``request`` and put its prompt in as token ids; the text of its answer's stream. The
        request's errors are the device process's (worker/generate_messages.py)."""
        text = self._text
        assert text is not None, "only once serves"
        sampling = check_request(request)
        if self._encoding >= MAX_QUEUED_GENERATES:
            raise Overloaded(
                f"{self._encoding} Generate prompts are being encoded, the most this worker takes; retry later",
                metadata={"maxQueued": str(MAX_QUEUED_GENERATES)},
            )
        self._encoding += 1
        try:  # a 1 MiB prompt or a long chat must not stall the other streams on this loop
            spec = await asyncio.to_thread(generation_request, request, sampling, lambda: text)
        finally:
            self._encoding -= 1
        request.ClearField("prompt")
        request.ClearField("messages")
        request.prompt_token_ids[:] = spec.prompt
        return StreamedText(text, spec.stop_set(self._eos), spec.stop_strings)

    def answer(self, raw: bytes) -> bytes:
        """A unary Generate's answer from the device process, with its text."""
        done = worker_pb.GenerateResponse.FromString(raw)
        done.text = answer_text(self._text, done)
        return done.SerializeToString()

    def last(self, raw: bytes, streamed: StreamedText) -> bytes:
        """A stream's last message from the device process, with its text: the whole answer's, and
        what the stream held back of it."""
        last = worker_pb.GenerateStreamResponse.FromString(raw)
        last.done.text = answer_text(self._text, last.done)
        last.text = streamed.finish(last.done.text)
        return last.SerializeToString()


def _parse(kind: type[M], raw: bytes) -> M:
    try:
        return kind.FromString(raw)
    except DecodeError as exc:  # as the device process's server says it
        raise undecodable(exc) from exc


__all__ = ["FrontText"]
