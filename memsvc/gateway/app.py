"""``memsvc gateway``: the OpenAI-compatible HTTP front door (FastAPI on uvicorn).

FastAPI because its pydantic request models give OpenAI-shaped 400s for free and Starlette's
streaming responses cancel the generator when a client disconnects, which is where a lease must be
released; uvicorn is the ASGI server it is built and tested with.

A request names a model; the gateway finds the workers serving it through the manager, takes a lease
on the best one (an awake one first; a sleeping one is woken by the lease), sends Generate (or
GenerateStream) to that worker directly, and releases the lease when the response ends or the
client leaves. Sleeping models are therefore served on request, at the cost of a wake.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memsvc.gateway.backends import Backends, Served
from memsvc.gateway.metrics import GatewayMetrics
from memsvc.gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    GatewayError,
    new_id,
    now,
    usage,
)
from memsvc.runtime.limits import (
    GATEWAY_BODY_TIMEOUT_S,
    MAX_GATEWAY_REQUESTS,
    MAX_GENERATE_TOKENS,
    MAX_HTTP_BODY_BYTES,
    MAX_ID_BYTES,
)
from memsvc.runtime.rpc_errors import error_info, retry_delay
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import WorkerState

log = logging.getLogger("memsvc.gateway")
T = TypeVar("T")

GENERATE_TIMEOUT_S = 600.0
DISCONNECT_POLL_S = 0.1
"""How often a request whose answer is not streamed checks that its client is still there."""
RETRY_AFTER_S = 2

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (502, "api_error"),
    grpc.StatusCode.PERMISSION_DENIED: (502, "api_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.ABORTED: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
"""A worker's or the manager's gRPC status as the client's HTTP status (502: the gateway's own
credentials were refused, not the client's)."""


def from_rpc(exc: grpc.aio.AioRpcError | grpc.RpcError, where: str) -> GatewayError:
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    status, kind = _STATUS.get(code, (500, "server_error"))
    delay = retry_delay(exc) if status == 503 else None  # the server's own (a loading worker's), else ours
    retry = max(1, math.ceil(delay)) if delay is not None else RETRY_AFTER_S if status == 503 else None
    return GatewayError(status, f"{where}: {details}", kind, code=code.name.lower(), retry_after=retry)


def _generate_request(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
) -> worker_pb.GenerateRequest:
    """What both endpoints send the worker, before the prompt. OpenAI's max_tokens is an upper bound
    (stop_at_context): unset, the most one Generate makes, so the model's context is what ends it."""
    sampling = worker_pb.SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k or 0, 0))
    if req.seed is not None:
        sampling.seed = req.seed
    return worker_pb.GenerateRequest(
        max_new_tokens=max_tokens if max_tokens is not None else MAX_GENERATE_TOKENS,
        sampling=sampling,
        ignore_eos=req.ignore_eos,
        stop_at_context=True,
        stop=req.stop_strings,  # the worker ends the generation at the token that completes one
    )


def _check_tokens(ids: list[int], worker: Served) -> None:
    """Token ids the worker would refuse, refused before the lease would wake it for nothing."""
    if worker.vocab_size and (bad := next((t for t in ids if t >= worker.vocab_size), None)) is not None:
        raise GatewayError(400, f"prompt token {bad} is not a token id in [0, {worker.vocab_size})", param="prompt")
    if worker.context_length and len(ids) >= worker.context_length:
        raise GatewayError(
            400,
            f"the prompt is {len(ids)} tokens: no room for a new one in the model's context of {worker.context_length}",
            param="prompt",
        )


