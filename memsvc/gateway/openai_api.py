"""The OpenAI API's requests as the gateway takes them, its errors, and its response objects.

Requests are pydantic models: a field of the wrong type or out of range is a 400 in OpenAI's error
shape (``{"error": {"message", "type", "param", "code"}}``) naming the field, before anything
reaches a worker. What memsvc does not do is refused by name, not ignored: ``n`` > 1, several
prompts in one request, ``logprobs``, tools.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
"""OpenAI's own limit on ``stop``."""

_UNIT_S = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|\u00b5s|ms|s|m|h)")


def keep_alive_seconds(value: str | float | None) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number of seconds, or a Go duration string (``"5m"``,
    ``"1h30m"``, ``"-1"``, ``"0"``); 0 = sleep right after, negative = never idle-sleep."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive {value!r} is neither seconds nor a duration such as '5m', '1h30m', '-1'")
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


class GatewayError(Exception):
    """An error a client gets as OpenAI's error JSON with this HTTP status."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, retry_after: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share (OpenAI's defaults: temperature 1, top_p 1)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    user: str | None = None
    ignore_eos: bool = False
    """vLLM's extension: do not stop at the model's end-of-sequence tokens."""
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
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
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

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (send several requests)")
        elif isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = ""

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    tools: Any = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: Any) -> Any:
        if tools:
            raise ValueError("tools are not supported")
        return tools

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
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "GatewayError", "StreamOptions", "keep_alive_seconds",
    "new_id", "now", "usage",
]  # fmt: skip
