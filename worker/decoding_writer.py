"""Writes a model's decoding alone (worker/model/text.py's ``decoding_only``: the tokenizer without
its BPE merges) to a file, in a process of its own: ``python -m worker.decoding_writer SOURCE FILE``,
``SOURCE`` a TextSource's fields as JSON. Exit 0 once ``FILE`` is there, whole (written aside, then
renamed); :data:`NO_TOKENIZER` for a model without one; 1 with the reason on stderr.

Why a process: the RPC front has this file written for the device process's engine, which matches
stop strings with it (worker/front_text.py), beside its own read of the text. Made from the
checkpoint's ``tokenizer.json`` as JSON (not from a tokenizer read first), it holds a GIL for about
a quarter of a second at Llama 3's size, in calls that do not let go of it; in the front's process
that held up the front's first requests. Here it takes another core, and neither the front's GIL nor
the model's, and it is done before the front's own read of the tokenizer.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from worker.checkpoint_files import read_json
from worker.model.text_source import TextSource

NO_TOKENIZER = 3
"""The exit status for a model without a tokenizer: nothing to write, nothing wrong."""


class NoTokenizer(Exception):
    """The model has no tokenizer."""


def write(where: TextSource, file: Path) -> None:
    """The decoding of the text at ``where`` into ``file`` (NoTokenizer: the model has none)."""
    from worker.model.text import TOKENIZER_FILE, decoding_only

    if where.directory:
        path = Path(where.directory, TOKENIZER_FILE)
        if not path.is_file():
            raise NoTokenizer(where.directory)
        spec = read_json(path)  # bounded: size, depth, a regular file
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: expected a JSON object")
        only = decoding_only(spec)
    else:
        text = where.load()
        if text is None:
            raise NoTokenizer("the model")
        only = text.only()
    part = file.with_suffix(".part")
    part.write_text(only)
    part.replace(file)  # whole or absent, whenever the device process looks


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m worker.decoding_writer SOURCE_JSON FILE", file=sys.stderr)
        return 2
    try:
        write(TextSource(**json.loads(args[0])), Path(args[1]))
    except NoTokenizer:
        return NO_TOKENIZER
    except Exception as exc:  # noqa: BLE001 - the front logs the reason and writes no decoding
        print(f"the model's decoding was not written: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
