"""The worker's start-up path on the CPU: what it imports before it listens, the background capture
of its CUDA graphs (the policy; the captures themselves are GPU-only, tests/gpu/test_background_capture.py),
and a smoke run of bench/bench_startup.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from childproc import REPO_ROOT, Proc
from grpc_health.v1 import health_pb2
from hungmount import HungMount
from test_hung_reads import eventually
from workerproc import _LISTENING, READY_TIMEOUT, WorkerProcess

from memsvc.errors import Loading, WrongState
from memsvc.runtime.rpc_errors import error_info, from_rpc_error, retry_delay
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker.core import LOADING_RETRY_S
from worker.device_loop import THREAD_NAME, DeviceLoop
from worker.model import graphs
from worker.model.graphs import BackgroundCapture

NOT_BEFORE_LISTENING = (
    "torch",
    "safetensors",
    "tokenizers",
    "jinja2",
    "transformers",
    "triton",
    "worker.model.runner",
    "worker.model.weights",
    "worker.model.text",
    "memsvc.manager",
    "memsvc.gateway",
    "fastapi",
    "uvicorn",
)
"""What `memsvc worker` must not import before its server listens (it loads them while it answers LOADING)."""


def test_the_worker_listens_before_the_model_layer_is_imported() -> None:
    code = (
        "import json, sys; import memsvc.cli, worker.main, worker.servicer, worker.core; "
        f"print(json.dumps(sorted(m for m in {NOT_BEFORE_LISTENING!r} if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []


def test_tritons_own_hash_begins_once_torch_is_imported(tmp_path: Path) -> None:
    """worker/main.py's import thread starts the thread that reads Triton's key back (importing Triton,
    which holds the GIL) once ``import torch`` is done, not beside it: on an H100 host that thread ran
    1.2 s beside the import, which took 0.1-0.35 s longer for it. A stand-in ``triton`` package makes
    the worker take that path on this GPU-less host; the recorder takes the real thread's place, so
    nothing imports it."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("")
    code = (
        "import json, sys\n"
        "import worker.main as m\n"
        "from worker.config import WorkerConfig\n"
        "seen = []\n"
        "m._hash_triton = lambda: seen.append('torch' in sys.modules)\n"
        "m.import_model_layer(WorkerConfig(model='synthetic:tiny', backend='auto')).join()\n"
        "print(json.dumps(seen))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == [True], "the hash began before torch was in (or never)"


def test_the_model_layer_imports_without_the_collector_and_leaves_what_it_made_frozen() -> None:
    """worker/main.py's collector_paused: no collection runs while torch and the model layer import
    (their passes over its objects were a tenth of the import), those objects are kept out of later
    ones (frozen), and the collector is on again afterwards."""
    code = (
        "import gc, json\n"
        "from worker.config import WorkerConfig\n"
        "from worker.main import import_model_layer\n"
        "before = (gc.isenabled(), gc.get_freeze_count())\n"
        "runs = []\n"
        "gc.callbacks.append(lambda phase, info: runs.append(info['generation']) if phase == 'start' else None)\n"
        "import_model_layer(WorkerConfig(model='synthetic:tiny', backend='host')).join()\n"
        "print(json.dumps([*before, len(runs), gc.isenabled(), gc.get_freeze_count()]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    enabled_before, frozen_before, collections, enabled_after, frozen_after = json.loads(done.stdout)
    assert (enabled_before, frozen_before) == (True, 0)
    # (after the freeze the young generation starts empty, and the little the thread allocates then,
    # a log line, stays under its threshold: a collection seen here ran during the imports)
    assert collections == 0, "the collector ran during the imports"
    assert enabled_after and frozen_after > 50_000  # torch's modules, functions and classes among them


def test_the_load_starts_beside_the_servers_start_and_ends_released_if_it_cannot_listen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """worker/main.py starts the load (the allocator, then the checkpoint's staging) while its server
    starts, not after it listens; a server that cannot start (a taken address) ends it and releases
    what it made, and the worker exits 2."""
    import worker.main
    from memsvc.errors import InvalidArgument
    from memsvc.runtime.auth import Security
    from worker.config import WorkerConfig
    from worker.core import WorkerCore

    cores: list[WorkerCore] = []
    seen: list[bool] = []

    class Recorded(WorkerCore):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            cores.append(self)

    async def listen_fails(*args: object) -> None:
        deadline = time.monotonic() + 60
        while cores[0].alloc is None and time.monotonic() < deadline:  # the load, begun meanwhile
            await asyncio.sleep(0.01)
        seen.append(cores[0].alloc is not None)
        raise InvalidArgument("cannot listen on '127.0.0.1:1': taken")

    monkeypatch.setattr(worker.main, "WorkerCore", Recorded)
    monkeypatch.setattr(worker.main, "_listen", listen_fails)
    monkeypatch.setattr(worker.main, "_exit_by", lambda seconds: None)  # this is pytest's process
    # the load's end is waited for up to this bound: here its imports may take longer than a worker's
    monkeypatch.setattr(worker.main, "EXIT_GRACE_S", 600.0)
    config = WorkerConfig(model="synthetic:tiny", backend="host", rpc_front="inline")
    code = asyncio.run(worker.main._serve(config, "127.0.0.1:1", None, None, Security()))
    assert (code, seen) == (2, [True])
    assert cores[0].alloc is None, "the allocator was released"


def test_the_model_package_still_exports_its_names() -> None:
    code = (
        "import json, sys, worker.model as m; before = 'torch' in sys.modules; "
        "names = [n for n in m.__all__ if getattr(m, n, None) is None]; "
        "print(json.dumps([before, names, m.ModelRunner.__module__]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == [False, [], "worker.model.runner"]
    import worker.model

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = worker.model.Nope


# ---- calls while the model loads ----
def test_a_call_while_the_model_loads_is_unavailable_with_a_retry_delay_and_succeeds_once_serving(
    tmp_path: Path,
) -> None:
    """The load is held in its checkpoint read (a hung mount that recovers): health says NOT_SERVING
    and the status LOADING; every data-plane call is UNAVAILABLE, reason LOADING, with a RetryInfo of
    LOADING_RETRY_S, which the client SDK's error carries; a health Watch then says SERVING, and the
    same Generate succeeds."""
    mount = HungMount(tmp_path, "ckpt")
    mount.hang()
    wp = WorkerProcess(mount.worker_args, env=mount.env())
    try:
        Proc.start(wp)  # not WorkerProcess.start: 'ready' comes once the mount recovers
        (listening,) = wp.wait_lines([_LISTENING], READY_TIMEOUT)
        wp.address = listening["address"]
        eventually(lambda: mount.hung, "the load's read to hang")
        check = health_pb2.HealthCheckRequest(service="")
        assert wp.health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
        status = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status
        assert status.state == common_pb.WORKER_STATE_LOADING
        request = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
        calls: list[Callable[[], object]] = [
            lambda: wp.stub.Generate(request, timeout=10),
            lambda: next(iter(wp.stub.GenerateStream(worker_pb.GenerateStreamRequest(request=request), timeout=10))),
            lambda: wp.stub.SwapBlocks(
                worker_pb.SwapBlocksRequest(
                    direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, src_blocks=[0], dst_blocks=[0]
                ),
                timeout=10,
            ),
            lambda: wp.stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="s"), timeout=10),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            info = error_info(err.value)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and info is not None, err.value
            assert info.reason == "LOADING" and retry_delay(err.value) == LOADING_RETRY_S
            relayed = from_rpc_error(err.value)
            assert isinstance(relayed, Loading) and relayed.retry_after_s == LOADING_RETRY_S
        watch = wp.health.Watch(check, timeout=READY_TIMEOUT)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        mount.recover()
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        assert len(wp.stub.Generate(request, timeout=60).token_ids) == 4
    finally:
        wp.kill()
        if (mount.root / "HANG").exists():
            mount.recover()


# ---- the background capture's policy (a recording capture; the loop and device loop are real) ----
class Rig:
    """A BackgroundCapture over a real loop thread and DeviceThread, with a capture that records."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> None:
        self.device = DeviceLoop(loop)
        self.busy = False
        self.allowed = True
        self.last = time.monotonic() - 10
        self.done: list[tuple[int, str]] = []
        self.running = 0
        self.most_at_once = 0
        self.fail: dict[int, Exception] = {}
        self.first_at = 0.0
        """When the first capture started (monotonic)."""
        self.bg = BackgroundCapture(sizes, self.capture, loop, self.device.submit, lambda: self.allowed, self.last_busy)

    def last_busy(self) -> float:
        if self.busy:
            self.last = time.monotonic()
        return self.last

    def capture(self, size: int) -> None:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            if size in self.fail:
                raise self.fail.pop(size)
            self.first_at = self.first_at or time.monotonic()
            time.sleep(0.01)
            self.done.append((size, threading.current_thread().name))
        finally:
            self.running -= 1

    def sizes(self) -> list[int]:
        return [s for s, _ in self.done]

    def wait(self, until: Callable[[], bool], timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < end, f"timed out: captured {self.sizes()}, pending {self.bg.pending}"
            time.sleep(0.005)


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[asyncio.AbstractEventLoop]:
    monkeypatch.setattr(graphs, "IDLE_S", 0.03)
    monkeypatch.setattr(graphs, "PATIENCE_S", 0.3)
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(timeout=10)
    lp.close()


def test_every_bucket_is_captured_smallest_first_one_job_at_a_time_on_the_device_thread(
    loop: asyncio.AbstractEventLoop,
) -> None:
    rig = Rig(loop)
    rig.bg.request()
    rig.wait(lambda: not rig.bg.pending)
    assert rig.sizes() == [1, 2, 4, 8] == rig.bg.captured
    assert {name for _, name in rig.done} == {THREAD_NAME}
    assert rig.most_at_once == 1
    rig.bg.request()  # nothing pending: nothing more
    time.sleep(0.1)
    assert rig.sizes() == [1, 2, 4, 8]
    rig.device.shutdown()


def test_a_capture_waits_while_the_engine_works(loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop)
    rig.busy = True
    rig.bg.request()
    time.sleep(10 * graphs.IDLE_S)
    assert rig.done == []
    rig.busy = False
    rig.wait(lambda: len(rig.done) == 4)
    assert rig.sizes() == [1, 2, 4, 8]
    rig.device.shutdown()


def test_a_bucket_steps_need_is_captured_under_load_once_it_waited_its_patience(
    loop: asyncio.AbstractEventLoop,
) -> None:
    rig = Rig(loop)
    rig.busy = True
    t0 = time.monotonic()
    rig.bg.want(4)
    rig.bg.want(4)  # asked again by the next eager step: still the first need's clock
    rig.wait(lambda: rig.sizes() == [4])
    assert time.monotonic() - t0 >= graphs.PATIENCE_S
    rig.bg.want(2)
    rig.wait(lambda: rig.bg.pending == (1, 8))  # a capture's bucket leaves pending after its capture ran
    assert rig.sizes() == [4, 2], "buckets no step needs wait for an idle engine"
    rig.bg.want(4)  # captured already: ignored
    rig.busy = False
    rig.wait(lambda: not rig.bg.pending)
    assert rig.sizes() == [4, 2, 1, 8] == rig.bg.captured
    rig.device.shutdown()


def test_no_capture_starts_until_the_worker_was_ready_for_a_while(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graphs, "IDLE_S", 0.5)
    t0 = time.monotonic()
    rig = Rig(loop)  # the engine has been idle for 10 s: only the set-up time holds the first capture
    rig.bg.request()
    rig.wait(lambda: not rig.bg.pending)
    assert rig.sizes() == [1, 2, 4, 8]
    assert rig.first_at - t0 >= graphs.IDLE_S, "a capture started before the worker was ready for IDLE_S"
    rig.device.shutdown()


def test_capturing_stalls_while_it_may_not_run_and_a_step_resumes_it(loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop)
    rig.allowed = False  # asleep, or a transition pending
    rig.bg.request()
    rig.wait(lambda: rig.bg.stalled)
    rig.allowed = True
    time.sleep(10 * graphs.IDLE_S)
    assert rig.done == [], "a stalled capture waits for a step"
    rig.bg.poke()
    rig.wait(lambda: not rig.bg.pending)
    assert rig.sizes() == [1, 2, 4, 8] and not rig.bg.stalled
    rig.device.shutdown()


def test_memory_asleep_stalls_and_a_failed_capture_leaves_its_bucket_to_eager_decoding(
    loop: asyncio.AbstractEventLoop,
) -> None:
    rig = Rig(loop)
    rig.fail = {1: WrongState("the 'cuda_graphs' memory is asleep"), 2: RuntimeError("out of memory")}
    rig.bg.request()
    rig.wait(lambda: rig.bg.stalled)
    assert rig.done == [] and rig.bg.pending == (1, 2, 4, 8)
    rig.bg.poke()
    rig.wait(lambda: not rig.bg.pending)
    assert rig.sizes() == [1, 4, 8] == rig.bg.captured
    rig.device.shutdown()


def test_a_shut_down_device_thread_ends_the_capture(loop: asyncio.AbstractEventLoop) -> None:
    rig = Rig(loop)
    rig.device.shutdown()
    rig.bg.request()
    time.sleep(10 * graphs.IDLE_S)
    assert rig.done == [] and rig.bg.pending == (1, 2, 4, 8)
    rig.bg.request()  # no error, no job: the worker is closing
    time.sleep(5 * graphs.IDLE_S)
    assert rig.done == []


# ---- the benchmark's smoke run ----
def test_the_startup_bench_runs_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    from bench import bench_startup
    from bench.bench_gateway import write_checkpoint

    ckpt = tmp_path / "tiny"
    write_checkpoint(ckpt, "tiny", "cpu")
    out = tmp_path / "startup.json"
    argv = [
        "--model",
        str(ckpt),
        "--backend",
        "host",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--kv-blocks",
        "64",
        "--cold",
        "--out",
        str(out),
    ]
    assert bench_startup.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["commit"]
    (run,) = res["worker"]["runs"]
    assert 0 < run["listening_s"] < run["serving_s"] < run["first_token_s"] < run["generate_end_s"]
    # the import thread began before SERVING; its line saying it ended may come after: the load imports
    # the same modules (waiting on their import locks) and can reach SERVING before that thread, on a
    # busy machine, gets the GIL back to log (2.89 s against 2.72 s in a fresh-clone run beside another)
    began = run["model_layer_imported_at_s"] - run["model_layer_imported_s"]
    assert 0 < began <= run["serving_s"] and run["weights_loaded_s"] >= 0
    assert run["exit_code"] == 0 and run["graph_captures"] == []  # the host backend has no graphs
    # the checkpoint was just written, so the page cache holds it: the read-ahead finds it and reads nothing
    assert run["read_ahead_gb"] == 0.0 and run["read_ahead_shards"] == 1 and run["read_ahead_at_s"] <= run["serving_s"]
    # ... and the staging copies it into the allocator's memory before the load (worker/staging.py)
    assert "staged_gb" in run and run["staged_at_s"] <= run["weights_loaded_at_s"] <= run["serving_s"]
    (theirs,) = res["transformers"]["runs"]
    assert 0 < theirs["loaded_s"] < theirs["first_token_s"] and theirs["from_pretrained_s"] > 0
    assert res["import_torch"]["import_torch_s"] > 0
    assert run["first_generate_s"] > 0 and run["second_generate_s"] > 0 and run["first_vs_later"] > 0
    parts = res["breakdown"]
    assert parts["layers"]["import_torch_s"] > 0 and parts["layers"]["import_model_layer_s"] > 0
    assert parts["native"]["allocator_s"] >= 0 and parts["fork"]["fork_to_cuda_ready_s"] > 0
    assert parts["tokenizer"]["tokens"] == 512 and parts["tokenizer"]["tokenizer_read_s"] > 0  # the word-level one
    assert "torch" in [r["package"] for r in parts["import_times"]]
    targets = {t["target"]: t["passed"] for t in res["targets"]}
    assert targets["the same tokens before and after the graphs are captured"] is True
    cold = res["cold"]
    assert cold["read_floor"]["bytes"] > 0 and cold["worker"]["serving_s"] > 0 and cold["serving_vs_read_floor"] > 0
    assert cold["transformers"]["loaded_s"] > 0


def test_the_startup_bench_can_write_a_checkpoint_with_a_real_models_kind_of_tokenizer(tmp_path: Path) -> None:
    """--tokenizer bpe: the checkpoint the bench writes reads as a byte-level BPE of the model's vocabulary
    (bench/bpe_tokenizer.py), and the worker starts and serves with it."""
    from tokenizers import Tokenizer

    from bench import bench_startup
    from bench.bpe_tokenizer import bpe_vocabulary

    out = tmp_path / "startup.json"
    argv = ["--shape", "tiny", "--backend", "host", "--tokenizer", "bpe", "--dir", str(tmp_path)]
    argv += ["--repeats", "1", "--warmup", "0", "--kv-blocks", "64", "--no-baseline", "--no-breakdown"]
    assert bench_startup.main([*argv, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    assert res["checkpoint"]["tokenizer"] == {"tokens": 512, "merges": len(bpe_vocabulary(512)[1])}
    tokenizer = Tokenizer.from_file(str(Path(res["model"]) / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    text = "naïve café, 你好\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    (run,) = res["worker"]["runs"]
    assert 0 < run["serving_s"] < run["first_token_s"] and run["exit_code"] == 0
    with pytest.raises(SystemExit):  # a checkpoint of the user's own is not rewritten
        bench_startup.main(["--model", res["model"], "--tokenizer", "bpe", "--out", str(out)])


def test_the_side_by_side_startup_bench_runs_both_trees_in_turn(tmp_path: Path) -> None:
    """bench/startup_ab.py: each tree's own bench_startup and worker, both compared in one JSON."""
    from bench import startup_ab
    from bench.bench_gateway import write_checkpoint

    ckpt = tmp_path / "tiny"
    write_checkpoint(ckpt, "tiny", "cpu")
    base = tmp_path / "base"
    for package in ("worker", "memsvc", "bench"):
        shutil.copytree(REPO_ROOT / package, base / package, ignore=shutil.ignore_patterns("__pycache__"))
    ours = base / "bench" / "bench_startup.py"  # a bench only the base tree has: its JSON shows which ran
    ours.write_text(ours.read_text().replace("\nTARGET_SERVING_S = 2.5\n", "\nTARGET_SERVING_S = 2.25\n"))
    out = tmp_path / "ab.json"
    bench = ["--model", str(ckpt), "--backend", "host", "--repeats", "1", "--warmup", "0", "--kv-blocks", "64"]
    argv = ["--base", str(base), "--base-commit", "b4se", "--rounds", "1", "--out", str(out), "--", *bench]
    assert startup_ab.main([*argv, "--no-baseline", "--no-breakdown"]) == 0
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["base"]["commit"] == "b4se"
    (base_run,), (new_run,) = res["runs"]["base"], res["runs"]["new"]
    assert base_run["commit"] == "b4se" and new_run["commit"] != "b4se"
    assert [t["goal_s"] for t in base_run["targets"][:1]] == [2.25] and new_run["targets"][0]["goal_s"] == 2.5
    for label in ("base", "new"):
        (start,) = res["summary"]["worker"][label]["starts"]
        assert 0 < start["serving_s"] < start["first_token_s"]
        assert res["summary"]["worker"][label]["median"]["first_token_s"] == start["first_token_s"]
        assert 0 < start["after_import_s"] < start["serving_s"]
    starts = {label: res["summary"]["worker"][label]["starts"][0] for label in ("base", "new")}
    rounds = res["new_minus_base_by_round"]["worker"]
    assert rounds["first_token_s"] == [starts["new"]["first_token_s"] - starts["base"]["first_token_s"]]
    with pytest.raises(SystemExit):
        startup_ab.main(["--base", str(tmp_path / "tiny"), "--", *bench])  # not a source tree


def test_the_side_by_side_table_sets_each_rounds_trees_against_each_other() -> None:
    """bench/startup_ab.py's round-by-round differences: each round's medians, new less base, so a host
    that slows down in one round shows as rounds that disagree; a round without a part has none."""
    from bench import startup_ab

    def start(first: float, serving: float, imported: float | None) -> dict[str, float]:
        run = {"first_token_s": first, "serving_s": serving}
        return run if imported is None else {**run, "model_layer_imported_at_s": imported}

    def rnd(*starts: dict[str, float]) -> dict[str, object]:
        return {"worker": {"runs": list(starts)}}

    results = {
        "base": [
            rnd(start(3.1, 3.0, 2.4), start(3.3, 3.2, 2.5)),
            rnd(start(2.3, 2.2, 1.8)),
            rnd(start(3.0, 2.9, None)),
        ],
        "new": [
            rnd(start(3.0, 2.9, 2.4), start(3.0, 2.9, 2.4)),
            rnd(start(2.8, 2.7, 2.1)),
            rnd(start(2.9, 2.8, 2.3)),
        ],
    }
    rounds = startup_ab.by_round(results, "worker")
    assert rounds["first_token_s"] == pytest.approx([3.0 - 3.2, 2.8 - 2.3, 2.9 - 3.0])
    # after the import: base's first round 0.6 and 0.7 (median 0.65), new's 0.5; its last round has no import
    assert rounds["after_import_s"][:2] == pytest.approx([0.5 - 0.65, 0.6 - 0.4])
    assert rounds["after_import_s"][2] is None
    summary = startup_ab.compare(results)
    assert summary["worker"]["new"]["median"]["after_import_s"] == pytest.approx(0.5)
    table = startup_ab.format_table(summary, {"worker": rounds})
    assert "new - base, round by round, first_token_s: -0.20, +0.50, -0.10 s" in table
    assert "new - base, round by round, after_import_s: -0.15, +0.20, -- s" in table
