"""The model layer on the host backend: config parsing, checkpoints into pool tensors, the paged KV
cache and swaps, and the proof points — identical greedy tokens across sleep levels and swaps, and
paged logits equal to a dense reference."""

from __future__ import annotations

import array
import copy
import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _util import busy_copy_stream
from model_helpers import dense_greedy, dense_logits
from safetensors.torch import save_file

from memsvc.errors import Cancelled, InvalidArgument, NotFound, WrongState
from worker.allocator import AllocatorConfig, MemoryAllocator
from worker.model import (
    PRESETS,
    CheckpointSource,
    ModelConfig,
    ModelRunner,
    SyntheticSource,
    allocate_weights,
    fill_synthetic,
    load_checkpoint,
    parse_model_spec,
    save_checkpoint,
)
from worker.model.decoder import Rope, forward, layer_kinds
from worker.model.generation import GenerationRequest
from worker.model.kv_cache import KvCache, Location, SwapDirection

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(
    params=[
        "host",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ]
)
def alloc(request: pytest.FixtureRequest) -> Iterator[MemoryAllocator]:
    """A fresh allocator per test: the host backend everywhere, cuda where a device is present."""
    a = MemoryAllocator(AllocatorConfig(backend=request.param, host_capacity_bytes=64 << 20, host_chunk_bytes=8 << 20))
    yield a
    a.close()


def tiny_runner(alloc: MemoryAllocator, source: Any = "synthetic:tiny", **kw: Any) -> ModelRunner:
    args: dict[str, Any] = {"num_device_blocks": 32, "num_host_blocks": 16, "block_size": 4} | kw
    return ModelRunner(alloc, source, **args)


def ptrs(runner: ModelRunner) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in runner.weights.items()} | {"kv": runner.kv_cache.device.tensor.data_ptr()}


def varied(tokens: list[int]) -> list[int]:
    """Guard against a degenerate model: a run that repeats one token would prove little."""
    assert len(set(tokens)) >= 4, tokens
    return tokens


# ---- config ----
LLAMA_32_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_config_parses_llama_qwen2_mistral_qwen3() -> None:
    llama = ModelConfig.from_hf(LLAMA_32_1B)
    assert llama == PRESETS["1b"]
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"

    qwen = ModelConfig.from_hf(QWEN25_05B)
    assert (qwen.family, qwen.head_dim, qwen.num_kv_heads, qwen.attention_bias) == ("qwen2", 64, 2, True)
    assert (qwen.tie_word_embeddings, qwen.rope_theta, qwen.rms_norm_eps, qwen.dtype) == (True, 1e6, 1e-6, "bfloat16")
    assert qwen.sliding_window is None  # use_sliding_window is false
    assert qwen.param_count() == 494_032_768  # Qwen2.5-0.5B

    mistral = ModelConfig.from_hf(MISTRAL_7B)
    assert (mistral.family, mistral.head_dim, mistral.sliding_window, mistral.attention_bias) == (
        "mistral",
        128,
        4096,
        False,
    )
    assert mistral.param_count() == 7_241_732_096  # Mistral-7B

    qwen3 = ModelConfig.from_hf(QWEN3_06B)
    assert (qwen3.family, qwen3.head_dim, qwen3.hidden_size // qwen3.num_heads, qwen3.attention_bias) == (
        "qwen3",
        128,
        64,
        False,
    )
    assert qwen3.qk_norm and not qwen3.o_proj_bias and qwen3.rope_theta == 1e6
    assert qwen3.param_count() == 596_049_920  # Qwen3-0.6B

    assert PRESETS["8b"].param_count() == 8_030_261_248  # Llama-3-8B
    assert PRESETS["8b"].param_bytes() == 16_060_522_496
    for preset in PRESETS.values():
        for legacy in (False, True):
            assert ModelConfig.from_hf(json.loads(json.dumps(preset.to_hf(legacy=legacy)))) == preset


