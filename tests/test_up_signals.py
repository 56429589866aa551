"""Ctrl-C on ``memsvc up`` (and so on ``make up``) as a terminal sends it: SIGINT to the whole process
group, the manager, the worker and the gateway included, while ``memsvc up`` also asks each child to
stop. Every process must end cleanly, ``memsvc up`` with 0 (make read a child killed by the second
signal as ``Error 241``), and the manager must not warn that the stopping worker's telemetry ended."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from upproc import Up, free_port


def test_ctrl_c_to_the_process_group_stops_everything_cleanly(tmp_path: Path) -> None:
    ports: list[int] = []
    while len(ports) < 3:
        if (p := free_port()) not in ports:
            ports.append(p)
    up = Up(tmp_path / "state", ports).start()
    try:
        assert up.proc.proc is not None and up.proc.new_session
        os.killpg(up.proc.proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the group
        code = up.proc.wait(60)
        err = up.proc.stderr_text()
        assert code == 0, up.proc.failure(f"memsvc up exited {code} after Ctrl-C")
        assert "exited with" not in err, err
        assert "telemetry" not in "\n".join(line for line in err.splitlines() if "WARNING" in line), err
    finally:
        up.close()
