"""The shape of a Llama-family decoder: what the weights, the KV cache and the decoder agree on.

One frozen value describes a model whether it comes from a Hugging Face ``config.json`` or a
``synthetic:<preset>``, so the allocator sizes, the checkpoint loader and the decoder cannot disagree
about a dimension.

Parsing cannot silently drop numerics. Every ``config.json`` key that transformers 5.17 writes for
the families served here, plus the legacy spellings and a few keys of neighbouring families, has one
entry in :data:`CONFIG_KEYS`: read by the parser, accepted only at the value that leaves the numbers
unchanged, or ignored because it does not reach the logits. Anything that would change the logits
and that the decoder does not implement (another activation, an unknown RoPE type, MLP biases,
sliding-window layers outside Gemma 3's, logit soft-capping) is refused by name rather than served
with wrong tokens that look right. Keys no entry names are ignored: transformers' modeling code for these
architectures reads only its config class's own fields and the few keys its shared RoPE and loading
code looks for (all in the table), so an unknown key changes nothing there either, and
tests/worker/test_config_keys.py fails when a future transformers writes a key the table lacks
(tests/worker/test_reference.py holds the numbers themselves to transformers).

Both config formats are read: transformers 5 (``rope_parameters`` holding ``rope_theta`` and
``rope_type``, ``dtype``) and the legacy one (top-level ``rope_theta``, ``rope_scaling``,
``torch_dtype``). Defaults for keys a file may omit are those of transformers' config classes, since
that is what transformers would compute with (a Mistral config without ``sliding_window`` slides at
4096; a Qwen3 config without ``head_dim`` has 128).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from memsvc.errors import InvalidArgument
from memsvc.runtime.limits import INT32_MAX

Family = Literal["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "qwen3_moe", "mixtral"]

FAMILIES: tuple[Family, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "qwen3_moe", "mixtral")
"""The decoder families implemented here, in the order messages list them."""

ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
"""``config.json`` ``architectures`` entry -> family (a model's ``save_pretrained`` writes it)."""
_FAMILY_ARCHITECTURE = {family: arch for arch, family in ARCHITECTURES.items()}
MODEL_TYPES: dict[str, Family] = {("gemma3_text" if f == "gemma3" else f): f for f in FAMILIES}
"""``config.json`` ``model_type`` -> family (every ``save_pretrained`` writes it; the family name, but
Gemma 3's text model's ``gemma3_text``: ``gemma3`` is its image-and-text model, not served here)."""
_FAMILY_MODEL_TYPE = {family: model_type for model_type, family in MODEL_TYPES.items()}

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
"""RoPE variants the decoder computes exactly as transformers does (worker/model/decoder.py's Rope);
longrope is Phi-3's alone."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
"""Gemma 3's RoPE bases where a config names none (its config class's ``default_theta``)."""
GEMMA3_PATTERN = 6
"""Gemma 3's ``sliding_window_pattern`` where neither it nor ``layer_types`` is given: every sixth layer
attends globally, the others slide."""
LAYER_TYPES = ("full_attention", "sliding_attention")
MOE_FAMILIES: tuple[Family, ...] = ("qwen3_moe", "mixtral")
"""The mixture-of-experts families: a router and experts in place of (most) layers' MLP."""
_WINDOWED: tuple[Family, ...] = ("mistral", "phi3", "gemma3", "qwen3_moe", "mixtral")
"""The families a sliding window is implemented for (Qwen2's and Qwen3's sliding layers are not)."""

BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position_embeddings": (1, 1 << 24),
    "original_max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "sliding_window_pattern": (1, 1024),
    "num_experts": (1, 4096),
    "num_local_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096),
    "moe_intermediate_size": (1, 1 << 18),
    "decoder_sparse_step": (1, 1024),
    "max_window_layers": (0, INT32_MAX),
}
"""The range every integer key of ``config.json`` must lie in (by its name, also inside
``rope_parameters``): positive where a zero divides or sizes nothing, and a few times the largest
published model's value at most (vocab 262144, hidden 16384, MLP 53248, 126 layers, 128 heads,
head_dim 256, a 10M context), all within :data:`INT32_MAX`. A value past them is a damaged or
hostile file, refused by name before anything is sized from it."""

_DEFAULT_THETA = 10000.0
"""transformers' ``RotaryEmbeddingConfigMixin.default_theta``: the base when a config names none."""
_FAMILY_THETA: dict[Family, float] = {"mixtral": 1_000_000.0}
"""A family whose config class's ``default_theta`` is not :data:`_DEFAULT_THETA`."""