class Gateway:
    """What the routes share (``app.state.gateway``): the backends, the metrics, the waits and the
    bound on completions served at once."""

    def __init__(self, backends: Backends, acquire_timeout: float, queue_timeout: float, max_requests: int) -> None:
        self.backends = backends
        self.metrics = GatewayMetrics()
        self.acquire_timeout = acquire_timeout
        self.queue_timeout = queue_timeout
        self.max_requests = max_requests
        self.in_flight = 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One of the ``max_requests`` completions served at once, or a 503."""
        if self.in_flight >= self.max_requests:
            raise GatewayError(
                503,
                f"the gateway is serving its limit of {self.max_requests} requests",
                "server_error",
                code="overloaded",
                retry_after=RETRY_AFTER_S,
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()

    async def models(self) -> dict[str, list[Served]]:
        try:
            return await self.backends.models()
        except grpc.RpcError as exc:
            raise from_rpc(exc, "manager") from None

    async def worker_for(self, model: str) -> Served:
        workers = (await self.models()).get(model)
        if not workers and self.backends.unknown_unavailable:
            # a worker that stopped before this manager heard its model (it restarted since) may be
            # the one: "does not exist" would be wrong until it is back or pruned (memsvc prune)
            raise GatewayError(
                503,
                f"the model {model!r} is not served by any reachable worker; "
                f"{self.backends.unknown_unavailable} registered worker(s) are unavailable",
                "server_error",
                code="model_unavailable",
                retry_after=RETRY_AFTER_S,
            )
        if not workers:
            raise GatewayError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        if all(s.state == common_pb.WORKER_STATE_UNAVAILABLE for s in workers):
            on_demand = [s for s in workers if await self.started_on_demand(s)]
            if on_demand:  # its acquire waits while its process starts (the policy's start_timeout)
                return Backends.pick(on_demand)
            raise GatewayError(
                503,
                f"the model {model!r} is registered but its worker is unavailable "
                f"({', '.join(s.name for s in workers)})",
                "server_error",
                code="model_unavailable",
                retry_after=RETRY_AFTER_S,
            )
        return Backends.pick(workers)

    async def started_on_demand(self, worker: Served) -> bool:
        """Whether ``worker``, unavailable, is one whose process is started when an acquire waits for
        it (its policy's start_timeout is above 0: memsvc up's ``[workers] stop_after``). False when
        the manager cannot say."""
        try:
            return await self.backends.start_timeout(worker) > 0
        except grpc.RpcError:
            return False


def create_app(
    backends: Backends,
    token: str = "",
    acquire_timeout: float = 300.0,
    queue_timeout: float = 30.0,
    max_requests: int = MAX_GATEWAY_REQUESTS,
    body_timeout: float = GATEWAY_BODY_TIMEOUT_S,
) -> FastAPI:
    """The gateway's routes over ``backends``; ``token``: the bearer token /v1 requires (empty: none);
    ``queue_timeout``: how long a request waits for room on its model's device; ``max_requests``: the
    completions served at once (each holds a connection, and a lease or a place in the queue);
    ``body_timeout``: how long a request's body may take to arrive, from its head (then a 408)."""
    app = FastAPI(title="memsvc gateway", docs_url=None, redoc_url=None, openapi_url=None)
    # a body is bounded while it is read (Starlette's limit, also for chunked bodies: its 413 comes
    # through the HTTPException handler below) and, by a Content-Length past it, before (_Edge: the
    # limit's own answer to that case is plain text, not OpenAI's error JSON)
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=MAX_HTTP_BODY_BYTES)
    app.add_middleware(_Edge, token=token, body_timeout=body_timeout)
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]  # Starlette types it loosely
    app.add_exception_handler(GatewayError, _gateway_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.state.gateway = Gateway(backends, acquire_timeout, queue_timeout, max_requests)
    app.include_router(routes)
    return app


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (413 body too large, 404 and 405 routes) in OpenAI's shape too."""
    message = _TOO_LARGE if exc.status_code == 413 else exc.detail
    return JSONResponse(GatewayError(exc.status_code, message).body(), status_code=exc.status_code, headers=exc.headers)


async def _gateway_error(_request: Request, exc: GatewayError) -> JSONResponse:
    headers = {"Retry-After": str(int(exc.retry_after))} if exc.retry_after else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = str(first.get("msg", "invalid request"))
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        msg = str(first["ctx"]["error"])  # our validators' own words, without pydantic's "Value error, "
    elif first.get("type") == "json_invalid":
        msg = "the request body is not valid JSON"
    return JSONResponse(GatewayError(400, msg, param=".".join(loc) or None).body(), status_code=400)


routes = APIRouter()


@routes.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(_gateway(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/healthz")
@routes.get("/health")  # as vLLM, SGLang and llama-swap spell it
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@routes.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready: the manager answers (``ok``), or it is away and the gateway serves the awake models it
    last listed (``degraded``); 503 when it never reached the manager."""
    backends = _gateway(request).backends
    try:
        await backends.models(timeout=3)
    except grpc.RpcError as exc:
        return JSONResponse({"status": "manager unreachable", "detail": str(exc)}, status_code=503)
    if backends.manager_away:
        why = "the manager does not answer: awake models are served without leases, sleeping ones wait for it"
        return JSONResponse({"status": "degraded", "detail": why})
    return JSONResponse({"status": "ok"})


def _model_card(name: str, workers: list[Served]) -> dict[str, Any]:
    """A model as /v1/models lists it; ``state``: its best worker's (memsvc's own field)."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "memsvc",
        "state": WorkerState.of(Backends.pick(workers).state).label,
    }


@routes.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    models = await _gateway(request).models()
    return {"object": "list", "data": [_model_card(name, ws) for name, ws in sorted(models.items())]}


@routes.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    """One model (a served name may hold a "/", as hub ids do); 404 naming it when none serves it,
    503 when its workers are all unavailable."""
    return _model_card(model, [await _gateway(request).worker_for(model)])


@routes.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> Response:
    return await _counted(_gateway(request), req.model, "completions", _completions(req, request))


@routes.post("/v1/chat/completions", response_model=None)
async def chat(req: ChatCompletionRequest, request: Request) -> Response:
    return await _counted(_gateway(request), req.model, "chat_completions", _chat(req, request))


async def _counted(gateway: Gateway, model: str, endpoint: str, answer: Awaitable[Response]) -> Response:
    try:
        response = await answer
    except GatewayError as exc:
        label = model if exc.code != "model_not_found" else ""
        gateway.metrics.requests.labels(label, endpoint, str(exc.status)).inc()
        raise
    gateway.metrics.requests.labels(model, endpoint, str(response.status_code)).inc()
    return response


async def _completions(req: CompletionRequest, request: Request) -> Response:
    worker = await _gateway(request).worker_for(req.model)
    gen = _generate_request(req, req.max_tokens)
    if isinstance(req.prompt, str):
        gen.prompt = req.prompt
    elif req.prompt and isinstance(req.prompt[0], str):
        gen.prompt = str(req.prompt[0])
    else:
        _check_tokens([int(t) for t in req.prompt], worker)
        gen.prompt_token_ids.extend(int(t) for t in req.prompt)
    return await _respond(req, worker, gen, "text_completion", request)


async def _chat(req: ChatCompletionRequest, request: Request) -> Response:
    worker = await _gateway(request).worker_for(req.model)
    gen = _generate_request(req, req.limit)
    gen.messages.extend(worker_pb.ChatMessage(role=m.role, content=m.text) for m in req.messages)
    return await _respond(req, worker, gen, "chat.completion", request)


async def _respond(
    req: CompletionRequest | ChatCompletionRequest,
    worker: Served,
    gen: worker_pb.GenerateRequest,
    kind: str,
    request: Request,
) -> Response:
    """The worker's answer: whole, or streamed as server-sent events; the lease goes back when it ends."""
    gateway = _gateway(request)
    backends, metrics = gateway.backends, gateway.metrics
    holder = f"gateway {request.state.request_id}"
    ids = req.return_token_ids if req.return_token_ids is not None else not worker.has_tokenizer
    t0 = time.perf_counter()
    stack = contextlib.AsyncExitStack()
    try:
        stack.enter_context(gateway.slot())
        if worker.state != common_pb.WORKER_STATE_AWAKE:
            metrics.wakes.labels(req.model).inc()
        for attempt in range(TURN_RETRIES + 1):
            leased_stack = contextlib.AsyncExitStack()  # this attempt's lease, and its call
            try:
                # raced with the client: one that leaves while queued or waking takes no lease (a
                # lease granted as it left is in the stack, and goes back below)
                leasing = backends.lease(
                    worker, holder, gateway.acquire_timeout, gateway.queue_timeout, req.keep_alive_s
                )
                granted = await _unless_client_left(request, leased_stack.enter_async_context(leasing))
            except grpc.RpcError as exc:
                await leased_stack.aclose()
                raise from_rpc(exc, "manager") from None
            except BaseException:
                await leased_stack.aclose()
                raise
            await stack.enter_async_context(leased_stack)
            leased = time.perf_counter()
            metrics.queue.labels(req.model).observe(granted.queued_s)
            metrics.wake.labels(req.model).observe(max(leased - t0 - granted.queued_s, 0.0))
            lease = granted.response
            if not lease.lease.lease_id:
                metrics.unleased.labels(req.model).inc()
            stub = backends.worker(lease.worker.address or worker.address)
            if not req.stream:
                try:
                    r = await _unless_client_left(request, stub.Generate(gen, timeout=GENERATE_TIMEOUT_S))
                except grpc.RpcError as exc:
                    _asleep_while_the_manager_is_away(exc, lease)
                    if attempt < TURN_RETRIES and _turn_ended(exc):
                        await leased_stack.aclose()
                        continue
                    raise from_rpc(exc, "worker") from None
                await stack.aclose()  # the lease goes back before the answer does
                metrics.completion_tokens.labels(req.model).inc(len(r.token_ids))
                return JSONResponse(_whole(kind, req.model, r, ids))
            call = stub.GenerateStream(worker_pb.GenerateStreamRequest(request=gen), timeout=GENERATE_TIMEOUT_S)
            leased_stack.callback(call.cancel)
            try:
                # errors before the first token are the response's status
                first = await _unless_client_left(request, call.read())
                break
            except grpc.RpcError as exc:
                _asleep_while_the_manager_is_away(exc, lease)
                if attempt < TURN_RETRIES and _turn_ended(exc):
                    await leased_stack.aclose()
                    continue
                raise from_rpc(exc, "worker") from None
        first_at = time.perf_counter()
        metrics.prefill.labels(req.model).observe(first_at - leased)
        metrics.first_token.labels(req.model).observe(first_at - t0)
    except BaseException:
        await stack.aclose()
        raise
    closed = _Once(stack.aclose)
    tally = _Tally(metrics, req.model, first_at)
    events = _stream(req, kind, first, call, closed, tally, ids)
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(closed))


