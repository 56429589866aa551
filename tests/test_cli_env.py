"""The CLI's environment defaults (issue: what operators trip over): a bad MEMSVC_* variable is the
command's usage error (one line, exit 2, no traceback) and never breaks ``--help`` or other commands;
on/off variables take 1/0, true/false, yes/no, on/off in any case and refuse anything else;
``memsvc --version`` answers."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memsvc import cli
from memsvc.runtime.flags import parse_bytes, text_or_none

MEMSVC = [sys.executable, "-m", "memsvc.cli"]


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMSVC, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env})


@pytest.mark.parametrize(
    ("var", "value", "flag"),
    [
        ("MEMSVC_KV_BLOCKS", "abc", "--kv-blocks"),
        ("MEMSVC_DEVICE", "cuda:0", "--device"),
        ("MEMSVC_DRAIN_TIMEOUT", "soon", "--drain-timeout"),
        ("MEMSVC_CHECKSUM", "maybe", "MEMSVC_CHECKSUM"),
    ],
)
def test_a_bad_variable_is_one_line_and_exit_2_and_help_still_works(var: str, value: str, flag: str) -> None:
    assert run(["worker", "--help"], **{var: value}).returncode == 0
    assert run(["manager", "--help"], **{var: value}).returncode == 0
    r = run(["worker", "--listen", "127.0.0.1:0"], **{var: value})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and flag in r.stderr and value in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("memsvc")


def _variables_with_a_form() -> list[tuple[str, str]]:
    """(command, variable) for every MEMSVC_* variable a service command reads whose value has a form
    to check (a number, size, address, choice or on/off), found in the parser itself, so a flag added
    later is covered without touching this list. Free-form strings (paths, names) have no form."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command in ("worker", "manager", "gateway"):
        for action in sub.choices[command]._actions:
            variable = getattr(action.default, "variable", None)
            formed = action.type not in (None, text_or_none)  # text_or_none: free-form, or unset
            if variable and (formed or action.choices is not None or "--no-" in str(action.option_strings)):
                found.append((command, variable))
    return found


_FORMED = _variables_with_a_form()


def test_the_table_of_checked_variables_is_the_whole_set() -> None:
    """The ones the issue found (log format and level, listen addresses, idle timeouts) are among them."""
    names = {v for _, v in _FORMED}
    issue = {"MEMSVC_LOG_FORMAT", "MEMSVC_LOG_LEVEL", "MEMSVC_GATEWAY_LISTEN", "MEMSVC_IDLE_SLEEP_TIMEOUT"}
    others = {"MEMSVC_MANAGER_LISTEN", "MEMSVC_WORKER_LISTEN", "MEMSVC_KV_BLOCKS", "MEMSVC_CHECKSUM", "MEMSVC_BACKEND"}
    assert issue | others <= names, names
    assert len(_FORMED) >= 25, _FORMED


@pytest.mark.parametrize(("command", "variable"), _FORMED)
def test_every_variable_with_a_bad_value_is_one_line_naming_it_and_exit_2(command: str, variable: str) -> None:
    """MEMSVC_LOG_FORMAT=xml was ignored; MEMSVC_LOG_LEVEL=loud, MEMSVC_GATEWAY_LISTEN=nonsense and
    MEMSVC_IDLE_SLEEP_TIMEOUT=abc were tracebacks with exit 1. Each is the command's usage error
    now, naming the variable and its value, before anything starts."""
    bad = "not-a-value!"
    r = run([command], **{variable: bad})
    assert r.returncode == 2, (variable, r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("memsvc") and variable in last and bad in last, r.stderr


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        ("True", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
    ],
)
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
    assert (args.kv_blocks, args.drain_seconds) == (77, 2.5)


