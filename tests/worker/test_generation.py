"""Generation semantics against the reference (transformers): EOS and stop tokens, sampling, finish
reasons and counts, streaming, text and chat templates, and new weights in place from another
checkpoint directory.

Models and tokenizers are made here with transformers and the tokenizers library themselves (a tiny
random Llama, a byte-level BPE trained on a few sentences with multi-byte characters); nothing comes
from the network.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hf_models import save, text_model, tiny_llama
from workerproc import WorkerProcess

from memsvc.runtime.limits import MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc
from worker.model.sampling import SamplingParams, filter_logits

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 9, 3]


def reference_greedy(model: Any, prompt: list[int], n: int, eos: int | list[int] | None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    if eos is not None:  # transformers pads after the stop token; the generation ended at it
        stops = {eos} if isinstance(eos, int) else set(eos)
        for i, t in enumerate(tokens):
            if t in stops:
                return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


def gen(stub: worker_grpc.ModelWorkerServiceStub, **fields: Any) -> worker_pb.GenerateResponse:
    return stub.Generate(worker_pb.GenerateRequest(**fields), timeout=60)


def code_of(call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    raise AssertionError("the call succeeded")


# ---- EOS and stop tokens ----


def test_generation_stops_at_the_models_eos_as_transformers_does(model: Any, tmp_path: Path) -> None:
    free = reference_greedy(model, PROMPT, 24, None)
    assert len(set(free)) > 4, f"the reference greedy tokens do not vary: {free}"
    eos = free[6]  # a token greedy decoding reaches: both must stop at its first appearance
    ref = reference_greedy(model, PROMPT, 24, eos)
    assert ref[-1] == eos and len(ref) < 24
    with WorkerProcess(["--model", str(save(model, tmp_path / "m", eos=eos))]) as wp:
        r = gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=24)
        assert list(r.token_ids) == ref
        assert r.finish_reason == common_pb.FINISH_REASON_STOP
        assert (r.prompt_token_count, r.completion_token_count) == (len(PROMPT), len(ref))
        info = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.model
        assert list(info.eos_token_ids) == [eos] and info.context_length == 512
        ignored = gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=24, ignore_eos=True)
        assert list(ignored.token_ids) == free and ignored.finish_reason == common_pb.FINISH_REASON_LENGTH
        stop = free[3]
        stopped = gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop])
        assert list(stopped.token_ids) == reference_greedy(model, PROMPT, 24, stop)
        assert stopped.finish_reason == common_pb.FINISH_REASON_STOP


def test_generation_config_eos_wins_over_config_json_as_in_transformers(model: Any, tmp_path: Path) -> None:
    free = reference_greedy(model, PROMPT, 24, None)
    eos_list = [free[9], free[4]]
    path = save(model, tmp_path / "m", eos=free[1], generation_eos=eos_list)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    ref = ref_model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=24,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
    )[0, len(PROMPT) :].tolist()
    with WorkerProcess(["--model", str(path)]) as wp:
        r = gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=24)
        assert list(r.token_ids) == ref[: len(r.token_ids)] and r.token_ids[-1] in eos_list
        assert sorted(wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.model.eos_token_ids) == sorted(
            eos_list
        )


# ---- sampling ----


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.6),
        SamplingParams(temperature=2.0, top_k=1),
    ],
    ids=str,
)
def test_the_sampled_distribution_is_transformers_own(params: SamplingParams) -> None:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    gen_ = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(300, generator=gen_) * 4
        ours = filter_logits(logits, params).softmax(-1)
        ids, scores = torch.zeros(1, 1, dtype=torch.long), logits[None].clone()
        ref = warpers(ids, scores)[0].softmax(-1)  # type: ignore[arg-type]  # transformers types these as Long/FloatTensor
        assert torch.equal(ours > 0, ref > 0), "a different set of tokens survives"
        assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)


def test_a_tiny_temperature_samples_the_most_likely_token_without_nan() -> None:
    logits = torch.tensor([1e4, -3.0, 9.5e3, 2.0])
    for temperature in (1e-30, 1e-45, 1e-8):
        probs = filter_logits(logits, SamplingParams(temperature=temperature, top_p=0.9)).softmax(-1)
        assert torch.isfinite(probs).all(), probs
        assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sampling_is_reproducible_per_seed_and_greedy_without_temperature(model: Any, tmp_path: Path) -> None:
    with WorkerProcess(["--model", str(save(model, tmp_path / "m"))]) as wp:
        greedy = list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=16).token_ids)
        assert (
            list(
                gen(
                    wp.stub,
                    prompt_token_ids=PROMPT,
                    max_new_tokens=16,
                    sampling=worker_pb.SamplingParams(temperature=0),
                ).token_ids
            )
            == greedy
        )
        hot = worker_pb.SamplingParams(temperature=1.5, top_p=0.95, seed=1234)
        first = list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=16, sampling=hot).token_ids)
        assert list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=16, sampling=hot).token_ids) == first
        others = {
            tuple(
                gen(
                    wp.stub,
                    prompt_token_ids=PROMPT,
                    max_new_tokens=16,
                    sampling=worker_pb.SamplingParams(temperature=1.5, top_p=0.95, seed=s),
                ).token_ids
            )
            for s in range(5)
        }
        assert len(others) > 1 and first != greedy, "sampling at temperature 1.5 always gave the same tokens"
        top1 = worker_pb.SamplingParams(temperature=1.5, top_k=1, seed=9)
        assert list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=16, sampling=top1).token_ids) == greedy
        for bad in (
            worker_pb.SamplingParams(temperature=-1),
            worker_pb.SamplingParams(temperature=1, top_p=1.5),
            worker_pb.SamplingParams(temperature=1, top_k=-2),
            worker_pb.SamplingParams(temperature=math.inf),
        ):
            assert code_of(lambda b=bad: gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=2, sampling=b)) == (
                grpc.StatusCode.INVALID_ARGUMENT
            )


# ---- streaming ----


def stream(stub: worker_grpc.ModelWorkerServiceStub, **fields: Any) -> list[worker_pb.GenerateStreamResponse]:
    return list(
        stub.GenerateStream(worker_pb.GenerateStreamRequest(request=worker_pb.GenerateRequest(**fields)), timeout=60)
    )


def test_a_stream_sends_the_same_tokens_as_generate_and_ends_with_the_whole_answer(model: Any, tmp_path: Path) -> None:
    free = reference_greedy(model, PROMPT, 20, None)
    with WorkerProcess(["--model", str(save(model, tmp_path / "m", eos=free[12]))]) as wp:
        whole = gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=20)
        msgs = stream(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=20)
        assert [t for m in msgs[:-1] for t in m.token_ids] == list(whole.token_ids)
        # tokens reach the client as they are made: several per message only while the client's side
        # is slower than the steps, so a loaded machine may send 13 in one, but not 400
        long = stream(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=400, ignore_eos=True)
        assert len(long) > 2, "the tokens came in one message: nothing was streamed"
        assert msgs[-1].HasField("done") and not any(m.HasField("done") for m in msgs[:-1])
        done = msgs[-1].done
        assert (list(done.token_ids), done.finish_reason, done.completion_token_count) == (
            list(whole.token_ids),
            common_pb.FINISH_REASON_STOP,
            len(whole.token_ids),
        )


def test_a_stream_whose_client_leaves_stops_and_frees_its_blocks(tmp_path: Path) -> None:
    with WorkerProcess(["--model", "synthetic:small"]) as wp:
        base = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.kv_cache
        call = wp.stub.GenerateStream(
            worker_pb.GenerateStreamRequest(
                request=worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=2000)
            )
        )
        first = next(call)
        assert len(first.token_ids) >= 1
        call.cancel()
        import time

        deadline = time.monotonic() + 10
        while True:
            kv = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.kv_cache
            if kv.device_free_block_count == base.device_free_block_count or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (kv.device_free_block_count, kv.sequence_count) == (base.device_free_block_count, base.sequence_count)
        r = wp.stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=2), timeout=5)
        assert len(r.token_ids) == 2, "the cancelled stream still holds the device"


# ---- text ----


@pytest.fixture(scope="module")
def text_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, Any]]:
    path, reference = text_model(tmp_path_factory.mktemp("text"))
    with WorkerProcess(["--model", str(path)]) as wp:
        yield wp, reference


def test_a_text_prompt_is_encoded_and_the_answer_decoded_as_transformers_does(
    text_worker: tuple[WorkerProcess, Any],
) -> None:
    wp, ref = text_worker
    prompt = "héllo wörld, naïve 😀 日本語"
    by_text = gen(wp.stub, prompt=prompt, max_new_tokens=24, ignore_eos=True)
    ids = ref(prompt)["input_ids"]
    assert ids[0] == ref.bos_token_id
    assert by_text.prompt_token_count == len(ids)
    by_ids = gen(wp.stub, prompt_token_ids=ids, max_new_tokens=24, ignore_eos=True)
    assert list(by_text.token_ids) == list(by_ids.token_ids)
    assert by_text.text == ref.decode(list(by_text.token_ids), skip_special_tokens=True)
    info = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.model
    assert info.has_tokenizer and info.has_chat_template


def test_chat_messages_are_rendered_as_transformers_apply_chat_template(text_worker: tuple[WorkerProcess, Any]) -> None:
    wp, ref = text_worker
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 😀 wörld?"}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    chat = gen(wp.stub, messages=[worker_pb.ChatMessage(**m) for m in messages], max_new_tokens=8, ignore_eos=True)
    by_ids = gen(wp.stub, prompt_token_ids=list(expected), max_new_tokens=8, ignore_eos=True)
    assert chat.prompt_token_count == len(expected)
    assert list(chat.token_ids) == list(by_ids.token_ids)


def test_streamed_text_adds_up_to_the_whole_text(text_worker: tuple[WorkerProcess, Any]) -> None:
    """A random model emits arbitrary bytes, some never forming a character: the stream's pieces still
    add up to the whole text (U+FFFD where the bytes are invalid, exactly where the reference has it)."""
    wp, ref = text_worker
    for seed in range(4):
        sampling = worker_pb.SamplingParams(temperature=1.2, seed=seed)
        msgs = stream(wp.stub, prompt="日本語 😀", max_new_tokens=40, ignore_eos=True, sampling=sampling)
        done = msgs[-1].done
        assert "".join(m.text for m in msgs) == done.text == ref.decode(list(done.token_ids), skip_special_tokens=True)


def test_streamed_text_never_splits_a_character(tmp_path: Path) -> None:
    """Token by token through the worker's stream decoder, a text whose characters span several
    byte-level tokens: every piece is whole characters, and they add up to the text."""
    from worker.generate_messages import StreamedText
    from worker.model.text import ModelText

    path, _ = text_model(tmp_path)
    text = ModelText.load(path)
    assert text is not None
    sample = "naïve café 😀 🚀 日本語のテキスト 🎉"
    ids = text.tokenizer.encode(sample, add_special_tokens=False).ids
    split = [i for i in ids if "\ufffd" in text.tokenizer.decode([i])]
    assert split, "no token of the sample is part of a character: the test would prove nothing"
    streamed = StreamedText(text, frozenset())
    pieces = [streamed.push(i) for i in ids]
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) + streamed.finish(sample) == sample


def test_text_is_refused_by_a_model_without_a_tokenizer_and_bad_prompts_change_nothing(tmp_path: Path) -> None:
    """A checkpoint directory without tokenizer.json serves token ids only (synthetic models have text)."""
    path = save(tiny_llama(), tmp_path / "ids-only")
    with WorkerProcess(["--model", str(path)]) as wp:
        assert code_of(lambda: gen(wp.stub, prompt="hello", max_new_tokens=2)) == grpc.StatusCode.FAILED_PRECONDITION
        chat = [worker_pb.ChatMessage(role="user", content="hi")]
        assert code_of(lambda: gen(wp.stub, messages=chat, max_new_tokens=2)) == grpc.StatusCode.FAILED_PRECONDITION
        two = worker_pb.GenerateRequest(prompt_token_ids=[1], prompt="x", max_new_tokens=2)
        assert code_of(lambda: wp.stub.Generate(two, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        big = worker_pb.GenerateRequest(prompt="x" * ((1 << 20) + 1), max_new_tokens=2)
        assert code_of(lambda: wp.stub.Generate(big, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        stops = worker_pb.GenerateRequest(prompt_token_ids=[1], max_new_tokens=2, stop=["x"])
        assert code_of(lambda: wp.stub.Generate(stops, timeout=10)) == grpc.StatusCode.FAILED_PRECONDITION
        for bad in ([""], ["x"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_STRING_BYTES + 1)]):
            refused = worker_pb.GenerateRequest(prompt_token_ids=[1], max_new_tokens=2, stop=bad)
            assert code_of(functools.partial(wp.stub.Generate, refused, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.kv_cache.sequence_count == 0


def test_stop_strings_end_a_kept_sequence_at_the_token_that_completes_them(
    text_worker: tuple[WorkerProcess, Any],
) -> None:
    """The engine ends a request at the token whose text completes a stop string (not a step later):
    a kept sequence holds exactly the tokens returned, and its continuation is what the whole answer
    without the stop would have said next. The worker matched them with the decoding alone that its
    RPC front wrote (worker/model/text_source.py), never reading the whole tokenizer itself."""
    wp, ref = text_worker
    full = gen(wp.stub, prompt="the quick brown fox", max_new_tokens=40, ignore_eos=True)
    text = ref.decode(list(full.token_ids), skip_special_tokens=True)
    stop = text[6:9]
    count = next(k for k in range(1, 41) if stop in ref.decode(list(full.token_ids[:k]), skip_special_tokens=True))
    kept = gen(
        wp.stub, prompt="the quick brown fox", max_new_tokens=40, ignore_eos=True, stop=[stop], sequence_id="stopped"
    )
    try:
        assert list(kept.token_ids) == list(full.token_ids[:count]) and kept.matched_stop == stop
        assert kept.text == text[: text.find(stop)] and kept.finish_reason == common_pb.FINISH_REASON_STOP
        more = gen(wp.stub, sequence_id="stopped", max_new_tokens=3, ignore_eos=True)
        assert list(more.token_ids) == list(full.token_ids[count : count + 3])
        said = wp.stderr_text()
        assert "model text: its decoding read for stop strings" in said and "read whole" not in said, said[-4000:]
    finally:
        wp.stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="stopped"), timeout=10)


# ---- new weights in place ----


def test_reload_weights_from_another_checkpoint_serves_its_tokens_and_a_mismatch_changes_nothing(
    tmp_path: Path,
) -> None:
    a, b = tiny_llama(seed=11), tiny_llama(seed=12)
    path_a, path_b = save(a, tmp_path / "a"), save(b, tmp_path / "b")
    wrong_layers = save(tiny_llama(seed=13, num_hidden_layers=3), tmp_path / "three-layers")
    wrong_shape = save(tiny_llama(seed=14), tmp_path / "bad-tensor")
    from safetensors.torch import load_file, save_file

    tensors = load_file(wrong_shape / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, wrong_shape / "model.safetensors", metadata={"format": "pt"})
    ref_a, ref_b = reference_greedy(a, PROMPT, 12, None), reference_greedy(b, PROMPT, 12, None)
    assert ref_a != ref_b
    with WorkerProcess(["--model", str(path_a)]) as wp:
        assert list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=12).token_ids) == ref_a
        for bad in (wrong_layers, wrong_shape, tmp_path / "missing"):
            req = worker_pb.ReloadWeightsRequest(model_path=str(bad))
            code = code_of(lambda r=req: wp.stub.ReloadWeights(r, timeout=60))
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (bad, code)
            assert list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=12).token_ids) == ref_a, bad
        r = wp.stub.ReloadWeights(worker_pb.ReloadWeightsRequest(model_path=str(path_b)), timeout=60)
        assert r.status.state == common_pb.WORKER_STATE_AWAKE and r.status.model.source == str(path_b)
        assert list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=12).token_ids) == ref_b
        wp.stub.Sleep(
            worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_2), timeout=60
        )  # a level-2 wake reloads b, not a
        wp.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)
        assert list(gen(wp.stub, prompt_token_ids=PROMPT, max_new_tokens=12).token_ids) == ref_b


def test_synthetic_models_have_a_tokenizer_over_their_whole_vocabulary() -> None:
    """Each preset's made tokenizer: exactly the preset's vocabulary, any text round-trips (bytes
    first), every id decodes, and the chat template writes role lines and the assistant's turn."""
    from worker.model.config import PRESETS
    from worker.model.synthetic_text import synthetic_text

    sample = "Hello, wörld! the quick brown fox\n\t€ 🦊"
    for preset, config in PRESETS.items():
        text = synthetic_text(config.vocab_size)
        assert text is not None and text.vocab_size == config.vocab_size, preset
        assert text.decode(text.encode(sample)) == sample, preset
        assert all(isinstance(text.decode([i]), str) for i in range(0, config.vocab_size, 97))
        assert text.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_a_synthetic_model_takes_and_gives_text_chat_and_stop_strings() -> None:
    """The default model of ``memsvc up`` (synthetic:small): a text prompt and a chat are encoded with
    its made tokenizer, the answer has text, and a stop string cut from that text ends a second run
    there, the text up to it returned."""
    with WorkerProcess(["--model", "synthetic:small"]) as wp:
        info = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=60).status.model
        assert info.has_tokenizer and info.has_chat_template
        r = gen(wp.stub, prompt="the quick brown fox", max_new_tokens=24)
        assert r.text and len(r.token_ids) == 24
        chat = gen(wp.stub, messages=[worker_pb.ChatMessage(role="user", content="hi")], max_new_tokens=8)
        from worker.model.synthetic_text import synthetic_text

        made = synthetic_text(info.vocab_size)
        assert made is not None
        assert chat.text and chat.prompt_token_count == len(made.encode_chat([{"role": "user", "content": "hi"}]))
        stop = r.text[len(r.text) // 2 :][:3]
        cut = gen(wp.stub, prompt="the quick brown fox", max_new_tokens=24, stop=[stop])
        assert (
            cut.finish_reason == common_pb.FINISH_REASON_STOP and r.text.startswith(cut.text) and stop not in cut.text
        )
