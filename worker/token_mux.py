"""Every GenerateStream's tokens between the device process and the RPC front, one frame per step.

With ``--rpc-front process`` (worker/rpc_front.py) the public gRPC server runs in a process of its
own, so writing a message per token per stream no longer takes the GIL from the device loop. The
front's GenerateStreams reach the device process over one bidirectional stream on its internal
socket (:data:`METHOD`): the front sends ``("open", id, GenerateStreamRequest bytes, device_text)``
and ``("cancel", id)``; the device answers with frames of ``(tokens, ends)``, where ``tokens`` holds
``(id, token ids, their text, prompt_token_count)`` for every stream a step (or several, when the
front reads slower than steps come) gave tokens, and ``ends`` holds ``(id, the final
GenerateStreamResponse bytes, None)`` or ``(id, None, (status code, details, trailing metadata))``
once a stream has ended. The device's cost is then one message per step, whatever the number of
streams; the front builds their messages. ``device_text`` false: the front makes the stream's text
(worker/front_text.py), and the device sends none. :data:`GENERATE` is a unary Generate the same
way: its answer without text, for the front to add.

A stream runs exactly as the servicer's own GenerateStream does (the same checks, bound, encoding,
stop rules and text), so both fronts give the same answers. Frames are pickled: both ends are this
worker's own processes, and the socket is in a directory only its user can enter.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError

from memsvc.errors import MemsvcError
from memsvc.runtime.rpc_errors import Context, to_status, undecodable
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker.generate_messages import response

if TYPE_CHECKING:
    from worker.generate_messages import StreamedText
    from worker.model.text import ModelText
    from worker.servicer import ModelWorkerServicer
    from worker.status import Generation

log = logging.getLogger("memsvc.worker")

SERVICE = "memsvc.internal.TokenMux"
METHOD = f"/{SERVICE}/Open"
GENERATE = f"/{SERVICE}/Generate"

TokenBatch: TypeAlias = tuple[int, list[int], str, int]
"""(stream id, token ids, their text, prompt_token_count: set in a stream's first batch, else 0)."""
Failure: TypeAlias = tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]
End: TypeAlias = tuple[int, bytes | None, Failure | None]
"""(stream id, the last GenerateStreamResponse serialised, or None and the status it failed with)."""
Frame: TypeAlias = tuple[list[TokenBatch], list[End]]


def dumps(frame: object) -> bytes:
    return pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - the worker's own processes, over a socket only its user reaches


def failure(exc: BaseException) -> Failure:
    """An exception as the status the inline servicer would answer with (memsvc.runtime.rpc_errors)."""
    status = to_status(exc)
    return status.code, status.details, tuple(status.trailing_metadata)


@dataclass(eq=False)
class _Stream:
    streamed: StreamedText
    prompt_tokens: int
    sequence_id: str
    text: ModelText | None