def test_version() -> None:
    r = run(["--version"])
    assert r.returncode == 0 and r.stdout.strip().startswith("memsvc 0.")
    # looked up only when asked for: not on a service's way to its start
    probe = (
        "import sys; from memsvc import cli; cli.parse(cli.build_parser(), ['worker']); "
        "print('importlib.metadata' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


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
        (
            ["worker", "--backend", "host", "--listen", "127.0.0.1:0", "--max-batch", "8", "--max-step-tokens", "4"],
            "--max-step-tokens",
        ),
    ]
    for args, named in cases:
        r = run(args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and named in errors[0] and errors[0].startswith("memsvc"), r.stderr


@pytest.mark.parametrize(
    ("variable", "child"),
    [
        ("MEMSVC_LOG_LEVEL", "up"),
        ("MEMSVC_KV_BLOCKS", "worker"),
        ("MEMSVC_WAKE_TIMEOUT", "gateway"),
    ],
)
def test_memsvc_up_with_a_bad_variable_exits_2_naming_it(tmp_path: Path, variable: str, child: str) -> None:
    """``memsvc up`` reads the logging variables itself, and its children read theirs: a child's usage
    error was ``memsvc up``'s exit 241 beside "the manager exited with -15" (a sibling it had stopped
    itself); now it is exit 2, the child's one line naming the variable, and no sibling blamed."""
    bad = "not-a-value!"
    args = [
        "up",
        "--backend",
        "host",
        "--model",
        "synthetic:tiny",
        "--state-dir",
        str(tmp_path / "state"),
        "--manager-listen",
        "127.0.0.1:0",
        "--worker-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "",
        "--gateway-listen",
        "127.0.0.1:0" if child == "gateway" else "",
    ]
    r = subprocess.run(
        [*MEMSVC, *args], capture_output=True, text=True, timeout=180, env={**os.environ, variable: bad}, cwd=tmp_path
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr
    named = [line for line in r.stderr.splitlines() if variable in line]
    assert len(named) == 1 and named[0].startswith(f"memsvc {child}: error:") and bad in named[0], r.stderr
    blamed = [line for line in r.stderr.splitlines() if line.startswith("memsvc up: the ")]
    assert blamed == ([] if child == "up" else [f"memsvc up: the {child} exited with 2"]), r.stderr


@pytest.mark.parametrize(
    ("command", "hidden", "extra"),
    [
        ("worker", "numpy", "worker"),
        ("up", "torch", "worker,gateway"),
        ("gateway", "fastapi", "gateway"),
    ],
)
def test_a_command_without_its_extra_names_the_extra(command: str, hidden: str, extra: str) -> None:
    """Without the worker (or gateway) extra, the command is a usage error saying what to install,
    not a ModuleNotFoundError from deep inside."""
    probe = f"import sys; sys.modules[{hidden!r}] = None\nfrom memsvc.cli import main\nsys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", probe, command], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and f"pip install 'memsvc[{extra}]'" in r.stderr and hidden in r.stderr


def test_help_shows_each_flags_default_and_its_variable() -> None:
    r = run(["worker", "--help"], MEMSVC_KV_BLOCKS="77", COLUMNS="400")
    assert r.returncode == 0, r.stderr
    flat = " ".join(r.stdout.split())
    assert "--kv-blocks KV_BLOCKS device KV cache blocks (default: 77; $MEMSVC_KV_BLOCKS)" in flat, flat
    # (the default in force: the variable's value)
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            variable = getattr(action.default, "variable", None)
            if variable:
                assert f"${variable})" in text, f"memsvc {command} --help does not name {variable}"


def section(doc: str, heading: str) -> str:
    """The text of the section ``## <heading>`` of the repository's file ``doc``, up to the next one."""
    text = (Path(__file__).resolve().parent.parent / doc).read_text()
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def test_the_readme_flag_table_lists_every_worker_flag() -> None:
    import re

    listed = set(re.findall(r"`(--[a-z0-9-]+)`", section("README.md", "Configuration")))
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    worker = sub.choices["worker"]
    flags = {o for a in worker._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    flags -= {o for o in flags if o.startswith("--no-")}  # the off spelling of an on/off flag
    assert flags <= listed, f"worker flags missing from README's Configuration: {sorted(flags - listed)}"


@pytest.mark.parametrize("command", ["worker", "gateway", "manager"])
def test_each_setting_is_the_one_definition_of_its_flag_variable_and_default(command: str) -> None:
    """A command's settings dataclass (memsvc/runtime/flags.py) is its flags: each flag's default, as
    its variable would spell it, parses to the field's default; with no flag and no variable the
    parser gives exactly the dataclass's defaults; each flag is documented (the worker's in the
    README's table, with its variable; the manager's in the README's paragraph, with its variable;
    the gateway's in docs/operations.md's section)."""
    import dataclasses
    import re

    from memsvc.gateway import Settings
    from memsvc.manager.serve_settings import ServeSettings
    from memsvc.runtime.flags import default_text, flag_name, settings_from, settings_of, variable
    from worker.config import WorkerConfig

    cls: type[Any] = {"worker": WorkerConfig, "gateway": Settings, "manager": ServeSettings}[command]
    settings = settings_of(cls)
    assert {f.name for f, _ in settings} == {f.name for f in dataclasses.fields(cls)} - {"security"}, (
        "a field without a flag"
    )
    for f, s in settings:
        if s.on_off:
            continue  # its text is made from its default: the parser's default below checks it
        parsed = s.parse(default_text(f, s)) if s.parse else default_text(f, s)
        assert parsed == f.default, f.name
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("MEMSVC_")]:
            mp.delenv(k)
        args = cli.parse(cli.build_parser(), [command])
    assert cls(**settings_from(cls, args)) == cls()
    if command == "worker":
        rows = [line for line in section("README.md", "Configuration").splitlines() if line.startswith("| `--")]
        for f, s in settings:
            row = next((r for r in rows if re.search(rf"`{flag_name(f, s)}`", r.split("|")[1])), None)
            assert row is not None, f"README: no row for {flag_name(f, s)}"
            assert f"`{variable(f, s)}`" in row.split("|")[2], f"README: {flag_name(f, s)}'s row lacks {variable(f, s)}"
    elif command == "manager":
        paragraph = section("README.md", "Configuration").split("Manager flags:", 1)[1]
        for f, s in settings:
            assert re.search(rf"`{flag_name(f, s)}` \(`{variable(f, s)}`", paragraph), (
                f"README's manager flags: no `{flag_name(f, s)}` (`{variable(f, s)}`"
            )
    else:
        gateway = section("docs/operations.md", "The gateway")
        for f, s in settings:
            assert re.search(rf"{flag_name(f, s)}\b", gateway), (
                f"docs/operations.md's gateway section: no {flag_name(f, s)}"
            )


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8Gi", 8 << 30),
        ("8GiB", 8 << 30),
        ("8gib", 8 << 30),
        ("8GB", 8 * 10**9),
        ("512MiB", 512 << 20),
        ("1.5Gi", 3 << 29),
        ("64kB", 64_000),
        ("4096", 4096),
    ],
)
def test_sizes_binary_and_decimal_suffixes(text: str, size: int) -> None:
    assert parse_bytes(text) == size


