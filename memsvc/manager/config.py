"""The manager's config file (TOML, or YAML when PyYAML is installed): default policy, static
workers and timing. Example::

    [manager]
    heartbeat_interval = 2.0        # seconds
    default_lease_ttl = 60.0

    [policy]                        # seeds the default policy (UpdatePolicy changes persist and win)
    idle_sleep_timeout = 300        # seconds idle -> tier 1
    idle_deep_sleep_timeout = 3600  # seconds idle -> tier 2 (level 2)
    device_budget_bytes = 0         # 0: the device's capacity
    host_budget_bytes = 0           # 0: unlimited
    device_swap_headroom_bytes = 0  # over the budget while an eviction and its wake overlap; 0: never
    time_slice = 2.0                # seconds a busy worker keeps its device once another waits; 0: pinned
    start_timeout = 0               # seconds an acquire waits for an unavailable worker to return; 0: none
    tag_actions = { weights = "offload", kv_cache = "discard" }

    [[workers]]                     # static workers, besides those that register themselves
    id = "gpu0"
    address = "10.0.0.7:50061"
    host = "gpu-host-1"
"""

from __future__ import annotations

import time
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from memsvc.errors import InvalidArgument
from memsvc.manager.policy import fields_from_config
from memsvc.manager.records import worker_id_from_name
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.store import StoredWorker


@dataclass(frozen=True)
class ManagerConfig:
    settings: ManagerSettings = field(default_factory=ManagerSettings)
    policy_fields: dict[str, Any] = field(default_factory=dict)
    workers: list[StoredWorker] = field(default_factory=list)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's tables: TOML, or YAML when the name ends in .yaml or .yml (this file's and
    ``memsvc up --config``'s, memsvc/_host.py)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read config {p}: {exc}") from exc
    raw: object
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise InvalidArgument(f"config {p}: {exc}") from exc
    else:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"config {p}: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidArgument(f"config {p}: expected tables, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None) -> ManagerConfig:
    if path is None:
        return ManagerConfig()
    p = Path(path)
    raw = read_config_file(p)
    unknown = set(raw) - {"manager", "policy", "workers"}
    if unknown:
        raise InvalidArgument(f"config {p}: unknown section(s) {sorted(unknown)}")
    known = {f.name for f in fields(ManagerSettings)}
    mgr = dict(raw.get("manager", {}))
    bad = set(mgr) - known
    if bad:
        raise InvalidArgument(f"config {p}: unknown [manager] key(s) {sorted(bad)}")
    try:
        settings = ManagerSettings(**{k: float(v) for k, v in mgr.items()})
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"config {p}: [manager] values are seconds (numbers): {exc}") from None
    workers = []
    for entry in raw.get("workers", []):
        if "id" not in entry or "address" not in entry:
            raise InvalidArgument(f"config {p}: every [[workers]] entry needs id and address")
        workers.append(
            StoredWorker(
                worker_id_from_name(str(entry["id"])),
                str(entry["address"]),
                str(entry.get("host", "")),
                True,
                time.time(),
            )
        )
    return ManagerConfig(settings, fields_from_config(dict(raw.get("policy", {}))), workers)