TURN_RETRIES = 3
"""Times a request whose worker went to sleep between its lease and its Generate (a turn given to
another worker on its device ended just then: memsvc/manager/turns.py) takes a new lease and tries
again; the lease waits for the worker's next turn."""


def _asleep_while_the_manager_is_away(exc: grpc.RpcError, lease: manager_pb.AcquireWorkerResponse) -> None:
    """A 503 when a worker served without a lease (the manager away) refused for its state: it went to
    sleep since the manager last listed it, and only the manager wakes it."""
    if not lease.lease.lease_id and _turn_ended(exc):
        raise GatewayError(
            503,
            f"the worker of this model is asleep and the manager, which wakes it, does not answer "
            f"({lease.worker.name})",
            "server_error",
            code="model_unavailable",
            retry_after=RETRY_AFTER_S,
        )


def _turn_ended(exc: grpc.RpcError) -> bool:
    """The worker refused the Generate for its state (asleep, or a Sleep pending), not for the
    request: FAILED_PRECONDITION whose ErrorInfo names the worker's state."""
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    info = error_info(exc)
    return info is not None and "state" in info.metadata


_TOO_LARGE = f"the request body is over {MAX_HTTP_BODY_BYTES} bytes"


def _declared_size(headers: dict[str, str]) -> int:
    """The body's Content-Length (0 when absent or unreadable: the read's own limit then applies)."""
    try:
        return int(headers.get("content-length", "0"))
    except ValueError:
        return 0