class TokenMux:
    """The device process's side: serves :data:`METHOD` on its internal server."""

    def __init__(self, servicer: ModelWorkerServicer) -> None:
        self._servicer = servicer

    def register(self, server: grpc.aio.Server) -> None:
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Open": grpc.stream_stream_rpc_method_handler(self._open, loads, dumps),
            "Generate": grpc.unary_unary_rpc_method_handler(
                self._generate, worker_pb.GenerateRequest.FromString, worker_pb.GenerateResponse.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    async def _generate(self, request: worker_pb.GenerateRequest, context: Context) -> worker_pb.GenerateResponse:
        return await self._servicer.generate(request, device_text=False)

    async def _open(self, frames: AsyncIterator[Any], context: Context) -> AsyncIterator[Frame]:
        link = _Link(self._servicer)
        reader = asyncio.ensure_future(link.read(frames))
        try:
            async for frame in link.frames(reader):
                yield frame
        finally:  # the front went away (or the server stops): every stream it opened stops too
            reader.cancel()
            link.close()


class _Link:
    """One front's connection: its open streams and the frame being gathered."""

    def __init__(self, servicer: ModelWorkerServicer) -> None:
        self._servicer = servicer
        self._core = servicer.core
        self._loop = asyncio.get_running_loop()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._streams: dict[int, _Stream] = {}
        self._tokens: dict[int, list[int]] = {}
        """Tokens posted since the last flush, per stream (in order)."""
        self._ending: list[tuple[int, Generation | BaseException]] = []
        self._flush_scheduled = False
        self._out_tokens: list[TokenBatch] = []
        self._out_ends: list[End] = []
        self._ready = asyncio.Event()

    async def read(self, frames: AsyncIterator[Any]) -> None:
        async for frame in frames:
            if frame[0] == "open":
                sid, raw, device_text = frame[1], frame[2], frame[3]
                self._tasks[sid] = asyncio.ensure_future(self._run(sid, raw, device_text))
            elif frame[0] == "cancel":
                task = self._tasks.pop(frame[1], None)
                if task is not None:
                    task.cancel()

    async def frames(self, reader: asyncio.Future[Any]) -> AsyncIterator[Frame]:
        """Frames as they gather, until the front closes its side."""
        done: asyncio.Future[Any] = asyncio.ensure_future(self._ready.wait())
        try:
            while True:
                await asyncio.wait({done, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not done.done():
                    return  # the front closed its side (or its stream broke)
                self._ready.clear()
                frame = (self._out_tokens, self._out_ends)
                self._out_tokens, self._out_ends = [], []
                yield frame
                done = asyncio.ensure_future(self._ready.wait())
        finally:
            done.cancel()

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    async def _run(self, sid: int, raw: bytes, device_text: bool) -> None:
        """One stream, as the servicer's GenerateStream runs it; its end goes into the next frame."""
        try:
            try:
                request = worker_pb.GenerateStreamRequest.FromString(raw)
            except DecodeError as exc:
                raise undecodable(exc) from exc
            spec, slot, streamed = await self._servicer.prepare_stream(request.request, device_text)
            text = self._core.text_or_none() if device_text else None
            self._streams[sid] = _Stream(streamed, len(spec.prompt), request.request.sequence_id, text)
            post = self._core.post

            def made(token: int) -> None:  # on the device loop: a step's tokens reach the loop together
                post(self._token, (sid, token))

            outcome: Generation | BaseException = await self._core.generate(spec, made, slot)
        except asyncio.CancelledError:
            self._streams.pop(sid, None)  # the front cancelled it: its caller left, nothing is sent
            raise
        except BaseException as exc:  # noqa: BLE001 - sent to the front as its status
            if not isinstance(exc, MemsvcError):
                log.error("unexpected error in GenerateStream", exc_info=exc)
            outcome = exc
        self._tasks.pop(sid, None)
        # through the same post as the tokens, so after every one of them (worker/device_loop.py)
        self._core.post(self._end, (sid, outcome))

    def _token(self, item: tuple[int, int]) -> None:
        sid, token = item
        self._tokens.setdefault(sid, []).append(token)
        self._schedule()

    def _end(self, item: tuple[int, Generation | BaseException]) -> None:
        self._ending.append(item)
        self._schedule()

    def _schedule(self) -> None:
        """One flush after every call a LoopPost batch carries: one frame per step."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        for sid, tokens in self._tokens.items():
            stream = self._streams.get(sid)
            if stream is None:
                continue
            text = "".join(stream.streamed.push(t) for t in tokens)
            self._out_tokens.append((sid, tokens, text, stream.prompt_tokens))
            stream.prompt_tokens = 0  # told with the first message, then 0 (unset)
        self._tokens = {}
        for sid, outcome in self._ending:
            stream = self._streams.pop(sid, None)
            if isinstance(outcome, BaseException):
                self._out_ends.append((sid, None, failure(outcome)))
                continue
            assert stream is not None
            done = response(outcome, stream.sequence_id, stream.text)
            last = worker_pb.GenerateStreamResponse(text=stream.streamed.finish(done.text), done=done)
            self._out_ends.append((sid, last.SerializeToString(), None))
        self._ending = []
        self._ready.set()


__all__ = ["GENERATE", "METHOD", "SERVICE", "End", "Frame", "TokenBatch", "TokenMux", "dumps", "failure", "loads"]
