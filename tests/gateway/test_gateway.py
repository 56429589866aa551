"""The OpenAI-compatible gateway with real processes: a manager, a worker serving a tiny text model
(a byte-level BPE tokenizer and a chat template, host backend) and ``memsvc gateway``, driven by the
real ``openai`` SDK and curl. The tokens through the gateway are the worker's own Generate tokens,
awake or asleep at level 1 or level 2 (the lease wakes it); errors come in OpenAI's JSON with the
right HTTP status and change nothing; a client that leaves mid-stream gives its lease back."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from gateway_env import MODEL, PROMPT, text_model_served, wait_for
from gatewayproc import GatewayProcess
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from hf_models import text_model
from managerproc import ManagerProcess
from workerproc import WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

openai = pytest.importorskip("openai")


class Stack:
    def __init__(self, manager: ManagerProcess, worker: WorkerProcess, gateway: GatewayProcess, model: Path) -> None:
        self.manager, self.worker, self.gateway, self.model = manager, worker, gateway, model
        self.client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def state(self) -> int:
        return int(self.worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.state)

    def leases(self) -> int:
        r = self.manager.stub.GetWorker(manager_pb.GetWorkerRequest(name="workers/gw0"), timeout=10)
        return int(r.worker.lease_count)

    def kv(self) -> common_pb.KvCacheInfo:
        kv: common_pb.KvCacheInfo = self.worker.stub.GetWorkerStatus(
            worker_pb.GetWorkerStatusRequest(), timeout=10
        ).status.kv_cache
        return kv

    def direct(self, **fields: Any) -> worker_pb.GenerateResponse:
        return self.worker.stub.Generate(worker_pb.GenerateRequest(**fields), timeout=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with text_model_served(tmp_path_factory.mktemp("gateway"), "gw0") as (mp, wp, path):
        gw = GatewayProcess(mp.address).start()
        try:
            yield Stack(mp, wp, gw, path)
        finally:
            gw.kill()


MESSAGES = [{"role": "user", "content": "hello there"}]


def test_models_list_the_served_model_with_its_state(stack: Stack) -> None:
    models = stack.client.models.list()
    ids = [x.id for x in models.data]
    assert ids == [MODEL]
    assert models.data[0].model_extra is not None and models.data[0].model_extra["state"] == "awake"
    stack.worker.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=60)
    try:
        # the state as the vocabulary spells it (WorkerState.label), once the manager heard of the sleep
        wait_for(
            lambda: stack.client.models.list().data[0].model_extra,
            lambda x: x is not None and x["state"] == "asleep",
            "the model listed as 'asleep'",
        )
    finally:
        stack.worker.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)


def test_one_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(stack: Stack) -> None:
    """GET /v1/models/{id} through the SDK: the served model's card; one nobody serves: 404 naming it."""
    card = stack.client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra is not None and card.model_extra["state"] == "awake"
    with pytest.raises(openai.NotFoundError) as err:
        stack.client.models.retrieve("org/no-such-model")
    assert "'org/no-such-model' does not exist" in str(err.value)


@pytest.mark.parametrize(
    "sleep", [None, common_pb.SLEEP_LEVEL_1, common_pb.SLEEP_LEVEL_2], ids=["awake", "level1", "level2"]
)
def test_completions_and_chat_give_the_workers_greedy_tokens_awake_or_asleep(stack: Stack, sleep: int | None) -> None:
    want = stack.direct(prompt=PROMPT, max_new_tokens=12, ignore_eos=False)
    want_chat = stack.direct(messages=[worker_pb.ChatMessage(role="user", content="hello there")], max_new_tokens=12)
    for call in range(4):
        if sleep is not None:
            stack.worker.stub.Sleep(worker_pb.SleepRequest(level=sleep), timeout=60)  # type: ignore[arg-type]
            assert stack.state() == common_pb.WORKER_STATE_ASLEEP
        if call == 0:
            r = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
            assert stack.leases() == 0, "a plain answer comes after its lease was released"
            assert r.choices[0].text == want.text and r.usage is not None
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_token_count, len(want.token_ids))
        elif call == 1:
            chat = stack.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
            assert stack.leases() == 0, "a plain answer comes after its lease was released"
            assert chat.choices[0].message.content == want_chat.text
            assert chat.choices[0].finish_reason == (
                "stop" if want_chat.finish_reason == common_pb.FINISH_REASON_STOP else "length"
            )
        elif call == 2:
            pieces = stack.client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(pieces)
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want.token_ids)
        else:
            stream = stack.client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            assert text == want_chat.text
        assert stack.state() == common_pb.WORKER_STATE_AWAKE
        wait_for(stack.leases, lambda n: n == 0, "the request's lease to be released")


def test_concurrent_streaming_clients_all_get_their_tokens(stack: Stack) -> None:
    want = stack.direct(prompt=PROMPT, max_new_tokens=10).text
    results: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            s = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
            results.append("".join(ch.choices[0].text for ch in s if ch.choices))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert results == [want] * 32
    wait_for(stack.leases, lambda n: n == 0, "every lease to be released")


