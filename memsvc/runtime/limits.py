"""Every bound on what a client can send or make a server keep, in one place.

docs/operations.md ("Bounds") lists these with what happens past them; tests/runtime/test_bounds.py checks
that the table and this module agree. A bound refuses with INVALID_ARGUMENT (a field too long or a
count too large: the request itself is wrong) or RESOURCE_EXHAUSTED (a queue or table is full: retry
later), and a refused call changes nothing.
"""

from __future__ import annotations

from memsvc.errors import InvalidArgument

# ---- strings a client sends and a server keeps ----
MAX_ID_BYTES = 128
"""request_id, sequence_id, worker id: room for any UUID or ULID with a prefix."""
MAX_ADDRESS_BYTES = 256
"""A worker's ``host:port`` address (RegisterWorker)."""
MAX_HOST_BYTES = 256
"""A worker's host name (RegisterWorker)."""
MAX_HOLDER_BYTES = 256
"""A lease's holder text (AcquireWorker)."""
MAX_PATH_BYTES = 4096
"""A filesystem path a client names (ReloadWeights' model_path)."""

INT32_MAX = 2**31 - 1
"""The largest proto int32: token ids, counts and the model's sizes travel as int32 (ModelInfo,
GenerateRequest), so a value past it loaded and then failed every GetWorkerStatus with INTERNAL."""

# ---- counts ----
MAX_WORKERS = 4096
"""Worker records a manager keeps (registered and configured)."""
MAX_POLICY_TAGS = 64
"""Tags in one policy's tag_actions."""
MAX_SWAP_PAIRS = 1 << 20
"""Blocks in one SwapBlocks / SwapWorkerBlocks call."""
MAX_PROMPT_TOKENS = 1 << 16
MAX_PROMPT_BYTES = 1 << 20
"""A text prompt, or the chat messages together (UTF-8 bytes), before encoding."""
MAX_CHAT_MESSAGES = 1024
MAX_STOP_TOKENS = 64
"""stop_token_ids of one Generate."""
MAX_STOP_STRINGS = 16
"""Stop strings of one Generate (the OpenAI API allows 4; vLLM's clients send more)."""
MAX_STOP_STRING_BYTES = 1024
"""One stop string (UTF-8 bytes): each is matched against the text after every token."""
MAX_GENERATE_TOKENS = 4096
"""max_new_tokens of one Generate (the model's context length may allow fewer)."""
MAX_QUEUED_GENERATES = 256
"""Generate calls queued or running on one worker at once (the engine runs up to --max-batch of
them in each step; the rest wait their turn)."""
MAX_PAGE_SIZE = 1000
"""Workers in one ListWorkers page, leases in one ListLeases page (default 50)."""
MAX_LEASES_PER_WORKER = 1024
"""Leases held (or being granted) on one worker at once."""
MAX_LEASES = 65536
"""Leases a manager holds at once, over all workers."""
MAX_KEEP_ALIVE_S = 30 * 86400.0
"""The longest keep_alive a lease may ask for (AcquireWorkerRequest.keep_alive)."""
MAX_QUEUED_TRANSITIONS = 64
"""The manager's calls waiting for, or running, one worker's transitions (SleepWorker, WakeWorker)."""
MAX_WATCHERS = 256
"""WatchWorkers streams a manager serves at once."""
MAX_TELEMETRY_SUBSCRIBERS = 64
"""StreamTelemetry streams a worker serves at once."""

# ---- the gateway (HTTP) ----
MAX_HTTP_BODY_BYTES = 8 << 20
"""A request body the gateway reads: the largest prompt (MAX_PROMPT_BYTES) even if JSON escapes every
character (``\\uXXXX``, six bytes each), with room for the rest of the request."""
MAX_GATEWAY_REQUESTS = 1024
"""Completions a gateway serves at once (queued for room, waking, or streaming); past it a 503 with
Retry-After, before any lease is taken."""
MAX_GATEWAY_CONNECTIONS = 4096
"""HTTP connections a gateway holds at once, at most (``--max-connections``; fewer when the open-files
limit leaves less room: memsvc.gateway.connections); past it a new one is answered 503 and closed."""
MAX_HTTP_HEAD_BYTES = 16 << 10
"""A request's line and headers together (h11's own default, named here); past it a 400."""
GATEWAY_HEADER_TIMEOUT_S = 10.0
"""Seconds a connection has to send a complete request head, from its start or its previous response
(``--header-timeout``); then it is closed."""
GATEWAY_BODY_TIMEOUT_S = 30.0
"""Seconds a request's body has to arrive in full, from its head (``--body-timeout``); then a 408."""
GATEWAY_IDLE_TIMEOUT_S = 5
"""Seconds a keep-alive connection may sit idle after a response (``--idle-timeout``, uvicorn's own
``timeout_keep_alive`` and default)."""


def check_length(value: str, limit: int, field: str) -> str:
    """``value`` if its UTF-8 form is at most ``limit`` bytes, else INVALID_ARGUMENT naming the field."""
    size = len(value.encode())
    if size > limit:
        raise InvalidArgument(
            f"{field} must be at most {limit} bytes, got {size}", metadata={"field": field, "maxBytes": str(limit)}
        )
    return value


__all__ = [
    "INT32_MAX",
    "GATEWAY_BODY_TIMEOUT_S",
    "GATEWAY_HEADER_TIMEOUT_S",
    "GATEWAY_IDLE_TIMEOUT_S",
    "MAX_ADDRESS_BYTES",
    "MAX_CHAT_MESSAGES",
    "MAX_GATEWAY_CONNECTIONS",
    "MAX_GATEWAY_REQUESTS",
    "MAX_GENERATE_TOKENS",
    "MAX_HOLDER_BYTES",
    "MAX_HOST_BYTES",
    "MAX_HTTP_BODY_BYTES",
    "MAX_HTTP_HEAD_BYTES",
    "MAX_ID_BYTES",
    "MAX_KEEP_ALIVE_S",
    "MAX_LEASES",
    "MAX_LEASES_PER_WORKER",
    "MAX_PAGE_SIZE",
    "MAX_PATH_BYTES",
    "MAX_POLICY_TAGS",
    "MAX_PROMPT_BYTES",
    "MAX_PROMPT_TOKENS",
    "MAX_QUEUED_GENERATES",
    "MAX_QUEUED_TRANSITIONS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_BYTES",
    "MAX_STOP_TOKENS",
    "MAX_SWAP_PAIRS",
    "MAX_TELEMETRY_SUBSCRIBERS",
    "MAX_WATCHERS",
    "MAX_WORKERS",
    "check_length",
]
