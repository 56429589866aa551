"""``memsvc up --log-format/--log-level`` reach every service it starts (they log to the one stderr)."""

from __future__ import annotations

import json
from pathlib import Path

from upproc import Up, free_port, wait_for


def test_up_passes_its_log_format_and_level_to_every_service(tmp_path: Path) -> None:
    ports: list[int] = []
    while len(ports) < 3:
        if (p := free_port()) not in ports:
            ports.append(p)
    up = Up(tmp_path / "state", ports, extra=["--log-format", "json", "--log-level", "debug"]).start()
    try:

        def records() -> list[dict[str, str]]:
            out = []
            for line in up.proc.stderr_text().splitlines():
                if line.startswith("{"):
                    out.append(json.loads(line))
            return out

        # the worker logs its import at debug; the manager and the gateway each log something by now
        found = wait_for(
            records,
            lambda rs: (
                {r["logger"].split(".")[1] for r in rs if "." in r["logger"]} >= {"manager", "worker"}
                and any(r["level"] == "debug" for r in rs)
            ),
            what="debug JSON records from the manager and the worker",
        )
        assert all(set(r) >= {"time", "level", "logger", "message"} for r in found)
        text_lines = [ln for ln in up.proc.stderr_text().splitlines() if " INFO " in ln or " DEBUG " in ln]
        assert text_lines == [], f"a service logged text, not JSON: {text_lines[:3]}"
    finally:
        up.close()
