"""The config.json key table (worker/model/config.py's CONFIG_KEYS), key by key, and its coverage of
what transformers writes.

Two directions. The walk: every entry does what it says — an ignored key changes nothing whatever
its value, a neutral key is accepted at each neutral value and refused (by name) at its ``refused``
example, and a read key changes the parsed config (each read key needs a case in ``READ_CASES``, so
a new read key cannot arrive untested). The coverage: every key that transformers 5.17 itself writes
or defines for the supported config classes (their dataclass fields, ``to_dict()``, a model's
``save_pretrained``, every ``RopeParameters`` key) has an entry, so when a future transformers adds a
key that changes the numbers, this test fails instead of the worker serving the old numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers.modeling_rope_utils import RopeParameters

from memsvc.errors import InvalidArgument
from worker.model.config import (
    CONFIG_KEYS,
    FAMILIES,
    FAMILY_DEFAULTS,
    GEMMA3_THETA,
    LAYER_TYPES,
    MODEL_TYPES,
    ROPE_PREFIX,
    Family,
    Fp8,
    KeyRule,
    ModelConfig,
    RopeScaling,
    fp8_config,
    key_rule,
)

CONFIG_CLASSES: dict[Family, Any] = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "phi3": transformers.Phi3Config,
    "gemma3": transformers.Gemma3TextConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
}
MODEL_CLASSES: dict[Family, Any] = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
}
DIMS = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.5, 2.0],
    "long_factor": [2.0, 4.0, 8.0],
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 32,
}
"""Phi-3's LongRoPE over 6 of head_dim 8's dimensions."""


MOE: dict[str, Any] = {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 16}
"""The MoE families' experts in :func:`base` (Mixtral's are intermediate_size wide whatever it says)."""


def base(family: Family) -> dict[str, Any]:
    """A small config.json of ``family`` as transformers 5 writes it (llama with llama3 RoPE, phi3 with
    LongRoPE and gemma3's full layers with linear RoPE, so the RoPE sub-keys have something to act on)."""
    gemma = family == "gemma3"
    hf = ModelConfig(
        family=family,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        attention_bias=family == "qwen2",
        sliding_window=16 if family in ("mistral", "gemma3") else None,
        layer_types=("sliding_attention", "full_attention") if gemma else None,
        local_rope_theta=10000.0 if gemma else None,
        query_pre_attn_scalar=8.0 if gemma else None,
        rope_scaling=RopeScaling("linear", 4.0) if gemma else None,
        rope_theta=1e6 if gemma else 10000.0,
        **(MOE if family in ("qwen3_moe", "mixtral") else {}),
    ).to_hf()
    if family == "mixtral":
        hf["sliding_window"] = 16
    if family == "llama":
        hf["rope_parameters"] = dict(LLAMA3)
    if family == "phi3":
        hf["rope_parameters"] = dict(LONGROPE)
        hf["original_max_position_embeddings"] = LONGROPE["original_max_position_embeddings"]
    return hf


def parse(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_hf(json.loads(json.dumps(hf)))


def rope_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict the ``rope_parameters.`` keys go in: Gemma 3's full layers' (it has one per layer type)."""
    rope: dict[str, Any] = hf["rope_parameters"]
    part: dict[str, Any] = rope.get("full_attention", rope)
    return part


def with_key(hf: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``hf`` with ``key`` set; a ``rope_parameters.`` key goes inside the RoPE dict."""
    out: dict[str, Any] = json.loads(json.dumps(hf))
    if key.startswith(ROPE_PREFIX):
        rope_dict(out)[key.removeprefix(ROPE_PREFIX)] = value
    else:
        out[key] = value
    return out


def rules() -> list[tuple[str, Family, KeyRule]]:
    found = []
    for key in CONFIG_KEYS:
        for family in FAMILIES:
            rule = key_rule(key, family)
            assert rule is not None
            found.append((key, family, rule))
    return found


def rule_id(item: tuple[str, Family, KeyRule]) -> str:
    return f"{item[0]}-{item[1]}"


# ---- the walk ----
@pytest.mark.parametrize("item", [r for r in rules() if r[2].handling == "ignored"], ids=rule_id)
def test_ignored_key_changes_nothing(item: tuple[str, Family, KeyRule]) -> None:
    key, family, _ = item
    hf = base(family)
    expected = parse({k: v for k, v in hf.items() if k != key})
    for value in ("anything", 12345, 0.5, None, True, {"a": 1}, [1, 2]):
        assert parse(with_key(hf, key, value)) == expected, (key, value)


@pytest.mark.parametrize("item", [r for r in rules() if r[2].handling == "neutral"], ids=rule_id)
def test_neutral_key_is_accepted_only_at_its_neutral_values(item: tuple[str, Family, KeyRule]) -> None:
    key, family, rule = item
    hf = base(family)
    expected = parse({k: v for k, v in hf.items() if k != key})
    values = [["full_attention"] * 2, None] if callable(rule.neutral) else list(rule.neutral)
    for value in values:
        assert rule.accepts(value)
        assert parse(with_key(hf, key, value)) == expected, (key, value)
    assert not rule.accepts(rule.refused)
    with pytest.raises(InvalidArgument, match=key.removeprefix(ROPE_PREFIX)) as ei:
        parse(with_key(hf, key, rule.refused))
    assert rule.why in str(ei.value)
    assert ei.value.metadata["key"] == key


def _bias(c: ModelConfig) -> bool:
    return c.attention_bias and c.o_proj_bias


def _no_key(*keys: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda hf: {k: v for k, v in hf.items() if k not in keys}


ReadCase = tuple[Family, dict[str, Any], Callable[[ModelConfig], bool] | str]
"""(family, changes — a value None removes the key; a ``rope_parameters.`` key goes inside the RoPE dict —,
a predicate on the parsed config or, for a refusal, a regex of its message)."""
REMOVE = object()

R = ROPE_PREFIX


def scaling(**expected: Any) -> Callable[[ModelConfig], bool]:
    """The parsed RoPE scaling has these fields."""
    return lambda c: c.rope_scaling is not None and all(getattr(c.rope_scaling, k) == v for k, v in expected.items())


def sliding_layers(c: ModelConfig) -> list[int]:
    return [i for i in range(c.num_layers) if c.layer_window(i) is not None]


WINDOW = {"use_sliding_window": True, "sliding_window": 8}

READ_CASES: dict[str, list[ReadCase]] = {
    "architectures": [
        ("llama", {"architectures": ["MistralForCausalLM"], "model_type": REMOVE}, lambda c: c.family == "mistral"),
    ],
    "model_type": [("llama", {"architectures": REMOVE, "model_type": "qwen3"}, lambda c: c.family == "qwen3")],
    "vocab_size": [("llama", {"vocab_size": 300}, lambda c: c.vocab_size == 300)],
    "hidden_size": [("llama", {"hidden_size": 64}, lambda c: c.hidden_size == 64)],
    "intermediate_size": [("qwen3", {"intermediate_size": 40}, lambda c: c.intermediate_size == 40)],
    "num_hidden_layers": [("mistral", {"num_hidden_layers": 3}, lambda c: c.num_layers == 3)],
    "num_attention_heads": [("qwen2", {"num_attention_heads": 8}, lambda c: c.num_heads == 8)],
    "num_key_value_heads": [
        ("llama", {"num_key_value_heads": 4}, lambda c: c.num_kv_heads == 4),
        ("llama", {"num_key_value_heads": None}, lambda c: c.num_kv_heads == 4),  # null: as many as query heads
    ],
    "head_dim": [
        ("qwen3", {"head_dim": 16}, lambda c: c.head_dim == 16),
        ("llama", {"head_dim": None}, lambda c: c.head_dim == 8),  # null: hidden_size / num_attention_heads
    ],
    "rms_norm_eps": [("qwen2", {"rms_norm_eps": 1e-5}, lambda c: c.rms_norm_eps == 1e-5)],
    "max_position_embeddings": [
        ("mistral", {"max_position_embeddings": 99}, lambda c: c.max_position_embeddings == 99),
        (
            "llama",
            {"max_position_embeddings": 99, R + "original_max_position_embeddings": REMOVE},
            scaling(original_max_position_embeddings=99),
        ),
    ],
    "tie_word_embeddings": [("qwen3", {"tie_word_embeddings": True}, lambda c: c.tie_word_embeddings)],
    "dtype": [
        ("llama", {"dtype": "bfloat16"}, lambda c: c.dtype == "bfloat16"),
        ("llama", {"dtype": "float8_e4m3fn"}, "dtype must be one of"),
    ],
    "torch_dtype": [
        ("llama", {"dtype": REMOVE, "torch_dtype": "float16"}, lambda c: c.dtype == "float16"),
        ("llama", {"dtype": "bfloat16", "torch_dtype": "float16"}, "'dtype' and 'torch_dtype' disagree"),
    ],
    "rope_parameters": [
        (
            "mistral",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            scaling(rope_type="linear", factor=2.0),
        ),
        ("mistral", {"rope_parameters": REMOVE}, lambda c: c.rope_theta == 10000.0),
    ],
    "rope_scaling": [
        (
            "llama",
            {"rope_parameters": REMOVE, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 3}},
            lambda c: c.rope_scaling is not None and c.rope_scaling.factor == 3.0 and c.rope_theta == 1e4,
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 3}}, "rope_parameters and rope_scaling disagree"),
    ],
    "rope_theta": [
        ("qwen2", {"rope_parameters": REMOVE, "rope_theta": 1234.0}, lambda c: c.rope_theta == 1234.0),
        ("qwen2", {"rope_theta": 1234.0}, "rope_theta and rope_theta disagree"),
    ],
    "original_max_position_embeddings": [
        (
            "llama",
            {R + "original_max_position_embeddings": REMOVE, "original_max_position_embeddings": 64},
            scaling(original_max_position_embeddings=64),
        ),
        ("llama", {"original_max_position_embeddings": 64}, "original_max_position_embeddings .*disagree"),
    ],
    "attention_bias": [("llama", {"attention_bias": True}, _bias), ("qwen3", {"attention_bias": True}, _bias)],
    "sliding_window": [
        ("mistral", {"sliding_window": 7}, lambda c: c.sliding_window == 7),
        ("mistral", {"sliding_window": None}, lambda c: c.sliding_window is None),
        ("mistral", {"sliding_window": REMOVE}, lambda c: c.sliding_window == 4096),  # transformers' default
        ("qwen3", {"sliding_window": 7}, lambda c: c.sliding_window is None),  # without use_sliding_window
    ],
    "use_sliding_window": [
        ("qwen2", WINDOW | {"max_window_layers": 1}, "layers 1..1 sliding-window layers"),
        (
            "qwen3",
            WINDOW | {"max_window_layers": 0, "layer_types": ["full_attention"] * 2},
            lambda c: c.sliding_window is None,
        ),  # explicit layer types win, as in transformers
    ],
    "max_window_layers": [
        ("qwen3", WINDOW | {"max_window_layers": 2}, lambda c: c.sliding_window is None),
        ("qwen3", WINDOW | {"max_window_layers": REMOVE}, lambda c: c.sliding_window is None),  # 28 >= 2 layers
    ],
    R + "rope_type": [
        ("llama", {R + "rope_type": "yarn"}, "RoPE type 'yarn'.*default, linear, llama3"),
        ("llama", {R + "rope_type": "dynamic"}, "'dynamic'"),
        ("llama", {R + "rope_type": "longrope"}, "'longrope'"),
        ("llama", {R + "rope_type": "linear"}, scaling(rope_type="linear", factor=8.0)),
    ],
    R + "type": [
        ("llama", {R + "rope_type": REMOVE, R + "type": "linear"}, scaling(rope_type="linear")),
        ("llama", {R + "type": "linear"}, "rope_type and rope_parameters.type disagree"),
    ],
    R + "rope_theta": [
        ("qwen3", {R + "rope_theta": 1e6}, lambda c: c.rope_theta == 1e6),
        ("qwen3", {R + "rope_theta": REMOVE}, lambda c: c.rope_theta == 1e4),
    ],
    R + "factor": [
        ("llama", {R + "factor": 32.0}, scaling(factor=32.0)),
        ("llama", {R + "factor": REMOVE}, "needs 'factor'"),
        ("qwen2", {R + "factor": 4.0}, "factor = 4.0 without a scaling rope_type"),
    ],
    R + "low_freq_factor": [
        ("llama", {R + "low_freq_factor": 2.0}, scaling(low_freq_factor=2.0)),
        ("llama", {R + "low_freq_factor": REMOVE}, "needs 'low_freq_factor'"),
    ],
    R + "high_freq_factor": [
        ("llama", {R + "high_freq_factor": 8.0}, scaling(high_freq_factor=8.0)),
        ("llama", {R + "high_freq_factor": 1.0}, "high_freq_factor != low_freq_factor"),
    ],
    R + "original_max_position_embeddings": [
        ("llama", {R + "original_max_position_embeddings": 16}, scaling(original_max_position_embeddings=16)),
        ("phi3", {R + "original_max_position_embeddings": REMOVE}, scaling(original_max_position_embeddings=32)),
        ("phi3", {R + "original_max_position_embeddings": 64}, "original_max_position_embeddings .*disagree"),
    ],
    "num_local_experts": [
        ("mixtral", {"num_local_experts": 6}, lambda c: c.num_experts == 6),
        ("qwen3_moe", {"num_local_experts": 6, "num_experts": 5}, "num_local_experts and num_experts disagree"),
    ],
    "num_experts": [
        ("qwen3_moe", {"num_local_experts": REMOVE, "num_experts": 6}, lambda c: c.num_experts == 6),
        ("mixtral", {"num_local_experts": REMOVE}, lambda c: c.num_experts == 8),  # Mixtral's default
    ],
    "num_experts_per_tok": [
        ("qwen3_moe", {"num_experts_per_tok": 3}, lambda c: c.experts_per_token == 3),
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok \\(5\\) exceeds the 4 experts"),
    ],
    "moe_intermediate_size": [
        ("qwen3_moe", {"moe_intermediate_size": 24}, lambda c: c.moe_intermediate_size == 24),
        ("qwen3_moe", {"moe_intermediate_size": REMOVE}, lambda c: c.moe_intermediate_size == 768),
    ],
    "norm_topk_prob": [
        ("qwen3_moe", {"norm_topk_prob": True}, lambda c: c.norm_topk_prob),
        ("qwen3_moe", {"norm_topk_prob": REMOVE}, lambda c: not c.norm_topk_prob),
    ],
    "decoder_sparse_step": [
        ("qwen3_moe", {"decoder_sparse_step": 2}, lambda c: c.dense_layers == (0,)),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step' must be an integer in \\[1,"),
    ],
    "mlp_only_layers": [
        ("qwen3_moe", {"mlp_only_layers": [1]}, lambda c: c.dense_layers == (1,) and not c.moe_layer(1)),
        ("qwen3_moe", {"mlp_only_layers": [2]}, "mlp_only_layers must list layer indices below 2"),
    ],
    "quantization_config": [
        (
            "llama",
            {"quantization_config": fp8_config(Fp8("tensor")), "dtype": "bfloat16"},
            lambda c: c.fp8 == Fp8("tensor"),
        ),
        ("qwen2", {"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq' is not implemented"),
    ],
    "hidden_activation": [
        ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation = 'gelu' is not supported for gemma3"),
        ("gemma3", {"hidden_activation": REMOVE}, lambda c: c.gemma),  # gelu_pytorch_tanh by default
    ],
    "query_pre_attn_scalar": [
        ("gemma3", {"query_pre_attn_scalar": 32}, lambda c: c.attention_scale == 32**-0.5),
        ("gemma3", {"query_pre_attn_scalar": REMOVE}, lambda c: c.query_pre_attn_scalar == 256),
    ],
    "layer_types": [
        ("gemma3", {"layer_types": ["full_attention"] * 2}, lambda c: c.layer_types == ("full_attention",) * 2),
        ("gemma3", {"layer_types": ["chunked_attention"] * 2}, "layer_types must list 2 of"),
    ],
    "sliding_window_pattern": [
        ("gemma3", {"layer_types": REMOVE, "sliding_window_pattern": 1}, lambda c: sliding_layers(c) == []),
        ("gemma3", {"layer_types": REMOVE}, lambda c: sliding_layers(c) == [0, 1]),  # every 6th is full
    ],
    "rope_local_base_freq": [
        (
            "gemma3",
            {
                "rope_parameters": REMOVE,
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                "rope_local_base_freq": 5e4,
            },
            lambda c: c.local_rope_theta == 5e4 and c.rope_theta == 1e6 and c.rope_scaling is not None,
        ),
        ("gemma3", {"rope_local_base_freq": 5e4}, "sliding_attention.rope_theta and rope_local_base_freq disagree"),
    ],
    "partial_rotary_factor": [
        ("phi3", {R + "partial_rotary_factor": REMOVE, "partial_rotary_factor": 0.75}, lambda c: c.rotary_dim == 6),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor .*disagree"),
    ],
    R + "partial_rotary_factor": [
        ("phi3", {R + "partial_rotary_factor": 0.75}, lambda c: c.partial_rotary_factor == 0.75 and c.rotary_dim == 6),
        ("phi3", {R + "partial_rotary_factor": 1.5}, "must be in \\(0, 1\\]"),
    ],
    R + "short_factor": [
        ("phi3", {R + "short_factor": [1.0, 1.0, 3.0]}, scaling(short_factor=(1.0, 1.0, 3.0))),
        ("phi3", {R + "short_factor": [1.0]}, "3 short and long factors"),
        ("phi3", {R + "short_factor": REMOVE}, "short_factor must be a list"),
    ],
    R + "long_factor": [
        ("phi3", {R + "long_factor": [3.0, 3.0, 3.0]}, scaling(long_factor=(3.0, 3.0, 3.0))),
        ("phi3", {R + "long_factor": "long"}, "long_factor must be a list"),
    ],
    R + "attention_factor": [
        ("phi3", {R + "attention_factor": 1.5}, scaling(attention_factor=1.5)),
        # by default from max_position_embeddings / original: 128 / 32
        ("phi3", {R + "attention_factor": REMOVE}, scaling(attention_factor=math.sqrt(1 + math.log(4) / math.log(32)))),
    ],
}


def _apply(hf: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(hf))
    for key, value in changes.items():
        rope = key.startswith(ROPE_PREFIX)
        target, name = (rope_dict(out), key.removeprefix(ROPE_PREFIX)) if rope else (out, key)
        if value is REMOVE:
            target.pop(name, None)
        else:
            target[name] = value
    return out


def test_every_read_key_has_cases() -> None:
    read_keys = {key for key, _, rule in rules() if rule.handling == "read"}
    assert read_keys == set(READ_CASES)


@pytest.mark.parametrize(
    ("key", "case"),
    [(k, c) for k, cases in READ_CASES.items() for c in cases],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_read_key_reaches_the_config(key: str, case: ReadCase) -> None:
    family, changes, expect = case
    assert key_rule(key, family) is not None
    hf = _apply(base(family), changes)
    if isinstance(expect, str):
        with pytest.raises(InvalidArgument, match=expect):
            parse(hf)
    else:
        config = parse(hf)
        assert expect(config), (key, changes, config)


# ---- refusals the table's neighbours make ----
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["Gemma2ForCausalLM"]}, r"unsupported architectures \['Gemma2ForCausalLM'\].*qwen3"),
        ({"architectures": ["LlamaForCausalLM", "MistralForCausalLM"]}, "unsupported architectures"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "qwen2"}, "name different families"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type"),
        ({"rope_parameters": "default"}, "must be an object"),
        ({"layer_types": ["full_attention"] * 3}, "3 entries for 2"),
        ({"attention_bias": 1}, "true or false"),
        ({"rope_parameters.rope_theta": -1.0}, "rope_theta must be > 0"),
    ],
)
def test_config_refuses_inconsistent_or_unimplemented_values(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse(_apply(base("llama"), changes))


def test_refusal_names_the_key_and_the_family() -> None:
    with pytest.raises(InvalidArgument) as ei:
        parse(base("mistral") | {"attention_bias": True})
    assert "attention_bias = True is not supported for mistral: Mistral has no projection biases" in str(ei.value)


# ---- coverage of what transformers writes ----
def _variants(family: Family) -> list[Any]:
    """Configs of ``family`` exercising each option this decoder reads (RoPE types, windows, biases)."""
    cls = CONFIG_CLASSES[family]
    out = [cls(), cls(**DIMS)]
    if family == "gemma3":  # one RoPE per layer type, and the older keys for them
        full = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
        out.append(
            cls(
                **DIMS,
                sliding_window=8,
                sliding_window_pattern=2,
                query_pre_attn_scalar=8,
                rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default"}},
            )
        )
        out.append(cls(**DIMS, rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=5e4))
    elif family != "phi3":  # Phi-3's config takes the default RoPE or LongRoPE only
        out += [
            cls(**DIMS, rope_parameters=dict(LLAMA3)),
            cls(**DIMS, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        ]
    if family in ("qwen2", "qwen3"):
        out.append(cls(**DIMS, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    if family == "mistral":
        out.append(cls(**DIMS, sliding_window=None))
    if family in ("llama", "qwen3"):
        out.append(cls(**DIMS, attention_bias=True))
    if family == "phi3":
        out.append(cls(**DIMS, rope_parameters=dict(LONGROPE), partial_rotary_factor=0.75, sliding_window=16))
        su = {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 32}
        out.append(cls(**DIMS, rope_scaling=su))  # the old name transformers reads as longrope
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_key_transformers_writes_is_in_the_table(family: Family, tmp_path: Path) -> None:
    cls = CONFIG_CLASSES[family]
    keys = {f.name for f in dataclasses.fields(cls)} | set(transformers.PreTrainedConfig().to_dict())
    rope_keys = {ROPE_PREFIX + k for k in RopeParameters.__annotations__}
    for i, config in enumerate(_variants(family)):
        keys |= set(config.to_dict())
        config.save_pretrained(tmp_path / f"config{i}")
        written = json.loads((tmp_path / f"config{i}" / "config.json").read_text())
        keys |= set(written)
        rope = written.get("rope_parameters") or {}
        parts = list(rope.values()) if set(rope) & set(LAYER_TYPES) else [rope]  # Gemma 3: one per layer type
        rope_keys |= {ROPE_PREFIX + k for part in parts for k in part}
    pad = {"pad_token_id": None} if family == "phi3" else {}  # Phi-3's default pad id is past DIMS' vocabulary
    MODEL_CLASSES[family](cls(**DIMS, **pad)).save_pretrained(tmp_path / "model")  # adds architectures and dtype
    keys |= set(json.loads((tmp_path / "model" / "config.json").read_text()))
    keys |= {"rope_theta", "rope_scaling", "torch_dtype"}  # the legacy spellings
    missing = sorted(k for k in keys | rope_keys if key_rule(k, family) is None)
    assert missing == [], f"transformers {transformers.__version__} writes keys CONFIG_KEYS does not know: {missing}"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_defaults_are_transformers_defaults(family: Family) -> None:
    """A key a config.json omits means the config class's default to transformers: ours must be the same."""
    cls = CONFIG_CLASSES[family]
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, ours in FAMILY_DEFAULTS[family].items():
        assert fields.get(key) == ours, (family, key)
    if family == "gemma3":
        assert cls.default_theta == {
            "global": GEMMA3_THETA["full_attention"],
            "local": GEMMA3_THETA["sliding_attention"],
        }
        assert "hidden_act" not in fields and fields["tie_word_embeddings"] is True
    else:  # the RoPE base a file without one gets: through the parser below
        assert fields["hidden_act"] == "silu" and fields["tie_word_embeddings"] is False
    assert fields.get("attention_bias", False) is False
    # and through the parser: a file without the keys parses to what transformers builds from it
    # (32 query heads: Qwen's default of 32 key/value heads must divide them)
    model_type = next(t for t, f in MODEL_TYPES.items() if f == family)
    minimal = {
        "model_type": model_type,
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "max_position_embeddings": 128,
    }
    ref = cls(**{k: v for k, v in minimal.items() if k != "model_type"})
    ref_rope = ref.rope_parameters.get("full_attention", ref.rope_parameters)
    ours_cfg = parse(minimal)
    assert ours_cfg.num_kv_heads == ref.num_key_value_heads
    assert ours_cfg.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert ours_cfg.rms_norm_eps == ref.rms_norm_eps and ours_cfg.rope_theta == ref_rope["rope_theta"]
    assert ours_cfg.sliding_window == (ref.sliding_window if family in ("mistral", "phi3", "gemma3") else None)