def test_a_client_that_leaves_mid_stream_releases_its_lease(stack: Stack) -> None:
    stream = stack.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    assert stack.leases() == 1
    stream.close()
    wait_for(stack.leases, lambda n: n == 0, "the lease of the client that left to be released")
    kv = stack.worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.kv_cache
    wait_for(
        lambda: stack.worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.kv_cache,
        lambda k: k.device_free_block_count == k.device_block_count,
        f"the stream's blocks to be freed ({kv})",
    )


def test_return_token_ids_puts_each_chunks_tokens_in_its_choice(stack: Stack) -> None:
    """vLLM's return_token_ids on a model with text: every streamed chunk's choice has ``token_ids``,
    which add up to what the worker answers alone; a whole answer's choice has them all."""
    prompt = [5, 7, 9]
    want = list(stack.direct(prompt_token_ids=prompt, max_new_tokens=12, ignore_eos=True).token_ids)
    extra = {"return_token_ids": True, "ignore_eos": True}
    chunks = list(
        stack.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=extra
        )
    )
    got = [t for ch in chunks for choice in ch.choices for t in (choice.model_extra or {}).get("token_ids", [])]
    assert got == want
    whole = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    assert (whole.choices[0].model_extra or {})["token_ids"] == want


def test_a_model_without_a_tokenizer_streams_token_ids(tmp_path: Path) -> None:
    """A checkpoint with no tokenizer.json: text is empty, so each streamed chunk carries its token ids
    instead (without asking), adding up to the worker's own answer, and a stream no longer sends
    nothing until its end."""
    from hf_models import save, tiny_llama

    path = save(tiny_llama(), tmp_path / "ids-only")
    mp = ManagerProcess(tmp_path / "manager.db", ["--idle-sleep-timeout", "0"]).start()
    try:
        with WorkerProcess(["--model", str(path), "--manager", mp.address]) as wp:
            served = lambda ws: any(x.status.model.served_model_name == "ids-only" for x in ws)  # noqa: E731
            wait_for(
                lambda: mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers, served, "registration"
            )
            # 200 tokens, not 10: a stream's messages may carry several steps' tokens where its reader
            # lags (10 came in one message in about one run of six, main's worker as well)
            alone = worker_pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=200, ignore_eos=True)
            want = list(wp.stub.Generate(alone, timeout=60).token_ids)
            gw = GatewayProcess(mp.address).start()
            try:
                client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)
                chunks = list(
                    client.completions.create(
                        model="ids-only",
                        prompt=[1, 2],
                        max_tokens=200,
                        temperature=0,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                )
            finally:
                gw.kill()
    finally:
        mp.kill()
    with_ids = [(ch.choices[0].model_extra or {}).get("token_ids") for ch in chunks if ch.choices]
    assert len([x for x in with_ids if x]) >= 2, "the stream sent its tokens in one piece"
    assert [t for x in with_ids if x for t in x] == want


def test_stop_strings_cut_the_text_at_the_first_stop(stack: Stack) -> None:
    full = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    assert len(full) > 4
    stop = full[2:4]
    cut = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop)
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = stack.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == full[: full.find(stop)]


