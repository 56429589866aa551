"""Model weights as pool tensors tagged ``weights``: names, allocation, where they come from
(a seeded synthetic preset or a safetensors checkpoint), and checkpoint I/O.

Every weight is allocated with ``alloc.empty(..., tag="weights")`` and never by torch's own
allocator, so the whole model sleeps and wakes with the pool at the same addresses, on the cuda and
the host backend alike. Loading copies *into* those tensors: a level-2 wake (weights discarded) reloads
the checkpoint without a single tensor changing address, so captured graphs and views stay valid.
That is also why the runner keeps its :class:`ModelSource` for the worker's whole life: a source is
cheap to hold and re-reads its data on every :meth:`ModelSource.load_into`.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from memsvc.errors import InvalidArgument
from memsvc.vocabulary import WEIGHTS
from worker.allocator import MemoryAllocator
from worker.checkpoint_files import CONFIG_FILE, SYNTHETIC_PREFIX, read_json
from worker.model.config import PRESETS, ModelConfig
from worker.model.generation import read_eos_token_ids
from worker.model.loader import INDEX_FILE, LoadStats, Progress, StreamingLoader, read_layout
from worker.model.text_source import TextOnce, TextSource

if TYPE_CHECKING:  # the text is read where it is asked for (worker/model/text_source.py), not with the weights
    from worker.model.text import ModelText

Weights = dict[str, torch.Tensor]


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model by its Hugging Face name, in checkpoint order."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if config.fused_checkpoint:  # Phi-3: [q; k; v] rows in one tensor
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.gemma:  # the norms before and after the MLP
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if config.moe_layer(i):  # the router, then each expert's SwiGLU
            router, experts = config.experts(i)
            shapes[router] = (config.num_experts, h)
            inter = config.moe_intermediate_size
            for gate, up, down in experts:
                shapes[gate], shapes[up], shapes[down] = (inter, h), (inter, h), (h, inter)
            continue
        if config.fused_checkpoint:  # Phi-3: [gate; up] rows in one tensor
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * config.intermediate_size, h)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    if config.fp8 is not None:  # each FP8 matrix's scales: per output row, per matrix, or per block
        for name in [n for n in shapes if quantized(config, n)]:
            shapes[name + config.fp8.scale_suffix] = config.fp8.scale_shape(*shapes[name])
    return shapes


def quantized(config: ModelConfig, name: str) -> bool:
    """Whether the weight ``name`` is an FP8 matrix (every projection of the decoder layers, with
    ``fp8``; not the embeddings nor the output projection)."""
    return config.fp8 is not None and name.startswith("model.layers.") and name.endswith("_proj.weight")


def weight_dtype(config: ModelConfig, name: str) -> torch.dtype:
    """The dtype the weight ``name`` is held in: FP8 matrices' ``float8_e4m3fn``, their scales'
    float32, everything else the model's."""
    if quantized(config, name):
        return torch.float8_e4m3fn
    if config.fp8 is not None and name.endswith((".weight_scale", ".weight_scale_inv")):
        return torch.float32
    return config.torch_dtype


FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
"""Per layer, the projections that read the same input: their matrices are row blocks of one pool
tensor, so the decoder runs each group as one matrix product (worker/model/decoder.py). A checkpoint
that stores them fused (Phi-3's ``qkv_proj`` and ``gate_up_proj``) is one tensor each already."""


def allocate_weights(config: ModelConfig, alloc: MemoryAllocator) -> Weights:
    """Uninitialised pool tensors for every weight (fill them with a source's ``load_into``).

    Every name is its own tensor, but each layer's :data:`FUSED_GROUPS` (weights, and biases when
    there are) are consecutive row slices of one allocation, and so are an MoE layer's experts: their
    gate and up rows in one ``[experts, 2 * width, hidden]`` tensor, their downs in another (what a
    grouped product over the experts reads)."""
    shapes = weight_shapes(config)
    dtype = config.torch_dtype
    weights: Weights = {}
    for i in range(config.num_layers):
        if config.moe_layer(i):  # each expert's [gate; up] rows, then their downs, as one tensor each
            _, experts = config.experts(i)
            inter, h = config.moe_intermediate_size, config.hidden_size
            gate_up = alloc.empty((config.num_experts, 2 * inter, h), dtype, tag=WEIGHTS)
            downs = alloc.empty((config.num_experts, h, inter), dtype, tag=WEIGHTS)
            for e, (gate, up, down) in enumerate(experts):
                weights[gate], weights[up], weights[down] = gate_up[e, :inter], gate_up[e, inter:], downs[e]
        for group in FUSED_GROUPS:
            for suffix in (".weight", ".bias", ".weight_scale", ".weight_scale_inv"):
                names = [f"model.layers.{i}.{g}{suffix}" for g in group]
                if names[0] not in shapes:
                    continue
                rows = [shapes[n][0] for n in names]
                whole = alloc.empty((sum(rows), *shapes[names[0]][1:]), weight_dtype(config, names[0]), tag=WEIGHTS)
                start = 0
                for name, n in zip(names, rows, strict=True):
                    weights[name] = whole[start : start + n]
                    start += n
    for name, shape in shapes.items():
        if name not in weights:
            weights[name] = alloc.empty(shape, weight_dtype(config, name), tag=WEIGHTS)
    return {name: weights[name] for name in shapes}


