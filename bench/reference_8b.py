"""An 8B-shaped Llama 3 checkpoint, written by transformers in its own (v5) format, served by the
worker's decoder and by transformers on the same GPU: the first greedy tokens in float32, and logits
in bfloat16 within a tolerance.

Run on the GPU machine: ``python3 -m bench.reference_8b --out reference_8b.json``. Weights are random
(drawn on the GPU, with the scale tests/hf_models.py uses, so greedy tokens vary), the shapes are
Llama-3-8B's (with Llama 3.1's llama3 RoPE scaling, which the v5 format keeps in
``rope_parameters``). The float32 checkpoint is 32 GB on disk; both models live on the GPU at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13, 578]
NEW = 16
BF16_TOLERANCE = 3e-2
"""Relative logit error bound in bfloat16, as tests/worker/test_reference.py (twice the worst measured on
tiny models)."""
ACCURACY_SLACK = 1.5
"""Our bf16 logits' error against float32 may be at most this times transformers' own
(tests/worker/test_reference.py)."""


def config(transformers: Any) -> Any:
    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        eos_token_id=None,
        bos_token_id=128000,
    )


@torch.no_grad()
def init_on_gpu(model: Any, seed: int, device: str = "cuda") -> None:
    """tests/hf_models.py's scale, drawn on the GPU (8B normal draws on a CPU take minutes; ``device``
    "cpu" is for the tiny shapes of a smoke run)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
        del noise


def reference_tokens(model: Any) -> list[int]:
    ids = torch.tensor([PROMPT], device="cuda")
    out = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids)
    )
    return list(out[0, len(PROMPT) :].tolist())


@torch.no_grad()
def reference_logits(model: Any, sequence: list[int]) -> torch.Tensor:
    """float32 logits at the positions that pick each new token of ``sequence`` (prompt + NEW)."""
    logits: torch.Tensor = model(torch.tensor([sequence[:-1]], device="cuda")).logits
    return logits[0, len(PROMPT) - 1 :].float()


def ours(path: Path, sequence: list[int]) -> tuple[list[int], torch.Tensor, float, str]:
    """Our greedy tokens, and our logits over ``sequence`` (the same positions as reference_logits)."""
    from worker.allocator import AllocatorConfig, MemoryAllocator
    from worker.model.decoder import forward
    from worker.model.runner import ModelRunner

    alloc = MemoryAllocator(AllocatorConfig(backend="cuda"))
    t0 = time.perf_counter()
    runner = ModelRunner(alloc, str(path), num_device_blocks=64, num_host_blocks=1, block_size=16)
    load_s = time.perf_counter() - t0
    tokens = runner.generate(PROMPT, NEW)
    runner.generate(sequence[:-1], 0, sequence_id="ref")  # the sequence's tokens, kept with blocks for them
    runner.kv_cache.ensure_capacity("ref", len(sequence) - 1)
    seq = runner.kv_cache.sequence("ref")
    logits = forward(
        runner.weights,
        runner.config,
        runner._rope,
        runner.kv_cache.device.tensor,
        seq.block_ids,
        sequence[:-1],
        0,
        all_logits=True,
    )[len(PROMPT) - 1 :]
    result = (tokens, logits.float().clone(), load_s, runner.config.dtype)
    del runner, seq
    alloc.close()
    torch.cuda.empty_cache()
    return result


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max().detach())


def main() -> None:
    transformers: Any = importlib.import_module("transformers")  # untyped: used as Any

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("reference_8b.json"))
    p.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    a = p.parse_args()
    root = a.dir or Path(tempfile.mkdtemp(prefix="ref8b-"))
    result: dict[str, Any] = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "prompt": PROMPT,
        "new_tokens": NEW,
    }
    try:
        t0 = time.perf_counter()
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config(transformers)).to(torch.float32).eval()
        init_on_gpu(model, seed=0)
        f32 = root / "llama3-8b-shaped-f32"
        model.save_pretrained(f32)
        result["write_f32_s"] = time.perf_counter() - t0
        cfg = json.loads((f32 / "config.json").read_text())
        assert "rope_parameters" in cfg and "rope_theta" not in cfg, "not the transformers 5 format"
        result["config_keys"] = sorted(cfg)
        ref_tokens = reference_tokens(model)
        assert len(set(ref_tokens)) > 4, f"greedy tokens do not vary: {ref_tokens}"
        sequence = PROMPT + ref_tokens  # every comparison of logits is over this one sequence
        ref_logits = reference_logits(model, sequence)
        del model
        torch.cuda.empty_cache()
        tokens, logits, load_s, dtype = ours(f32, sequence)
        result["float32"] = {
            "reference_tokens": ref_tokens,
            "tokens": tokens,
            "tokens_equal": tokens == ref_tokens,
            "max_relative_logit_error": relative(logits, ref_logits),
            "load_s": load_s,
            "our_dtype": dtype,
        }
        print(json.dumps(result["float32"]), flush=True)

        t0 = time.perf_counter()
        model = transformers.LlamaForCausalLM.from_pretrained(f32, dtype=torch.bfloat16, device_map="cuda").eval()
        model.config.dtype = torch.bfloat16  # what the saved config.json must say its tensors are
        shutil.rmtree(f32)  # the disk holds one of the two checkpoints at a time
        bf16 = root / "llama3-8b-shaped-bf16"
        model.save_pretrained(bf16)
        result["write_bf16_s"] = time.perf_counter() - t0
        written = json.loads((bf16 / "config.json").read_text()).get("dtype")
        assert written == "bfloat16", f"the bf16 checkpoint's config says dtype {written!r}"
        ref_tokens16 = reference_tokens(model)
        ref_logits16 = reference_logits(model, sequence)
        del model
        torch.cuda.empty_cache()
        tokens16, logits16, load16, dtype16 = ours(bf16, sequence)
        err16 = relative(logits16, ref_logits16)
        ours_vs_f32, theirs_vs_f32 = relative(logits16, ref_logits), relative(ref_logits16, ref_logits)
        result["bfloat16"] = {
            "reference_tokens": ref_tokens16,
            "tokens": tokens16,
            "tokens_equal": tokens16 == ref_tokens16,
            "our_dtype": dtype16,
            "max_relative_logit_error": err16,
            "tolerance": BF16_TOLERANCE,
            "ours_vs_float32": ours_vs_f32,
            "transformers_vs_float32": theirs_vs_f32,
            "within": err16 <= BF16_TOLERANCE and ours_vs_f32 <= ACCURACY_SLACK * theirs_vs_f32,
            "load_s": load16,
        }
        print(json.dumps(result["bfloat16"]), flush=True)
        result["passed"] = bool(
            result["float32"]["tokens_equal"]
            and result["float32"]["max_relative_logit_error"] <= 1e-4
            and result["bfloat16"]["within"]
            and dtype16 == "bfloat16"
        )
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        a.out.write_text(json.dumps(result, indent=1))
    print("PASSED" if result.get("passed") else "FAILED", flush=True)


if __name__ == "__main__":
    main()
