"""What every memsvc metrics registry shares: ``memsvc_build_info``, and no ``*_created`` series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Info, disable_created_metrics

disable_created_metrics()  # type: ignore[no-untyped-call]
"""No ``*_created`` series beside every counter and histogram (they doubled the series and
Prometheus needs none of them: a counter's reset is seen in its values). Process-wide: the gateway's
registry too."""


def build_info(registry: CollectorRegistry) -> None:
    """``memsvc_build_info{version, python, grpcio}`` = 1, for dashboards and alerts across upgrades."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "unknown"

    info = Info("memsvc_build", "The running memsvc: its version, Python's and grpcio's", registry=registry)
    info.info({"version": of("memsvc"), "python": platform.python_version(), "grpcio": of("grpcio")})


__all__ = ["build_info"]
