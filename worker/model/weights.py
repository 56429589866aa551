"""Model weights as pool tensors tagged ``weights``: names, allocation, synthetic fill, safetensors I/O.

Every weight is allocated with ``alloc.empty(..., tag="weights")`` and never by torch's own
allocator, so the whole model sleeps and wakes with the pool at the same addresses, on the cuda and
the host backend alike. Loading copies *into* those tensors: a level-2 wake (weights discarded) reloads
the checkpoint without a single tensor changing address, so captured graphs and views stay valid.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from memsvc.errors import InvalidArgument, NotFound
from worker.allocator import MemoryAllocator
from worker.model.config import ModelConfig

WEIGHTS_TAG = "weights"
INDEX_FILE = "model.safetensors.index.json"

Weights = dict[str, torch.Tensor]


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model by its Hugging Face name, in checkpoint order."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def allocate_weights(config: ModelConfig, alloc: MemoryAllocator) -> Weights:
    """Uninitialised pool tensors for every weight (fill them with a source's ``load_into``)."""
    return {
        name: alloc.empty(shape, config.torch_dtype, tag=WEIGHTS_TAG) for name, shape in weight_shapes(config).items()
    }


@torch.no_grad()
def fill_synthetic(weights: Mapping[str, torch.Tensor], config: ModelConfig, seed: int) -> None:
    """Seeded random weights (normal, std 0.02; norm scales 1), generated on the tensors' device.

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
        t.normal_(0.0, 0.02, generator=gen)


@contextlib.contextmanager
def _open(file: Path) -> Iterator[Any]:
    """``safe_open`` with a damaged file reported as the caller's bad input, naming the file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise InvalidArgument(f"{file}: cannot read safetensors file ({e})") from None


def _shard_files(path: Path) -> dict[str, Path]:
    """Which file holds each tensor: the index of a sharded checkpoint, else every *.safetensors file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"{index}: not a safetensors index ({e})") from None
        return {str(name): path / str(file) for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotFound(f"{path}: no *.safetensors files")
    where: dict[str, Path] = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                where[name] = file
    return where


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike[str], weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Copy a Hugging Face safetensors checkpoint into the existing weight tensors, in place.

    Every tensor's presence and shape is checked before the first byte is copied, so a wrong or
    incomplete checkpoint leaves the weights as they were. Tensors the model does not use (a saved
    ``lm_head`` of a tied model, rotary buffers) are ignored; dtypes are converted to the config's.
    """
    root = Path(path)
    if not root.is_dir():
        raise NotFound(f"checkpoint directory {root} does not exist")
    expected = weight_shapes(config)
    where = _shard_files(root)
    missing = [name for name in expected if name not in where]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InvalidArgument(f"checkpoint {root}: missing tensor '{missing[0]}'{more}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    for file, names in by_file.items():
        if not file.is_file():
            raise NotFound(f"checkpoint {root}: shard {file.name} does not exist")
        with _open(file) as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise InvalidArgument(
                        f"checkpoint {root}: tensor '{name}' has shape {shape}, the config needs {expected[name]}"
                    )
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                weights[name].copy_(f.get_tensor(name))


def save_checkpoint(path: str | os.PathLike[str], weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Write ``config.json`` and ``model.safetensors`` in Hugging Face layout (tests, exports)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {name: weights[name].detach().to("cpu").contiguous() for name in weight_shapes(config)}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint directory's ``config.json``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise NotFound(f"{file} does not exist")
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise InvalidArgument(f"{file}: not valid JSON ({e})") from None
    return ModelConfig.from_hf(raw)


__all__ = [
    "WEIGHTS_TAG",
    "Weights",
    "allocate_weights",
    "fill_synthetic",
    "load_checkpoint",
    "read_config",
    "save_checkpoint",
    "weight_shapes",
]
