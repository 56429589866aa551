"""The worker's RPC front in a process of its own (``memsvc worker --rpc-front process``).

Python runs one thread at a time per process: a gRPC server writing a message per token for each of
256 streams holds the GIL for much of every engine step, and the device loop, which shares it, steps
that much slower. Here the public server (the port, TLS, the token, health and reflection) runs in
a child process; the device process keeps the allocator, the model, the engine and the servicer,
serving them on a unix socket in a directory only its user can enter.

- Every method but GenerateStream passes through as bytes: the same request reaches the same
  servicer, with the caller's deadline, and its status (code, message, ErrorInfo) comes back as it
  was; a caller who leaves cancels the inner call.
- GenerateStream goes through worker/token_mux.py: one stream to the device process carries every
  stream's tokens, a frame per step; this process builds and writes the per-stream messages.
- The model's text is read and served here (worker/front_text.py): the device process says where it
  is, as a line on this process's stdin, once it knows; this process reads it and says what it
  found on its stdout, which the device process's load checks. Generate and GenerateStream then
  reach the device process with token ids and leave it without text.
- Health mirrors the device process's; the first time this server answers SERVING it says so on its
  stdout (the device process says "ready" only then). The stop is the device process's to order
  (SIGTERM, or its end closing this process's stdin): this server then drains for the worker's drain
  time and exits, and removes the device process's socket directory if that process was killed.

On stdin, JSON lines: the configuration (:class:`FrontConfig`), then ``{"text": TextSource's fields}``.
On stdout: ``{"address": ...}`` (or ``{"error": ...}``), ``{"text": {"info": ...} or {"error": ...}}``,
``{"serving": true}``, in that order (the device process sets SERVING only after the text's line);
and ``{"decoding": path or ""}`` after the text's line, before or after the serving one
(worker/front_text.py).

:class:`FrontProcess` starts and stops it from the device process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memsvc.errors import InvalidArgument, MemsvcError, Unavailable
from memsvc.runtime.auth import Security
from memsvc.runtime.logs import configure
from memsvc.runtime.rpc_errors import Context
from memsvc.runtime.serving import SERVER_OPTIONS, Server, run_service, start_server
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker import token_mux
from worker.front_text import FrontText
from worker.generate_messages import StreamedText
from worker.model.text_source import TextInfo, TextSource
from worker.token_mux import Frame

PARENT_EXIT_S = 30.0
"""How long a front whose input ended waits to see its parent gone before it removes the socket directory."""
log = logging.getLogger("memsvc.worker.front")

SERVICE = worker_pb.DESCRIPTOR.services_by_name["ModelWorkerService"]
START_TIMEOUT_S = 60.0
"""How long the device process waits for the front to listen (its imports: a second or two)."""
STOP_MARGIN_S = 5.0
"""After the drain, how long the device process waits for the front to exit before killing it."""


class DeviceStreams:
    """This process's side of the token mux: opens streams, hands each its frames' parts."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._queues: dict[int, asyncio.Queue[Any]] = {}
        self._next = 0
        self._call: Any = None
        self._outgoing: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._receiver: asyncio.Task[None] | None = None

    def _connect(self) -> None:
        if self._call is not None:
            return
        open_mux = self._channel.stream_stream(
            token_mux.METHOD, request_serializer=token_mux.dumps, response_deserializer=token_mux.loads
        )
        self._call = open_mux(self._send())
        self._receiver = asyncio.ensure_future(self._receive(self._call))

    async def _send(self) -> AsyncIterator[tuple[Any, ...]]:
        while True:
            yield await self._outgoing.get()

    async def _receive(self, call: Any) -> None:
        try:
            async for frame in call:
                self._dispatch(frame)
        except grpc.aio.AioRpcError as exc:
            log.error("the device process's token stream ended: %s", exc.details())
        finally:
            self._call = None
            gone = token_mux.failure(Unavailable("the worker's device process is not answering"))
            for queue in self._queues.values():
                queue.put_nowait((None, gone))
            self._queues.clear()

    def _dispatch(self, frame: Frame) -> None:
        tokens, ends = frame
        for sid, ids, text, prompt_tokens in tokens:
            queue = self._queues.get(sid)
            if queue is not None:
                queue.put_nowait((ids, text, prompt_tokens))
        for sid, last, failed in ends:
            queue = self._queues.pop(sid, None)
            if queue is not None:
                queue.put_nowait((last, failed))

    def open(self, raw: bytes, device_text: bool) -> tuple[int, asyncio.Queue[Any]]:
        """Start a stream (``device_text``: the device process makes its text, else this one does):
        its id, and the queue its token batches, then its end, arrive on."""
        self._connect()
        self._next += 1
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[self._next] = queue
        self._outgoing.put_nowait(("open", self._next, raw, device_text))
        return self._next, queue

    def cancel(self, sid: int) -> None:
        """The caller left: the device stops the stream at its next step."""
        if self._queues.pop(sid, None) is not None:
            self._outgoing.put_nowait(("cancel", sid))

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._receiver is not None:
            self._receiver.cancel()