def test_a_stop_string_ends_the_generation_and_usage_counts_what_was_returned(stack: Stack) -> None:
    """Streamed usage said prompt_tokens 0 whenever a stop string hit, and a whole answer counted the
    tokens the worker kept making after the stop (60 for a 6-token answer). The worker now ends the
    generation at the token that completes the stop string: the answer is the text before it and
    usage counts exactly the tokens up to that one, streamed or not, through the gateway or not. The
    reference is the tokenizer itself: the shortest run of the unstopped answer's tokens whose text
    holds the stop."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(stack.model / "tokenizer.json"))
    ref = stack.direct(prompt=PROMPT, max_new_tokens=60, ignore_eos=True)
    full = tok.decode(list(ref.token_ids), skip_special_tokens=True)
    assert len(full) > 8 and ref.prompt_token_count > 0 and full == ref.text, full
    stop = full[4:7]
    count = next(k for k in range(1, 61) if stop in tok.decode(list(ref.token_ids[:k]), skip_special_tokens=True))
    assert count < 60, "the stop must come well before max_tokens"
    answer = full[: full.find(stop)]

    direct = stack.direct(prompt=PROMPT, max_new_tokens=60, ignore_eos=True, stop=["never in it", stop])
    assert (list(direct.token_ids), direct.text, direct.matched_stop) == (list(ref.token_ids[:count]), answer, stop)
    assert direct.finish_reason == common_pb.FINISH_REASON_STOP and direct.completion_token_count == count
    msgs = list(
        stack.worker.stub.GenerateStream(
            worker_pb.GenerateStreamRequest(
                request=worker_pb.GenerateRequest(prompt=PROMPT, max_new_tokens=60, ignore_eos=True, stop=[stop])
            ),
            timeout=60,
        )
    )
    assert "".join(x.text for x in msgs) == answer and msgs[-1].done.matched_stop == stop
    assert [t for x in msgs for t in x.token_ids] == list(ref.token_ids[:count])

    extra = {"ignore_eos": True}
    whole = stack.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop], extra_body=extra
    )
    assert whole.choices[0].text == answer and whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (ref.prompt_token_count, count)
    chunks = list(
        stack.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=60,
            temperature=0,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == answer
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    streamed = chunks[-1].usage
    assert streamed is not None
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (ref.prompt_token_count, count)
    wait_for(stack.leases, lambda n: n == 0, "the leases to be released")
    wait_for(stack.kv, lambda kv: kv.device_free_block_count == kv.device_block_count, "the KV blocks back")


def curl(url: str, path: str, body: str | None, headers: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    exe = shutil.which("curl")
    if exe is None:
        pytest.skip("curl is not installed")
    args = [exe, "-s", "-o", "-", "-w", "\n%{http_code}", f"{url}{path}"]
    for h in ("Content-Type: application/json", *headers):
        args += ["-H", h]
    if body is not None:
        args += ["-d", body]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    text, _, code = out.rpartition("\n")
    return int(code), json.loads(text)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ('{"model": "nope", "prompt": "x"}', 404, "model"),
        ('{"model": "text-model", "prompt": "x", "n": 2}', 400, "n"),
        ('{"model": "text-model", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        ('{"model": "text-model", "prompt": "x", "temperature": 3}', 400, "temperature"),
        ('{"model": "text-model", "prompt": ["a", "b"]}', 400, "prompt"),
        ('{"model": "text-model", "prompt": "x", "max_tokens": 100000}', 400, None),
        ('{"model": "text-model", "prompt": "x" ', 400, None),
    ],
    ids=["unknown-model", "n", "max-tokens", "temperature", "two-prompts", "too-long", "bad-json"],
)
def test_bad_requests_get_openai_errors_and_change_nothing(
    stack: Stack, body: str, status: int, param: str | None
) -> None:
    # settled first: a stream an earlier test cut short frees its blocks at the worker's next step
    before = wait_for(
        stack.kv, lambda k: k.device_free_block_count == k.device_block_count, "every KV block free again"
    )
    wait_for(stack.leases, lambda n: n == 0, "earlier leases to be released")
    code, err = curl(stack.gateway.url, "/v1/completions", body)
    assert code == status, err
    assert set(err) == {"error"} and err["error"]["message"] and err["error"]["type"]
    if param is not None:
        assert err["error"]["param"] == param
    assert stack.kv() == before
    assert stack.leases() == 0


def test_health_and_readiness(stack: Stack) -> None:
    assert curl(stack.gateway.url, "/healthz", None) == (200, {"status": "ok"})
    assert curl(stack.gateway.url, "/health", None) == (200, {"status": "ok"})  # vLLM's and SGLang's spelling
    assert curl(stack.gateway.url, "/readyz", None)[0] == 200


def _health_command(url: str) -> subprocess.CompletedProcess[str]:
    import sys

    argv = [sys.executable, "-m", "memsvc.cli", "health", url, "--timeout", "5"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_a_gateway_whose_manager_is_gone_is_alive_but_not_ready(tmp_path: Path) -> None:
    gw = GatewayProcess("127.0.0.1:1").start()
    try:
        assert curl(gw.url, "/healthz", None)[0] == 200
        code, body = curl(gw.url, "/readyz", None)
        assert code == 503 and body["status"] == "manager unreachable"
        # `memsvc health` on a URL (compose's check of the gateway): 0 on 2xx, 1 otherwise or unreachable
        alive = _health_command(f"{gw.url}/healthz")
        assert alive.returncode == 0 and "HTTP 200" in alive.stdout, alive
        ready = _health_command(f"{gw.url}/readyz")
        assert ready.returncode == 1 and "HTTP 503" in ready.stdout, ready
    finally:
        gw.kill()
    gone = _health_command(f"{gw.url}/healthz")
    assert gone.returncode == 1 and gone.stderr.strip(), gone


def test_the_bearer_token_is_required_when_set(stack: Stack, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    gw = GatewayProcess(stack.manager.address, ["--token-file", str(token)]).start()
    try:
        code, err = curl(gw.url, "/v1/models", None)
        assert code == 401 and err["error"]["code"] == "invalid_api_key"
        code, _ = curl(gw.url, "/v1/models", None, ("Authorization: Bearer wrong",))
        assert code == 401
        # two Authorization headers: neither counts (the last used to win)
        code, err = curl(gw.url, "/v1/models", None, ("Authorization: Bearer wrong", "Authorization: Bearer s3cret"))
        assert code == 400 and "more than one Authorization" in err["error"]["message"], err
        # /metrics is behind the token too, as the manager's is
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(f"{gw.url}/metrics", timeout=30)
        assert denied.value.code == 401
        authed = urllib.request.Request(f"{gw.url}/metrics", headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(authed, timeout=30) as r:
            assert r.status == 200 and b"memsvc_gateway" in r.read()
        # the gateway dials the manager with the same token; this manager has none and ignores it
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert [x.id for x in client.models.list().data] == [MODEL]
    finally:
        gw.kill()


def test_memsvc_up_starts_the_gateway_in_front_of_its_worker(tmp_path: Path) -> None:
    from upproc import Up, free_port

    up = Up(tmp_path / "state", [free_port(), free_port(), free_port()]).start()
    try:
        client = openai.OpenAI(base_url=f"{up.gateway_url}/v1", api_key="unused", max_retries=0, timeout=30)

        def models() -> list[str]:
            try:
                return [x.id for x in client.models.list().data]
            except openai.APIConnectionError:
                return []

        assert wait_for(models, lambda ids: ids == ["synthetic:tiny"], "the gateway to list up's worker", 60)
        r = client.completions.create(model="synthetic:tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 5
    finally:
        up.close()


def test_metrics_count_requests_and_responses_carry_a_request_id(stack: Stack) -> None:
    stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    streamed = stack.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert len(list(streamed)) >= 2
    curl(stack.gateway.url, "/v1/completions", '{"model": "nope", "prompt": "x"}')
    exe = shutil.which("curl")
    assert exe is not None
    probe = [exe, "-s", "-D", "-", "-o", "/dev/null", "-H", "X-Request-Id: probe-42", f"{stack.gateway.url}/healthz"]
    head = subprocess.run(probe, capture_output=True, text=True, timeout=30).stdout
    assert "x-request-id: probe-42" in head.lower()
    scrape = [exe, "-s", f"{stack.gateway.url}/metrics"]
    text = subprocess.run(scrape, capture_output=True, text=True, timeout=30).stdout
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    ok = 'memsvc_gateway_requests_total{code="200",endpoint="completions",model="text-model"}'
    assert samples.get(ok, 0) >= 1
    assert samples.get('memsvc_gateway_requests_total{code="404",endpoint="completions",model=""}', 0) >= 1
    assert samples.get('memsvc_gateway_completion_tokens_total{model="text-model"}', 0) >= 3
    for part in ("time_to_first_token", "queue", "wake", "prefill"):
        assert samples.get(f'memsvc_gateway_{part}_seconds_count{{model="text-model"}}', 0) >= 1, part
    assert samples.get('memsvc_gateway_tokens_per_second_count{model="text-model"}', 0) >= 1


@pytest.fixture
def two_models(tmp_path: Path) -> Iterator[tuple[ManagerProcess, list[WorkerProcess], GatewayProcess]]:
    """Two workers on 6 MiB simulated devices of one host: the default budget (the device's size) fits
    one awake tiny model, so waking one puts the other, idle, to sleep."""
    mp = ManagerProcess(tmp_path / "manager.db", ["--idle-sleep-timeout", "0"]).start()
    workers: list[WorkerProcess] = []
    try:
        for name in ("alpha", "beta"):
            flags = [
                "--model",
                "synthetic:tiny",
                "--host-capacity",
                "6MiB",
                "--manager",
                mp.address,
                "--worker-id",
                name,
                "--served-model-name",
                name,
            ]
            workers.append(WorkerProcess(flags).start())
        wait_for(
            lambda: mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers,
            lambda ws: len([x for x in ws if x.status.model.served_model_name]) == 2,
            "both registrations",
        )
        gw = GatewayProcess(mp.address, ["--queue-timeout", "1"]).start()
        try:
            yield mp, workers, gw
        finally:
            gw.kill()
    finally:
        for wp in workers:
            wp.kill()
        mp.kill()


def _state_of(mp: ManagerProcess, name: str) -> int:
    return int(mp.stub.GetWorker(manager_pb.GetWorkerRequest(name=f"workers/{name}"), timeout=10).worker.state)


@pytest.mark.parametrize("headroom", [0, 6 << 20], ids=["evict-first", "evict-beside-the-wake"])
def test_requests_alternating_between_two_models_wake_each_and_sleep_the_other(
    two_models: tuple[ManagerProcess, list[WorkerProcess], GatewayProcess], headroom: int
) -> None:
    mp, _, gw = two_models
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert sorted(x.id for x in client.models.list().data) == ["alpha", "beta"]
    mp.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/alpha"), timeout=60)  # both load awake; one fits
    mp.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            policy=manager_pb.Policy(device_swap_headroom_bytes=headroom),
            update_mask=FieldMask(paths=["device_swap_headroom_bytes"]),
        ),
        timeout=10,
    )
    answers: dict[str, list[int]] = {}
    for model in ("alpha", "beta", "alpha", "beta"):
        r = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=6, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 6
        other = "beta" if model == "alpha" else "alpha"
        wait_for(
            lambda other=other: _state_of(mp, other),  # type: ignore[misc]
            lambda s: s == common_pb.WORKER_STATE_ASLEEP,
            f"{other} to be put to sleep for {model}",
        )
        answers.setdefault(model, []).append(r.usage.completion_tokens)
    assert answers == {"alpha": [6, 6], "beta": [6, 6]}
    overlapped = mp.stderr_text().count("to sleep beside the wake")
    assert (overlapped == 4) if headroom else (overlapped == 0), (
        f"{overlapped} overlapped evictions, headroom {headroom}"
    )


def test_a_model_that_cannot_get_room_waits_then_gets_503_with_retry_after(
    two_models: tuple[ManagerProcess, list[WorkerProcess], GatewayProcess],
) -> None:
    """alpha is leased and pinned (a time_slice of 0: it never gives up its turn; tests/manager/test_turns.py
    has the turns a busy model takes otherwise), so beta cannot get room: its request waits out the
    gateway's 1 s queue and gets 503 with Retry-After."""
    mp, _, gw = two_models
    pin = manager_pb.UpdatePolicyRequest(
        name="workers/alpha", policy=manager_pb.Policy(), update_mask=FieldMask(paths=["time_slice"])
    )
    mp.stub.UpdatePolicy(pin, timeout=10)
    mp.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/beta"), timeout=60)
    held = mp.stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name="workers/alpha", holder="test"), timeout=60)
    try:
        t0 = time.monotonic()
        exe = shutil.which("curl")
        assert exe is not None
        args = [
            exe,
            "-s",
            "-D",
            "-",
            f"{gw.url}/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            '{"model": "beta", "prompt": [1, 2], "max_tokens": 2}',
        ]
        out = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
        waited = time.monotonic() - t0
        head, _, body = out.partition("\n\n")
        assert head.startswith("HTTP/1.1 503"), out
        assert "retry-after:" in head.lower(), out
        assert body.strip(), repr(out)
        assert json.loads(body)["error"]["type"] == "server_error", out
        assert waited >= 0.9, f"answered after {waited:.2f} s: it did not wait for room"
        assert (
            _state_of(mp, "alpha") == common_pb.WORKER_STATE_AWAKE
            and _state_of(mp, "beta") == common_pb.WORKER_STATE_ASLEEP
        )
    finally:
        mp.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=held.lease.lease_id), timeout=10)