def test_config_reads_transformers5_keys_like_the_legacy_ones() -> None:
    """transformers 5 moves the RoPE settings into rope_parameters and spells torch_dtype dtype: the same
    model in either spelling is the same config (theta and llama3 scaling included, not the 10000 default)."""
    tf5 = {k: v for k, v in LLAMA_32_1B.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    tf5["rope_parameters"] = dict(LLAMA_32_1B["rope_scaling"], rope_theta=500000.0)
    tf5["dtype"] = "bfloat16"
    assert ModelConfig.from_hf(tf5) == ModelConfig.from_hf(LLAMA_32_1B) == PRESETS["1b"]
    # a config's own save_pretrained writes model_type without architectures
    assert ModelConfig.from_hf({k: v for k, v in tf5.items() if k != "architectures"}) == PRESETS["1b"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architectures"),
        ({"architectures": None, "model_type": None}, "neither 'architectures' nor 'model_type'"),
        ({"model_type": "gemma2"}, "unsupported model_type 'gemma2'.*llama.*mistral.*qwen2.*qwen3"),
        ({"model_type": "qwen2"}, "name different families"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": "16"}, "num_hidden_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 5}, "multiple of 'num_key_value_heads'"),
    ],
)
def test_config_rejects_what_the_decoder_cannot_run(change: dict[str, Any], message: str) -> None:
    raw = {k: v for k, v in (LLAMA_32_1B | change).items() if v is not None}
    with pytest.raises(InvalidArgument, match=message):
        ModelConfig.from_hf(raw)


def test_model_spec(tmp_path: Path) -> None:
    assert isinstance(parse_model_spec("synthetic:small"), SyntheticSource)
    with pytest.raises(InvalidArgument, match="preset"):
        parse_model_spec("synthetic:huge")
    with pytest.raises(NotFound):
        parse_model_spec(str(tmp_path / "absent"))


# ---- weights and checkpoints ----
def test_weights_live_in_the_weights_pool(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    for t in runner.weights.values():
        assert alloc.lookup(t.data_ptr(), t.numel() * t.element_size())[1] == "weights"
    assert "lm_head.weight" in runner.weights
    assert sum(t.numel() for t in runner.weights.values()) == runner.config.param_count()
    info = runner.info()
    assert (info["source"], info["family"], info["weights_bytes"]) == ("synthetic:tiny", "llama", 558_336)
    assert info["kv_cache"]["block_bytes"] == runner.kv_cache.block_bytes


def test_checkpoint_roundtrip_in_place(alloc: MemoryAllocator, tmp_path: Path) -> None:
    config = PRESETS["tiny"]
    src = allocate_weights(config, alloc)
    fill_synthetic(src, config, seed=1)
    save_checkpoint(tmp_path, src, config)

    dst = allocate_weights(config, alloc)
    for t in dst.values():
        t.zero_()
    before = {name: t.data_ptr() for name, t in dst.items()}
    load_checkpoint(tmp_path, dst, config)
    assert {name: t.data_ptr() for name, t in dst.items()} == before
    for name, t in src.items():
        assert torch.equal(dst[name], t), name
    assert CheckpointSource(tmp_path).config == config


def test_sharded_checkpoint_loads(alloc: MemoryAllocator, tmp_path: Path) -> None:
    config = PRESETS["tiny"]
    src = allocate_weights(config, alloc)
    fill_synthetic(src, config, seed=2)
    names = list(src)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in shards.items():
        save_file({n: src[n].clone() for n in part}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = allocate_weights(config, alloc)
    load_checkpoint(tmp_path, dst, config)
    assert all(torch.equal(dst[n], src[n]) for n in names)


def test_bad_checkpoint_names_the_tensor_and_changes_nothing(alloc: MemoryAllocator, tmp_path: Path) -> None:
    config = PRESETS["tiny"]
    src = allocate_weights(config, alloc)
    fill_synthetic(src, config, seed=3)
    tensors = {n: t.clone() for n, t in src.items()}
    dst = allocate_weights(config, alloc)
    for t in dst.values():
        t.fill_(7.0)

    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidArgument, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path, dst, config)

    wrong = dict(tensors)
    wrong["model.norm.weight"] = torch.ones(config.hidden_size + 1)
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidArgument, match=r"'model\.norm\.weight' has shape"):
        load_checkpoint(tmp_path, dst, config)
    assert all(bool((t == 7.0).all()) for t in dst.values())

    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidArgument, match="model.safetensors"):
        load_checkpoint(tmp_path, dst, config)


