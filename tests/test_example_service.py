"""examples/acquire_and_generate.py, run as another service runs it: a separate process that talks to
a running manager and worker (``memsvc up``, host backend) through the generated stubs only.

The worker is put to sleep first, so the example's lease has to wake it; afterwards the example must
have printed the worker's greedy tokens, exited 0 and released its lease (lease count 0 at the
manager). A second run happens where ``import torch`` fails (a ``torch`` package on PYTHONPATH that
raises ImportError), proving the example needs nothing but grpcio and the stubs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from upproc import REPO_ROOT, Up, free_port, run, wait_state

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

EXAMPLE = REPO_ROOT / "examples" / "acquire_and_generate.py"
PROMPT = [1, 2, 3]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    pair = Up(tmp_path_factory.mktemp("example") / "state", [free_port(), free_port(), free_port()]).start()
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
def asleep(up: Up) -> Up:
    """The pair with local0 asleep at level 1 and no lease, so the example's AcquireWorker must wake it."""
    assert up.stub is not None
    wk = up.get()
    if wk.state != common_pb.WORKER_STATE_ASLEEP:
        up.stub.SleepWorker(
            manager_pb.SleepWorkerRequest(name="workers/local0", level=common_pb.SLEEP_LEVEL_1), timeout=60
        )
    wk = wait_state(up.stub, "local0", common_pb.WORKER_STATE_ASLEEP)
    assert wk.lease_count == 0
    return up


def direct_tokens(up: Up) -> list[int]:
    """What the worker itself generates for PROMPT (it must be awake)."""
    with grpc.insecure_channel(up.worker_address) as ch:
        reply = worker_grpc.ModelWorkerServiceStub(ch).Generate(
            worker_pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS), timeout=60
        )
    return list(reply.token_ids)


def run_example(up: Up, env: dict[str, str]) -> list[int]:
    argv = [
        sys.executable,
        str(EXAMPLE),
        "--manager",
        up.manager_address,
        "--worker",
        "local0",
        "--prompt",
        *map(str, PROMPT),
        "--max-new-tokens",
        str(NEW_TOKENS),
    ]
    r = run(argv, env=env, timeout=300)
    assert r.returncode == 0, f"example exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = r.stdout.strip().splitlines()
    assert lines, f"example printed nothing\nstderr:\n{r.stderr}"
    tokens = [int(t) for t in lines[-1].split()]
    assert len(tokens) == NEW_TOKENS, r.stdout
    return tokens


def assert_released_and_awake(up: Up) -> None:
    assert up.stub is not None
    wk = up.get()
    assert wk.lease_count == 0, "the example's lease was not released"
    assert wk.state == common_pb.WORKER_STATE_AWAKE, "the lease woke the worker and nothing has put it back to sleep"
    assert wk.HasField("idle_since_time"), "with no lease left the idle clock runs"
    listed = up.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers
    assert [(x.name, x.lease_count) for x in listed] == [("workers/local0", 0)]


def test_example_wakes_the_sleeping_worker_generates_and_releases(asleep: Up) -> None:
    tokens = run_example(asleep, dict(os.environ))
    assert_released_and_awake(asleep)
    assert tokens == direct_tokens(asleep), "the example's tokens are the worker's greedy tokens"


def test_example_needs_only_the_stubs(asleep: Up, tmp_path: Path) -> None:
    blocked = tmp_path / "no-torch"
    (blocked / "torch").mkdir(parents=True)
    (blocked / "torch" / "__init__.py").write_text('raise ImportError("torch is blocked in this test")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), *filter(None, [os.environ.get("PYTHONPATH")])])}
    probe = run([sys.executable, "-c", "import torch"], env=env)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr, "the torch block does not work"
    tokens = run_example(asleep, env)
    assert_released_and_awake(asleep)
    assert tokens == direct_tokens(asleep)