def test_without_max_tokens_a_chat_ends_at_the_models_context(stack: Stack) -> None:
    """OpenAI's max_tokens is a bound: unset, the answer runs until the model's context is full."""
    context = stack.worker.stub.GetWorkerStatus(
        worker_pb.GetWorkerStatusRequest(), timeout=10
    ).status.model.context_length
    chat = stack.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == context
    wait_for(stack.leases, lambda n: n == 0, "the lease to be released")


def test_without_max_tokens_a_chat_on_a_kv_pool_smaller_than_the_context_ends_at_the_pool(tmp_path: Path) -> None:
    """What every OpenAI client sends by default, on a worker whose KV cache (4 blocks of 16 tokens)
    holds less than the model's context (512): the gateway asks for up to 4096 tokens, and the
    worker used to reserve them all at admission and answer 503 for ever. Blocks are taken as the
    tokens are made, so the answer runs until the pool is full: finish_reason "length"."""
    path, _ = text_model(tmp_path)
    mp = ManagerProcess(tmp_path / "manager.db").start()
    try:
        args = ["--model", str(path), "--manager", mp.address, "--worker-id", "small-kv", "--kv-blocks", "4"]
        with WorkerProcess(args) as wp:
            wait_for(
                lambda: mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers,
                lambda ws: any(x.status.model.served_model_name == MODEL for x in ws),
                "registration",
            )
            gw = GatewayProcess(mp.address).start()
            try:
                client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
                chat = client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
                )
                assert chat.choices[0].finish_reason == "length" and chat.usage is not None
                assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 4 * 16 + 1  # the last is not fed
                kv = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.kv_cache
                assert kv.device_free_block_count == kv.device_block_count == 4
            finally:
                gw.kill()
    finally:
        mp.kill()