async def _fail(context: Context, failed: token_mux.Failure) -> None:
    code, details, trailing = failed
    await context.abort(code, details, trailing)


class Proxy:
    """The ModelWorkerService's methods, served here for the device process."""

    def __init__(self, channel: grpc.aio.Channel, streams: DeviceStreams, text: FrontText) -> None:
        self._channel = channel
        self._streams = streams
        self._text = text
        self._generate_ids: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(token_mux.GENERATE)

    def register(self, server: grpc.aio.Server) -> None:
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for method in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{method.name}"
            if method.name == "GenerateStream":
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(self._generate_stream)
            elif method.name == "Generate":
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(self._generate(path))
            elif method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(self._pass_stream(path))
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(self._pass_unary(path))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))

    def _pass_unary(self, path: str) -> Callable[[bytes, Context], Any]:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(path)

        async def unary(raw: bytes, context: Context) -> bytes:
            try:
                out: bytes = await call(raw, timeout=context.time_remaining())
                return out
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
                raise  # (abort raises)

        return unary

    def _pass_stream(self, path: str) -> Callable[[bytes, Context], AsyncIterator[bytes]]:
        open_call: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = self._channel.unary_stream(path)

        async def stream(raw: bytes, context: Context) -> AsyncIterator[bytes]:
            call = open_call(raw, timeout=context.time_remaining())
            try:
                async for message in call:
                    yield message
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
            finally:
                call.cancel()

        return stream

    def _generate(self, path: str) -> Callable[[bytes, Context], Any]:
        """Generate: its text here once this process has read it, else as it came."""
        as_it_came = self._pass_unary(path)

        async def generate(raw: bytes, context: Context) -> bytes:
            if not self._text.serves:
                return await as_it_came(raw, context)  # type: ignore[no-any-return]
            try:
                ids = await self._text.unary(raw)
                out: bytes = await self._generate_ids(ids, timeout=context.time_remaining())
                return self._text.answer(out)
            except MemsvcError as exc:
                await _fail(context, token_mux.failure(exc))
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
            raise AssertionError("abort raises")

        return generate

    async def _generate_stream(self, raw: bytes, context: Context) -> AsyncIterator[bytes]:
        streamed: StreamedText | None = None
        if self._text.serves:
            try:
                raw, streamed = await self._text.stream(raw)
            except MemsvcError as exc:
                await _fail(context, token_mux.failure(exc))
        sid, queue = self._streams.open(raw, device_text=streamed is None)
        ended = False
        try:
            while not ended:
                items = [await queue.get()]
                while not _is_end(items[-1]) and not queue.empty():  # the client reads slower than steps come
                    items.append(queue.get_nowait())
                ended = _is_end(items[-1])
                batches = items[:-1] if ended else items
                if batches:  # one message for every batch that came meanwhile
                    tokens = [t for ids, _, _ in batches for t in ids]
                    if streamed is not None:
                        text = "".join(streamed.push(t) for t in tokens)
                    else:
                        text = "".join(text for _, text, _ in batches)
                    message = worker_pb.GenerateStreamResponse(
                        token_ids=tokens, text=text, prompt_token_count=batches[0][2]
                    )
                    yield message.SerializeToString()
            last, failed = items[-1]
            if failed is not None:
                await _fail(context, failed)
            yield last if streamed is None else self._text.last(last, streamed)
        finally:
            if not ended:
                self._streams.cancel(sid)


