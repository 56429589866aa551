"""Generate's messages and the worker's generation values, both ways: a GenerateRequest checked and
turned into a :class:`~worker.model.generation.GenerationRequest` (text encoded, chat rendered), and a
finished :class:`~worker.status.Generation` turned into a GenerateResponse (with its text).

Every field is checked here, before the worker queues anything: one prompt form, its size, the
counts, the sampling values (:func:`check_request`, before the worker's state: bad input is
INVALID_ARGUMENT whatever the state); then the prompt is encoded (:func:`generation_request`), where
a model without a tokenizer refuses text with FAILED_PRECONDITION.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from google.protobuf import duration_pb2

from memsvc.errors import InvalidArgument
from memsvc.runtime.limits import (
    MAX_CHAT_MESSAGES,
    MAX_GENERATE_TOKENS,
    MAX_ID_BYTES,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKENS,
    check_length,
)
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import FinishReason
from worker.model.generation import GenerationRequest
from worker.model.sampling import SamplingParams
from worker.status import Generation
from worker.stop_strings import HeldText, cut_at_stop

if TYPE_CHECKING:  # the model's text comes with its load; the servicer must not wait for tokenizers and jinja2
    from worker.model.text import ModelText, TextStream


def check_request(request: worker_pb.GenerateRequest) -> SamplingParams:
    """Every check that needs no tokenizer (cheap: run before anything is queued); its sampling."""
    if not 0 <= request.max_new_tokens <= MAX_GENERATE_TOKENS:
        raise InvalidArgument(
            f"max_new_tokens must be in [0, {MAX_GENERATE_TOKENS}]", metadata={"field": "max_new_tokens"}
        )
    check_length(request.sequence_id, MAX_ID_BYTES, "sequence_id")
    if len(request.stop_token_ids) > MAX_STOP_TOKENS:
        raise InvalidArgument(f"at most {MAX_STOP_TOKENS} stop_token_ids", metadata={"field": "stop_token_ids"})
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings", metadata={"field": "stop"})
    for stop in request.stop:
        if not stop:
            raise InvalidArgument("a stop string must not be empty", metadata={"field": "stop"})
        check_length(stop, MAX_STOP_STRING_BYTES, "stop")
    forms = [name for name in ("prompt_token_ids", "prompt", "messages") if _given(request, name)]
    if len(forms) > 1:
        raise InvalidArgument(f"give the prompt in one form, not as {' and as '.join(forms)}")
    if request.prompt:
        check_length(request.prompt, MAX_PROMPT_BYTES, "prompt")
    elif request.messages:
        if len(request.messages) > MAX_CHAT_MESSAGES:
            raise InvalidArgument(f"at most {MAX_CHAT_MESSAGES} messages", metadata={"field": "messages"})
        size = sum(len(m.role.encode()) + len(m.content.encode()) for m in request.messages)
        if size > MAX_PROMPT_BYTES:
            raise InvalidArgument(
                f"the messages hold {size} bytes, at most {MAX_PROMPT_BYTES}", metadata={"field": "messages"}
            )
    elif len(request.prompt_token_ids) > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"the prompt is {len(request.prompt_token_ids)} tokens, at most {MAX_PROMPT_TOKENS}")
    s = request.sampling
    return SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0, seed=s.seed if s.HasField("seed") else None
    )


def generation_request(
    request: worker_pb.GenerateRequest, sampling: SamplingParams, text: Callable[[], ModelText]
) -> GenerationRequest:
    """The request (already checked: ``sampling`` is what :func:`check_request` returned) with its
    prompt encoded; ``text()`` is the model's text side (it raises for a model without one), asked
    for only to encode a prompt: stop strings need the decoding alone, which the engine asks for
    (worker/model/text_source.py), so a worker whose RPC front encodes does not read the whole text
    for them. Encoding a long prompt takes a while: the servicer runs this on a thread."""
    if request.prompt:
        prompt = text().encode(request.prompt)
    elif request.messages:
        prompt = text().encode_chat([{"role": m.role, "content": m.content} for m in request.messages])
    else:
        prompt = list(request.prompt_token_ids)
    if len(prompt) > MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"the prompt is {len(prompt)} tokens, at most {MAX_PROMPT_TOKENS}")
    return GenerationRequest(
        prompt=prompt,
        max_new_tokens=request.max_new_tokens,
        sequence_id=request.sequence_id or None,
        sampling=sampling,
        stop_token_ids=frozenset(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        stop_at_context=request.stop_at_context,
        stop_strings=tuple(request.stop),
    )


def _given(request: worker_pb.GenerateRequest, field: str) -> bool:
    value = getattr(request, field)
    return bool(len(value)) if not isinstance(value, str) else bool(value)


def answer_text(text: ModelText | None, done: worker_pb.GenerateResponse) -> str:
    """An answer's text: its tokens' but the stop token that ended it (a stop string's last token
    stays: its text may begin before the stop string), cut before the stop string that ended it.
    Made where the text is served: here, or in the RPC front's process (worker/rpc_front.py)."""
    if text is None:
        return ""
    tokens = list(done.token_ids)
    if done.finish_reason == FinishReason.STOP.proto and not done.matched_stop:
        tokens = tokens[:-1]
    whole = text.decode(tokens)
    return cut_at_stop(whole, [done.matched_stop]) if done.matched_stop else whole


def response(g: Generation, sequence_id: str, text: ModelText | None) -> worker_pb.GenerateResponse:
    """The answer, with its text where ``text`` is given (else the RPC front's process adds it)."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(g.seconds * 1e9))
    done = worker_pb.GenerateResponse(
        token_ids=g.tokens,
        sequence_id=sequence_id,
        duration=d,
        block_ids=g.block_ids,
        finish_reason=g.finish_reason.proto,
        prompt_token_count=g.prompt_tokens,
        completion_token_count=len(g.tokens),
        matched_stop=g.matched_stop,
    )
    done.text = answer_text(text, done)
    return done


class StreamedText:
    """The text of a stream's tokens as they come. A stop token ends the generation, so its text is
    left out at once (as :func:`completion` leaves it out of the whole); text that may be the start
    of one of the request's stop strings is held back until the next token tells (worker/stop_strings.py)."""

    def __init__(self, text: ModelText | None, stops: frozenset[int], stop_strings: Sequence[str] = ()) -> None:
        self._stream: TextStream | None = text.stream() if text is not None else None
        self._stops = stops
        self._held = HeldText(stop_strings)

    def push(self, token: int) -> str:
        """The text this token lets the stream send ("" for a stop token, one that only starts a
        character, or one whose text may begin a stop string)."""
        if self._stream is None or token in self._stops:
            return ""
        return self._held.feed(self._stream.step(token))

    def finish(self, whole: str) -> str:
        """What the stream still holds back at the end: text held for a stop string that never came,
        and bytes that never completed a character (a model can emit such bytes), which the whole
        text decodes as U+FFFD. The pieces and this add up to ``whole``."""
        return whole[self._held.sent :]


__all__ = ["StreamedText", "answer_text", "check_request", "generation_request", "response"]