def test_a_client_that_leaves_a_plain_request_stops_its_generation(
    two_models: tuple[ManagerProcess, list[WorkerProcess], GatewayProcess],
) -> None:
    mp, (alpha, _), gw = two_models
    exe = shutil.which("curl")
    assert exe is not None
    body = '{"model": "alpha", "prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": true}'
    args = [
        exe,
        "-s",
        "--max-time",
        "0.5",
        f"{gw.url}/v1/completions",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
    ]
    assert subprocess.run(args, capture_output=True, text=True, timeout=60).returncode == 28  # curl: timed out

    def lease_count() -> int:
        return int(mp.stub.GetWorker(manager_pb.GetWorkerRequest(name="workers/alpha"), timeout=10).worker.lease_count)

    wait_for(lease_count, lambda n: n == 0, "the lease of the client that left")
    wait_for(
        lambda: alpha.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.kv_cache,
        lambda k: k.device_free_block_count == k.device_block_count,
        "the generation's blocks to be freed",
    )
    scrape = subprocess.run([exe, "-s", f"{gw.url}/metrics"], capture_output=True, text=True, timeout=30).stdout
    assert 'memsvc_gateway_requests_total{code="499",endpoint="completions",model="alpha"} 1.0' in scrape, scrape


def _manager_worker(stack: Stack) -> manager_pb.Worker:
    worker: manager_pb.Worker = stack.manager.stub.GetWorker(
        manager_pb.GetWorkerRequest(name="workers/gw0"), timeout=10
    ).worker
    return worker


def _idle_sleep_timeout(stack: Stack, seconds: float) -> None:
    policy = manager_pb.Policy(idle_sleep_timeout=Duration(seconds=int(seconds), nanos=int(seconds % 1 * 1e9)))
    stack.manager.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(policy=policy, update_mask=FieldMask(paths=["idle_sleep_timeout"])), timeout=10
    )