def test_qwen2_checkpoint_with_biases_loads_and_generates(alloc: MemoryAllocator, tmp_path: Path) -> None:
    config = dataclasses.replace(PRESETS["tiny"], family="qwen2", attention_bias=True)
    weights = allocate_weights(config, alloc)
    fill_synthetic(weights, config, seed=4)
    assert weights["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0
    save_checkpoint(tmp_path, weights, config)

    runner = tiny_runner(alloc, str(tmp_path))
    assert runner.config == config
    tokens = varied(runner.generate(PROMPT, 10))
    assert tokens == dense_greedy(weights, config, PROMPT, 10)
    no_bias = {n: torch.zeros_like(t) if n.endswith("bias") else t for n, t in weights.items()}
    # the biases are really applied: dropping them moves the logits (greedy tokens may not change)
    with_b, without_b = dense_logits(weights, config, PROMPT), dense_logits(no_bias, config, PROMPT)
    assert (with_b - without_b).abs().max().item() > 1e-3


# ---- decoder against the dense reference ----
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"family": "mistral", "sliding_window": 6},
        {"family": "qwen2", "attention_bias": True, "tie_word_embeddings": True},
    ],
    ids=["llama", "mistral-window", "qwen2-tied"],
)
def test_paged_decoder_matches_dense_reference(alloc: MemoryAllocator, variant: dict[str, Any]) -> None:
    config = dataclasses.replace(PRESETS["tiny"], **variant)
    weights = allocate_weights(config, alloc)
    fill_synthetic(weights, config, seed=5)
    kv = KvCache(config, alloc, num_device_blocks=24, num_host_blocks=0, block_size=3)
    for i in range(4):  # fragment the free list so the sequence's blocks are scattered
        kv.allocate_sequence(f"filler{i}")
        kv.ensure_capacity(f"filler{i}", 3 * (i + 1))
    kv.free_sequence("filler1")
    kv.free_sequence("filler3")
    tokens = [11, 400, 3, 77, 250, 9, 9, 131, 500, 42, 1, 0, 317, 64]
    kv.allocate_sequence("s")
    kv.ensure_capacity("s", len(tokens))
    blocks = kv.sequence("s").block_ids
    assert blocks != sorted(blocks) or blocks[-1] - blocks[0] != len(blocks) - 1  # not one contiguous run

    rope = Rope.build(config, alloc.torch_device)
    chunks = [(0, 5), (5, 6), (6, 7), (7, 11), (11, 12), (12, 14)]  # prefill, decode steps, a chunk
    paged = torch.cat(
        [forward(weights, config, rope, kv.device.tensor, blocks, tokens[a:b], a, all_logits=True) for a, b in chunks]
    )
    reference = dense_logits(weights, config, tokens)
    torch.testing.assert_close(paged.cpu().double(), reference, atol=1e-5, rtol=1e-4)
    last = forward(weights, config, rope, kv.device.tensor, blocks, tokens[13:], 13)
    torch.testing.assert_close(last.cpu().double(), reference[-1], atol=1e-5, rtol=1e-4)


