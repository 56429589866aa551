"""Models by Hugging Face Hub id, with no network (worker/model/hub.py): a worker started with
``--model acme/text-model`` and ``HF_HUB_OFFLINE=1`` serves the snapshot a Hub cache holds in the
Hub's documented layout (``models--acme--text-model/snapshots/<commit>/``, ``refs/main`` naming the
commit), under the Hub id as its name, with the same tokens and text as the checkpoint directory it
came from; an id the cache does not hold is refused at start with one line that says what was tried."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import text_model
from upproc import wait_for
from workerproc import WorkerProcess

from memsvc.v1 import model_worker_service_pb2 as worker_pb

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/text-model"


def hub_cache(root: Path, repo: str, checkpoint: Path) -> Path:
    """A Hub cache (``HF_HOME``) holding ``checkpoint`` as the main revision of ``repo``: as the Hub's
    client writes it, each file of the snapshot a link to a blob."""
    org, name = repo.split("/")
    entry = root / "hub" / f"models--{org}--{name}"
    snapshot = entry / "snapshots" / COMMIT
    shutil.copytree(checkpoint, entry / "blobs")
    snapshot.mkdir(parents=True)
    for blob in (entry / "blobs").iterdir():
        (snapshot / blob.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    return root


def offline(home: Path) -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def test_a_hub_id_in_the_cache_serves_what_its_checkpoint_directory_serves(tmp_path: Path) -> None:
    path, _ = text_model(tmp_path)
    home = hub_cache(tmp_path / "hf", REPO, path)
    req = worker_pb.GenerateRequest(prompt="the quick brown fox", max_new_tokens=12)
    with WorkerProcess(["--model", str(path)]) as wp:
        want = wp.stub.Generate(req, timeout=60)
    with WorkerProcess(["--model", REPO], env=offline(home)) as wp:
        st = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=60).status
        assert (st.model.source, st.model.served_model_name) == (REPO, REPO)
        assert st.model.has_tokenizer and st.model.has_chat_template
        got = wp.stub.Generate(req, timeout=60)
        # the start found the snapshot in the cache before the load resolved the id: its shards were
        # looked at by the read-ahead and staged (worker/prefetch.py, worker/staging.py) as a directory's are
        read_ahead = re.compile(r"checkpoint read-ahead: 0\.00 GB read of [1-9]\d* shards")
        log = wait_for(wp.stderr_text, lambda t: read_ahead.search(t) is not None, what="the read-ahead's line")
    assert (list(got.token_ids), got.text) == (list(want.token_ids), want.text)
    assert "GB on the device" in log, log


def test_an_id_the_cache_lacks_is_refused_at_start_saying_what_was_tried(tmp_path: Path) -> None:
    home = tmp_path / "hf"
    home.mkdir()
    argv = [
        sys.executable,
        "-m",
        "memsvc.cli",
        "worker",
        "--backend",
        "host",
        "--listen",
        "127.0.0.1:0",
        "--model",
        "acme/absent",
    ]
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, **offline(home)}
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "'acme/absent' is not a directory here" in errors[0] and "not in the Hub cache" in errors[0], errors


def test_a_load_on_a_terminal_draws_a_progress_bar_and_a_piped_one_does_not(tmp_path: Path) -> None:
    """stderr a terminal (memsvc up in a shell): a bar of the bytes read, up to 100%. Piped (a log
    file, a supervisor): no bar, only the log line after the load."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    path, _ = text_model(tmp_path)
    argv = [
        sys.executable,
        "-m",
        "memsvc.cli",
        "worker",
        "--backend",
        "host",
        "--listen",
        "127.0.0.1:0",
        "--model",
        str(path),
    ]
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=side)
    os.close(side)
    seen = b""
    try:
        while b"model: built" not in seen and proc.poll() is None:  # the log line after the load
            ready, _, _ = select.select([main], [], [], 60)
            assert ready, f"nothing on the terminal for 60 s: {seen[-2000:]!r}"
            try:
                seen += os.read(main, 65536)
            except OSError:  # the worker exited: the terminal's other side is gone
                break
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        os.close(main)
    text = seen.decode(errors="replace")
    assert f"loading {path}" in text and "100%" in text, text[-2000:]

    r = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert r.stderr is not None
    piped = b""
    while b"model: built" not in piped and (line := r.stderr.readline()):
        piped += line
    r.terminate()
    r.wait(timeout=60)
    r.stderr.close()
    assert b"model: built" in piped and b"loading " not in piped and b"100%" not in piped, piped[-2000:]


def test_only_a_directory_here_is_known_before_the_load_resolves_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the RPC front is told as the load begins (worker/core.py) is what resolve returns then;
    a Hub id (even one the cache holds: the Hub may have a newer snapshot) and a synthetic model's
    name are known only once the load has resolved them."""
    from worker.model.hub import known_dir, resolve

    (tmp_path / "synthetic:tiny").mkdir()
    monkeypatch.chdir(tmp_path)  # where a relative synthetic:tiny would be a directory
    assert known_dir(str(tmp_path)) == resolve(str(tmp_path)) == tmp_path
    assert known_dir("synthetic:tiny") is None
    assert known_dir(REPO) is None
    (tmp_path / "file").write_text("")
    assert known_dir(str(tmp_path / "file")) is None
