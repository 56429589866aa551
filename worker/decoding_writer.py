"""Writes a model's decoding alone (worker/model/text.py's ``Decoding.only``: the tokenizer without
its BPE merges) to a file, in a process of its own: ``python -m worker.decoding_writer SOURCE FILE``,
``SOURCE`` a TextSource's fields as JSON. Exit 0 once ``FILE`` is there, whole (written aside, then
renamed); 1 with the reason on stderr.

Why a process: the RPC front writes this file for the device process's engine, which matches stop
strings with it (worker/front_text.py). Making it holds a process's GIL for about a quarter of a
second at Llama 3's size (the whole tokenizer as JSON, parsed), in calls that do not let go of it,
and the front makes it just as the worker begins to serve: in the front's own process that held up
the front's first requests. Here it takes another core, and neither the front's GIL nor the model's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from worker.model.text_source import TextSource


def write(where: TextSource, file: Path) -> None:
    """The decoding of the text at ``where`` into ``file`` (ValueError: the model has no tokenizer)."""
    text = where.load()
    if text is None:
        raise ValueError(f"{where.directory or 'the model'} has no tokenizer")
    part = file.with_suffix(".part")
    part.write_text(text.only())
    part.replace(file)  # whole or absent, whenever the device process looks


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m worker.decoding_writer SOURCE_JSON FILE", file=sys.stderr)
        return 2
    try:
        write(TextSource(**json.loads(args[0])), Path(args[1]))
    except Exception as exc:  # noqa: BLE001 - the front reads the reason and writes no decoding
        print(f"the model's decoding was not written: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