def test_keep_alive_overrides_the_idle_timer_after_the_request(stack: Stack) -> None:
    """Ollama's keep_alive: -1 keeps the model awake past the policy's idle timeout, 0 puts it to sleep
    right after the response, unset leaves the policy in force; out of range is a 400 that changes
    nothing."""
    _idle_sleep_timeout(stack, 0.5)
    try:
        r = stack.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"keep_alive": "-1"}
        )
        assert r.usage is not None and r.usage.completion_tokens == 2
        assert _manager_worker(stack).keep_alive.ToNanoseconds() == -1_000_000_000
        time.sleep(2.0)  # four policy timeouts
        assert _manager_worker(stack).state == common_pb.WORKER_STATE_AWAKE, "keep_alive -1 still let it idle-sleep"

        with pytest.raises(openai.BadRequestError) as bad:
            stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"keep_alive": "40d"})
        assert bad.value.status_code == 400 and "keep_alive" in str(bad.value.body)
        for typo in ("1000h", "--5", "+-5", "-+5s"):  # one sign at most: "--5" was read as -5, "+-5" as +5
            with pytest.raises(openai.BadRequestError) as bad:
                stack.client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"keep_alive": typo}
                )
            assert "keep_alive" in str(bad.value.body), (typo, bad.value.body)
        assert _manager_worker(stack).keep_alive.ToNanoseconds() == -1_000_000_000, "a refused request changed it"
        assert _manager_worker(stack).state == common_pb.WORKER_STATE_AWAKE

        stack.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, extra_body={"keep_alive": 0}
        )
        wait_for(
            lambda: _manager_worker(stack).state,
            lambda s: s == common_pb.WORKER_STATE_ASLEEP,
            "keep_alive 0 to put the model to sleep after its response",
            timeout=10,
        )

        stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)  # wakes it
        assert not _manager_worker(stack).HasField("keep_alive"), "a request without keep_alive restores the policy"
        wait_for(
            lambda: _manager_worker(stack).state,
            lambda s: s == common_pb.WORKER_STATE_ASLEEP,
            "the policy's idle timer",
            timeout=10,
        )
    finally:
        _idle_sleep_timeout(stack, 0)
        stack.worker.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)
        wait_for(lambda: _manager_worker(stack).state, lambda s: s == common_pb.WORKER_STATE_AWAKE, "the wake")


def test_requests_that_arrive_during_a_wake_join_it(stack: Stack) -> None:
    """Twelve requests for a level-2 sleeper at once: one wake serves them all, each gets the greedy
    tokens, and no request sees the wake as an error."""
    want = stack.direct(prompt=PROMPT, max_new_tokens=6).text
    stack.worker.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_2), timeout=60)
    wait_for(lambda: _manager_worker(stack).state, lambda s: s == common_pb.WORKER_STATE_ASLEEP, "level 2")
    watch = stack.manager.stub.WatchWorkers(manager_pb.WatchWorkersRequest(names=["workers/gw0"]), timeout=120)
    states: list[int] = []

    def follow() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled below
            states.extend(int(e.worker.state) for e in watch)

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    wait_for(lambda: len(states), lambda n: n > 0, "the watch's snapshot (subscribed before the requests)")
    results: list[str] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            if i % 2:
                s = stack.client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True
                )
                results.append("".join(ch.choices[0].text for ch in s if ch.choices))
            else:
                r = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
                results.append(r.choices[0].text)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    watch.cancel()
    watcher.join(timeout=10)
    assert not errors, errors[:3]
    assert results == [want] * 12
    woke = [
        i for i in range(1, len(states)) if states[i] == common_pb.WORKER_STATE_AWAKE and states[i - 1] != states[i]
    ]
    assert len(woke) == 1, f"one wake for all twelve, saw states {states}"
    wait_for(stack.leases, lambda n: n == 0, "every lease to be released")


def test_concurrent_streams_across_two_models_that_fit_one_at_a_time(
    two_models: tuple[ManagerProcess, list[WorkerProcess], GatewayProcess],
) -> None:
    """32 streaming clients, half per model, on a device whose budget fits one: the manager serves one
    model's leases, then sleeps it to wake the other for the requests that queued; nobody errs."""
    mp, workers, _ = two_models
    gw = GatewayProcess(mp.address, ["--queue-timeout", "60"]).start()  # the fixture's 1 s queue is for 503s
    try:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
        want = {
            name: wp.stub.Generate(
                worker_pb.GenerateRequest(prompt_token_ids=[3, 1, 4, 1, 5], max_new_tokens=8), timeout=60
            ).token_ids
            for name, wp in zip(("alpha", "beta"), workers, strict=True)
        }
        mp.stub.SleepWorker(
            manager_pb.SleepWorkerRequest(name="workers/alpha"), timeout=60
        )  # both load awake; one fits
        results: dict[str, list[int]] = {"alpha": [], "beta": []}
        errors: list[BaseException] = []

        def one(model: str) -> None:
            try:
                s = client.completions.create(
                    model=model,
                    prompt=[3, 1, 4, 1, 5],
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = list(s)
                assert chunks[-1].usage is not None
                results[model].append(chunks[-1].usage.completion_tokens)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=("alpha" if i % 2 else "beta",)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors[:3]
        assert {k: len(v) for k, v in results.items()} == {"alpha": 16, "beta": 16}
        assert all(n == len(want[k]) for k, v in results.items() for n in v), (results, want)
        states = {_state_of(mp, name) for name in ("alpha", "beta")}
        assert common_pb.WORKER_STATE_ASLEEP in states, "the budget fits one: one of them sleeps"
    finally:
        gw.kill()


def _asleep(stack: Stack) -> None:
    if stack.state() != common_pb.WORKER_STATE_ASLEEP:
        stack.worker.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=60)
    wait_for(lambda: _manager_worker(stack).state, lambda s: s == common_pb.WORKER_STATE_ASLEEP, "the sleep")