class _Edge:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide a client's disconnect from
    the endpoints): every response carries ``X-Request-Id`` (the client's, or a new one) and gets one
    log line; with a token, /v1 and /metrics require ``Authorization: Bearer <token>``; a request with
    two Authorization headers is a 400 (whichever counted would be a guess); a Content-Length past
    MAX_HTTP_BODY_BYTES is a 413 before the body is read; a body that has not arrived in full
    ``body_timeout`` seconds after the head is a 408 (:func:`_body_in_time`)."""

    def __init__(self, app: ASGIApp, token: str = "", body_timeout: float = GATEWAY_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.token = token
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive = _body_in_time(receive, self.body_timeout)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        sent_id = headers.get("x-request-id", "")[:MAX_ID_BYTES]
        # the id names the lease's holder and goes back as a header: printable ASCII only, so it stays
        # within MAX_ID_BYTES and the holder's bound (another is given in its place)
        ok = sent_id.isascii() and sent_id.isprintable()
        rid = sent_id if sent_id and ok else new_id("req")
        scope.setdefault("state", {})["request_id"] = rid
        status = 0
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        path = str(scope.get("path", ""))
        sent = headers.get("authorization", "").encode()
        authorizations = sum(k.lower() == b"authorization" for k, _ in scope.get("headers", []))
        guarded = path.startswith("/v1/") or path == "/metrics"  # as the manager's /metrics is
        if authorizations > 1:  # which one counts would be the server's guess: none does
            err = GatewayError(400, "more than one Authorization header", param=None, code="invalid_request")
            await JSONResponse(err.body(), status_code=400)(scope, receive, send_with_id)
        elif self.token and guarded and not hmac.compare_digest(sent, f"Bearer {self.token}".encode()):
            err = GatewayError(401, "missing or wrong bearer token", code="invalid_api_key")
            denied = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await denied(scope, receive, send_with_id)
        elif _declared_size(headers) > MAX_HTTP_BODY_BYTES:
            await JSONResponse(GatewayError(413, _TOO_LARGE).body(), status_code=413)(scope, receive, send_with_id)
        else:
            await self.app(scope, receive, send_with_id)
        log.info("%s %s %s %d %.1f ms", rid, scope.get("method", ""), path, status, (time.perf_counter() - t0) * 1e3)


def _body_in_time(receive: Receive, timeout: float) -> Receive:
    """``receive``, with the body's time bound: the request's body must have arrived in full
    ``timeout`` seconds after its head, else the read raises a 408 (Starlette's HTTPException, which
    FastAPI passes on from the body's read and the app answers in OpenAI's shape, as the body
    limit's 413) that closes the connection. A route reads its body before it does anything else,
    so a late one never starts its work (no lease, no wake). A trickle of bytes does not extend the
    bound (a read timeout between chunks would: slowloris sends a byte at a time); the reads after
    the body (a disconnect's) are not bounded."""
    deadline = asyncio.get_running_loop().time() + timeout
    done = False

    async def receive_in_time() -> Message:
        nonlocal done
        if done:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise HTTPException(
                408, f"the request body did not arrive within {timeout:g} s", headers={"Connection": "close"}
            ) from None
        done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return receive_in_time


async def _unless_client_left(request: Request, call: Awaitable[T]) -> T:
    """``call``'s result, unless the client disconnects first: then the call is cancelled (the worker
    stops the generation at its next step and frees its blocks) and the answer is a 499."""
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await task
            raise GatewayError(499, "the client closed the request", code="client_closed_request")


class _Tally:
    """A streamed response's token count, and its decode rate once it ends (tokens after the first,
    over the time since the first)."""

    def __init__(self, metrics: GatewayMetrics, model: str, first_at: float) -> None:
        self._tokens = metrics.completion_tokens.labels(model)
        self._rate = metrics.decode_rate.labels(model)
        self.first_at = first_at
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n
        self._tokens.inc(n)

    def done(self) -> None:
        elapsed = time.perf_counter() - self.first_at
        if self.count > 1 and elapsed > 0:
            self._rate.observe((self.count - 1) / elapsed)


class _Once:
    """An async cleanup that runs once, from the stream's end or the response's background task
    (which also runs when the client left before the stream started)."""

    def __init__(self, fn: Callable[[], Awaitable[Any]]) -> None:
        self._fn: Callable[[], Awaitable[Any]] | None = fn

    async def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            await fn()


def _reason(r: worker_pb.GenerateResponse) -> str:
    """OpenAI's finish_reason: "stop" for an EOS, a stop token or a stop string, else "length"."""
    return "stop" if r.finish_reason == common_pb.FINISH_REASON_STOP else "length"


def _whole(kind: str, model: str, r: worker_pb.GenerateResponse, ids: bool = False) -> dict[str, Any]:
    """The whole answer; with ``ids``, its choice carries ``token_ids`` (see ``return_token_ids``)."""
    if kind == "chat.completion":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": r.text}}
        rid = new_id("chatcmpl")
    else:
        choice = {"index": 0, "text": r.text, "logprobs": None}
        rid = new_id("cmpl")
    choice["finish_reason"] = _reason(r)
    if ids:
        choice["token_ids"] = list(r.token_ids)
    return {
        "id": rid,
        "object": kind,
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": usage(r.prompt_token_count, len(r.token_ids)),
    }


async def _stream(
    req: CompletionRequest | ChatCompletionRequest,
    kind: str,
    first: Any,
    call: Any,
    closed: _Once,
    tally: _Tally,
    ids: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``[DONE]``; the lease goes when it ends.
    With ``ids`` every message of the worker's is a chunk whose choice carries its ``token_ids``."""
    chat = kind == "chat.completion"
    rid, created, model = new_id("chatcmpl" if chat else "cmpl"), now(), req.model
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": rid,
            "object": chunk_kind,
            "created": created,
            "model": model,
            "choices": [choice] if choice is not None else [],
        }
        body.update(extra or {})
        return f"data: {json.dumps(body)}\n\n"

    def piece(text: str, reason: str | None = None, tokens: Sequence[int] = ()) -> dict[str, Any]:
        if chat:
            choice = {"index": 0, "delta": {"content": text} if text or reason is None else {}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if ids and reason is None:
            choice["token_ids"] = list(tokens)
        return choice

    prompt_tokens = 0
    finish: str | None = None
    try:
        if chat:
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        msg = first
        while msg is not grpc.aio.EOF and msg is not None:
            tally.add(len(msg.token_ids))
            prompt_tokens = msg.prompt_token_count or prompt_tokens  # the first message tells it
            if msg.text or (ids and msg.token_ids):
                yield event(piece(msg.text, tokens=msg.token_ids))
            if msg.HasField("done"):
                prompt_tokens = msg.done.prompt_token_count
                finish = _reason(msg.done)
            msg = await call.read()
        yield event(piece("", finish or "length"))
        tally.done()
        if req.include_usage:
            yield event(None, {"usage": usage(prompt_tokens, tally.count)})
        yield "data: [DONE]\n\n"
    except grpc.RpcError as exc:
        err = from_rpc(exc, "worker")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        await closed()


__all__ = ["Gateway", "create_app", "from_rpc", "routes"]
