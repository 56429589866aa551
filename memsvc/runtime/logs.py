"""How the services log: one handler on stderr, as text (the default) or as one JSON object per line
(``--log-format json``, for log shippers), at ``--log-level``. Their stdout carries only the lines
that say where they listen and when they are ready (``memsvc worker local0 listening on …``), which
scripts and tests wait for."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message"}`` (and ``"exception"`` with its traceback), one line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def announce(line: str, stream: TextIO | None = None) -> None:
    """Write one of those lines (stdout unless ``stream``) in a single write, then flush.

    ``memsvc up`` runs its services as child processes sharing one stdout; ``print`` writes the text
    and its newline separately when the stream is unbuffered, so two services starting at once could
    splice their lines together and hide them from whoever waits for them."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()


def configure(level: str = "info", fmt: str = "text") -> None:
    """The process's logging, replacing whatever handlers the root logger had."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def current_logging() -> tuple[str, str]:
    """(level, format) of this process's logging, for a child process to log the same way."""
    root = logging.getLogger()
    json_lines = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.level).lower(), "json" if json_lines else "text"


__all__ = ["FORMATS", "LEVELS", "JsonFormatter", "announce", "configure", "current_logging"]