def _awake(stack: Stack) -> None:
    if stack.state() != common_pb.WORKER_STATE_AWAKE:
        stack.worker.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)
    wait_for(lambda: _manager_worker(stack).state, lambda s: s == common_pb.WORKER_STATE_AWAKE, "the wake")


_CHAT = {"model": MODEL, "messages": MESSAGES}
_PLAIN = {"model": MODEL, "prompt": "x"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {**_PLAIN, "max_tokens": 5000}, "max_tokens"),
        ("chat/completions", {**_CHAT, "max_completion_tokens": 5000}, "max_completion_tokens"),
        ("completions", {"model": MODEL, "prompt": [1 << 40]}, "prompt"),
        ("completions", {"model": MODEL, "prompt": [1_000_000]}, "prompt"),
        ("completions", {"model": MODEL, "prompt": [1] * 512}, "prompt"),
        ("completions", {"model": MODEL, "prompt": ""}, "prompt"),
        ("completions", {"model": MODEL, "prompt": "x" * ((1 << 20) + 1)}, "prompt"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 1025}, "messages"),
        ("completions", {**_PLAIN, "temperature": "0.5"}, "temperature"),
        ("completions", {**_PLAIN, "stream": "yes"}, "stream"),
        ("completions", {"model": MODEL, "prompt": [True, 2]}, "prompt"),
        ("completions", {**_PLAIN, "frequency_penalty": 1.5}, "frequency_penalty"),
        ("completions", {**_PLAIN, "presence_penalty": 0.5}, "presence_penalty"),
        ("completions", {**_PLAIN, "logit_bias": {"5": 100}}, "logit_bias"),
        ("completions", {**_PLAIN, "best_of": 2}, "best_of"),
        ("completions", {**_PLAIN, "suffix": "end"}, "suffix"),
        ("chat/completions", {**_CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ("chat/completions", {**_CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ("completions", {**_PLAIN, "stop": ["x" * 1025]}, "stop"),
    ],
    ids=[
        "max-tokens",
        "max-completion-tokens",
        "token-past-int32",
        "token-past-vocab",
        "prompt-fills-context",
        "empty-prompt",
        "prompt-bytes",
        "messages",
        "temperature-as-text",
        "stream-as-text",
        "bool-token",
        "frequency-penalty",
        "presence-penalty",
        "logit-bias",
        "best-of",
        "suffix",
        "response-format",
        "functions",
        "stop-bytes",
    ],
)
def test_bad_requests_are_refused_before_they_wake_a_sleeping_model(
    stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    """Bad input is refused by the gateway itself, naming the field, before it takes a lease: a request
    that cannot be served does not wake the model (the worker's own checks only run once awake), and a
    field the gateway would drop (a penalty, a bias, a response format) is refused, not ignored."""
    import httpx

    wait_for(stack.leases, lambda n: n == 0, "earlier leases to be released")
    _asleep(stack)
    try:
        r = httpx.post(f"{stack.gateway.url}/v1/{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
        assert (err["param"] or "").split(".")[0] == param, err
        assert not err["message"].startswith("Value error"), err  # the validator's words, not pydantic's
        assert stack.state() == common_pb.WORKER_STATE_ASLEEP, "a refused request woke the model"
        assert stack.leases() == 0
    finally:
        _awake(stack)


def test_the_sdk_raises_bad_request_for_a_parameter_the_gateway_does_not_apply(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        stack.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, presence_penalty=1.0)
    assert "presence_penalty" in bad.value.message
    neutral: dict[str, Any] = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}
    # ignore_eos: at the default temperature (1) the token drawn can be the end of text (it was, in one
    # fresh-clone run), and the answer then has one token
    ok = stack.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        response_format={"type": "text"},
        extra_body={"ignore_eos": True},
        **neutral,
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_top_k_reaches_the_worker(stack: Stack) -> None:
    """vLLM's top_k: 1 at temperature 1 is greedy, so the text is the worker's greedy text (dropped,
    the answer would be a random sample of this random model)."""
    want = stack.direct(prompt=PROMPT, max_new_tokens=12, ignore_eos=True).text
    for seed in (1, 2):
        r = stack.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"top_k": 1, "ignore_eos": True},
        )
        assert r.choices[0].text == want
    # clients send unset optional fields as null: each means "the default", never a 400. Greedy, so
    # that the answer is the worker's own (sampled, this random model ended at once at its EOS in one
    # CI run: an empty text)
    nulls = dict.fromkeys(("top_k", "stop", "seed", "user", "frequency_penalty", "logit_bias", "stream_options"))
    r = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=nulls)
    direct = stack.direct(prompt=PROMPT, max_new_tokens=2)
    assert r.choices[0].text == direct.text != "" and r.usage is not None
    assert r.usage.completion_tokens == len(direct.token_ids) == 2


