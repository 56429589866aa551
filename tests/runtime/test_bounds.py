"""The bounds table of docs/operations.md says what memsvc/runtime/limits.py enforces (one place for both)."""

from __future__ import annotations

import re

from upproc import REPO_ROOT

from memsvc.gateway.connections import connection_bound
from memsvc.manager.controller import REQUEST_CACHE as MANAGER_REPLAY
from memsvc.manager.settings import ManagerSettings
from memsvc.runtime import limits
from worker.state_machine import WorkerStateMachine

DOC = REPO_ROOT / "docs" / "operations.md"


def _table() -> dict[str, str]:
    text = DOC.read_text()
    section = text[text.index("## Bounds") :]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("bound", "---"):
            rows[cells[0]] = cells[1]
    return rows


def _number(text: str) -> int:
    return int(re.match(r"\d+", text).group())  # type: ignore[union-attr]


def test_the_bounds_table_matches_the_limits() -> None:
    rows = _table()
    expect = {
        "`request_id`, `sequence_id`, worker id": limits.MAX_ID_BYTES,
        "worker `address`, `host` (RegisterWorker)": limits.MAX_ADDRESS_BYTES,
        "lease `holder`": limits.MAX_HOLDER_BYTES,
        "lease `ttl`": int(ManagerSettings().max_lease_ttl),
        "workers a manager keeps": limits.MAX_WORKERS,
        "tags in one policy's `tag_actions`": limits.MAX_POLICY_TAGS,
        "blocks in one `SwapBlocks` / `SwapWorkerBlocks`": limits.MAX_SWAP_PAIRS,
        "prompt tokens of one `Generate` (after encoding text or rendering messages)": limits.MAX_PROMPT_TOKENS,
        "a text `prompt`, or the chat `messages` together": limits.MAX_PROMPT_BYTES,
        "chat `messages` of one `Generate`": limits.MAX_CHAT_MESSAGES,
        "`stop_token_ids` of one `Generate`": limits.MAX_STOP_TOKENS,
        "`stop` strings of one `Generate`": limits.MAX_STOP_STRINGS,
        "`model_path` of `ReloadWeights`": limits.MAX_PATH_BYTES,
        "`max_new_tokens` of one `Generate`": limits.MAX_GENERATE_TOKENS,
        "`Generate` calls queued or running on one worker": limits.MAX_QUEUED_GENERATES,
        "workers in one `ListWorkers` page": limits.MAX_PAGE_SIZE,
        "retry results kept": MANAGER_REPLAY,
        "leases on one worker, and in all": limits.MAX_LEASES_PER_WORKER,
        "`SleepWorker` / `WakeWorker` calls waiting for one worker": limits.MAX_QUEUED_TRANSITIONS,
        "`WatchWorkers` streams of a manager, `StreamTelemetry` streams of a worker": limits.MAX_WATCHERS,
        "gateway request body": limits.MAX_HTTP_BODY_BYTES,
        "completions a gateway serves at once (streaming, waking or queued for room)": limits.MAX_GATEWAY_REQUESTS,
        "connections a gateway holds open": limits.MAX_GATEWAY_CONNECTIONS,
        "a gateway request's head (request line and headers)": limits.MAX_HTTP_HEAD_BYTES,
        "time for a gateway request's head to arrive, from the connection's start or its previous response": int(
            limits.GATEWAY_HEADER_TIMEOUT_S
        ),
        "time for a gateway request's body to arrive, from its head": int(limits.GATEWAY_BODY_TIMEOUT_S),
    }
    assert limits.MAX_HOST_BYTES == limits.MAX_ADDRESS_BYTES, "one row documents both"
    for row, value in expect.items():
        assert row in rows, f"docs/operations.md's bounds table has no row {row!r}"
        assert _number(rows[row]) == value, f"{row}: the docs say {rows[row]!r}, the code {value}"
    assert f"{WorkerStateMachine.REQUEST_CACHE} (worker)" in rows["retry results kept"]
    assert rows["leases on one worker, and in all"].endswith(f", {limits.MAX_LEASES}")
    streams = rows["`WatchWorkers` streams of a manager, `StreamTelemetry` streams of a worker"]
    assert streams.endswith(f", {limits.MAX_TELEMETRY_SUBSCRIBERS}")
    assert rows["`stop` strings of one `Generate`"].endswith(f"(each 1-{limits.MAX_STOP_STRING_BYTES} bytes)")
    assert f"{connection_bound(1024)} under 1024" in rows["connections a gateway holds open"]