def test_greedy_generation_matches_reference_and_is_deterministic(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    tokens = varied(runner.generate(PROMPT, 12))
    assert tokens == dense_greedy(runner.weights, runner.config, PROMPT, 12)
    assert runner.generate(PROMPT, 12) == tokens
    assert tiny_runner(alloc, SyntheticSource("tiny", seed=0)).generate(PROMPT, 12) == tokens
    assert tiny_runner(alloc, SyntheticSource("tiny", seed=1)).generate(PROMPT, 12) != tokens
    assert runner.kv_cache.stats()["sequences"] == 0
    assert runner.kv_cache.stats()["device_free_blocks"] == 32


def test_continuing_a_sequence_equals_one_call(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    whole = varied(runner.generate(PROMPT, 10, "a"))
    assert runner.generate(PROMPT, 5, "b") + runner.generate([], 5, "b") == whole
    assert runner.generate(PROMPT, 0, "c") == []
    assert runner.generate([], 10, "c") == whole
    # extra prompt tokens on a continuation are fed before generating
    more = runner.generate([1, 2], 4, "b")
    assert more == dense_greedy(runner.weights, runner.config, PROMPT + whole + [1, 2], 4)
    runner.free_sequence("a")
    with pytest.raises(NotFound):
        runner.free_sequence("a")


def test_a_kept_prompt_without_new_tokens_holds_its_blocks_at_once(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)  # block_size 4
    assert runner.generate(PROMPT, 0, "a") == []
    assert len(runner.kv_cache.sequence("a").block_ids) == -(-len(PROMPT) // 4)
    free = runner.kv_cache.stats()["device_free_blocks"]
    assert runner.generate([], 3, "a") == dense_greedy(runner.weights, runner.config, PROMPT, 3)
    assert runner.kv_cache.stats()["device_free_blocks"] == free  # 5 + 2 positions fit the 2 blocks held


def test_a_caller_leaving_during_the_last_step_keeps_nothing(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    runner.generate(PROMPT, 2, "a")
    seq = runner.kv_cache.sequence("a")
    before = (list(seq.tokens), seq.num_cached, list(seq.block_ids))
    left = False

    def made(token: int) -> None:
        nonlocal left
        left = True  # the caller goes while the one and only step runs

    with pytest.raises(Cancelled):
        runner.run(GenerationRequest([], 1, "a"), lambda: left, made)
    assert (list(seq.tokens), seq.num_cached, list(seq.block_ids)) == before


def test_generate_rejects_bad_input_and_changes_nothing(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc, num_device_blocks=4)  # 16 positions
    runner.generate(PROMPT, 2, "s")
    before = (runner.kv_cache.stats(), copy.deepcopy(runner.kv_cache.sequence("s")))
    vocab = runner.config.vocab_size
    cases: list[tuple[Any, Any, str | None, type[Exception]]] = [
        ([vocab], 1, None, InvalidArgument),
        ([-1], 1, None, InvalidArgument),
        ([True], 1, None, InvalidArgument),
        ("abc", 1, None, InvalidArgument),
        ([], 3, None, InvalidArgument),
        ([], 3, "new", NotFound),  # no prompt: a continuation of a sequence that is not there
        ([1], -1, None, InvalidArgument),
        ([1], 1.5, None, InvalidArgument),
        ([1], runner.max_new_tokens_limit + 1, None, InvalidArgument),
        ([1], 1, "", InvalidArgument),
        ([1] * 1000, 1049, None, InvalidArgument),  # past max_position_embeddings (2048)
        ([1], 20, None, InvalidArgument),  # past the whole KV pool
        ([], 12, "s", InvalidArgument),  # the kept sequence would outgrow the pool
    ]
    for prompt, n, seq, error in cases:
        with pytest.raises(error):
            runner.generate(prompt, n, seq)
        assert (runner.kv_cache.stats(), runner.kv_cache.sequence("s")) == before, (prompt, n, seq)
    assert "new" not in runner.kv_cache.sequences


# ---- sleep and wake ----
def test_level1_sleep_wake_same_tokens(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    before = varied(runner.generate(PROMPT, 16))
    runner.generate(PROMPT, 3, "kept")
    addresses = ptrs(runner)

    alloc.sleep({"weights": "offload", "kv_cache": "discard"})
    with pytest.raises(WrongState, match="asleep"):
        runner.generate(PROMPT, 1)
    alloc.wake_up()
    assert runner.drop_kv() == ["kept"]
    assert runner.kv_cache.stats()["device_free_blocks"] == 32
    assert ptrs(runner) == addresses
    assert runner.generate(PROMPT, 16) == before


def test_level2_reload_from_checkpoint_same_tokens(alloc: MemoryAllocator, tmp_path: Path) -> None:
    config = PRESETS["tiny"]
    weights = allocate_weights(config, alloc)
    fill_synthetic(weights, config, seed=6)
    save_checkpoint(tmp_path / "ckpt", weights, config)
    del weights

    runner = tiny_runner(alloc, CheckpointSource(tmp_path / "ckpt"))
    before = varied(runner.generate(PROMPT, 16))
    addresses = ptrs(runner)

    alloc.sleep({"weights": "discard", "kv_cache": "discard"})
    alloc.wake_up(["weights"])  # partial wake: weights first, as an RL loop would
    runner.reload_weights()
    with pytest.raises(WrongState, match="kv_cache"):
        runner.generate(PROMPT, 1)
    alloc.wake_up(["kv_cache"])
    runner.drop_kv()
    assert ptrs(runner) == addresses
    assert runner.generate(PROMPT, 16) == before


def test_reload_weights_needs_awake_weights(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    alloc.sleep({"weights": "discard"})
    with pytest.raises(WrongState):
        runner.reload_weights()
    alloc.wake_up()
    runner.reload_weights()  # synthetic sources regenerate the same weights
    assert runner.generate(PROMPT, 8) == dense_greedy(runner.weights, runner.config, PROMPT, 8)


# ---- swap ----
def test_swap_out_and_into_other_slots_continues_identically(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    kv = runner.kv_cache
    whole = varied(runner.generate(PROMPT, 14))

    part = runner.generate(PROMPT, 6, "s")  # 10 positions cached: 3 blocks of 4
    seq = kv.sequence("s")
    old_device = list(seq.block_ids)
    host_dst = [9, 3, 12]
    moved = runner.swap("out", list(zip(old_device, host_dst, strict=True)))
    assert moved == 3 * kv.block_bytes
    assert (seq.block_ids, seq.location) == (host_dst, "host")
    with pytest.raises(WrongState, match="swapped out"):
        runner.generate([], 1, "s")

    runner.generate([300, 301, 302], 9, "other")  # reuses and overwrites the freed device blocks
    assert set(old_device) <= set(kv.sequence("other").block_ids)
    free = sorted(set(range(kv.device.num_blocks)) - set(kv.sequence("other").block_ids))
    device_dst = [free[-1], free[-5], free[-3]]
    assert not set(device_dst) & set(old_device)
    assert runner.swap("in", list(zip(host_dst, device_dst, strict=True))) == 3 * kv.block_bytes
    assert (seq.block_ids, seq.location) == (device_dst, "device")
    assert kv.stats()["host_free_blocks"] == 16

    assert part + runner.generate([], 8, "s") == whole


def test_swaps_begun_without_waiting_chain_and_generation_waits_for_them(alloc: MemoryAllocator) -> None:
    """begin_swap moves ownership at once and leaves the copy running: a sequence swapped out, in to
    other device blocks, out and in again (each swap reading what the one before wrote), with no wait
    between them, then continued by generate at once, decodes exactly like a sequence never moved.
    Generation waits for every swap begun before it: on cuda they all queue behind a 512 MiB copy."""
    runner = tiny_runner(alloc)
    kv = runner.kv_cache
    whole = varied(runner.generate(PROMPT, 14))
    part = runner.generate(PROMPT, 6, "s")
    seq = kv.sequence("s")
    pending = []
    busy = busy_copy_stream(alloc)  # on cuda the swaps below are still queued when generate starts
    for host_dst, device_dst in (([9, 3, 12], [30, 20, 25]), ([0, 15, 7], [1, 31, 17])):
        pending.append(runner.begin_swap("out", np.asarray(seq.block_ids), np.asarray(host_dst)))
        assert (seq.block_ids, seq.location) == (host_dst, "host")  # before any copy is waited for
        pending.append(runner.begin_swap("in", np.asarray(host_dst), np.asarray(device_dst)))
        assert (seq.block_ids, seq.location) == (device_dst, "device")
    assert [p.moved_bytes for p in pending] == [3 * kv.block_bytes] * 4
    assert part + runner.generate([], 8, "s") == whole
    for p in pending:
        p.wait()
    del busy


def test_swap_whole_sequence_survives_kv_discard(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    whole = varied(runner.generate(PROMPT, 12))
    part = runner.generate(PROMPT, 4, "parked")
    runner.generate([1, 2, 3], 4, "live")
    parked = runner.kv_cache.sequence("parked").block_ids
    runner.swap("out", [(b, i) for i, b in enumerate(parked)])

    alloc.sleep({"weights": "offload", "kv_cache": "discard"})
    alloc.wake_up()
    assert runner.drop_kv() == ["live"]
    runner.swap("in", [(i, 20 + i) for i in range(len(parked))])
    assert part + runner.generate([], 8, "parked") == whole


def test_partial_swap_makes_a_sequence_mixed(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    runner.generate(PROMPT, 6, "s")
    seq = runner.kv_cache.sequence("s")
    first = seq.block_ids[0]
    runner.swap("out", [(first, 0)])
    assert seq.location == "mixed" and seq.block_locations[0] == "host"
    with pytest.raises(WrongState):
        runner.generate([], 1, "s")
    runner.swap("in", [(0, first)])
    assert runner.kv_cache.sequence("s").location == "device"
    runner.free_sequence("s")
    assert runner.kv_cache.stats()["device_free_blocks"] == 32 and runner.kv_cache.stats()["host_free_blocks"] == 16


def test_swap_free_blocks_is_a_plain_copy(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    kv = runner.kv_cache
    kv.device.tensor[7].fill_(1.25)
    assert runner.swap("out", [(7, 2)]) == kv.block_bytes
    assert bool((kv.host.tensor[2] == 1.25).all())
    assert kv.stats()["device_free_blocks"] == 32 and kv.stats()["host_free_blocks"] == 16
    assert runner.swap("out", []) == 0


def test_swap_validation_changes_nothing(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    kv = runner.kv_cache
    runner.generate(PROMPT, 6, "a")  # device blocks 0, 1, 2
    runner.generate(PROMPT, 6, "b")  # device blocks 3, 4, 5
    runner.swap("out", [(3, 0), (4, 1), (5, 2)])  # b on host blocks 0, 1, 2

    def snapshot() -> tuple[Any, ...]:
        seqs = {k: copy.deepcopy(s) for k, s in kv.sequences.items()}
        return kv.stats(), seqs, kv.device.tensor.clone(), kv.host.tensor.clone()

    before = snapshot()
    bad: list[tuple[str, Any, str]] = [
        ("out", [(0, 1)], "in use by sequence 'b'"),
        ("in", [(0, 1)], "in use by sequence 'a'"),
        ("out", [(0, 5), (0, 6)], "source twice"),
        ("out", [(0, 5), (1, 5)], "destination twice"),
        ("out", [(32, 5)], "out of range"),
        ("out", [(0, 16)], "out of range"),
        ("in", [(-1, 10)], "out of range"),
        ("in", [(0, 10), (1, 10)], "destination twice"),
        ("out", [(0, 5), (1, 6), (2, 0)], "in use"),  # valid pairs first: still nothing moves
        ("out", [(0, True)], "integer"),
        ("out", [(0,)], "expected"),
        ("sideways", [(0, 5)], "direction"),
    ]
    for direction, pairs, message in bad:
        with pytest.raises(InvalidArgument, match=message):
            runner.swap(direction, pairs)  # type: ignore[arg-type]
        after = snapshot()
        assert after[:2] == before[:2], (direction, pairs)
        assert torch.equal(after[2], before[2]) and torch.equal(after[3], before[3]), (direction, pairs)
    with pytest.raises(InvalidArgument, match="method"):
        runner.swap("out", [(0, 5)], method="teleport")
    assert snapshot()[:2] == before[:2]


def test_swap_ids_takes_arrays_and_refuses_malformed_ids(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    kv = runner.kv_cache
    runner.generate(PROMPT, 6, "a")  # device blocks 0, 1, 2
    assert kv.swap_ids("out", np.array([0, 1]), array.array("q", [4, 5])) == 2 * kv.block_bytes
    assert kv.sequence("a").block_locations == ["host", "host", "device"]
    assert kv.swap_ids("in", torch.tensor([4, 5]), [9, 8]) == 2 * kv.block_bytes
    assert kv.sequence("a").block_ids == [9, 8, 2] and kv.sequence("a").location == "device"
    assert kv.swap_ids("out", [], np.zeros(0, np.int32)) == 0
    before = (kv.stats(), copy.deepcopy(kv.sequence("a")))
    for src, dst, message in [
        ([9, 8], [1], "2 source blocks but 1"),
        ([[9, 8]], [[1, 2]], "flat sequence"),
        ([9.0], [1], "integers"),
        (np.array([True]), [1], "integers"),
        (["9"], [1], "integers"),
        ([9, None], [1, 2], "integers"),
        ([2**64], [1], "integers"),
        (np.array([2**63], np.uint64), [1], "out of range"),
        ("98", "12", "integers"),
        ([True, 9], [1, 2], "booleans"),
        (np.array([2**63 + 5], np.uint64), [1], "out of range"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            kv.swap_ids("out", src, dst)
        assert (kv.stats(), kv.sequence("a")) == before, (src, dst)


def test_a_freed_sequence_object_does_not_see_reused_slots(alloc: MemoryAllocator) -> None:
    kv = tiny_runner(alloc).kv_cache
    a = kv.allocate_sequence("a")
    kv.ensure_capacity("a", 2 * kv.block_size)
    kv.free_sequence("a")
    kv.allocate_sequence("b")
    kv.ensure_capacity("b", 2 * kv.block_size)  # takes a's table slots again
    kv.swap_ids("out", [kv.sequence("b").block_ids[0]], [3])
    assert (a.block_ids, a.location) == ([], "device")
    kv.drop_all()
    assert kv.sequences == {} and a.block_ids == []


def test_native_kv_table_refuses_bad_buffers_and_indices() -> None:
    """kv_check / kv_move (native/kvtable.c) index raw memory: a wrong dtype, layout or index must be
    an InvalidArgument that changes nothing, never a write out of bounds."""
    from worker import _native

    owner = np.full(8, -1, np.int64)
    owner_src = np.array([0, -1, 1, -1], np.int64)
    block, host = np.array([0, 2], np.int64), np.zeros(2, np.bool_)
    ids = np.array([0, 2], np.int64)
    assert _native.kv_check(ids, ids, 4, 8, owner) == (_native.KV_OK, 0)
    assert _native.kv_check(ids, np.array([1, 1]), 4, 8, owner) == (_native.KV_DST_TWICE, 1)
    assert _native.kv_check(ids, np.array([1, 8]), 4, 8, owner) == (_native.KV_DST_RANGE, 1)
    for bad in (ids.astype(np.float64), ids.astype(np.int32), np.arange(4, dtype=np.int64)[::2], [0, 2]):
        with pytest.raises(InvalidArgument):
            _native.kv_check(bad, ids, 4, 8, owner)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        _native.kv_check(ids, ids, 4, 9, owner)  # the owner array is shorter than the pool
    before = (owner.copy(), owner_src.copy(), block.copy(), host.copy())
    for bad_src, bad_dst in (([0, 4], [1, 2]), ([0, 2], [1, 8]), ([-1, 2], [1, 2])):
        with pytest.raises(InvalidArgument):
            _native.kv_move(np.array(bad_src), np.array(bad_dst), owner_src, owner, block, host, True)
        assert all(np.array_equal(x, y) for x, y in zip((owner, owner_src, block, host), before, strict=True))
    with pytest.raises(InvalidArgument):  # slot_host of the wrong item kind
        _native.kv_move(ids, ids, owner_src, np.full(8, -1, np.int64)[:], block, host.astype(np.float32), True)
    assert _native.kv_move(ids, np.array([5, 6]), owner_src, owner, block, host, True) == 2  # owned blocks moved
    assert owner_src.tolist() == [-1, -1, -1, -1] and owner[5] == 0 and owner[6] == 1
    assert block.tolist() == [5, 6] and host.tolist() == [True, True]
    # From 1024 ids both passes run without the GIL: same results, and the first bad index still found.
    n = 4096
    owner_src, owner = np.where(np.arange(n) % 3 == 0, np.arange(n) // 3, -1), np.full(n, -1, np.int64)
    block, host = np.arange(0, n, 3, dtype=np.int64), np.ones((n + 2) // 3, np.bool_)
    src, dst = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)[::-1].copy()
    dst_bad = dst.copy()
    dst_bad[3000] = dst_bad[10]
    assert _native.kv_check(src, dst_bad, n, n, owner) == (_native.KV_DST_TWICE, 3000)
    assert _native.kv_check(src, dst, n, n, owner) == (_native.KV_OK, 0)
    assert _native.kv_move(src, dst, owner_src, owner, block, host, False) == len(block)
    assert (owner_src == -1).all() and owner[n - 1 - 3 * np.arange(len(block))].tolist() == list(range(len(block)))
    assert block.tolist() == (n - 1 - 3 * np.arange(len(block))).tolist() and not host.any()


def test_swap_bookkeeping_matches_a_reference_model(alloc: MemoryAllocator) -> None:
    """Random swaps, valid and not, several sequences and free blocks mixed in one call: the vectorised
    ownership arrays must agree with a plain per-block model, and the bytes must move with them."""
    runner = tiny_runner(alloc, num_device_blocks=24, num_host_blocks=20)
    kv = runner.kv_cache
    rng = random.Random(11)
    for name in "abcd":
        kv.allocate_sequence(name)
        kv.ensure_capacity(name, rng.randint(1, 4) * kv.block_size)
    ref = {n: list(zip(kv.sequence(n).block_locations, kv.sequence(n).block_ids, strict=True)) for n in "abcd"}
    pools = {"device": kv.device, "host": kv.host}
    for step in range(300):
        direction: SwapDirection = rng.choice(["out", "in"])
        src_loc: Location
        dst_loc: Location
        src_loc, dst_loc = ("device", "host") if direction == "out" else ("host", "device")
        k = rng.randint(1, 6)
        src = [rng.randrange(pools[src_loc].num_blocks) for _ in range(k)]
        dst = [rng.randrange(pools[dst_loc].num_blocks) for _ in range(k)]
        owned = {(loc, b): (n, i) for n, table in ref.items() for i, (loc, b) in enumerate(table)}
        valid = len(set(src)) == k and len(set(dst)) == k and not any((dst_loc, d) in owned for d in dst)
        marks = [float((step * 7 + j) % 200) for j in range(k)]
        if valid:
            for b, v in zip(src, marks, strict=True):
                pools[src_loc].tensor[b].fill_(v)
            assert kv.swap_ids(direction, np.array(src), dst) == k * kv.block_bytes
            for s_, d, v in zip(src, dst, marks, strict=True):
                assert bool((pools[dst_loc].tensor[d] == v).all()), (step, s_, d)
                if (src_loc, s_) in owned:
                    n, i = owned[(src_loc, s_)]
                    ref[n][i] = (dst_loc, d)
        else:
            with pytest.raises(InvalidArgument):
                kv.swap_ids(direction, src, dst)
        for n, table in ref.items():
            seq = kv.sequence(n)
            assert list(zip(seq.block_locations, seq.block_ids, strict=True)) == table, (step, n)
        held = {loc: sum(1 for t in ref.values() for loc2, _ in t if loc2 == loc) for loc in pools}
        stats = kv.stats()
        assert stats["device_free_blocks"] == kv.device.num_blocks - held["device"]
        assert stats["host_free_blocks"] == kv.host.num_blocks - held["host"]
    for n in "abcd":  # every block comes back
        kv.free_sequence(n)
    assert kv.stats()["device_free_blocks"] == kv.device.num_blocks and kv.stats()["host_free_blocks"] == 20


def test_swap_while_kv_asleep_is_refused(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    runner.generate(PROMPT, 2, "s")
    alloc.sleep({"kv_cache": "offload"})
    with pytest.raises(WrongState):
        runner.swap("out", [(0, 0)])
    alloc.wake_up()
    assert runner.kv_cache.sequence("s").location == "device"


def test_kv_blocks_are_contiguous_byte_ranges(alloc: MemoryAllocator) -> None:
    runner = tiny_runner(alloc)
    c, kv = runner.config, runner.kv_cache
    assert kv.block_bytes == c.num_layers * 2 * 4 * c.num_kv_heads * c.head_dim * 4 == 4 * c.kv_bytes_per_token()
    base = kv.device.tensor.data_ptr()
    assert kv.device.tensor[5].data_ptr() == base + 5 * kv.block_bytes
    assert kv.device.tensor[5].is_contiguous()
    assert alloc.lookup(base, 32 * kv.block_bytes)[1] == "kv_cache"
    assert kv.host.tensor.shape == kv.device.tensor.shape[:0] + (16,) + kv.device.tensor.shape[1:]


def test_a_warm_up_step_runs_one_layer_of_each_kind_and_the_last() -> None:
    assert layer_kinds(PRESETS["8b"]) == (0, 31)
    tiny = PRESETS["tiny"]
    n = tiny.num_layers
    assert layer_kinds(tiny) == ((0, n - 1) if n > 1 else (0,))
    moe = dataclasses.replace(tiny, family="qwen3_moe", num_experts=4, experts_per_token=2, moe_intermediate_size=32)
    assert layer_kinds(dataclasses.replace(moe, num_layers=4, dense_layers=(2,))) == (0, 2, 3)
    types = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention")
    gemma = dataclasses.replace(
        tiny, family="gemma3", num_layers=5, layer_types=types, local_rope_theta=1e4, sliding_window=4
    )
    assert layer_kinds(gemma) == (0, 2, 4)