@torch.no_grad()
def fill_synthetic(weights: Mapping[str, torch.Tensor], config: ModelConfig, seed: int) -> None:
    """Seeded random weights, generated on the tensors' device: embeddings std 0.02, every other
    matrix std 1/sqrt(fan_in), norm scales 1.

    The 1/sqrt(fan_in) scale lets each layer move the residual stream as much as the embedding does;
    with 0.02 everywhere, a model with tied embeddings just echoes its last input token, which makes
    "the same tokens after wake" prove nothing.

    Generating in place on the device needs no host staging, so even an 8B-shaped model fills in
    seconds; the stream of numbers depends on the device type, so tokens are reproducible per device.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name in weight_shapes(config):
        t = weights[name]
        if name.endswith("norm.weight"):
            t.fill_(1.0)
            continue
        gen = generators.get(t.device)
        if gen is None:
            gen = generators[t.device] = torch.Generator(device=t.device)
            gen.manual_seed(seed)
        std = 0.02 if name.endswith("embed_tokens.weight") or t.dim() < 2 else t.shape[-1] ** -0.5
        t.normal_(0.0, std, generator=gen)


def check_checkpoint(path: str | os.PathLike[str], config: ModelConfig) -> dict[Path, list[str]]:
    """Which file holds which of the model's tensors, after checking every tensor is there with the
    config's shape and every header involved is sound: reads the files' headers only, not their
    data, with the very parse the load uses (worker/model/loader.py), so what passes here loads."""
    return read_layout(path, weight_shapes(config)).by_file()


def load_checkpoint(
    path: str | os.PathLike[str],
    weights: Mapping[str, torch.Tensor],
    config: ModelConfig,
    loader: StreamingLoader | None = None,
) -> LoadStats:
    """Copy a Hugging Face safetensors checkpoint into the existing weight tensors, in place.

    Every header, tensor's presence and shape is checked before the first byte is copied, so a
    wrong, damaged or truncated checkpoint leaves the weights as they were. Tensors the model does
    not use (a saved ``lm_head`` of a tied model, rotary buffers) are ignored; dtypes are converted
    to the config's. ``loader``: keep one across loads to keep its staging ring (a fresh one
    allocates its ring for this call alone); see :class:`StreamingLoader`.
    """
    return (loader or StreamingLoader()).load(path, weights, weight_shapes(config))


def save_checkpoint(path: str | os.PathLike[str], weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Write ``config.json`` and ``model.safetensors`` in Hugging Face layout (tests, exports)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    # clone: fused projections share one allocation, and safetensors refuses tensors that share memory
    tensors = {name: weights[name].detach().to("cpu").clone() for name in weight_shapes(config)}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint directory's ``config.json``."""
    return ModelConfig.from_hf(read_json(Path(path) / CONFIG_FILE))


class ModelSource(abc.ABC):
    """A model's config plus a way to (re)write its weights into existing tensors."""

    name: str
    """How the model was named (``synthetic:tiny``, a checkpoint path): for info and telemetry."""
    config: ModelConfig
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a generation (worker/model/generation.py); none for synthetic models."""
    text_once: TextOnce
    """The model's tokenizer and chat template, read when first asked for (:attr:`text`)."""

    @property
    def text(self) -> ModelText | None:
        """The model's tokenizer and chat template, when its directory has them (a synthetic model's
        are made for it), read now if no one asked before (worker/model/text_source.py)."""
        return self.text_once.get()

    @abc.abstractmethod
    def load_into(self, weights: Mapping[str, torch.Tensor], progress: Progress | None = None) -> None:
        """Write every weight in place; tensors keep their addresses. ``progress``: told the bytes
        read as the load goes (a checkpoint's; made weights have nothing to read)."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise what :meth:`load_into` would raise before copying a byte (a missing or mismatched
        file), without reading the data: a level-2 wake checks first, so it can refuse with nothing
        changed."""

    def make_room(self, nbytes: int) -> None:
        """Before ``nbytes`` of device memory are allocated for the weights: give back device memory
        this source holds for its first load (a checkpoint's start-up staging) unless they fit beside
        it. Nothing, for a source that holds none."""
        return None


