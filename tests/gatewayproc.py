"""A real ``memsvc gateway`` process for the gateway tests: started on port 0, its bound address read
from its "listening on" line, stopped with SIGTERM (or killed, whatever happened in the test)."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Sequence

from childproc import Proc, ProcError

_LISTENING = re.compile(r"^memsvc gateway listening on (?P<address>\S+)$")
READY_TIMEOUT = 60.0


class GatewayStartError(ProcError):
    """The gateway exited or did not report its address in time."""


class GatewayProcess(Proc):
    stop_timeout = 30.0

    def __init__(self, manager: str, args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "memsvc.cli", "gateway", "--listen", "127.0.0.1:0", "--manager", manager, *args]
        super().__init__(argv, name="gateway", new_session=False, env=env)
        self.url = ""

    def start(self) -> GatewayProcess:
        super().start()
        try:
            found = self.wait_lines([_LISTENING], READY_TIMEOUT, GatewayStartError, "listening")
            self.url = f"http://{found[0]['address']}"
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self) -> int:
        try:
            return self.signal_and_wait(signal.SIGTERM)
        except ProcError as exc:
            raise AssertionError(str(exc)) from None
