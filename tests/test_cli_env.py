"""The CLI's environment defaults (issue: what operators trip over): a bad MEMSVC_* variable is the
command's usage error (one line, exit 2, no traceback) and never breaks ``--help`` or other commands;
on/off variables take 1/0, true/false, yes/no, on/off in any case and refuse anything else;
``memsvc --version`` answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memsvc import cli

MEMSVC = [sys.executable, "-m", "memsvc.cli"]


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMSVC, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env})


@pytest.mark.parametrize(("var", "value", "flag"), [
    ("MEMSVC_KV_BLOCKS", "abc", "--kv-blocks"), ("MEMSVC_DEVICE", "cuda:0", "--device"),
    ("MEMSVC_DRAIN_TIMEOUT", "soon", "--drain-timeout"), ("MEMSVC_CHECKSUM", "maybe", "MEMSVC_CHECKSUM"),
])  # fmt: skip
def test_a_bad_variable_is_one_line_and_exit_2_and_help_still_works(var: str, value: str, flag: str) -> None:
    assert run(["worker", "--help"], **{var: value}).returncode == 0
    assert run(["manager", "--help"], **{var: value}).returncode == 0
    r = run(["worker", "--listen", "127.0.0.1:0"], **{var: value})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and flag in r.stderr and value in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("memsvc")


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("true", True), ("True", True), ("YES", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])  # fmt: skip
def test_on_off_variables_take_the_usual_spellings(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    for name in ("MEMSVC_CHECKSUM", "MEMSVC_HUGE_PAGES", "MEMSVC_CUDA_GRAPHS"):
        monkeypatch.setenv(name, value)
    args = cli.parse(cli.build_parser(), ["worker"])
    assert (args.checksum, args.huge_pages, args.cuda_graphs) == (expected, expected, expected)
    assert cli.parse(cli.build_parser(), ["worker", "--no-checksum"]).checksum is False


def test_numbers_from_the_environment_are_the_flags_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMSVC_KV_BLOCKS", "77")
    monkeypatch.setenv("MEMSVC_DRAIN_TIMEOUT", "2.5")
    args = cli.parse(cli.build_parser(), ["worker"])
    assert (args.kv_blocks, args.drain_timeout) == (77, 2.5)


def test_version() -> None:
    r = run(["--version"])
    assert r.returncode == 0 and r.stdout.strip().startswith("memsvc 0.")


def test_user_errors_at_start_are_one_line_and_exit_2(tmp_path: Path) -> None:
    """A config file or a model directory that is not there, or a model the decoder does not serve:
    one line naming it, exit 2, no traceback (a traceback is for bugs)."""
    root = tmp_path
    unsupported = root / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"model_type": "gpt2"}')
    cases = [
        (["manager", "--listen", "127.0.0.1:0", "--config", str(root / "missing.toml")], "missing.toml"),
        (["worker", "--backend", "host", "--listen", "127.0.0.1:0", "--model", "/no/such/dir"], "/no/such/dir"),
        (["worker", "--backend", "host", "--listen", "127.0.0.1:0", "--model", str(unsupported)], "gpt2"),
    ]
    for args, named in cases:
        r = run(args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and named in errors[0] and errors[0].startswith("memsvc"), r.stderr