FAMILY_DEFAULTS: dict[Family, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mistral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
    "qwen2": {
        "num_key_value_heads": 32,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "phi3": {
        "num_key_value_heads": None,
        "head_dim": None,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "sliding_window": None,
        "original_max_position_embeddings": 4096,
    },
    "gemma3": {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
    "mixtral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
}
"""What transformers 5.17's config classes use for a key the file omits (None: derived — key/value heads
from the query heads, ``head_dim`` from hidden_size / num_attention_heads). tests/worker/test_reference.py
checks each against the classes themselves."""


# ---- the key table ----
Handling = Literal["read", "neutral", "ignored"]


@dataclass(frozen=True)
class KeyRule:
    """How one ``config.json`` key is handled for one family."""

    handling: Handling
    """``read``: the parser turns it into the ModelConfig. ``neutral``: accepted only at a value that
    leaves the numbers as the decoder computes them, refused otherwise. ``ignored``: it does not reach
    the logits (training, generation defaults, bookkeeping)."""
    why: str
    """What the key does; for a neutral key, what the decoder would get wrong (said in the refusal)."""
    neutral: tuple[Any, ...] | Callable[[Any], bool] = ()
    """``neutral`` only: the accepted values (``None`` is spelled out where accepted), or a predicate."""
    refused: Any = None
    """``neutral`` only: a value that is refused; documents the rule and lets the tests walk it."""

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` may stand for this key (always, unless the key is neutral)."""
        if self.handling != "neutral":
            return True
        if callable(self.neutral):
            return self.neutral(value)
        return any(_same(value, n) for n in self.neutral)


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps booleans apart from numbers: ``mlp_bias: 1`` is not ``False``'s neutral 0,
    and ``pretraining_tp: true`` is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _all_full_attention(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(t == "full_attention" for t in value))


def read(why: str) -> KeyRule:
    return KeyRule("read", why)


def neutral(values: tuple[Any, ...] | Callable[[Any], bool], refused: Any, why: str) -> KeyRule:
    return KeyRule("neutral", why, values, refused)


def ignored(why: str) -> KeyRule:
    return KeyRule("ignored", why)


ROPE_PREFIX = "rope_parameters."
"""Keys inside ``rope_parameters`` (or the legacy ``rope_scaling``) are named with this prefix in the table."""

_ROPE_ONLY_REFUSED = "read only by RoPE types the decoder refuses (yarn, longrope); default, linear, llama3 ignore it"
_PHI3_LONGROPE = "LongRoPE (Phi-3): "


def _longrope_only(why: str) -> dict[Family, KeyRule]:
    """A key LongRoPE reads: Phi-3 reads it, the other families' RoPE types ignore it."""
    rules: dict[Family, KeyRule] = {f: ignored(_ROPE_ONLY_REFUSED) for f in FAMILIES}
    rules["phi3"] = read(_PHI3_LONGROPE + why)
    return rules


def _gemma3_reads(why: str, others: KeyRule, gemma3: KeyRule | None = None) -> dict[Family, KeyRule]:
    """A key Gemma 3 reads (``why``; or ``gemma3``'s own rule) and the other families treat as ``others``."""
    rules: dict[Family, KeyRule] = {f: others for f in FAMILIES}
    rules["gemma3"] = gemma3 if gemma3 is not None else read(why)
    return rules


def _moe_reads(why: str, mixtral: bool = True) -> dict[Family, KeyRule]:
    """A key the mixture-of-experts families read (Qwen3-MoE; Mixtral too unless ``mixtral`` is False);
    the dense ones never look at it."""
    rules: dict[Family, KeyRule] = {f: ignored("only the mixture-of-experts families read it") for f in FAMILIES}
    rules["qwen3_moe"] = read(why)
    rules["mixtral"] = read(why) if mixtral else ignored("Mixtral's transformers code does not read it")
    return rules


def _partial_rotary() -> dict[Family, KeyRule]:
    """Phi-3 rotates the first ``head_dim * partial_rotary_factor`` of each head; the others all of it."""
    whole = neutral((1, 1.0, None), 0.5, "RoPE on part of each head is not implemented (it rotates all of head_dim)")
    rules: dict[Family, KeyRule] = {f: whole for f in FAMILIES}
    rules["phi3"] = read("the fraction of each head RoPE rotates (Phi-4-mini: 0.75); the rest passes through")
    return rules


CONFIG_KEYS: dict[str, KeyRule | dict[Family, KeyRule]] = {
    # which model
    "architectures": read("names the family; must agree with model_type (a config's own save_pretrained omits it)"),
    "model_type": read("names the family; must agree with architectures"),
    # dimensions
    "vocab_size": read("rows of the embedding and the output projection (required)"),
    "hidden_size": read("width of the residual stream (required)"),
    "intermediate_size": read("width of the SwiGLU MLP (required)"),
    "num_hidden_layers": read("decoder layers (required)"),
    "num_attention_heads": read("query heads (required)"),
    "num_key_value_heads": read("key/value heads of grouped-query attention"),
    "head_dim": read("per-head width; apart from hidden_size / num_attention_heads when given"),
    # numerics the decoder implements
    "rms_norm_eps": read("epsilon of every RMSNorm"),
    "max_position_embeddings": read("longest sequence served; llama3 RoPE's original context when it names none"),
    "tie_word_embeddings": read("the output projection reuses embed_tokens"),
    "dtype": read("weights, activations and KV cache dtype (transformers 5 spelling)"),
    "torch_dtype": read("weights, activations and KV cache dtype (legacy spelling; must agree with dtype)"),
    "rope_parameters": read("RoPE base and scaling (transformers 5: rope_theta and rope_type inside)"),
    "rope_scaling": read("RoPE scaling (legacy; transformers prefers it to rope_parameters, so both must agree)"),
    "rope_theta": read("RoPE base (legacy top level; must agree with rope_parameters.rope_theta)"),
    "original_max_position_embeddings": read(
        "llama3 and longrope's original context at the top level (transformers prefers it to the one in "
        "rope_parameters)"
    ),
    "attention_bias": {
        "llama": read("biases on q/k/v and o_proj"),
        "mistral": neutral(
            (False, None),
            True,
            "Mistral has no projection biases: transformers ignores this key and drops the "
            "bias tensors, so a checkpoint that has them is not the model its config describes",
        ),
        "qwen2": ignored("Qwen2 always has q/k/v biases and never an o_proj bias; transformers does not read this key"),
        "qwen3": read("biases on q/k/v and o_proj"),
        "phi3": ignored("Phi-3 has no projection biases; transformers does not read this key"),
        "gemma3": read("biases on q/k/v and o_proj"),
        "qwen3_moe": read("biases on q/k/v and o_proj"),
        "mixtral": neutral(
            (False, None),
            True,
            "Mixtral has no projection biases: transformers ignores this key and drops the bias tensors",
        ),
    },
    "sliding_window": {
        "llama": neutral((None,), 4096, "Llama attends to every earlier position; no sliding window is implemented"),
        "mistral": read("a query attends to the most recent sliding_window positions, in every layer"),
        "qwen2": read("window of the sliding-attention layers, which exist only with use_sliding_window"),
        "qwen3": read("window of the sliding-attention layers, which exist only with use_sliding_window"),
        "phi3": read("a query attends to the most recent sliding_window positions, in every layer"),
        "gemma3": read("window of the sliding_attention layers (layer_types)"),
        "qwen3_moe": read("every layer's window, with use_sliding_window"),
        "mixtral": read("a query attends to the most recent sliding_window positions, in every layer"),
    },
    "use_sliding_window": {
        "llama": neutral((False, None), True, "Llama has no sliding-window layers"),
        "mistral": neutral(
            (False, None), True, "Mistral's window is sliding_window itself; this Qwen switch is not Mistral's"
        ),
        "qwen2": read("turns layers from max_window_layers on into sliding-window layers (refused: not implemented)"),
        "qwen3": read("turns layers from max_window_layers on into sliding-window layers (refused: not implemented)"),
        "phi3": neutral(
            (False, None), True, "Phi-3's window is sliding_window itself; this Qwen switch is not Phi-3's"
        ),
        "gemma3": ignored("only Qwen reads it; Gemma 3's sliding layers are its layer_types"),
        "qwen3_moe": read("turns sliding_window on, in every layer"),
        "mixtral": neutral(
            (False, None), True, "Mixtral's window is sliding_window itself; this Qwen switch is not Mixtral's"
        ),
    },
    "max_window_layers": {
        "llama": ignored("only Qwen reads it"),
        "mistral": ignored("only Qwen reads it"),
        "phi3": ignored("only Qwen reads it"),
        "gemma3": ignored("only Qwen reads it"),
        "qwen3_moe": ignored("Qwen3-MoE slides in every layer with use_sliding_window; only Qwen2/Qwen3 read it"),
        "mixtral": ignored("only Qwen reads it"),
        "qwen2": read("first layer that slides when use_sliding_window is set"),
        "qwen3": read("first layer that slides when use_sliding_window is set"),
    },
    "layer_types": _gemma3_reads(
        "each layer's attention: sliding_attention (over sliding_window positions) or full_attention",
        neutral(
            _all_full_attention,
            ["full_attention", "sliding_attention"],
            "per-layer attention types other than full attention (sliding or chunked layers) are not implemented; "
            "Mistral's window comes from sliding_window",
        ),
    ),
    "_sliding_window_pattern": ignored(
        "transformers' own copy of sliding_window_pattern; layer_types is written beside it"
    ),
    "num_local_experts": _moe_reads("experts in each MoE layer (num_experts, the other spelling, must agree)"),
    "num_experts": _moe_reads("experts in each MoE layer (num_local_experts, the other spelling, must agree)"),
    "num_experts_per_tok": _moe_reads("experts each token is routed to (top-k of the router's softmax)"),
    "moe_intermediate_size": _moe_reads(
        "width of each expert's SwiGLU MLP (Mixtral's experts are intermediate_size wide)", mixtral=False
    ),
    "norm_topk_prob": _moe_reads("the top-k routing weights are renormalised to sum to 1", mixtral=False),
    "decoder_sparse_step": _moe_reads("every n-th layer is an MoE layer, the others dense", mixtral=False),
    "mlp_only_layers": _moe_reads("layers with a dense MLP instead of experts", mixtral=False),
    "output_router_logits": ignored("what a transformers forward returns besides the logits"),
    "router_aux_loss_coef": ignored("a training loss"),
    "router_jitter_noise": ignored("noise on the router's input while training only"),
    "sliding_window_pattern": _gemma3_reads(
        "every n-th layer attends globally, the others slide (older files; layer_types wins)",
        ignored("only Gemma reads it"),
    ),
    "rope_local_base_freq": _gemma3_reads(
        "RoPE base of the sliding layers (older files; rope_parameters.sliding_attention in transformers 5)",
        ignored("only Gemma 3 reads it"),
    ),
    "hidden_activation": _gemma3_reads(
        "the GeGLU MLP's activation: gelu_pytorch_tanh (others are refused)", ignored("only Gemma reads it")
    ),
    "use_bidirectional_attention": neutral(
        (False, None), True, "attention is causal here; bidirectional attention (an embedding model's) is not"
    ),
    # numerics the decoder does not implement: accepted only where they change nothing
    "hidden_act": _gemma3_reads(
        "",
        neutral(
            ("silu", "swish"),
            "gelu",
            "the MLP is SwiGLU: only the silu activation (transformers also calls it swish) is implemented",
        ),
        ignored("Gemma 3 reads hidden_activation, not this key"),
    ),
    "mlp_bias": neutral((False, None), True, "the MLP projections have no biases here"),
    "pretraining_tp": neutral(
        (1, None), 2, "tensor-parallel slicing of the projections at pretraining is not reproduced"
    ),
    "partial_rotary_factor": _partial_rotary(),
    "attn_logit_softcapping": neutral((None,), 50.0, "attention-score soft-capping is not implemented"),
    "final_logit_softcapping": neutral((None,), 30.0, "output-logit soft-capping is not implemented"),
    "query_pre_attn_scalar": _gemma3_reads(
        "attention scores are scaled by its inverse square root (not head_dim's)",
        neutral((None,), 256, "attention scales scores by 1/sqrt(head_dim) only"),
    ),
    "embedding_multiplier": neutral((None, 1, 1.0), 12.0, "embeddings are not rescaled"),
    "logits_scaling": neutral((None, 1, 1.0), 8.0, "logits are not rescaled"),
    "residual_multiplier": neutral((None, 1, 1.0), 0.22, "residual branches are not rescaled"),
    "attention_multiplier": neutral((None,), 0.015625, "attention scales scores by 1/sqrt(head_dim) only"),
    "use_qk_norm": neutral(
        (None, False), True, "q/k RMSNorm is Qwen3's own (weights q_norm/k_norm), not switched by this key"
    ),
    "quantization_config": read(
        "FP8 weights as llm-compressor writes them (compressed-tensors, float-quantized: per-channel or per-tensor "
        "weight scales, dynamic per-token activations) or transformers' fine-grained FP8 (128 x 128 blocks); "
        "other quantizations are refused by name"
    ),
    # do not reach the logits
    "_name_or_path": ignored("where transformers loaded it from"),
    "transformers_version": ignored("which transformers wrote the file"),
    "id2label": ignored("labels of classification heads"),
    "label2id": ignored("labels of classification heads"),
    "problem_type": ignored("loss of classification heads"),
    "chunk_size_feed_forward": ignored("a memory-saving chunking that these architectures do not use"),
    "is_encoder_decoder": ignored("these architectures are decoder-only whatever it says"),
    "output_attentions": ignored("what a transformers forward returns besides the logits"),
    "output_hidden_states": ignored("what a transformers forward returns besides the logits"),
    "return_dict": ignored("what a transformers forward returns besides the logits"),
    "use_cache": ignored("whether transformers keeps a KV cache: same logits either way"),
    "bos_token_id": ignored("a generation setting (tokenizer and stopping), not the logits"),
    "eos_token_id": ignored("a generation setting (tokenizer and stopping), not the logits"),
    "pad_token_id": ignored("padding row of the embedding only matters for training; no padding is fed here"),
    "initializer_range": ignored("initialisation of untrained weights"),
    "attention_dropout": ignored("dropout is off at inference"),
    "resid_pdrop": ignored("dropout is off at inference"),
    "embd_pdrop": ignored("dropout is off at inference"),
    # inside rope_parameters / rope_scaling
    ROPE_PREFIX + "rope_type": read("default, linear or llama3; longrope for Phi-3 (others are refused)"),
    ROPE_PREFIX + "type": read("legacy spelling of rope_type (must agree with it)"),
    ROPE_PREFIX + "rope_theta": read("RoPE base"),
    ROPE_PREFIX + "factor": read(
        "linear and llama3 scaling factor, what longrope's attention factor derives from; with the default type it "
        "must be absent or 1"
    ),
    ROPE_PREFIX + "low_freq_factor": read("llama3 (other types ignore it, as transformers does)"),
    ROPE_PREFIX + "high_freq_factor": read("llama3 (other types ignore it, as transformers does)"),
    ROPE_PREFIX + "original_max_position_embeddings": read(
        "llama3's and longrope's pretraining context (other types ignore it, as transformers does)"
    ),
    ROPE_PREFIX + "partial_rotary_factor": _partial_rotary(),
    ROPE_PREFIX + "attention_factor": _longrope_only("scales cos and sin (default from factor)"),
    ROPE_PREFIX + "beta_fast": ignored(_ROPE_ONLY_REFUSED),
    ROPE_PREFIX + "beta_slow": ignored(_ROPE_ONLY_REFUSED),
    ROPE_PREFIX + "short_factor": _longrope_only("frequency divisors up to the original context"),
    ROPE_PREFIX + "long_factor": _longrope_only("frequency divisors past the original context"),
    ROPE_PREFIX + "mscale": ignored(_ROPE_ONLY_REFUSED),
    ROPE_PREFIX + "mscale_all_dim": ignored(_ROPE_ONLY_REFUSED),
    ROPE_PREFIX + "truncate": ignored(_ROPE_ONLY_REFUSED),
}
"""The one rule for every known ``config.json`` key: a :class:`KeyRule`, or one per family where the
families differ. Keys inside ``rope_parameters``/``rope_scaling`` carry :data:`ROPE_PREFIX`."""


def key_rule(key: str, family: Family) -> KeyRule | None:
    """The rule for ``key`` in ``family``; None for a key the table does not know (ignored)."""
    rule = CONFIG_KEYS.get(key)
    if isinstance(rule, dict):
        return rule[family]
    return rule


def _check_neutral(raw: Mapping[str, Any], family: Family, prefix: str, where: str) -> None:
    """Refuse the first neutral key of ``raw`` that is away from its neutral value."""
    for key, value in raw.items():
        rule = key_rule(prefix + str(key), family)
        if rule is not None and not rule.accepts(value):
            raise InvalidArgument(
                f"config.json: {where}{key} = {value!r} is not supported for {family}: {rule.why}",
                metadata={"key": prefix + str(key)},
            )


# ---- the value ----
@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1+ style frequency scaling (``rope_type`` "llama3"), plain "linear" scaling, or Phi-3's
    "longrope".

    Llama-3.2 checkpoints ship with "llama3" scaling; it changes the rotary frequencies at every
    position, so ignoring it would silently change every logit.

    LongRoPE divides each frequency by its own factor: ``short_factor`` while a sequence is within
    ``original_max_position_embeddings``, ``long_factor`` past it, and scales cos and sin by
    ``attention_factor``. Which set a row uses follows transformers' rule for the call that computes
    it: the long set once the sequence the call reads (its prompt, or its prefix up to the token)
    is longer than the original context (worker/model/decoder.py's ``rope_long``).
    """

    rope_type: Literal["linear", "llama3", "longrope"]
    factor: float
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    original_max_position_embeddings: int = 8192
    """llama3 and longrope: the context length the unscaled frequencies were trained for (parsing
    takes it from the config, falling back to ``max_position_embeddings`` as transformers does)."""
    short_factor: tuple[float, ...] = ()
    """longrope only: one divisor per rotated frequency."""
    long_factor: tuple[float, ...] = ()
    """longrope only."""
    attention_factor: float = 1.0
    """longrope only: cos and sin are multiplied by it."""


@dataclass(frozen=True)
class Fp8:
    """FP8 weights (``float8_e4m3fn``) with their scales, and activations quantized to FP8 per token
    as each product runs: llm-compressor's FP8-dynamic scheme (compressed-tensors' float-quantized
    format), which the matrix products compute as FP8 x FP8 with float32 accumulation
    (``torch._scaled_mm``; worker/model/decoder.py's ``project``). Every projection of the decoder
    layers is quantized; the embeddings and the output projection are not."""

    weight_strategy: Literal["channel", "tensor", "block"]
    """A scale per output row (``weight_scale`` ``[rows, 1]``), one per matrix (``[1]``), or, in
    transformers' fine-grained FP8 (the Qwen3 and DeepSeek FP8 releases), one per 128 x 128 block
    (``weight_scale_inv`` ``[rows / 128, columns / 128]``, the activations quantized per token in
    groups of 128 columns)."""

    @property
    def scale_suffix(self) -> str:
        """What a matrix's scales are called beside its ``weight``."""
        return "_scale_inv" if self.weight_strategy == "block" else "_scale"

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        if self.weight_strategy == "block":
            return (-(-rows // FP8_BLOCK), -(-columns // FP8_BLOCK))
        return (rows, 1) if self.weight_strategy == "channel" else (1,)


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and numerics of a decoder of one of :data:`FAMILIES`."""

    family: Family
    """Which Hugging Face architecture the weights follow (names, biases, q/k norms)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention: ``num_heads`` is a multiple of it)."""
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    """Longest sequence (prompt + generated tokens) the worker accepts."""
    tie_word_embeddings: bool = False
    """The output projection reuses ``embed_tokens`` (no ``lm_head.weight`` tensor)."""
    attention_bias: bool = False
    """q/k/v projections carry biases: always for Qwen2, never for Mistral; for Llama and Qwen3 the
    o_projection has one too (see :attr:`o_proj_bias`)."""
    dtype: str = "float32"
    """Weights, activations and KV cache dtype: float32, bfloat16 or float16."""
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    """A query attends to at most this many most recent positions (None: all): in every layer (Mistral,
    Mixtral, Phi-3, Qwen3-MoE), or in Gemma 3's sliding layers."""
    partial_rotary_factor: float = 1.0
    """Phi-3: RoPE rotates the first :attr:`rotary_dim` of each head, the rest passes through."""
    layer_types: tuple[str, ...] | None = None
    """Gemma 3: each layer's attention, ``sliding_attention`` (over :attr:`sliding_window`) or
    ``full_attention``; None: every layer alike (Mistral's and Phi-3's window is every layer's)."""
    local_rope_theta: float | None = None
    """Gemma 3: the sliding layers' RoPE base (default RoPE); the full layers' is :attr:`rope_theta`
    with :attr:`rope_scaling`."""
    query_pre_attn_scalar: float | None = None
    """Gemma 3: attention scores are scaled by its inverse square root (None: head_dim's)."""
    num_experts: int = 0
    """Qwen3-MoE, Mixtral: experts in each MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to: the top-k of the router's softmax."""
    moe_intermediate_size: int = 0
    """Width of each expert's SwiGLU MLP."""
    norm_topk_prob: bool = False
    """The top-k routing weights are renormalised to sum to 1 (always, for Mixtral)."""
    dense_layers: tuple[int, ...] = ()
    """Layers of an MoE model with a dense MLP (``intermediate_size`` wide) instead of experts."""
    fp8: Fp8 | None = None
    """FP8 weights and activations (None: the weights are in :attr:`dtype`)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InvalidArgument(f"model family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgument(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"model config: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise InvalidArgument("model config: rope_theta and rms_norm_eps must be > 0")
        if self.sliding_window is not None and (self.family not in _WINDOWED or self.sliding_window <= 0):
            raise InvalidArgument(
                f"model config: sliding_window must be a positive integer on {', '.join(_WINDOWED)} only, got "
                f"{self.sliding_window} on {self.family}"
            )
        gemma = self.family == "gemma3"
        if gemma != (self.layer_types is not None) or gemma != (self.local_rope_theta is not None):
            raise InvalidArgument("model config: layer_types and local_rope_theta are gemma3's, and it needs both")
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES)
        ):
            raise InvalidArgument(f"model config: layer_types must be {self.num_layers} of {', '.join(LAYER_TYPES)}")
        if self.query_pre_attn_scalar is not None and not (gemma and self.query_pre_attn_scalar > 0):
            raise InvalidArgument("model config: query_pre_attn_scalar is gemma3's, and > 0")
        if self.fp8 is not None and (self.dtype == "float16" or self.num_experts):
            raise InvalidArgument(
                "model config: FP8 weights are implemented for dense bfloat16 (and float32) models only"
            )
        widths = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        if self.fp8 is not None and self.fp8.weight_strategy == "block" and any(x % FP8_BLOCK for x in widths):
            raise InvalidArgument(f"model config: 128 x 128 FP8 blocks need widths that are multiples of 128: {widths}")
        if (self.family in MOE_FAMILIES) != (self.num_experts > 0):
            raise InvalidArgument(f"model config: experts are {' and '.join(MOE_FAMILIES)}'s, and they need some")
        if self.num_experts and not (
            1 <= self.experts_per_token <= self.num_experts
            and self.moe_intermediate_size > 0
            and set(self.dense_layers) <= set(range(self.num_layers))
        ):
            raise InvalidArgument(
                f"model config: {self.experts_per_token} experts per token of {self.num_experts}, experts "
                f"{self.moe_intermediate_size} wide, dense layers {self.dense_layers}: out of range"
            )
        if self.partial_rotary_factor != 1.0 and self.family != "phi3":
            raise InvalidArgument("model config: a partial_rotary_factor other than 1 is phi3's only")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise InvalidArgument(
                f"model config: partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} must "
                "rotate an even number of dimensions, at least 2"
            )
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            if self.family != "phi3":
                raise InvalidArgument("model config: longrope RoPE is phi3's only")
            if not len(s.short_factor) == len(s.long_factor) == self.rotary_dim // 2:
                raise InvalidArgument(
                    f"model config: longrope needs {self.rotary_dim // 2} short and long factors (rotary_dim / 2), "
                    f"got {len(s.short_factor)} and {len(s.long_factor)}"
                )
        # The Hugging Face architectures fix these; a config that disagrees would not round-trip through to_hf.
        if self.family == "qwen2" and not self.attention_bias:
            raise InvalidArgument("model config: qwen2 always has q/k/v biases (attention_bias=True)")
        if self.family == "mistral" and self.attention_bias:
            raise InvalidArgument("model config: mistral has no attention biases")
        if self.rope_scaling is not None and self.rope_scaling.factor <= 0:
            raise InvalidArgument(f"model config: RoPE scaling factor must be > 0, got {self.rope_scaling.factor}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj carries a bias: Llama, Qwen3 and Gemma 3 put ``attention_bias`` on all four
        projections; Qwen2 has q/k/v biases only."""
        return self.attention_bias and self.family in ("llama", "qwen3", "gemma3", "qwen3_moe")

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head RoPE rotates (transformers: ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's original context: a row whose call reads more positions than this uses the long
        factors (None: not LongRoPE)."""
        s = self.rope_scaling
        return s.original_max_position_embeddings if s is not None and s.rope_type == "longrope" else None

    @property
    def fused_checkpoint(self) -> bool:
        """Phi-3's checkpoints hold q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``."""
        return self.family == "phi3"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 and Gemma 3: per-head RMSNorm (``q_norm``/``k_norm``, ``[head_dim]``) on q and k
        before RoPE."""
        return self.family in ("qwen3", "gemma3", "qwen3_moe")

    @property
    def gemma(self) -> bool:
        """Gemma 3's layer: embeddings scaled by sqrt(hidden_size); RMSNorm scales by ``1 + weight`` in
        float32; a norm after attention and around the MLP too (four a layer); a GeGLU MLP."""
        return self.family == "gemma3"

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (Qwen3-MoE, Mixtral)."""
        return self.num_experts > 0

    def moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the router and its experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def experts(self, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
        """An MoE layer's weight names, as its checkpoints spell them: the router's, and each
        expert's (gate, up, down) projections (Mixtral's w1, w3, w2)."""
        if self.family == "mixtral":
            m = f"model.layers.{layer}.block_sparse_moe."
            names = [
                (f"{m}experts.{e}.w1.weight", f"{m}experts.{e}.w3.weight", f"{m}experts.{e}.w2.weight")
                for e in range(self.num_experts)
            ]
        else:
            m = f"model.layers.{layer}.mlp."
            names = [
                tuple(f"{m}experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))  # type: ignore[misc]
                for e in range(self.num_experts)
            ]
        return m + "gate.weight", names

    @property
    def routing_in_float32(self) -> bool:
        """Mixtral weighs the experts' outputs by float32 routing weights; Qwen3-MoE rounds them to
        the model dtype first (as each transformers model does)."""
        return self.family == "mixtral"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention (None: it attends to every earlier position)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float | None:
        """The attention scores' scale where it is not 1/sqrt(head_dim) (Gemma 3's query_pre_attn_scalar)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5

    # ---- sizes ----
    def param_count(self) -> int:
        """Number of parameters, counting a tied embedding once."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.o_proj_bias:
            per_layer += h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.gemma:
            per_layer += 2 * h  # the norms after attention and before the MLP
        total = self.vocab_size * h + self.num_layers * per_layer + h
        for i in range(self.num_layers):  # the MLPs: experts and their router, or a dense one
            moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)
            total += moe if self.moe_layer(i) else 3 * h * self.intermediate_size
        if not self.tie_word_embeddings:
            total += self.vocab_size * h
        return total

    def param_bytes(self) -> int:
        """Bytes of the weights as held: FP8 matrices one byte a parameter, plus their float32 scales."""
        total = self.param_count() * self.torch_dtype.itemsize
        if self.fp8 is None:
            return total
        h, q, kv, inter = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        shapes = (
            [(q + 2 * kv, h), (h, q), (2 * inter, h), (inter, h)]
            if self.fused_checkpoint
            else [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
        )
        scales = sum(math.prod(self.fp8.scale_shape(rows, cols)) for rows, cols in shapes)
        per_layer = sum(rows * cols for rows, cols in shapes)
        return total - self.num_layers * (per_layer * (self.torch_dtype.itemsize - 1) - 4 * scales)

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token position."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict, either format; InvalidArgument for what this
        decoder would compute differently from transformers (see :data:`CONFIG_KEYS`)."""
        if not isinstance(hf, Mapping):
            raise InvalidArgument("config.json must hold a JSON object")
        family = _family(hf)
        _check_neutral(hf, family, "", "")
        defaults = FAMILY_DEFAULTS[family]

        def get(key: str) -> Any:
            """The file's value; the family's transformers default where the key is absent. An explicit
            null means "derived" (as transformers' ``__post_init__`` treats num_key_value_heads)."""
            return hf[key] if key in hf else defaults.get(key)

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise InvalidArgument(f"config.json: missing required key '{key}'")
            return hf[key]

        num_heads = _int(need("num_attention_heads"), "num_attention_heads")
        hidden = _int(need("hidden_size"), "hidden_size")
        num_layers = _int(need("num_hidden_layers"), "num_hidden_layers")
        head_dim = get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise InvalidArgument(
                    f"config.json: 'hidden_size' ({hidden}) must be a multiple of 'num_attention_heads' ({num_heads})"
                    " when there is no 'head_dim'",
                    metadata={"key": "hidden_size"},
                )
            head_dim = hidden // num_heads
        head_dim = _int(head_dim, "head_dim")
        if head_dim % 2:
            raise InvalidArgument(
                f"config.json: 'head_dim' ({head_dim}) must be even (RoPE rotates pairs)", metadata={"key": "head_dim"}
            )
        kv = get("num_key_value_heads")
        num_kv_heads = _int(num_heads if kv is None else kv, "num_key_value_heads")
        if num_heads % num_kv_heads:
            raise InvalidArgument(
                f"config.json: 'num_attention_heads' ({num_heads}) must be a multiple of 'num_key_value_heads'"
                f" ({num_kv_heads})",
                metadata={"key": "num_key_value_heads"},
            )
        eps = _float(get("rms_norm_eps"), "rms_norm_eps")
        if not 0 < eps < 1:
            raise InvalidArgument(
                f"config.json: 'rms_norm_eps' must be in (0, 1), got {eps}", metadata={"key": "rms_norm_eps"}
            )
        max_pos = _int(get("max_position_embeddings"), "max_position_embeddings")
        layer_types, local_theta, scale = None, None, None
        if family == "gemma3":
            theta, scaling, local_theta = _gemma3_rope(hf, max_pos)
            layer_types = _gemma3_layer_types(hf, num_layers)
            if get("hidden_activation") != "gelu_pytorch_tanh":
                raise InvalidArgument(
                    f"config.json: hidden_activation = {get('hidden_activation')!r} is not supported for gemma3: "
                    "the GeGLU MLP implements gelu_pytorch_tanh only",
                    metadata={"key": "hidden_activation"},
                )
            scale = _float(get("query_pre_attn_scalar"), "query_pre_attn_scalar", positive=True)
        else:
            theta, scaling = _rope(hf, family, max_pos)
        partial = _partial_rotary_factor(hf, family)
        if family in ("llama", "qwen3", "gemma3", "qwen3_moe"):
            attention_bias = _bool(hf.get("attention_bias") or False, "attention_bias")
        else:
            attention_bias = family == "qwen2"
        tie = hf.get("tie_word_embeddings")
        tie = defaults.get("tie_word_embeddings", False) if tie is None else tie
        return cls(
            family=family,
            vocab_size=_int(need("vocab_size"), "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(need("intermediate_size"), "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=eps,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_bool(tie, "tie_word_embeddings"),
            attention_bias=attention_bias,
            dtype=_dtype(hf),
            rope_scaling=scaling,
            sliding_window=_sliding_window(hf, family, num_layers),
            partial_rotary_factor=partial,
            layer_types=layer_types,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=scale,
            **_moe(hf, family, num_layers),
            fp8=_fp8(hf.get("quantization_config")),
        )

    def to_hf(self, legacy: bool = False) -> dict[str, Any]:
        """A ``config.json`` dict that :meth:`from_hf` reads back to this config (test checkpoints):
        as transformers 5 writes it, or with ``legacy`` in the old key names."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.family == "phi3":
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope.update(rope_type=s.rope_type, factor=s.factor)
            if s.rope_type == "longrope":
                rope.update(
                    short_factor=list(s.short_factor),
                    long_factor=list(s.long_factor),
                    attention_factor=s.attention_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings,
                )
            if s.rope_type == "llama3":
                rope.update(
                    low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings,
                )
        hf: dict[str, Any] = {
            "architectures": [_FAMILY_ARCHITECTURE[self.family]],
            "model_type": _FAMILY_MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.family in ("llama", "qwen3", "gemma3", "qwen3_moe"):
            hf["attention_bias"] = self.attention_bias
        if self.family in ("mistral", "phi3", "gemma3", "mixtral"):
            hf["sliding_window"] = self.sliding_window
        if self.family == "qwen3_moe":
            hf.update(
                use_sliding_window=self.sliding_window is not None,
                sliding_window=self.sliding_window,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=list(self.dense_layers),
            )
        if self.moe:
            hf.update(num_local_experts=self.num_experts, num_experts_per_tok=self.experts_per_token)
        if self.fp8 is not None:
            hf["quantization_config"] = fp8_config(self.fp8)
        if self.family == "gemma3":
            del hf["hidden_act"]
            hf.update(
                hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=self.query_pre_attn_scalar,
                layer_types=list(self.layer_types or ()),
            )
            local = {"rope_type": "default", "rope_theta": self.local_rope_theta}
            if legacy:
                theta = rope.pop("rope_theta")
                scaled = None if rope["rope_type"] == "default" else rope
                hf.update(
                    rope_theta=theta,
                    rope_local_base_freq=self.local_rope_theta,
                    rope_scaling=scaled,
                    torch_dtype=self.dtype,
                )
            else:
                hf.update(rope_parameters={"full_attention": rope, "sliding_attention": local}, dtype=self.dtype)
            return hf
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope":
            hf["original_max_position_embeddings"] = self.rope_scaling.original_max_position_embeddings
        if self.family in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=False, sliding_window=None)
        if legacy:
            theta = rope.pop("rope_theta")
            hf.update(rope_theta=theta, rope_scaling=None if rope["rope_type"] == "default" else rope)
            hf["torch_dtype"] = self.dtype
        else:
            hf.update(rope_parameters=rope, dtype=self.dtype)
        return hf


# ---- parsing helpers ----
def _family(hf: Mapping[str, Any]) -> Family:
    """The family from ``architectures`` and/or ``model_type``: either suffices, both must agree.

    A model's ``save_pretrained`` writes both; a config's own ``save_pretrained`` writes only
    ``model_type`` (``architectures`` is None in a fresh config and left out as a default).
    """
    implemented = ", ".join(f"{f} ({_FAMILY_ARCHITECTURE[f]})" for f in FAMILIES)
    archs, model_type = hf.get("architectures"), hf.get("model_type")
    by_arch: Family | None = None
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise InvalidArgument(
                f"config.json: unsupported architectures {archs!r}: this decoder implements {implemented}",
                metadata={"key": "architectures"},
            )
        by_arch = ARCHITECTURES[archs[0]]
    by_type: Family | None = None
    if model_type is not None:
        if model_type not in MODEL_TYPES:
            raise InvalidArgument(
                f"config.json: unsupported model_type {model_type!r}: this decoder implements {implemented}",
                metadata={"key": "model_type"},
            )
        by_type = MODEL_TYPES[model_type]
    if by_arch is not None and by_type is not None and by_arch != by_type:
        raise InvalidArgument(
            f"config.json: architectures {archs!r} and model_type {model_type!r} name different families"
        )
    family = by_arch or by_type
    if family is None:
        raise InvalidArgument(
            f"config.json: neither 'architectures' nor 'model_type' names the model; this decoder implements "
            f"{implemented}"
        )
    return family


def _int(value: Any, key: str) -> int:
    """An integer key, within its :data:`BOUNDS` (found by the key's last name), named when refused."""
    lo, hi = BOUNDS.get(key.rsplit(".", 1)[-1], (-INT32_MAX, INT32_MAX))
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value != int(value) or not lo <= value <= hi:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise InvalidArgument(
            f"config.json: '{key}' must be an integer in [{lo}, {hi}], got {shown}", metadata={"key": key}
        )
    return int(value)


def _float(value: Any, key: str, positive: bool = False) -> float:
    """A number key (finite; ``positive``: > 0, for what divides or scales), named when refused."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"config.json: '{key}' must be a number, got {value!r}", metadata={"key": key})
    if positive and not value > 0:
        raise InvalidArgument(f"config.json: '{key}' must be > 0, got {value!r}", metadata={"key": key})
    return float(value)


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"config.json: '{key}' must be true or false, got {value!r}")
    return value


def _agreed(a: Any, b: Any, what: str) -> Any:
    """One value given in two places: either may be absent (None); both present must be equal, since
    transformers would silently use one of them."""
    if a is not None and b is not None and not _same(a, b):
        raise InvalidArgument(f"config.json: {what} disagree ({a!r} vs {b!r})")
    return a if a is not None else b


def _dtype(hf: Mapping[str, Any]) -> str:
    value = _agreed(hf.get("dtype"), hf.get("torch_dtype"), "'dtype' and 'torch_dtype'")
    if value is None:
        return "float32"
    if value not in DTYPES:
        raise InvalidArgument(f"config.json: dtype must be one of {sorted(DTYPES)}, got {value!r}")
    return str(value)


def _rope(hf: Mapping[str, Any], family: Family, max_pos: int) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + top-level
    ``rope_theta`` (legacy), resolved the way transformers' ``RotaryEmbeddingConfigMixin`` does."""
    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, Mapping):
            raise InvalidArgument(f"config.json: {name} must be an object, got {value!r}")
    if params and legacy and dict(params) != dict(legacy):
        raise InvalidArgument(
            "config.json: rope_parameters and rope_scaling disagree (transformers would use rope_scaling)"
        )
    raw: Mapping[str, Any] = legacy or params or {}
    where = "rope_scaling" if legacy else "rope_parameters"
    if any(isinstance(v, Mapping) and ROPE_PREFIX + str(k) not in CONFIG_KEYS for k, v in raw.items()):
        # transformers' nested form, one dict per layer type ({"full_attention": {...}, "sliding_attention": ...})
        raise InvalidArgument(f"config.json: per-layer-type RoPE parameters in {where} are not implemented")
    _check_neutral(raw, family, ROPE_PREFIX, where + ".")

    kind = _agreed(raw.get("rope_type"), raw.get("type"), f"{where}.rope_type and {where}.type") or "default"
    if family == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # what transformers' Phi-3 config makes of the old names
    theta = _agreed(raw.get("rope_theta"), hf.get("rope_theta"), f"{where}.rope_theta and rope_theta")
    theta = _FAMILY_THETA.get(family, _DEFAULT_THETA) if theta is None else _float(theta, "rope_theta")
    if theta <= 0:
        raise InvalidArgument(f"config.json: rope_theta must be > 0, got {theta}")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise InvalidArgument(f"config.json: {where} of rope_type {kind!r} needs '{key}'")
        return raw[key]

    if kind == "default":
        factor = raw.get("factor")
        if factor is not None and not _same(factor, 1):
            raise InvalidArgument(
                f"config.json: {where}.factor = {factor!r} without a scaling rope_type: transformers would ignore it;"
                " name the rope_type it was trained with"
            )
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", _float(need("factor"), f"{where}.factor", positive=True))
    if kind == "llama3":
        original = _agreed(
            hf.get("original_max_position_embeddings"),
            raw.get("original_max_position_embeddings"),
            f"original_max_position_embeddings and {where}.original_max_position_embeddings",
        )
        scaling = RopeScaling(
            "llama3",
            _float(need("factor"), f"{where}.factor", positive=True),
            low_freq_factor=_float(need("low_freq_factor"), f"{where}.low_freq_factor", positive=True),
            high_freq_factor=_float(need("high_freq_factor"), f"{where}.high_freq_factor", positive=True),
            original_max_position_embeddings=_int(
                max_pos if original is None else original, f"{where}.original_max_position_embeddings"
            ),
        )
        if scaling.high_freq_factor == scaling.low_freq_factor:
            raise InvalidArgument(f"config.json: {where}: llama3 needs high_freq_factor != low_freq_factor")
        return theta, scaling
    if kind == "longrope" and family == "phi3":
        return theta, _longrope(hf, raw, where, max_pos)
    raise InvalidArgument(
        f"config.json: RoPE type {kind!r} ({where}) is not implemented; this decoder implements "
        f"{', '.join(ROPE_TYPES)}",
        metadata={"key": ROPE_PREFIX + "rope_type"},
    )


def _longrope(hf: Mapping[str, Any], raw: Mapping[str, Any], where: str, max_pos: int) -> RopeScaling:
    """Phi-3's LongRoPE as transformers 5.17 computes it (``_compute_longrope_parameters``): the
    original context is the config's top-level one (the class default, 4096, when the file has none;
    transformers prefers it to the one in the RoPE dict, so the two must agree), ``factor`` defaults
    to max_position_embeddings / original, ``attention_factor`` to sqrt(1 + ln(factor) / ln(original))
    (1 for a factor of at most 1)."""
    top = hf.get("original_max_position_embeddings", FAMILY_DEFAULTS["phi3"]["original_max_position_embeddings"])
    original = _int(
        _agreed(
            top,
            raw.get("original_max_position_embeddings"),
            f"original_max_position_embeddings and {where}.original_max_position_embeddings",
        ),
        "original_max_position_embeddings",
    )
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = raw.get(name)
        if not isinstance(value, list) or not value:
            raise InvalidArgument(f"config.json: {where}.{name} must be a list of numbers for longrope, got {value!r}")
        factors[name] = tuple(_float(v, f"{where}.{name}", positive=True) for v in value)
    factor = raw.get("factor")
    factor = max_pos / original if factor is None else _float(factor, f"{where}.factor", positive=True)
    attention = raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = _float(attention, f"{where}.attention_factor", positive=True)
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
        attention_factor=attention,
    )


def _gemma3_rope(hf: Mapping[str, Any], max_pos: int) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's two RoPEs, as its config class resolves them: ``rope_parameters`` holds one dict per
    layer type (transformers 5), or the old files give ``rope_theta`` and ``rope_scaling`` (the full
    layers') and ``rope_local_base_freq`` (the sliding layers'); bases default to :data:`GEMMA3_THETA`.
    The full layers' RoPE is read as any family's (default, linear or llama3); the sliding layers'
    must be the default one. Returns (full theta, full scaling, sliding theta)."""
    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, Mapping):
            raise InvalidArgument(f"config.json: {name} must be an object, got {value!r}")
    if params and not set(params) <= set(LAYER_TYPES):
        raise InvalidArgument(
            f"config.json: Gemma 3's rope_parameters holds one object per layer type ({', '.join(LAYER_TYPES)}), "
            f"got the keys {sorted(params)}",
            metadata={"key": "rope_parameters"},
        )
    parts = {t: (params or {}).get(t) or {} for t in LAYER_TYPES}
    for t, part in parts.items():
        if not isinstance(part, Mapping):
            raise InvalidArgument(f"config.json: rope_parameters.{t} must be an object, got {part!r}")
    full, local = dict(parts["full_attention"]), dict(parts["sliding_attention"])
    if legacy:
        if any(k in full and not _same(full[k], v) for k, v in legacy.items()):
            raise InvalidArgument("config.json: rope_scaling and rope_parameters.full_attention disagree")
        full.update(legacy)  # the old files' scaling is the full layers'
    theta = _agreed(
        full.get("rope_theta"), hf.get("rope_theta"), "rope_parameters.full_attention.rope_theta and rope_theta"
    )
    local_theta = _agreed(
        local.get("rope_theta"),
        hf.get("rope_local_base_freq"),
        "rope_parameters.sliding_attention.rope_theta and rope_local_base_freq",
    )
    full["rope_theta"] = GEMMA3_THETA["full_attention"] if theta is None else theta
    kind = _agreed(local.get("rope_type"), local.get("type"), "the sliding layers' rope_type and type")
    if kind not in (None, "default") or set(local) - {"rope_type", "type", "rope_theta"}:
        raise InvalidArgument(
            f"config.json: rope_parameters.sliding_attention = {dict(local)!r}: the sliding layers' RoPE is the "
            "default one with its own base here; scaling it is not implemented",
            metadata={"key": "rope_parameters"},
        )
    base, scaling = _rope({"rope_parameters": full}, "gemma3", max_pos)
    local_base = (
        GEMMA3_THETA["sliding_attention"] if local_theta is None else _float(local_theta, "rope_local_base_freq")
    )
    if local_base <= 0:
        raise InvalidArgument(f"config.json: the sliding layers' rope_theta must be > 0, got {local_base}")
    return base, scaling, local_base


_FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
FP8_BLOCK = 128
"""The block of transformers' fine-grained FP8: 128 x 128 weights per scale, 128 activations per scale."""


def fp8_config(fp8: Fp8) -> dict[str, Any]:
    """The ``quantization_config`` llm-compressor (transformers, for blocks) writes for this scheme
    (test checkpoints)."""
    if fp8.weight_strategy == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    group = {
        "targets": ["Linear"],
        "weights": {**_FP8_WEIGHTS, "strategy": fp8.weight_strategy},
        "input_activations": dict(_FP8_TOKENS),
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


_FP8_TOKENS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}


def _fp8(raw: Any) -> Fp8 | None:
    """``quantization_config``: None; compressed-tensors' FP8-dynamic (see :class:`Fp8`): one config
    group targeting ``Linear``, 8-bit float symmetric static weights per channel or per tensor, 8-bit
    float dynamic per-token input activations, ``lm_head`` ignored (nothing else); or transformers'
    fine-grained FP8 with 128 x 128 blocks and dynamic activations. Anything else — another method
    (GPTQ, AWQ, bitsandbytes), weight-only FP8, static activation scales, a quantized KV cache — is
    refused with what it is."""
    if raw is None:
        return None

    def refuse(why: str) -> InvalidArgument:
        return InvalidArgument(f"config.json: quantization_config: {why}", metadata={"key": "quantization_config"})

    if not isinstance(raw, Mapping):
        raise refuse(f"must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "fp8":  # transformers' fine-grained FP8
        if raw.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK]:
            raise refuse(f"weight_block_size {raw.get('weight_block_size')!r}: 128 x 128 blocks are implemented")
        if raw.get("activation_scheme", "dynamic") != "dynamic" or raw.get("fmt", "e4m3") != "e4m3":
            raise refuse("dynamic activations in e4m3 are implemented")
        if raw.get("modules_to_not_convert") not in (None, ["lm_head"]):
            raise refuse(f"modules_to_not_convert {raw.get('modules_to_not_convert')!r}: every Linear but lm_head")
        return Fp8("block")
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r} is not implemented (FP8 of compressed-tensors or transformers is)")
    if raw.get("format") != "float-quantized":
        raise refuse(f"compressed-tensors format {raw.get('format')!r} is not implemented (float-quantized is)")
    if raw.get("kv_cache_scheme") is not None or raw.get("sparsity_config"):
        raise refuse("a quantized KV cache or sparse weights are not implemented")
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise refuse("one config group (every Linear the same way) is implemented")
    (group,) = groups.values()
    if not isinstance(group, Mapping) or group.get("targets") != ["Linear"]:
        raise refuse("the group must target every Linear (targets: ['Linear'])")
    weights, tokens = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, Mapping) or any(weights.get(k) != v for k, v in _FP8_WEIGHTS.items()):
        raise refuse(f"weights {weights!r}: 8-bit float, symmetric, static scales are implemented")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise refuse(f"weight strategy {strategy!r}: channel or tensor is implemented")
    if not isinstance(tokens, Mapping) or any(tokens.get(k) != v for k, v in _FP8_TOKENS.items()):
        raise refuse(f"input_activations {tokens!r}: dynamic 8-bit float per token is implemented")
    if group.get("output_activations") is not None:
        raise refuse("quantized output activations are not implemented")
    if list(raw.get("ignore") or []) != ["lm_head"]:
        raise refuse(f"ignore {raw.get('ignore')!r}: every Linear but lm_head quantized is implemented")
    return Fp8(strategy)


def _moe(hf: Mapping[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """The experts of Qwen3-MoE or Mixtral as their transformers configs resolve them (none for the
    dense families): ``num_experts`` and ``num_local_experts`` are one key spelled two ways; Qwen3-MoE's
    layers are MoE ones where ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
    ``mlp_only_layers``; Mixtral's experts are ``intermediate_size`` wide and always renormalised."""
    if family not in MOE_FAMILIES:
        return {}
    defaults = FAMILY_DEFAULTS[family]
    count = _agreed(hf.get("num_local_experts"), hf.get("num_experts"), "num_local_experts and num_experts")
    if count is None:
        count = defaults.get("num_experts", defaults.get("num_local_experts"))
    experts = _int(count, "num_experts")
    per_token = _int(hf.get("num_experts_per_tok", defaults["num_experts_per_tok"]), "num_experts_per_tok")
    if per_token > experts:
        raise InvalidArgument(
            f"config.json: num_experts_per_tok ({per_token}) exceeds the {experts} experts",
            metadata={"key": "num_experts_per_tok"},
        )
    if family == "mixtral":
        return {
            "num_experts": experts,
            "experts_per_token": per_token,
            "norm_topk_prob": True,
            "moe_intermediate_size": _int(hf["intermediate_size"], "intermediate_size"),
        }
    step = _int(hf.get("decoder_sparse_step", defaults["decoder_sparse_step"]), "decoder_sparse_step")
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_layer(i, num_layers) for i in only):
        raise InvalidArgument(
            f"config.json: mlp_only_layers must list layer indices below {num_layers}, got {only!r}",
            metadata={"key": "mlp_only_layers"},
        )
    norm = hf.get("norm_topk_prob")
    return {
        "num_experts": experts,
        "experts_per_token": per_token,
        "moe_intermediate_size": _int(
            hf.get("moe_intermediate_size", defaults["moe_intermediate_size"]), "moe_intermediate_size"
        ),
        "norm_topk_prob": _bool(defaults["norm_topk_prob"] if norm is None else norm, "norm_topk_prob"),
        "dense_layers": tuple(i for i in range(num_layers) if i in only or (i + 1) % step),
    }


def _is_layer(value: Any, num_layers: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < num_layers


def _gemma3_layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Gemma 3's layer types: ``layer_types``, or from ``sliding_window_pattern`` (every n-th layer
    full, the others sliding; 6 by default), as its config class makes them."""
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern")
        pattern = GEMMA3_PATTERN if pattern is None else _int(pattern, "sliding_window_pattern")
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise InvalidArgument(
            f"config.json: layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}, got {types!r}",
            metadata={"key": "layer_types"},
        )
    return tuple(types)


def _partial_rotary_factor(hf: Mapping[str, Any], family: Family) -> float:
    """Phi-3's fraction of each head that RoPE rotates: in the RoPE dict (transformers 5) or at the top
    level (older files; transformers takes it from there when the dict has none); 1 elsewhere (the
    table holds the others to 1)."""
    if family != "phi3":
        return 1.0
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    value = _agreed(
        hf.get("partial_rotary_factor"),
        rope.get("partial_rotary_factor"),
        "partial_rotary_factor and rope_parameters.partial_rotary_factor",
    )
    if value is None:
        return 1.0
    factor = _float(value, "partial_rotary_factor", positive=True)
    if factor > 1:
        raise InvalidArgument(f"config.json: partial_rotary_factor must be in (0, 1], got {factor}")
    return factor


def _sliding_window(hf: Mapping[str, Any], family: Family, num_layers: int) -> int | None:
    """Mistral's window (every layer); for Qwen, a refusal where sliding-window layers would exist.

    Qwen2/Qwen3 slide in the layers from ``max_window_layers`` on when ``use_sliding_window`` is set
    and no explicit ``layer_types`` says otherwise (transformers' config ``__post_init__``); those
    layers are not implemented. ``layer_types`` itself is held to all full attention by the table.
    """
    layer_types = hf.get("layer_types")
    if layer_types is not None and len(layer_types) != num_layers:
        raise InvalidArgument(
            f"config.json: layer_types has {len(layer_types)} entries for {num_layers} num_hidden_layers"
        )
    defaults = FAMILY_DEFAULTS[family]
    window = hf["sliding_window"] if "sliding_window" in hf else defaults.get("sliding_window")  # null: no window
    if family == "qwen3_moe":  # every layer slides when use_sliding_window is set (its config's __post_init__)
        use = _bool(hf.get("use_sliding_window") or False, "use_sliding_window")
        window = window if use else None
    if family in ("mistral", "phi3", "gemma3", "mixtral", "qwen3_moe"):
        if window is None:
            return None
        window = _int(window, "sliding_window")
        if window <= 0:
            raise InvalidArgument(f"config.json: sliding_window must be > 0, got {window}")
        return window
    if family in ("qwen2", "qwen3"):
        use = _bool(hf.get("use_sliding_window") or False, "use_sliding_window")
        first = hf.get("max_window_layers")
        first = _int(defaults["max_window_layers"] if first is None else first, "max_window_layers")
        if use and window is not None and layer_types is None and first < num_layers:
            raise InvalidArgument(
                f"config.json: use_sliding_window makes layers {first}..{num_layers - 1} sliding-window layers "
                f"(max_window_layers {first}, sliding_window {window}); they are not implemented for {family}",
                metadata={"key": "use_sliding_window"},
            )
    return None


_TINY = ModelConfig(
    family="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    dtype="float32",
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    "small": replace(
        _TINY,
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
    ),
    "1b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        dtype="bfloat16",
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
    ),
    "8b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        dtype="bfloat16",
    ),
}
"""Shapes for ``synthetic:<preset>`` models: tiny and small for tests, 1b (Llama-3.2-1B) and 8b
(Llama-3-8B) for realistic memory sizes in benchmarks."""

__all__ = [
    "ARCHITECTURES",
    "BOUNDS",
    "CONFIG_KEYS",
    "DTYPES",
    "FAMILIES",
    "FAMILY_DEFAULTS",
    "MODEL_TYPES",
    "PRESETS",
    "ROPE_PREFIX",
    "ROPE_TYPES",
    "Family",
    "KeyRule",
    "FP8_BLOCK",
    "Fp8",
    "ModelConfig",
    "RopeScaling",
    "fp8_config",
    "key_rule",
]
