"""Text in and out of a model: its tokenizer (``tokenizer.json``, the ``tokenizers`` library) and its
chat template (jinja2), read from the model directory as transformers would read them.

- Encoding a prompt adds what the tokenizer's post-processor adds (a BOS token, say), as
  ``tokenizer(text)`` does in transformers; a rendered chat is encoded without them, as
  ``apply_chat_template(tokenize=True)`` does (the template writes its own BOS).
- The chat template is rendered the way transformers renders it: a sandboxed jinja2 environment with
  ``trim_blocks``/``lstrip_blocks`` and loop controls, its ``tojson`` (no HTML escaping),
  ``raise_exception`` and ``strftime_now``, the ``{% generation %}`` tag, and the tokenizer's special
  tokens (``bos_token``, ``eos_token``, ...) as variables. Tests compare the result with
  transformers' ``apply_chat_template`` on the same directory.
- Streaming text never splits a character: :class:`TextStream` is the ``tokenizers`` library's own
  incremental decoder, which holds back bytes until they complete a character.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from memsvc.errors import InvalidArgument, WrongState
from worker.checkpoint_files import read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers 5 saves a tokenizer's chat template (older ones put it in tokenizer_config.json)."""
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers passes to a chat template."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): rendered as
    its body, as transformers renders it when it is not tracking assistant tokens."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Decoding:
    """A tokenizer's way from token ids to text, and no more.

    Decoding takes each id's token (the model's vocabulary and the added tokens) through the
    tokenizer's decoder; it never uses a BPE's merges, which are most of a large tokenizer's file and
    of its read. :func:`decoding_only` writes a tokenizer without them, which decodes every id as the
    whole one does: the RPC front has it written for the device process (worker/decoding_writer.py),
    whose engine decodes to match stop strings (worker/model/text_source.py), and reading it there
    holds the model's GIL for a quarter of the whole one's read (0.06 s against 0.25 s at Llama 3's
    size on the development machine, 0.11-0.15 s on the GPU hosts).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def read(cls, file: str | Path) -> Decoding:
        """A tokenizer file's decoding (as :func:`decoding_only` writes one); InvalidArgument where it
        does not read."""
        return cls(_read_tokenizer(file))

    def only(self) -> str:
        """This tokenizer as JSON without what decoding leaves unused (see :func:`decoding_only`)."""
        return decoding_only(json.loads(self.tokenizer.to_str()))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> TextStream:
        return TextStream(self.tokenizer)


class ModelText(Decoding):
    """A model directory's tokenizer, special tokens and chat template."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: Mapping[str, str], chat_template: str | None) -> None:
        super().__init__(tokenizer)
        self.special_tokens = dict(special_tokens)
        self._template = _environment().from_string(chat_template) if chat_template else None

    @classmethod
    def load(cls, path: str | Path) -> ModelText | None:
        """The directory's text side, or None when it has no ``tokenizer.json`` (ids only)."""
        root = Path(path)
        file = root / TOKENIZER_FILE
        if not file.is_file():
            return None
        tokenizer = _read_tokenizer(file)
        config = _read_json(root / TOKENIZER_CONFIG)
        special = {name: token for name in SPECIAL_TOKENS if (token := _token_text(config.get(name))) is not None}
        template = _chat_template(root, config)
        try:
            return cls(tokenizer, special, template)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"{root}: the chat template does not parse ({exc})") from None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """A text prompt's tokens, with the special tokens the tokenizer adds."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``, as text."""
        if self._template is None:
            raise WrongState("this model has no chat template: send prompt or prompt_token_ids")
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    **self.special_tokens,
                )
            )
        except jinja2.TemplateError as exc:  # raise_exception() in the template: the messages do not fit it
            raise InvalidArgument(f"the chat template refused the messages: {exc}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The rendered chat's tokens, without adding special tokens (the template writes them)."""
        return list(self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids)


class TextStream:
    """Text of a token stream, piece by piece, each piece whole characters only.

    ``DecodeStream`` refuses a token whose decoding changes text it already gave out ("Invalid
    prefix"). A SentencePiece decoder's byte fallback does that: it decodes a run of byte tokens
    together, and a run that is not UTF-8 becomes one U+FFFD per byte, so ``<0x0A>`` (a newline,
    given out) followed by ``<0x80>`` turns the newline into U+FFFD. A model can emit such a run
    (one with random weights readily does), and the engine matching stop strings failed the whole
    batch with it.
    Here the stream starts again at that token: what was given out stays, the token's own text comes
    (decoded alone), and the whole answer's text is the whole decoding as always."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decode = DecodeStream(skip_special_tokens=True)

    def step(self, token: int) -> str:
        """The text this token completes ("" while it only starts a character, or is special)."""
        try:
            return str(self._decode.step(self._tokenizer, token) or "")
        except Exception:  # noqa: BLE001 - the library's own type: the prefix above; alone, a token has none
            self._decode = DecodeStream(skip_special_tokens=True)
            return str(self._decode.step(self._tokenizer, token) or "")


def decoding_only(spec: dict[str, Any]) -> str:
    """A tokenizer's JSON (``tokenizer.json``'s, parsed) without what decoding leaves unused: a
    BPE's merges (``spec`` is changed)."""
    model = spec.get("model")
    if isinstance(model, dict) and model.get("type") == "BPE":
        model["merges"] = []
    return json.dumps(spec, ensure_ascii=False)


def _read_tokenizer(file: str | Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own exception types for a bad file
        raise InvalidArgument(f"{file}: cannot read the tokenizer ({exc})") from None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.exists():
        return {}
    raw = read_json(file)  # bounded: size, depth, a regular file
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{file}: expected a JSON object")
    return raw


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja (transformers 5), else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: the one named "default")."""
    file = root / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


__all__ = [
    "CHAT_TEMPLATE_FILE",
    "TOKENIZER_CONFIG",
    "TOKENIZER_FILE",
    "Decoding",
    "ModelText",
    "TextStream",
    "decoding_only",
]
