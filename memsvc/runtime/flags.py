"""Command-line settings: flags whose defaults come from ``MEMSVC_<FLAG>`` variables, the value types
every service's flags share (sizes, addresses, counts, seconds), and typed settings that generate their
flags: a frozen dataclass whose fields carry :func:`setting` metadata (``worker.config.WorkerConfig``)
is the one definition of those flags, their variables, defaults and help; :func:`add_settings` makes
the flags and :func:`settings_from` the value back, as vLLM's ``EngineArgs`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}i": 1 << (10 * n) for n, p in enumerate("kmgt", 1)},
    **{f"{p}ib": 1 << (10 * n) for n, p in enumerate("kmgt", 1)},
    **{f"{p}b": 10 ** (3 * n) for n, p in enumerate("kmgt", 1)},
}
"""Size suffixes, in any case: ``Ki Mi Gi Ti`` and ``KiB MiB GiB TiB`` are powers of 1024 (as in
Kubernetes quantities and IEC), ``kB MB GB TB`` powers of 1000. A bare ``k M G T`` is refused:
Kubernetes reads ``8G`` as 8e9 bytes, most CLIs as 8 GiB, and a size must not depend on which."""


class EnvDefault(str):
    """A flag's default as its MEMSVC_<NAME> variable gives it (or the built-in one), remembering the
    variable's name so that ``--help`` can show it."""

    variable: str

    def __new__(cls, value: str, variable: str) -> EnvDefault:
        self = super().__new__(cls, value)
        self.variable = variable
        return self


def env(name: str, default: str) -> str:
    """Every flag's default can come from MEMSVC_<FLAG> (containers are configured by environment)."""
    return EnvDefault(os.environ.get(f"MEMSVC_{name}", default), f"MEMSVC_{name}")


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default (the one in force: its variable's value when set) and the
    environment variable it reads."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = (action.help or "").removesuffix(" (default: %(default)s)")  # BooleanOptionalAction's own
        if not action.option_strings or action.default is argparse.SUPPRESS or "%(default)" in text:
            return text
        variable = getattr(action.default, "variable", None)
        if variable is None and action.default in (None, False):  # --json and the like: nothing to show
            return text
        if "(default:" in text and text.endswith(")"):  # the help says what the default means
            return text[:-1] + (f"; ${variable})" if variable else ")")
        shown = "%(default)s" if action.default not in (None, "") else "none"
        return f"{text} (default: {shown}" + (f"; ${variable})" if variable else ")")


class Parser(argparse.ArgumentParser):
    """Every command's parser, with :class:`HelpFormatter`, and the one check of MEMSVC_* values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        """argparse converts a string default with the flag's type, but names the flag, not the
        variable the value came from, and never checks a default against the flag's choices. A flag
        left at its MEMSVC_<NAME> default gets both here: a bad variable is one line naming it,
        exit 2 (``MEMSVC_LOG_FORMAT=xml`` used to be ignored, ``MEMSVC_LOG_LEVEL=loud`` a traceback)."""
        if not isinstance(arg_string, EnvDefault) or isinstance(arg_string, OnOffDefault):
            return super()._get_value(action, arg_string)
        shown = f"{arg_string.variable}={str(arg_string)!r}"
        try:
            value = super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:
            self.error(f"{shown}: {exc.message}")
        if action.choices is not None and value not in action.choices:
            self.error(f"{shown}: expected one of {', '.join(map(str, action.choices))}")
        return value


ENV_TRUE = frozenset({"1", "true", "yes", "on"})
ENV_FALSE = frozenset({"0", "false", "no", "off"})


class OnOffDefault(EnvDefault):
    """An on/off flag's default as MEMSVC_<NAME> spells it: kept a string until the command is known
    (:func:`env_bools`), so a bad value is only that command's usage error."""


def on_off(p: argparse.ArgumentParser, flag: str, default: str, help: str) -> None:  # noqa: A002 - argparse's name
    """``--flag`` / ``--no-flag``, its default from MEMSVC_<FLAG>."""
    name = flag.removeprefix("--").replace("-", "_").upper()
    p.add_argument(
        flag,
        action=argparse.BooleanOptionalAction,
        default=OnOffDefault(env(name, default), f"MEMSVC_{name}"),
        help=help,
    )


def env_bools(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Turn the on/off flags' environment defaults into bools: 1/0, true/false, yes/no, on/off in any
    case; anything else is a usage error (exit 2), not a silent "off"."""
    for dest, value in vars(args).items():
        if not isinstance(value, OnOffDefault):
            continue
        word = value.strip().lower()
        if word not in ENV_TRUE | ENV_FALSE:
            parser.error(f"{value.variable}={str(value)!r}: expected 1/0, true/false, yes/no or on/off")
        setattr(args, dest, word in ENV_TRUE)


def parse_bytes(text: str) -> int:
    """``8GiB`` or ``8Gi`` (binary), ``8GB`` (decimal), or a plain byte count (see :data:`_UNITS`)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m and unit in ("k", "m", "g", "t"):
        n, u = m.group(1), unit.upper()
        raise argparse.ArgumentTypeError(
            f"ambiguous size: {text!r}: write {n}{u}i or {n}{u}iB for powers of 1024, {n}{u}B for powers of 1000"
        )
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB, 8Gi, 8GiB, 16GB)")
    return int(float(m.group(1)) * _UNITS[unit])


def listen_address(text: str) -> str:
    """``host:port`` to serve on (port 0: any free one), checked before anything starts: a typo is a
    usage error naming the flag or its variable, not a traceback from the server library."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"not a host:port address: {text!r}")
    return text.strip()


def text_or_none(text: str) -> str | None:
    """A flag's text as given, or None for '' ("not set": the service's own default stands)."""
    return text if text.strip() else None


def listen_or_none(text: str) -> str:
    """A listen address, or '' for "do not serve this"."""
    return "" if text.strip() == "" else listen_address(text)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A flag's type: an integer >= ``minimum`` (a count of blocks or requests, a device ordinal)."""

    def parse_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse_int


