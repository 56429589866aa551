"""Compiled modules kept between starts (memsvc/runtime/bytecode.py): where the installed packages have
no byte-code and the interpreter may not write it beside them, a service writes it under its
``--bytecode-cache`` once and imports from there after; where they have it, nothing changes.

Each case is a real interpreter over real files: a package laid out as an installer without
compiling leaves it, imported under ``PYTHONDONTWRITEBYTECODE=1``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
from childproc import REPO_ROOT, Proc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from managerproc import _LISTENING, READY_TIMEOUT


def _installed(site: Path) -> Path:
    """A package ``probe_pkg`` (three modules) as a non-compiling installer leaves it: sources only."""
    pkg = site / "probe_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "sub.py").write_text("from probe_pkg import VALUE\nDOUBLE = 2 * VALUE\n")
    (pkg / "other.py").write_text("TRIPLE = 3\n")
    return pkg


def _start(site: Path, cache: str, *, extra_env: dict[str, str] | None = None) -> list[str]:
    """One start: keep_bytecode(cache) for probe_pkg, then its imports, then a child process's import
    of the module it did not import (a worker's RPC front is such a child); the lines it printed."""
    code = (
        "import subprocess, sys\n"
        "from memsvc.runtime.bytecode import keep_bytecode\n"
        f"print('kept', keep_bytecode({cache!r}, probes=('probe_pkg',)))\n"
        "import probe_pkg.sub\n"
        "print('double', probe_pkg.sub.DOUBLE)\n"
        "subprocess.run([sys.executable, '-c', 'import probe_pkg.other'], check=True)\n"
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)]),
        "PYTHONDONTWRITEBYTECODE": "1",
        **(extra_env or {}),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _linked(real: Path, dst: Path) -> None:
    """An installed package's files as links under ``dst``, its byte-code left out: the package as a
    non-compiling installer leaves it."""
    for src in real.rglob("*"):
        if "__pycache__" in src.parts or src.is_dir():
            continue
        to = dst / src.relative_to(real)
        to.parent.mkdir(parents=True, exist_ok=True)
        to.symlink_to(src)


def _pycs(root: Path) -> list[Path]:
    return sorted(root.rglob("*.pyc")) if root.exists() else []


def test_a_package_without_byte_code_is_compiled_once_into_the_cache_and_read_from_it_after(tmp_path: Path) -> None:
    site, cache = tmp_path / "site", tmp_path / "cache"
    pkg = _installed(site)
    first = _start(site, str(cache))
    assert first == [f"kept {cache}", "double 2"]
    mirrored = cache / pkg.relative_to(pkg.anchor)  # (the standard library's own land there too, once)
    cached = {p.name.split(".")[0]: p for p in _pycs(mirrored)}
    assert set(cached) == {"__init__", "sub", "other"}, _pycs(cache)  # "other": the child's
    assert _pycs(site) == [], "nothing may be written beside the sources"
    stamps = {name: p.stat().st_mtime_ns for name, p in cached.items()}

    second = _start(site, str(cache))
    assert second == first
    assert {p.name.split(".")[0]: p.stat().st_mtime_ns for p in _pycs(mirrored)} == stamps, "read back, not rewritten"

    (pkg / "sub.py").write_text("from probe_pkg import VALUE\nDOUBLE = 3 * VALUE\n")  # a new version installed
    os.utime(pkg / "sub.py", ns=(stamps["sub"] + 10**9, stamps["sub"] + 10**9))
    assert _start(site, str(cache))[1] == "double 3", "a changed source is compiled again, never served stale"


def test_installed_byte_code_or_an_interpreter_that_writes_it_is_left_alone(tmp_path: Path) -> None:
    site, cache = tmp_path / "site", tmp_path / "cache"
    _installed(site)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site)], check=True, env=clean)  # what pip does
    assert _start(site, str(cache)) == ["kept None", "double 2"]
    assert not cache.exists()

    site2 = tmp_path / "site2"
    _installed(site2)
    lines = _start(site2, str(cache), extra_env={"PYTHONDONTWRITEBYTECODE": ""})  # Python writes beside them
    assert lines == ["kept None", "double 2"]
    assert not cache.exists()
    assert _pycs(site2), "Python wrote its own __pycache__"