def test_a_bare_size_letter_is_refused_as_ambiguous() -> None:
    r = run(["worker", "--backend", "host", "--host-capacity", "8G"])
    assert r.returncode == 2 and "ambiguous size: '8G'" in r.stderr and "8Gi" in r.stderr and "8GB" in r.stderr, r


@pytest.mark.parametrize("command", ["worker", "manager", "gateway"])
def test_services_log_json_lines_at_the_level_asked(tmp_path: Path, command: str) -> None:
    """--log-format json: every stderr line is one JSON object (time, level, logger, message);
    --log-level warning drops the INFO lines. stdout keeps the listening line scripts wait for."""
    import json
    import signal
    import time

    extra = {
        "worker": ["--backend", "host", "--model", "synthetic:tiny"],
        "manager": ["--db", str(tmp_path / "m.db")],
        "gateway": ["--manager", "127.0.0.1:1"],
    }[command]
    for level, want_info in (("info", True), ("warning", False)):
        argv = [*MEMSVC, command, "--listen", "127.0.0.1:0", "--log-format", "json", "--log-level", level, *extra]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            line = ""
            while "listening on" not in line and time.monotonic() < deadline:
                line = proc.stdout.readline()
                assert line or proc.poll() is None, "exited before listening"
            time.sleep(1.0)  # let it log its start
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        records = [json.loads(x) for x in err.splitlines() if x.strip()]
        assert all({"time", "level", "logger", "message"} <= set(r) for r in records), err
        levels = {r["level"] for r in records}
        assert ("info" in levels) == want_info, (level, levels, err)


def test_every_flag_of_every_command_says_what_it_is_for() -> None:
    """``memsvc up --help`` listed --manager-listen with no word of help, and others with it."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = [
        f"{command} {action.option_strings[0]}"
        for command, p in sub.choices.items()
        for action in p._actions
        if action.option_strings
        and action.help != argparse.SUPPRESS
        and not (action.help or "").strip()
        and not isinstance(action, argparse._HelpAction)
    ]
    assert silent == [], silent
