"""The OpenAI API's requests as the gateway takes them, its errors, and its response objects.

Requests are pydantic models: a field of the wrong type or out of range is a 400 in OpenAI's error
shape (``{"error": {"message", "type", "param", "code"}}``) naming the field, before anything
reaches a worker. Strict: OpenAI refuses ``"temperature": "0.5"`` or ``"stream": "yes"``, and a
lenient parse would turn ``[true]`` into a token id. The worker's own bounds (memsvc.runtime.limits) are
checked here too, because the gateway takes a lease before the worker sees the request, and a
request that can only be refused must not wake a sleeping model for nothing. What memsvc does not do
is refused by name, not ignored (the answer would silently differ from the one asked for): ``n`` > 1,
several prompts in one request, ``logprobs``, ``echo``, tools, penalties, ``logit_bias``,
``best_of``, ``suffix``, a ``response_format`` other than text.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from memsvc.errors import InvalidArgument
from memsvc.runtime.limits import (
    MAX_CHAT_MESSAGES,
    MAX_GENERATE_TOKENS,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_STOP_STRING_BYTES,
    check_length,
)

OPENAI_MAX_STOP_STRINGS = 4
"""OpenAI's own limit on ``stop``."""
TOKEN_ID_END = 1 << 31
"""Token ids travel as int32 (GenerateRequest.prompt_token_ids)."""
_STRICT = ConfigDict(extra="ignore", strict=True)


def _refuse_unless(value: Any, info: ValidationInfo, *neutral: Any) -> Any:
    """``value`` if it asks for nothing (unset, or one of ``neutral``), else the field is refused by
    name: the gateway would otherwise answer as if it had not been sent."""
    if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
        raise ValueError(f"{info.field_name} is not supported")
    return value


_UNIT_S = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_NUMBER = re.compile(r"[0-9]*\.?[0-9]+([eE][+-]?[0-9]+)?")
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|\u00b5s|ms|s|m|h)")


def keep_alive_seconds(value: str | float | None) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number of seconds, or a Go duration string (``"5m"``,
    ``"1h30m"``, ``"-1"``, ``"0"``); 0 = sleep right after, negative = never idle-sleep."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    # one sign at most: "--5" and "+-5" are typos, not -5 and +5 (float() would take the second sign)
    body = text[1:] if text.startswith(("+", "-")) else text
    if _NUMBER.fullmatch(body):
        return sign * float(body)
    parts = _DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive {value!r} is neither seconds nor a duration such as '5m', '1h30m', '-1'")
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


class GatewayError(Exception):
    """An error a client gets as OpenAI's error JSON with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share (OpenAI's defaults: temperature 1, top_p 1)."""

    model_config = _STRICT

    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=TOKEN_ID_END)
    """vLLM's extension: keep only the k most likely tokens (0 or -1: all)."""
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    user: str | None = None
    ignore_eos: bool = False
    """vLLM's extension: do not stop at the model's end-of-sequence tokens."""
    return_token_ids: bool | None = None
    """vLLM's extension: each choice (and each streamed chunk's) carries ``token_ids``, the tokens it
    holds. Unset: on for a model without a tokenizer, whose text is empty (a stream would otherwise
    send nothing until it ends)."""
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    top_logprobs: Any = None
    keep_alive: str | float | None = None
    """Ollama's extension: how long the model stays awake once idle after this request (a duration
    or seconds; 0 = sleep right after, negative = never idle-sleep; unset: the manager's policy)."""

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > OPENAI_MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {OPENAI_MAX_STOP_STRINGS} non-empty strings")
        for s in stops:
            if len(s.encode()) > MAX_STOP_STRING_BYTES:
                raise ValueError(f"each stop string must be at most {MAX_STOP_STRING_BYTES} bytes")
        return stop

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, value: str | float | None) -> str | float | None:
        seconds = keep_alive_seconds(value)
        if seconds is not None and not -1e12 < seconds < 1e12:
            raise ValueError("keep_alive is out of range")
        return value

    @property
    def keep_alive_s(self) -> float | None:
        return keep_alive_seconds(self.keep_alive)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, 0, 0.0)

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, {})

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, 0)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _text_fits(text: str, what: str) -> None:
    """The worker's bound on a prompt's bytes (memsvc.runtime.limits.check_length), as a field error here."""
    try:
        check_length(text, MAX_PROMPT_BYTES, what)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=0, le=MAX_GENERATE_TOKENS)
    echo: bool = False
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (send several requests)")
        elif isinstance(prompt, list):
            if len(prompt) > MAX_PROMPT_TOKENS:
                raise ValueError(f"at most {MAX_PROMPT_TOKENS} prompt tokens, got {len(prompt)}")
            if any(not 0 <= t < TOKEN_ID_END for t in prompt):  # type: ignore[operator]
                raise ValueError(f"token ids are in [0, {TOKEN_ID_END})")
        text = prompt if isinstance(prompt, str) else prompt[0] if prompt and isinstance(prompt[0], str) else None
        if not prompt or text == "":
            # an empty text prompt is no prompt at all to the worker (proto3 sends "" as unset)
            raise ValueError("the prompt is empty")
        if text is not None:
            _text_fits(text, "the prompt")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, 1)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, "")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class ContentPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = ""

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = Field(None, ge=0, le=MAX_GENERATE_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_GENERATE_TOKENS)
    tools: Any = None
    functions: Any = None
    function_call: Any = None
    tool_choice: Any = None
    response_format: Any = None

    @field_validator("messages")
    @classmethod
    def _messages_fit(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        _text_fits("".join(m.text for m in messages), "the messages together")
        return messages

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: Any) -> Any:
        if tools:
            raise ValueError("tools are not supported")
        return tools

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, [])

    @field_validator("function_call", "tool_choice")
    @classmethod
    def _no_call(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, "none")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless(value, info, {"type": "text"})

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


__all__ = [
    "TOKEN_ID_END",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GatewayError",
    "StreamOptions",
    "keep_alive_seconds",
    "new_id",
    "now",
    "usage",
]