def non_negative_seconds(text: str) -> float:
    """A flag's type: a finite number of seconds >= 0."""
    value = seconds_or_unset(text)
    if value is None:
        raise argparse.ArgumentTypeError("not a number of seconds: ''")
    return value


def seconds_up_to_an_hour(text: str) -> float:
    """A flag's type: seconds in [0, 3600] (a drain or a read bound longer than that is a typo)."""
    value = non_negative_seconds(text)
    if value > 3600:
        raise argparse.ArgumentTypeError(f"must be at most 3600 seconds, got {text!r}")
    return value


def some_seconds_up_to_an_hour(text: str) -> float:
    """A flag's type: seconds in (0, 3600]."""
    value = seconds_up_to_an_hour(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def count_or_auto(text: str) -> int | None:
    """A flag's type: an integer >= 1, or ``auto`` (None: the program sizes it)."""
    return None if text.strip().lower() == "auto" else int_at_least(1)(text)


def lease_ttl_seconds(text: str) -> float:
    """A flag's type: a gateway lease's TTL, seconds in [1, 3600] (it is renewed every third of it:
    shorter would flood the manager with renewals, longer hold a dead gateway's workers awake)."""
    value = seconds_up_to_an_hour(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text!r}")
    return value


def seconds_or_unset(text: str) -> float | None:
    """Seconds (not negative), or '' for "not set here" (the store's or config's value stands)."""
    if text.strip() == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """A flag's type: a span of time, ``90s``, ``10m``, ``2h``, ``1d`` or plain seconds (not negative)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 10m, 2h, 1d, or seconds)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def reserve_size(text: str) -> int | str:
    """``--host-reserve``: ``auto`` or a size."""
    return "auto" if text.strip().lower() == "auto" else parse_bytes(text)


def prepin_size(text: str) -> int | str:
    """``--host-prepin``: ``auto``, ``weights`` or a size."""
    from memsvc.vocabulary import WEIGHTS

    return WEIGHTS if text.strip().lower() == WEIGHTS else reserve_size(text)


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one field of a settings dataclass is a flag (see :func:`setting`)."""

    help: str
    parse: Callable[[str], Any] | None = None
    """The flag's type: text to the field's value (None: the text itself)."""
    flag: str = ""
    """``--name``; empty: the field's name with ``-`` for ``_``."""
    text: str | None = None
    """The default as the flag and its variable spell it, where ``str(default)`` would not (a size,
    ``auto`` for None); tests/test_cli_env.py checks that it parses to the field's default."""
    choices: tuple[str, ...] | None = None
    on_off: bool = False
    """``--name`` / ``--no-name``, a bool (its variable 1/0, true/false, yes/no, on/off)."""
    env: str = ""
    """The variable's name after ``MEMSVC_``; empty: the flag's name (``--kv-blocks``: KV_BLOCKS)."""


_SETTING = "memsvc.setting"
"""The key of a field's :class:`Setting` in its dataclass metadata."""


def setting(default: Any, help: str, **how: Any) -> Any:  # noqa: A002 - argparse's name
    """A dataclass field that is also a flag ``--name`` with the variable ``MEMSVC_NAME``: its default
    is ``default``, and ``how`` holds :class:`Setting`'s other fields."""
    return dataclasses.field(default=default, metadata={_SETTING: Setting(help, **how)})


def settings_of(cls: type) -> list[tuple[dataclasses.Field[Any], Setting]]:
    """The fields of the dataclass ``cls`` that are flags, in their order, with their settings."""
    return [(f, f.metadata[_SETTING]) for f in dataclasses.fields(cls) if _SETTING in f.metadata]


def flag_name(f: dataclasses.Field[Any], s: Setting) -> str:
    return s.flag or "--" + f.name.replace("_", "-")


def variable(f: dataclasses.Field[Any], s: Setting) -> str:
    """``MEMSVC_<FLAG>`` (or the name the setting gives): the variable a flag's default comes from."""
    return "MEMSVC_" + (s.env or flag_name(f, s).removeprefix("--").replace("-", "_").upper())


def default_text(f: dataclasses.Field[Any], s: Setting) -> str:
    """The field's default as its flag is written."""
    if s.text is not None:
        return s.text
    if s.on_off:
        return "1" if f.default else "0"
    return str(f.default)


def add_settings(p: argparse.ArgumentParser, cls: type) -> None:
    """A flag for each field of ``cls`` that is a :func:`setting`, its default from its variable."""
    for f, s in settings_of(cls):
        name = flag_name(f, s)
        if s.on_off:
            assert not s.env, "an on/off flag's variable is named after it"
            on_off(p, name, default_text(f, s), s.help)
            continue
        key = variable(f, s).removeprefix("MEMSVC_")
        typed: dict[str, Any] = {"type": s.parse} if s.parse else {}  # text as it is: no check to name
        p.add_argument(name, choices=s.choices, default=env(key, default_text(f, s)), help=s.help, dest=f.name, **typed)


def settings_from(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``cls`` that :func:`add_settings`'s flags gave ``args``."""
    return {f.name: getattr(args, f.name) for f, _ in settings_of(cls)}
