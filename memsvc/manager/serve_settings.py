"""How one ``memsvc manager`` process serves: its address, its database, its config file, its metrics
endpoint and the seed of the default policy. Each field is a ``memsvc manager`` flag and a
``MEMSVC_*`` variable (memsvc/runtime/flags.py), this its one definition; the README's "Manager
flags" paragraph documents them, and tests/test_cli_env.py holds the three together.

Apart from :mod:`memsvc.manager.settings` (the config file's ``[manager]`` table: timing that may
differ per deployment but not per process) and light on purpose: the CLI imports it to build
``--help``, before anything else of the manager."""

from __future__ import annotations

from dataclasses import dataclass

from memsvc.runtime.flags import listen_address, listen_or_none, seconds_or_unset, setting, text_or_none


@dataclass(frozen=True)
class ServeSettings:
    listen: str = setting(
        "127.0.0.1:50051", "host:port to serve on (0: any port)", parse=listen_address, env="MANAGER_LISTEN"
    )
    db: str = setting(
        "memsvc-manager.db",
        "where policies, registrations and leases live: a SQLite file, or postgresql://user@host/db for several "
        "replicas (one leads, the others forward to it; needs memsvc[postgres])",
    )
    advertise: str | None = setting(
        None,
        "with a postgresql:// --db: host:port the other replicas forward to (default: the listen address, this "
        "host's name for a wildcard)",
        parse=text_or_none,
        text="",
    )
    config: str | None = setting(
        None, "TOML or YAML: default policy, static workers, timing", parse=text_or_none, text=""
    )
    metrics_listen: str = setting("", "host:port of Prometheus /metrics", parse=listen_or_none)
    idle_sleep_timeout: float | None = setting(
        None, "seed: seconds idle before tier 1 (0: never)", parse=seconds_or_unset, text=""
    )
    idle_deep_sleep_timeout: float | None = setting(
        None, "seed: seconds idle before tier 2, level 2 (0: never)", parse=seconds_or_unset, text=""
    )

    def policy_seed(self) -> dict[str, float]:
        """The default policy's fields these flags set (they win over the config file's ``[policy]``)."""
        seed = {"idle_sleep_timeout": self.idle_sleep_timeout, "idle_deep_sleep_timeout": self.idle_deep_sleep_timeout}
        return {name: value for name, value in seed.items() if value is not None}