def test_an_oversize_body_is_413_and_wakes_nothing(stack: Stack, tmp_path: Path) -> None:
    """The body is bounded before it is read (Content-Length) and while it is read (chunked): a client
    cannot make the gateway hold an unbounded body, and a sleeping model stays asleep."""
    from memsvc.runtime.limits import MAX_HTTP_BODY_BYTES

    exe = shutil.which("curl")
    assert exe is not None
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": MODEL, "prompt": "x" * MAX_HTTP_BODY_BYTES, "max_tokens": 1}))
    wait_for(stack.leases, lambda n: n == 0, "earlier leases to be released")
    _asleep(stack)
    try:
        for extra in ((), ("-H", "Transfer-Encoding: chunked")):
            args = [
                exe,
                "-s",
                "-o",
                "-",
                "-w",
                "\n%{http_code}",
                f"{stack.gateway.url}/v1/completions",
                "-H",
                "Content-Type: application/json",
                *extra,
                "--data-binary",
                f"@{body}",
            ]
            out = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
            text, _, code = out.rpartition("\n")
            assert code == "413", (extra, out[:300])
            err = json.loads(text)["error"]
            assert err["type"] == "invalid_request_error" and str(MAX_HTTP_BODY_BYTES) in err["message"], err
        assert stack.state() == common_pb.WORKER_STATE_ASLEEP
        assert stack.leases() == 0
    finally:
        _awake(stack)


def test_a_request_id_that_is_not_ascii_is_replaced_not_refused(stack: Stack) -> None:
    """X-Request-Id names the lease's holder; a client's id the manager would refuse (128 latin-1
    characters are 256 UTF-8 bytes, past the holder's bound with the gateway's prefix) is replaced."""
    import httpx

    r = httpx.post(
        f"{stack.gateway.url}/v1/completions",
        json={**_PLAIN, "max_tokens": 1},
        headers={b"X-Request-Id": ("\u00e9" * 128).encode("latin-1")},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"].isascii() and r.headers["x-request-id"].startswith("req-")


def test_queued_requests_are_bounded_and_one_whose_client_leaves_wakes_nothing(
    two_models: tuple[ManagerProcess, list[WorkerProcess], GatewayProcess],
) -> None:
    """Requests waiting for room on their model's device (every neighbour leased and pinned) are bounded
    (--max-requests, streams and queued alike): past it a 503 with Retry-After at once. One whose
    client leaves stops waiting: when room comes, nothing is woken and nothing evicted for the caller
    who left, and its place is free again."""
    import httpx

    mp, _, _ = two_models
    gw = GatewayProcess(mp.address, ["--queue-timeout", "60", "--max-requests", "2"]).start()
    try:
        mask = FieldMask(paths=["time_slice"])  # a time_slice of 0: leased, alpha never gives up its turn
        pin = manager_pb.UpdatePolicyRequest(name="workers/alpha", policy=manager_pb.Policy(), update_mask=mask)
        mp.stub.UpdatePolicy(pin, timeout=10)
        mp.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/beta"), timeout=60)
        held = mp.stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name="workers/alpha", holder="test"), timeout=60)
        exe = shutil.which("curl")
        assert exe is not None
        clients = [
            subprocess.Popen(
                [
                    exe,
                    "-s",
                    "--max-time",
                    "120",
                    f"{gw.url}/v1/completions",
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    json.dumps({"model": "beta", "prompt": [1, 2], "max_tokens": 2, "stream": stream}),
                ]
            )
            for stream in (False, True)
        ]
        exe_metrics = [exe, "-s", f"{gw.url}/metrics"]

        def scrape() -> str:
            return subprocess.run(exe_metrics, capture_output=True, text=True, timeout=30).stdout

        # (the metrics, not a completion, which would take one of the two places while a client came)
        wait_for(scrape, lambda text: "memsvc_gateway_requests_in_flight 2.0" in text, "both clients to be queued")
        busy = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "alpha", "messages": MESSAGES}, timeout=30)
        assert busy.status_code == 503 and busy.headers.get("retry-after"), busy.text
        assert busy.json()["error"]["code"] == "overloaded", busy.text
        for p in clients:  # both still queued: their clients leave now
            assert p.poll() is None, "a queued client was answered"
            p.terminate()
        assert [p.wait(timeout=30) for p in clients] == [-signal.SIGTERM] * 2
        left = 'memsvc_gateway_requests_total{code="499",endpoint="completions",model="beta"} 2.0'
        wait_for(scrape, lambda text: left in text, "the gateway to see both clients leave")
        assert "memsvc_gateway_requests_in_flight 0.0" in scrape()
        mp.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=held.lease.lease_id), timeout=10)
        time.sleep(2.0)  # eight of the queue's polls
        assert _state_of(mp, "beta") == common_pb.WORKER_STATE_ASLEEP, "beta was woken for clients that had left"
        assert _state_of(mp, "alpha") == common_pb.WORKER_STATE_AWAKE, "alpha was evicted for clients that had left"
        ok = httpx.post(f"{gw.url}/v1/completions", json={"model": "alpha", "prompt": [1], "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        gw.kill()