class SyntheticSource(ModelSource):
    """Seeded random weights in a preset's shapes (:data:`PRESETS`), for tests and benchmarks, with a
    tokenizer and a chat template made for the preset's vocabulary (worker/model/synthetic_text.py)."""

    def __init__(self, preset: str, seed: int = 0) -> None:
        if preset not in PRESETS:
            raise InvalidArgument(f"unknown synthetic preset {preset!r}: expected one of {sorted(PRESETS)}")
        self.name = SYNTHETIC_PREFIX + preset
        self.config = PRESETS[preset]
        self.seed = seed
        self.text_once = TextOnce(TextSource(synthetic_vocab=self.config.vocab_size))

    def load_into(self, weights: Mapping[str, torch.Tensor], progress: Progress | None = None) -> None:
        fill_synthetic(weights, self.config, self.seed)

    def check(self) -> None:
        """Nothing to read: the weights are made from the seed."""


class CheckpointSource(ModelSource):
    """A local Hugging Face checkpoint directory: ``config.json`` and ``*.safetensors``."""

    loader: StreamingLoader
    """Reads the files into the weights; kept, with its staging ring, for every later load."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        same_as: ModelSource | None = None,
        loader: StreamingLoader | None = None,
    ) -> None:
        """``same_as``: new weights for that model (ReloadWeights from another directory, the
        reinforcement-learning loop). The configuration must be exactly that model's and every
        tensor's shape is checked before a byte is copied; the tokenizer and EOS tokens stay that
        model's (the vocabulary is the same by construction), and so does the loader.

        ``loader``: what reads the files. The source keeps it, and with it its staging ring, for
        every later load (a level-2 wake reloads many times); give it the worker's allocator
        (``StreamingLoader(alloc)``) so the ring is the allocator's fast page-locked memory. By
        default a loader of its own, with torch's pinned memory for a CUDA destination."""
        self.path = Path(path)
        if loader is None and isinstance(same_as, CheckpointSource):
            loader = same_as.loader
        self.loader = loader if loader is not None else StreamingLoader()
        self.name = str(self.path)
        self.config = read_config(self.path)
        if same_as is not None:
            if self.config != same_as.config:
                diff = next(
                    f"{f.name}: {getattr(same_as.config, f.name)!r} -> {getattr(self.config, f.name)!r}"
                    for f in dataclasses.fields(ModelConfig)
                    if getattr(same_as.config, f.name) != getattr(self.config, f.name)
                )
                raise InvalidArgument(
                    f"{self.path} is not a checkpoint of the served model's configuration ({diff})",
                    metadata={"path": self.name},
                )
            self.eos_token_ids, self.text_once = same_as.eos_token_ids, same_as.text_once
            self.check()
            return
        self.eos_token_ids = read_eos_token_ids(self.path)
        self.text_once = TextOnce(TextSource(directory=str(self.path)))

    def load_into(self, weights: Mapping[str, torch.Tensor], progress: Progress | None = None) -> None:
        self.loader.load(self.path, weights, weight_shapes(self.config), progress)

    def make_room(self, nbytes: int) -> None:
        self.loader.make_room(nbytes)

    def check(self) -> None:
        """:func:`check_checkpoint`, through the loader: bounded as its loads are (a hung mount)."""
        self.loader.check(self.path, weight_shapes(self.config))


def parse_model_spec(
    spec: str, seed: int = 0, loader: StreamingLoader | None = None, name: str | None = None
) -> ModelSource:
    """``synthetic:<preset>`` or a checkpoint directory path (read by ``loader``, see
    :class:`CheckpointSource`); ``name``: how to name a checkpoint instead of its path (the Hub id
    its snapshot was resolved from, worker/model/hub.py)."""
    if not isinstance(spec, str) or not spec:
        raise InvalidArgument("model spec must be 'synthetic:<preset>' or a checkpoint directory")
    if spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticSource(spec[len(SYNTHETIC_PREFIX) :], seed)
    source = CheckpointSource(spec, loader=loader)
    source.name = name or source.name
    return source


__all__ = [
    "FUSED_GROUPS",
    "INDEX_FILE",
    "SYNTHETIC_PREFIX",
    "CheckpointSource",
    "ModelSource",
    "SyntheticSource",
    "Weights",
    "allocate_weights",
    "check_checkpoint",
    "fill_synthetic",
    "load_checkpoint",
    "parse_model_spec",
    "read_config",
    "save_checkpoint",
    "weight_shapes",
]
