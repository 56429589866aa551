"""The shape of a Llama-family decoder: what the weights, the KV cache and the decoder agree on.

One frozen value describes a model whether it comes from a Hugging Face ``config.json`` or a
``synthetic:<preset>``, so the allocator sizes, the checkpoint loader and the decoder cannot disagree
about a dimension. Parsing is strict: an architecture or option this decoder would compute wrongly
(another activation, an unknown RoPE scaling, MLP biases) is refused rather than served with wrong
logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from memsvc.errors import InvalidArgument

Family = Literal["llama", "qwen2", "mistral"]

_ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_FAMILY_ARCHITECTURE = {family: arch for arch, family in _ARCHITECTURES.items()}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1+ style frequency scaling (``rope_type`` "llama3") or plain "linear" scaling.

    Llama-3.2 checkpoints ship with "llama3" scaling; it changes the rotary frequencies at every
    position, so ignoring it would silently change every logit.
    """

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    original_max_position_embeddings: int = 8192
    """llama3 only: the context length the unscaled frequencies were trained for."""


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and numerics of a Llama / Qwen2 / Mistral decoder."""

    family: Family
    """Which Hugging Face architecture the weights follow (names and biases)."""
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
    """q/k/v projections carry biases (always for Qwen2)."""
    dtype: str = "float32"
    """Weights, activations and KV cache dtype: float32, bfloat16 or float16."""
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    """Mistral: a query attends to at most this many most recent positions (None: all)."""

    def __post_init__(self) -> None:
        if self.family not in _FAMILY_ARCHITECTURE:
            raise InvalidArgument(f"model family must be llama, qwen2 or mistral, got {self.family!r}")
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "max_position_embeddings",
        ):  # fmt: skip
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
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise InvalidArgument(f"model config: sliding_window must be > 0, got {self.sliding_window}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    # ---- sizes ----
    def param_count(self) -> int:
        """Number of parameters, counting a tied embedding once."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        total = self.vocab_size * h + self.num_layers * per_layer + h
        if not self.tie_word_embeddings:
            total += self.vocab_size * h
        return total

    def param_bytes(self) -> int:
        return self.param_count() * self.torch_dtype.itemsize

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token position."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict; InvalidArgument for what this decoder cannot run."""
        if not isinstance(hf, Mapping):
            raise InvalidArgument("config.json must hold a JSON object")
        archs = hf.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in _ARCHITECTURES:
            raise InvalidArgument(f"unsupported architectures {archs!r}: expected one of {sorted(_ARCHITECTURES)}")
        family = _ARCHITECTURES[archs[0]]

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise InvalidArgument(f"config.json: missing required key '{key}'")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidArgument(f"config.json: hidden_act {act!r} is not supported (only silu)")
        if hf.get("mlp_bias"):
            raise InvalidArgument("config.json: mlp_bias is not supported")
        if family == "qwen2" and hf.get("use_sliding_window"):
            raise InvalidArgument("config.json: Qwen2 use_sliding_window is not supported")

        num_heads = _int(need("num_attention_heads"), "num_attention_heads")
        hidden = _int(need("hidden_size"), "hidden_size")
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise InvalidArgument("config.json: hidden_size is not a multiple of num_attention_heads")
            head_dim = hidden // num_heads
        dtype = hf.get("torch_dtype", hf.get("dtype")) or "float32"
        sliding = hf.get("sliding_window") if family == "mistral" else None
        return cls(
            family=family,
            vocab_size=_int(need("vocab_size"), "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(need("intermediate_size"), "intermediate_size"),
            num_layers=_int(need("num_hidden_layers"), "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_int(hf.get("num_key_value_heads") or num_heads, "num_key_value_heads"),
            head_dim=_int(head_dim, "head_dim"),
            rope_theta=_float(hf.get("rope_theta", 10000.0), "rope_theta"),
            rms_norm_eps=_float(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            max_position_embeddings=_int(hf.get("max_position_embeddings", 2048), "max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if family == "qwen2" else bool(hf.get("attention_bias", False)),
            dtype=str(dtype),
            rope_scaling=_rope_scaling(hf.get("rope_scaling")),
            sliding_window=None if sliding is None else _int(sliding, "sliding_window"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that :meth:`from_hf` reads back to this config (test checkpoints)."""
        hf: dict[str, Any] = {
            "architectures": [_FAMILY_ARCHITECTURE[self.family]],
            "model_type": _MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "rope_scaling": None,
        }
        if self.family != "qwen2":
            hf["attention_bias"] = self.attention_bias
        if self.family == "mistral":
            hf["sliding_window"] = self.sliding_window
        if self.rope_scaling is not None:
            s = self.rope_scaling
            hf["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor}
            if s.rope_type == "llama3":
                hf["rope_scaling"].update(
                    low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings,
                )
        return hf


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise InvalidArgument(f"config.json: '{key}' must be an integer, got {value!r}")
    return int(value)


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"config.json: '{key}' must be a number, got {value!r}")
    return float(value)


def _rope_scaling(raw: Any) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"config.json: rope_scaling must be an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    factor = _float(raw.get("factor", 1.0), "rope_scaling.factor")
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor,
            low_freq_factor=_float(raw.get("low_freq_factor", 1.0), "rope_scaling.low_freq_factor"),
            high_freq_factor=_float(raw.get("high_freq_factor", 4.0), "rope_scaling.high_freq_factor"),
            original_max_position_embeddings=_int(
                raw.get("original_max_position_embeddings", 8192), "rope_scaling.original_max_position_embeddings"
            ),
        )
    raise InvalidArgument(f"config.json: rope_scaling type {kind!r} is not supported (linear, llama3)")


_TINY = ModelConfig(
    family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=2048, dtype="float32",
)  # fmt: skip

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

__all__ = ["DTYPES", "PRESETS", "Family", "ModelConfig", "RopeScaling"]
