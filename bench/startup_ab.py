"""Start-up, side by side: ``bench_startup`` run from two source trees in turn on one machine.

Why: the GPU hosts lent for a run differ by more than most start-up changes are worth (``import
torch`` took 0.86 s on one H100 host and 1.38 s on another), so a change is measured only against the
tree before it, on the same machine, in rounds that alternate (base, new, base, new: a machine that
warms up or slows down shows in both). Each tree runs its own ``bench.bench_startup`` with its own
``memsvc worker``: the base tree is what it was, start-up code and bench alike.

The base tree is made where the repository is, and carried: ``git archive <rev> worker memsvc bench |
tar -x -C <dir>``, with the built extension (``worker/_native.abi3.so``) and the generated stubs
(``memsvc/v1/*_pb2*.py``) copied in (from this tree, where the native layer did not change). Then,
on the GPU machine::

    python -m bench.startup_ab --base <dir> --base-commit <rev> --rounds 2 --out ab.json -- \\
        --model /tmp/ck --repeats 2 --warmup 1 --no-baseline --no-breakdown

Everything after ``--`` goes to both trees' ``bench_startup`` (``--out`` is this tool's). The table
gives each tree's starts and their medians, then new less base round by round (:data:`PAIRED`); the
JSON keeps every run of both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
KEYS = (
    "first_token_s",
    "after_import_s",
    "serving_s",
    "listening_s",
    "model_layer_imported_at_s",
    "staged_at_s",
    "weights_loaded_at_s",
    "weights_loaded_s",
    "warm_up_s",
    "text_waited_s",
    "first_vs_later",
)
"""What the table compares (``bench_startup``'s per-start fields, and :data:`DERIVED`; a tree that does
not log a part has none of it)."""
DERIVED = {"after_import_s": ("serving_s", "model_layer_imported_at_s")}
"""Per-start differences of two fields: ``after_import_s``, from the model layer's import to ``SERVING``.
The import is most of a start and varies most between a host's starts (1.79-2.86 s in one A/B on an
H100, 2026-12-07), and a change after it shows in this part alone."""
PAIRED = ("first_token_s", "after_import_s")
"""What :func:`compare` sets side by side round by round (new less base, medians of each round's starts):
a host that speeds up or slows down between rounds moves both trees of a round alike, so rounds that
disagree in sign say the change is within the host's noise."""
SECTIONS = ("worker", "standby")
"""The starts of ``bench_startup``'s JSON compared: spawns, and starts from a standby (``--standby``)."""


def run_tree(tree: Path, commit: str, bench_args: Sequence[str], out: Path) -> dict[str, Any]:
    """``bench_startup`` from ``tree`` (its modules first on the path, its directory the cwd), its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")]))}
    if commit:
        env["MEMSVC_COMMIT"] = commit
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_startup", *bench_args, "--out", str(out)], cwd=tree, env=env, check=False
    )
    if not out.is_file():
        return {"errors": {"run": f"bench_startup exited {done.returncode} and wrote no JSON"}}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def with_derived(run: dict[str, Any]) -> dict[str, Any]:
    """A start's fields with :data:`DERIVED` added where both of its fields are there."""
    out = dict(run)
    for key, (later, earlier) in DERIVED.items():
        a, b = run.get(later), run.get(earlier)
        if isinstance(a, int | float) and isinstance(b, int | float):
            out[key] = a - b
    return out


def medians(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The median of each of :data:`KEYS` over ``runs`` that have it."""
    out = {}
    for key in KEYS:
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        if values:
            out[key] = statistics.median(values)
    return out


def compare(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per tree and section: every start's values of :data:`KEYS`, and their medians."""
    summary: dict[str, Any] = {}
    for label, rounds in results.items():
        for section in SECTIONS:
            runs = [with_derived(run) for res in rounds for run in res.get(section, {}).get("runs", [])]
            if runs:
                summary.setdefault(section, {})[label] = {
                    "starts": [{k: r.get(k) for k in KEYS} for r in runs],
                    "median": medians(runs),
                }
    return summary


def by_round(results: dict[str, list[dict[str, Any]]], section: str) -> dict[str, list[float | None]]:
    """For each of :data:`PAIRED`: new less base in ``section``, round by round (each the median of the
    round's starts; None where a round of either tree has none)."""

    def round_median(res: dict[str, Any], key: str) -> float | None:
        return medians([with_derived(r) for r in res.get(section, {}).get("runs", [])]).get(key)

    out: dict[str, list[float | None]] = {}
    for key in PAIRED:
        diffs: list[float | None] = []
        for base, new in zip(results["base"], results["new"], strict=False):
            a, b = round_median(base, key), round_median(new, key)
            diffs.append(None if a is None or b is None else b - a)
        out[key] = diffs
    return out


def format_table(summary: dict[str, Any], rounds: dict[str, dict[str, list[float | None]]] | None = None) -> str:
    """The table of :func:`compare`'s ``summary``, each section followed by its ``rounds`` (:func:`by_round`)."""
    lines = []
    for section, trees in summary.items():
        labels = list(trees)
        lines.append(f"{section}: " + " | ".join(f"{label} ({len(trees[label]['starts'])} starts)" for label in labels))
        for key in KEYS:
            cells = []
            for label in labels:
                values = [s[key] for s in trees[label]["starts"] if isinstance(s.get(key), int | float)]
                med = trees[label]["median"].get(key)
                cells.append("--" if med is None else f"{med:.3f} ({', '.join(f'{v:.2f}' for v in values)})")
            lines.append(f"  {key:28s} " + " | ".join(f"{c:36s}" for c in cells))
        for key, diffs in (rounds or {}).get(section, {}).items():
            cells = ["--" if d is None else f"{d:+.2f}" for d in diffs]
            lines.append(f"  new - base, round by round, {key}: {', '.join(cells)} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    split = args_in.index("--") if "--" in args_in else len(args_in)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the tree to compare with (see above)")
    ap.add_argument("--base-commit", default="", help="the base tree's commit, for the JSON")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of base then new")
    ap.add_argument("--out", default="startup_ab.json")
    args = ap.parse_args(args_in[:split])
    bench_args = args_in[split + 1 :]
    if "--out" in bench_args:
        ap.error("--out after -- is this tool's: give it before --")
    if not (args.base / "bench" / "bench_startup.py").is_file():
        ap.error(f"{args.base} has no bench/bench_startup.py: not a source tree (see --help)")
    trees = {"base": (args.base.resolve(), args.base_commit), "new": (REPO_ROOT, os.environ.get("MEMSVC_COMMIT", ""))}
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    with tempfile.TemporaryDirectory(prefix="startup-ab-") as tmp:
        for i in range(args.rounds):
            for label, (tree, commit) in trees.items():
                print(f"[startup_ab] round {i + 1}/{args.rounds}: {label} ({tree})", flush=True)
                results[label].append(run_tree(tree, commit, bench_args, Path(tmp) / f"{label}-{i}.json"))
    summary = compare(results)
    rounds = {section: by_round(results, section) for section in summary}
    res = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "bench_args": bench_args,
        "base": {"tree": str(args.base), "commit": args.base_commit},  # as given: no host's absolute path
        "errors": {
            f"{label} round {i + 1}": run["errors"]
            for label, rounds in results.items()
            for i, run in enumerate(rounds)
            if run.get("errors")
        },
        "summary": summary,
        "new_minus_base_by_round": rounds,
        "runs": results,
    }
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(format_table(summary, rounds))
    print(f"[startup_ab] wrote {args.out}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