def test_off_and_a_cache_of_the_callers_own_change_nothing(tmp_path: Path) -> None:
    site, cache = tmp_path / "site", tmp_path / "cache"
    _installed(site)
    assert _start(site, "off") == ["kept None", "double 2"]
    assert _pycs(tmp_path) == []
    own = tmp_path / "own"
    assert _start(site, str(cache), extra_env={"PYTHONPYCACHEPREFIX": str(own)})[0] == "kept None"
    assert not cache.exists()
    assert _pycs(own) == [], "PYTHONDONTWRITEBYTECODE still holds: the caller's choice, whole"


def test_a_cache_that_cannot_be_made_or_has_no_home_is_not_used(tmp_path: Path) -> None:
    """Python would then look for byte-code only where none can be kept, and compile even the standard
    library's at every start: the interpreter is left as it was."""
    site = tmp_path / "site"
    _installed(site)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert _start(site, str(a_file / "cache")) == ["kept None", "double 2"]
    assert _start(site, "~no-such-user-here/cache") == ["kept None", "double 2"]  # no home to expand it in
    assert _pycs(tmp_path) == []


def test_a_service_started_over_packages_without_byte_code_keeps_theirs_in_its_cache(tmp_path: Path) -> None:
    """``memsvc manager`` end to end, its grpc package installed without byte-code (a tree of links to
    the real one's sources, found first on the path): it serves, says where it keeps them, and they
    are there, none beside the sources."""
    site, cache = tmp_path / "site", tmp_path / "cache"
    _linked(Path(grpc.__file__).parent, site / "grpc")
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"},
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    argv = [sys.executable, "-m", "memsvc.cli", "manager", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "m.db")]
    with Proc([*argv, "--bytecode-cache", str(cache)], env=env, name="manager").start() as proc:
        address = proc.wait_lines([_LISTENING], READY_TIMEOUT)[0]["address"]
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert re.search(rf"compiled modules are kept in {re.escape(str(cache))}", proc.stderr_text())
        grpc_pycs = _pycs(cache / (site / "grpc").relative_to(site.anchor))
        assert any(p.name.startswith("__init__.") for p in grpc_pycs), _pycs(cache)[:5]
        assert _pycs(site) == []


def test_what_building_a_services_parser_imports_is_kept_too(tmp_path: Path) -> None:
    """The parser's own imports (protobuf's runtime, through the vocabulary's enums that flags choose
    from) come before the flags are read: ``--bytecode-cache`` is read from the command line ahead of
    them, and what they compile lands in the cache. Before, those modules were compiled at every start."""
    import google.protobuf

    site, cache = tmp_path / "site", tmp_path / "cache"
    _linked(Path(grpc.__file__).parent, site / "grpc")  # what says the installation has no byte-code
    _linked(Path(google.protobuf.__file__).parent, site / "google" / "protobuf")
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"},
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "MEMSVC_BYTECODE_CACHE": str(cache),  # the flag's default: read ahead as the flag itself is
    }
    probe = (
        "import sys; import memsvc.cli as cli\n"
        "sys.argv = ['memsvc', 'manager', '--help']\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "import google.protobuf.descriptor as d; print(d.__file__, d.__cached__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2].startswith(str(site)), "the linked protobuf, without byte-code, was the one imported"
    pycs = {p.name.split(".")[0] for p in _pycs(cache / (site / "google" / "protobuf").relative_to(site.anchor))}
    assert {"descriptor", "descriptor_pool"} <= pycs, sorted(pycs)
    assert _pycs(site) == []


def test_the_directory_is_read_ahead_only_where_the_parser_would_give_the_same() -> None:
    from memsvc.runtime.bytecode import default_dir
    from memsvc.runtime.service_flags import bytecode_cache_before_parsing as ahead

    assert ahead(["worker", "--model", "m", "--bytecode-cache", "/c"]) == "/c"
    assert ahead(["manager", "--bytecode-cache=/c"]) == "/c"
    assert ahead(["gateway"]) == os.environ.get("MEMSVC_BYTECODE_CACHE", default_dir())
    assert ahead(["status", "--bytecode-cache", "/c"]) is None  # not a service's command
    assert ahead(["--version"]) is None
    assert ahead(["worker", "--bytecode", "/c"]) is None  # a prefix argparse accepts: left to the parser
    assert ahead(["worker", "--bytecode-cache", "/a", "--bytecode-cache", "/b"]) is None
    assert ahead(["worker", "--bytecode-cache"]) is None  # no value: the parser's usage error