def _is_end(item: tuple[Any, ...]) -> bool:
    """A stream's queue holds (token ids, text, prompt_token_count) batches, then (last message, failure)."""
    return len(item) == 2  # noqa: PLR2004


async def _mirror_health(channel: grpc.aio.Channel, srv: Server) -> None:
    """This server's health is the device process's (NOT_SERVING while the model loads). The first
    SERVING, once this server answers with it, is told to the device process, which says "ready" only
    then: a client that checks health on the word finds SERVING. Only the first: nothing reads this
    process's stdout after that, and a pipe nobody reads would fill and block this process."""
    stub = health_pb2_grpc.HealthStub(channel)
    name = SERVICE.full_name
    told = False

    async def mirror(serving: bool) -> None:
        nonlocal told
        await srv.set_serving(serving)
        await srv.set_serving(serving, name)
        if serving and not told:
            told = True
            _tell({"serving": True})

    while True:
        try:
            async for answer in stub.Watch(health_pb2.HealthCheckRequest(service=name)):
                await mirror(answer.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError:
            await mirror(False)
        await asyncio.sleep(0.5)  # the device process restarts its server only as it stops: retry calmly


async def serve(config: FrontConfig, security: Security) -> int:
    """Serve until stopped. On stdout, as JSON lines: where this server listens (or why it cannot),
    then, once, that it answers SERVING (see :func:`_mirror_health`)."""
    listen, device, drain = config.listen, config.device, config.drain
    channel = grpc.aio.insecure_channel(device, options=SERVER_OPTIONS)
    streams = DeviceStreams(channel)
    text = FrontText(config.socket_dir)
    try:
        proxy = Proxy(channel, streams, text)
        srv = await start_server(listen, [proxy.register], [SERVICE.full_name], security=security)
    except InvalidArgument as exc:
        _tell({"error": str(exc)})
        return 2
    await srv.set_serving(False)
    await srv.set_serving(False, SERVICE.full_name)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    if not _tell({"address": srv.address}):  # the device process stopped while this one started
        stop.set()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # a terminal's Ctrl-C: the device process orders the stop
    # the device process holds this stdin open: its end (however it ended) ends this process too;
    # before that, it says there where the model's text is (worker/front_text.py)
    reading: list[asyncio.Task[None]] = []

    async def read_text(where: TextSource) -> None:
        writing = asyncio.ensure_future(text.write_decoding(where))  # by a process of its own, beside the read
        found = await text.read(where)
        _tell({"text": found})  # the load waits for this line: the decoding's comes after
        if "info" not in found:  # the load fails: no decoding
            text.stop_writing()
        _tell({"decoding": await writing})  # "" too: requests with stop strings wait for this line

    def told(line: dict[str, Any]) -> None:
        if isinstance(line.get("text"), dict) and not reading:
            reading.append(asyncio.ensure_future(read_text(TextSource(**line["text"]))))

    ended = _Input(stop, told)
    await loop.connect_read_pipe(lambda: ended, sys.stdin)
    health = asyncio.ensure_future(_mirror_health(channel, srv))
    await stop.wait()
    health.cancel()
    for task in reading:
        task.cancel()
    text.stop_writing()  # a decoding's writer still running ends now (its thread with it)
    await srv.set_serving(False)
    await srv.stop(drain)
    streams.close()
    await channel.close()
    if config.socket_dir and ended.ended:  # stdin ended: the device process is going without the stop it orders
        await _remove_when_parent_gone(config.socket_dir, config.device_pid)
    return 0


async def _remove_when_parent_gone(socket_dir: str, device_pid: int) -> None:
    """Remove the device process's socket directory once this process is re-parented: the dying device
    process closes this stdin before the kernel hands its children on, so right after the end of input
    the parent may still be the device process; waited for up to :data:`PARENT_EXIT_S`."""
    deadline = time.monotonic() + PARENT_EXIT_S
    while os.getppid() == device_pid and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    if os.getppid() != device_pid:
        shutil.rmtree(socket_dir, ignore_errors=True)


def _tell(line: dict[str, Any]) -> bool:
    """One JSON line to the device process; False when it has gone (it closed its end of the pipe)."""
    try:
        print(json.dumps(line), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit: nobody reads it
        return False
    return True


class _Input(asyncio.Protocol):
    """This process's stdin after the configuration's line: JSON lines from the device process
    (``told``), then its end, which stops this process. (The configuration's line is read before,
    by :func:`main`: the device process writes the next only after this process said where it
    listens, so that read takes nothing of it.)"""

    MAX_LINE = 1 << 16
    """A line from the device process at most (a path, a few fields)."""

    def __init__(self, stop: asyncio.Event, told: Callable[[dict[str, Any]], None]) -> None:
        self._stop = stop
        self._told = told
        self._buffer = b""
        self.ended = False

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        self._buffer = self._buffer[-self.MAX_LINE :]
        for line in lines:
            try:
                parsed = json.loads(line)
            except ValueError:
                log.error("the device process said something that is not JSON: %r", line[:200])
                continue
            if isinstance(parsed, dict):
                self._told(parsed)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._stop.set()


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    """What the device process tells the front, as one JSON line on its stdin."""

    listen: str
    device: str
    drain: float
    security: dict[str, Any]
    """memsvc.runtime.auth.Security's fields (JSON: its tuple of allowed clients is a list)."""
    log_level: str = "info"
    log_format: str = "text"
    socket_dir: str = ""
    """The directory the device process made for its socket: it removes it as it exits, but a device
    process killed (SIGKILL, the OOM killer) cannot, and the front, which outlives it briefly, does."""
    device_pid: int = 0
    """The device process: once this process's parent is another (it was re-parented: the device
    process died, at whatever moment of this one's life), the socket directory is the front's to remove."""


_ARGV = (sys.executable, "-m", "worker.rpc_front")
_ahead: subprocess.Popen[bytes] | None = None
"""A front started ahead (:func:`start_ahead`), waiting for its config on its stdin."""


def start_ahead() -> None:
    """Start a front now, before its config is known, for the next :meth:`FrontProcess.start` (a
    standby worker's: worker/standby.py): its interpreter and imports, half a second, are then done by
    the time the worker listens. Its input ending (this process exiting first) ends it."""
    global _ahead
    if _ahead is None:
        _ahead = subprocess.Popen(_ARGV, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def drop_ahead() -> None:
    """End the front started ahead, if any (a worker that serves inline has no use for it)."""
    global _ahead
    if _ahead is not None and _ahead.stdin is not None:
        _ahead.stdin.close()
        _ahead.wait()
    _ahead = None


class _Child:
    """The front's process as FrontProcess drives it: one asyncio started, or one started ahead (a
    ``Popen``, its stdout read through the loop, its exit waited for on a thread)."""

    def __init__(
        self,
        spawned: asyncio.subprocess.Process | None,
        popen: subprocess.Popen[bytes] | None,
        reader: asyncio.StreamReader | None,
    ) -> None:
        self._spawned, self._popen, self._reader = spawned, popen, reader

    @classmethod
    async def start(cls) -> _Child:
        global _ahead
        popen, _ahead = _ahead, None
        if popen is None or popen.poll() is not None:
            spawned = await asyncio.create_subprocess_exec(
                *_ARGV, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            return cls(spawned, None, None)
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
        return cls(None, popen, reader)

    def write(self, data: bytes) -> None:
        if self._spawned is not None:
            assert self._spawned.stdin is not None
            self._spawned.stdin.write(data)
        else:
            assert self._popen is not None and self._popen.stdin is not None
            self._popen.stdin.write(data)
            self._popen.stdin.flush()

    async def readline(self) -> bytes:
        if self._spawned is not None:
            assert self._spawned.stdout is not None
            return await self._spawned.stdout.readline()
        assert self._reader is not None
        return await self._reader.readline()

    async def wait(self) -> int:
        if self._spawned is not None:
            return await self._spawned.wait()
        assert self._popen is not None
        return await asyncio.to_thread(self._popen.wait)

    def send_signal(self, sig: int) -> None:
        process = self._spawned or self._popen
        assert process is not None
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class FrontProcess:
    """The front as the device process sees it: started, watched, stopped.

    After its address, what the front says on its stdout is read by one task (:meth:`_listen`) and
    handed to whoever waits for it: the model's text (:meth:`text_found`), the decoding it wrote for
    the engine (:meth:`decoding_written`), that it serves (:meth:`serving`)."""

    def __init__(self, process: _Child, address: str) -> None:
        self._process = process
        self.address = address
        loop = asyncio.get_running_loop()
        self._text: asyncio.Future[TextInfo] = loop.create_future()
        self._decoding: asyncio.Future[str] = loop.create_future()
        self._serving: asyncio.Future[bool] = loop.create_future()
        self._text.add_done_callback(_retrieved)  # a load that failed before it knew asks for none
        self._listening = asyncio.ensure_future(self._listen())

    @classmethod
    async def start(cls, config: FrontConfig) -> FrontProcess:
        """Start it (or take the one started ahead) and wait until it listens; InvalidArgument when it
        cannot (the address taken)."""
        process = await _Child.start()
        process.write(json.dumps(dataclasses.asdict(config)).encode() + b"\n")
        try:
            line = await asyncio.wait_for(process.readline(), START_TIMEOUT_S)
            answer = json.loads(line) if line else {"error": f"the RPC front exited ({await process.wait()})"}
        except (TimeoutError, ValueError) as exc:
            answer = {"error": f"the RPC front did not start: {exc!r}"}
        if "address" not in answer:
            process.send_signal(signal.SIGKILL)
            await process.wait()
            raise InvalidArgument(str(answer.get("error", answer)))
        return cls(process, str(answer["address"]))

    async def _listen(self) -> None:
        """Read the front's lines until it exits; what it never said is then settled: the text with
        Unavailable, no decoding (""), not serving."""
        try:
            while line := await self._process.readline():
                with contextlib.suppress(ValueError):
                    told = json.loads(line)
                    if isinstance(told, dict):
                        self._told(told)
        finally:
            if not self._text.done():
                self._text.set_exception(Unavailable("the RPC front exited before it read the model's text"))
            if not self._decoding.done():
                self._decoding.set_result("")
            if not self._serving.done():
                self._serving.set_result(False)

    def _told(self, told: dict[str, Any]) -> None:
        found = told.get("text")
        if isinstance(found, dict) and not self._text.done():
            if "info" in found:
                self._text.set_result(TextInfo(**found["info"]))
            else:
                self._text.set_exception(InvalidArgument(str(found.get("error", found))))
        if isinstance(told.get("decoding"), str) and not self._decoding.done():
            self._decoding.set_result(told["decoding"])
        if told.get("serving") is True and not self._serving.done():
            self._serving.set_result(True)

    def tell_text(self, where: TextSource) -> None:
        """Where the model's text is: the front reads it now (see :meth:`text_found`)."""
        with contextlib.suppress(OSError):  # it exited: text_found says so
            self._process.write(json.dumps({"text": dataclasses.asdict(where)}).encode() + b"\n")

    async def text_found(self) -> TextInfo:
        """What the front found where :meth:`tell_text` said: InvalidArgument where the text does
        not read, Unavailable if the front exited first."""
        return await asyncio.shield(self._text)

    async def decoding_written(self) -> str:
        """Where the front wrote the model's decoding alone for the engine, after it told the text
        (worker/front_text.py); "" where it wrote none or exited first."""
        return await asyncio.shield(self._decoding)

    async def serving(self) -> bool:
        """Wait until the front answers health checks with SERVING (it mirrors the device process's
        health); False if it exited first."""
        return await asyncio.shield(self._serving)

    async def wait(self) -> int:
        return await self._process.wait()

    async def stop(self, drain: float) -> None:
        """SIGTERM: it drains for ``drain`` seconds, then exits (killed if it has not by then)."""
        self._process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self._process.wait(), drain + STOP_MARGIN_S)
        except TimeoutError:
            log.error("the RPC front did not exit %.0f s after the stop; killing it", drain + STOP_MARGIN_S)
            self._process.send_signal(signal.SIGKILL)
            await self._process.wait()


def main() -> int:
    line = sys.stdin.readline()
    if not line:  # the device process stopped before it could say what to serve: nothing to do
        return 0
    config = FrontConfig(**json.loads(line))
    configure(config.log_level, config.log_format)
    fields = dict(config.security)
    fields["allowed_clients"] = tuple(fields.get("allowed_clients", ()))
    return run_service(serve(config, Security(**fields)))


if __name__ == "__main__":
    sys.exit(main())
