"""GPU-only proofs for the serving engine: the Triton paged-decode kernel agrees with the torch path
(which the host backend runs in CI), a batch of concurrent requests gets the tokens each gets alone,
through CUDA graphs as through eager steps, and graphs captured before a sleep replay after the wake
without being captured again, their memory discarded while asleep."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from worker import _native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_native.cuda_device_count() == 0, reason="needs a CUDA device"),
]

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from memsvc.vocabulary import CUDA_GRAPHS, KV_CACHE, WEIGHTS, SleepLevel  # noqa: E402
from worker.allocator import AllocatorConfig, MemoryAllocator  # noqa: E402
from worker.model.decoder import DecodeRows, add_rms_norm, apply_rope, rms_norm, rope_store, silu_mul  # noqa: E402
from worker.model.generation import GenerationRequest  # noqa: E402
from worker.model.kernels import (  # noqa: E402
    triton_add_rms_norm,
    triton_rms_norm,
    triton_rope_store,
    triton_silu_mul,
)
from worker.model.paged_attention import torch_paged_decode, triton_paged_decode  # noqa: E402
from worker.model.runner import ModelRunner  # noqa: E402
from worker.model.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def cuda_alloc() -> Iterator[MemoryAllocator]:
    a = MemoryAllocator(AllocatorConfig(backend="cuda", host_chunk_bytes=64 << 20))
    yield a
    a.close()


ATTENTION_SHAPES = pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [
        (32, 8, 128, 16, None),
        (8, 8, 64, 16, None),
        (16, 2, 64, 8, 37),
        (4, 2, 16, 4, None),
    ],
)
"""(query heads, KV heads, head_dim, block size, sliding window) the paged kernels are checked at."""


def _matches_torch(q: torch.Tensor, layer: torch.Tensor, rows: DecodeRows, window: int | None) -> None:
    """The Triton kernels' result within the dtype's tolerance of the torch path's in float32."""
    want = torch_paged_decode(q.float(), layer.float(), rows, window)
    got = triton_paged_decode(q, layer, rows, window).float()
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    err = (got - want).abs().max().item()
    nh, nkv, hd = q.shape[1], layer.shape[3], q.shape[2]
    print(f"{q.dtype} heads {nh}/{nkv} head_dim {hd} window {window}: {len(q)} rows, max |err| {err:.2e}")
    assert err < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@ATTENTION_SHAPES
def test_triton_kernel_matches_the_torch_path(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    g = torch.Generator(device="cuda").manual_seed(heads * 1000 + head_dim)
    blocks = 300
    layer = torch.randn(blocks, 2, block_size, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    lengths = torch.tensor([1, 2, block_size, block_size + 1, 63, 64, 65, 200, 1000], device="cuda")
    width = math.ceil(1000 / block_size)
    tables = torch.stack([torch.randperm(blocks, device="cuda", generator=g)[:width] for _ in range(len(lengths))])
    q = torch.randn(len(lengths), heads, head_dim, device="cuda", generator=g).to(dtype)
    _matches_torch(q, layer, DecodeRows(len(lengths), tables, lengths), window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@ATTENTION_SHAPES
def test_triton_kernel_matches_the_torch_path_on_paged_rows(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    """A step as a graph bucket holds it: decodes, prompt chunks (rows sharing a table, read in tiles
    of rows), a one-row chunk, and padding rows on one table; tiles that straddle chunks and decodes."""
    g = torch.Generator(device="cuda").manual_seed(heads * 7 + head_dim)
    blocks = 400
    layer = torch.randn(blocks, 2, block_size, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    # (kind, start, rows): a decode of a sequence of `start` tokens, a chunk of `rows` rows at start..,
    # or padding rows (one table, each reading one position)
    layout = [("d", 5, 1), ("d", 70, 1), ("p", 0, 40), ("p", 30, 9), ("d", 1, 1), ("p", 200, 1), ("d", 300, 1)]
    layout += [("d", 17 + i, 1) for i in range(37)] + [("p", 100, 130), ("p", 0, 3), ("pad", 0, 11)]
    width = math.ceil(600 / block_size)
    tables: list[torch.Tensor] = []
    row_tables: list[int] = []
    lengths: list[int] = []
    for kind, start, n in layout:
        tables.append(torch.randperm(blocks, device="cuda", generator=g)[:width])
        row_tables += [len(tables) - 1] * n
        lengths += [start if kind == "d" else 1 if kind == "pad" else start + j + 1 for j in range(n)]
    q = torch.randn(len(lengths), heads, head_dim, device="cuda", generator=g).to(dtype)
    rows = DecodeRows(
        len(lengths), torch.stack(tables), torch.tensor(lengths, device="cuda"), torch.tensor(row_tables, device="cuda")
    )
    _matches_torch(q, layer, rows, window)


Tokens = list[list[int]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_elementwise_kernels_match_torch(dtype: torch.dtype) -> None:
    """Every op within one rounding step of the largest element (float32: reduction order);
    RMSNorm and SiLU-mul, which round where torch rounds, give torch's 16-bit results almost
    everywhere (RoPE rounds once instead of three times, see worker/model/kernels.py)."""
    g = torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    x, w = rand(37, 4096), rand(4096)
    q, cos, sin = rand(37, 32, 128), rand(37, 1, 128), rand(37, 1, 128)
    gate, up = rand(37, 14336), rand(37, 14336)
    qkv, gate_up = rand(37, 32 * 128 + 2 * 8 * 128), rand(37, 2 * 14336)  # fused products: strided halves
    qs = qkv[:, : 32 * 128].view(37, 32, 128)
    ks, vs = qkv[:, 32 * 128 : 40 * 128].view(37, 8, 128), qkv[:, 40 * 128 :].view(37, 8, 128)
    pool, slots = torch.zeros(4, 2, 16, 8, 128, dtype=dtype, device="cuda"), torch.arange(37, device="cuda")
    q_turned, k_turned = triton_rope_store(qs, ks, vs, cos, sin, pool, slots // 16, slots % 16)
    for name, got, want in [
        ("rms_norm strided", triton_rms_norm(qs, w[:128], 1e-6), rms_norm(qs, w[:128], 1e-6)),
        ("rope strided q", q_turned, apply_rope(qs, cos, sin)),
        ("rope strided k", k_turned, apply_rope(ks, cos, sin)),
        (
            "silu_mul strided",
            triton_silu_mul(gate_up[:, :14336], gate_up[:, 14336:]),
            silu_mul(gate_up[:, :14336], gate_up[:, 14336:]),
        ),
        ("rms_norm", triton_rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)),
        ("rms_norm per head", triton_rms_norm(q, w[:128], 1e-6), rms_norm(q, w[:128], 1e-6)),
        ("silu_mul", triton_silu_mul(gate, up), silu_mul(gate, up)),
    ]:
        err = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        same = (got == want).float().mean().item()
        print(f"{dtype} {name}: max |err| {err:.2e} of max {scale:.2e}; {same:.4%} elements identical")
        assert err <= (2e-6 if dtype == torch.float32 else 2.0**-6) * scale
        if dtype != torch.float32 and not name.startswith("rope"):
            assert same > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_kernels_give_what_their_parts_give(dtype: torch.dtype) -> None:
    """The residual add fused with its RMSNorm, and the queries' and keys' rotation fused with the K/V
    writes: the sum exactly torch's, the norm within the unfused kernel's bounds, the rotation RoPE's
    float32 arithmetic rounded once, and every slot of the pool what torch's indexed writes of the
    rotated keys and the values give."""
    g = torch.Generator(device="cuda").manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    x, delta, w = rand(37, 4096), rand(37, 4096), rand(4096)
    total, normed = triton_add_rms_norm(x, delta, w, 1e-5)
    want_total, want_normed = add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, want_total)
    assert torch.equal(normed, triton_rms_norm(want_total, w, 1e-5))
    err = (normed.float() - want_normed.float()).abs().max().item()
    assert err <= (2e-6 if dtype == torch.float32 else 2.0**-6) * want_normed.float().abs().max().item()

    heads, kv_heads, hd, block_size, blocks = 32, 8, 128, 16, 8
    qkv = rand(37, (heads + 2 * kv_heads) * hd)  # a fused product: q, k and v are strided column slices
    q = qkv[:, : heads * hd].view(37, heads, hd)
    k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(37, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd :].view(37, kv_heads, hd)
    cos, sin = rand(37, 1, hd), rand(37, 1, hd)
    where = torch.randperm(blocks * block_size, device="cuda", generator=g)[:37]  # one slot per row
    write_blocks, write_slots = where // block_size, where % block_size
    pool = torch.zeros(blocks, 3, 2, block_size, kv_heads, hd, dtype=dtype, device="cuda")  # 3 layers
    layer = pool[:, 1]
    q_turned, k_turned = triton_rope_store(q, k, v, cos, sin, layer, write_blocks, write_slots)
    want_pool = torch.zeros_like(pool)
    want_pool[:, 1][write_blocks, 0, write_slots] = k_turned
    want_pool[:, 1][write_blocks, 1, write_slots] = v
    assert torch.equal(pool, want_pool)  # the rotated keys and the values, the other layers and slots untouched
    # RoPE rounded once: float32 arithmetic, one rounding to the dtype (one float32 step apart where it fuses)
    for x, got in ((q, q_turned), (k, k_turned)):
        half = hd // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1).float()
        once = (x.float() * cos.float() + turned * sin.float()).to(dtype)
        step = 2e-6 if dtype == torch.float32 else 2.0**-7
        assert (got.float() - once.float()).abs().max().item() <= step * once.float().abs().max().item()
        if dtype != torch.float32:
            assert (got == once).float().mean().item() > 0.99
    torch_pool = torch.zeros_like(pool)
    torch_q, torch_k = rope_store(q, k, v, cos, sin, torch_pool[:, 1], write_blocks, write_slots)
    for got, want in ((q_turned, torch_q), (k_turned, torch_k)):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= (2e-6 if dtype == torch.float32 else 2.0**-6) * want.float().abs().max().item()


def _alone_and_batched(runner: ModelRunner, requests: list[GenerationRequest]) -> tuple[Tokens, Tokens]:
    alone = [runner.run(r).tokens for r in requests]
    batched: list[list[int]] = [[] for _ in requests]
    start = threading.Barrier(len(requests))

    def one(i: int) -> None:
        start.wait()
        batched[i] = runner.run(requests[i]).tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return alone, batched


def _requests(vocab: int, n: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (5 + 7 * i,), generator=g).tolist()
        sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=100 + i)
        sampling = sampled if i % 3 == 2 else SamplingParams()
        out.append(GenerationRequest(prompt, 24 + i, sampling=sampling, ignore_eos=True))
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_batch_gets_the_tokens_each_request_gets_alone(cuda_alloc: MemoryAllocator, graphs: bool) -> None:
    runner = ModelRunner(cuda_alloc, "synthetic:small", 512, 16, block_size=16, max_batch=16, cuda_graphs=graphs)
    requests = _requests(runner.config.vocab_size, 12)
    steps0 = runner.engine.steps
    alone, batched = _alone_and_batched(runner, requests)
    assert all(len(set(t)) > 3 for t in alone), alone
    assert batched == alone
    assert runner.kv_cache.stats()["device_free_blocks"] == 512
    print(f"{'graphs' if graphs else 'eager'}: {runner.engine.steps - steps0} steps for {len(requests)} requests twice")
    if graphs:
        assert runner.graphs is not None and runner.graphs.replays > 0


def test_graphs_captured_before_a_sleep_replay_after_the_wake(cuda_alloc: MemoryAllocator) -> None:
    runner = ModelRunner(cuda_alloc, "synthetic:1b", 1024, 16, block_size=16, max_batch=8, cuda_graphs=True)
    assert runner.graphs is not None
    requests = _requests(runner.config.vocab_size, 6)
    _, before = _alone_and_batched(runner, requests)
    tags = cuda_alloc.stats().tags
    assert tags[CUDA_GRAPHS].mapped_bytes > 0, "the graphs' memory is in their tag"
    captured = runner.graphs.captures
    for level in (SleepLevel.LEVEL_1, SleepLevel.LEVEL_2):
        cuda_alloc.sleep(level.actions)
        runner.drop_kv()
        asleep = cuda_alloc.stats().tags
        assert asleep[CUDA_GRAPHS].mapped_bytes == 0 and asleep[KV_CACHE].mapped_bytes == 0
        cuda_alloc.wake_up()
        if level == SleepLevel.LEVEL_2:
            runner.reload_weights()
        replays = runner.graphs.replays
        _, after = _alone_and_batched(runner, requests)
        assert after == before, f"level {int(level)}"
        assert runner.graphs.replays > replays and runner.graphs.captures == captured
    assert cuda_alloc.stats().tags[WEIGHTS].mapped_bytes > 0


def _compiled_variants() -> set[str]:
    """The variants Triton has compiled so far, over every Triton kernel the model runs (a JITFunction
    keeps one compiled variant per specialisation of its arguments, per device)."""
    from worker.model import kernels, paged_kernel

    jitted = {"rows": paged_kernel.paged_decode_kernel, "tiles": paged_kernel.paged_tile_kernel, **kernels._compiled}
    return {f"{name}: {key}" for name, fn in jitted.items() for cache in fn.device_caches.values() for key in cache[0]}


def test_nothing_compiles_after_the_warm_up(cuda_alloc: MemoryAllocator) -> None:
    """Ready means ready: after ModelRunner.warm_up, requests of any prompt length, alone and batched,
    eager and replayed, launch only kernels already compiled (a compile after ready cost the first
    request of a new prompt length about a second on the H200)."""
    from worker.model import kernels, paged_kernel

    # what earlier tests compiled does not count: fresh JITFunctions, empty caches of the module-level ones
    paged_kernel.paged_decode_kernel.device_caches.clear()
    paged_kernel.paged_tile_kernel.device_caches.clear()
    kernels._compiled.clear()
    runner = ModelRunner(
        cuda_alloc, "synthetic:small", 512, 16, block_size=16, max_batch=16, cuda_graphs=True, defer_graph_capture=True
    )
    runner.warm_up()
    after_warm_up = _compiled_variants()
    assert after_warm_up
    g = torch.Generator().manual_seed(11)
    vocab = runner.config.vocab_size
    lengths = [1, 2, 15, 16, 17, 40, 100, 255, 256, 300]
    requests = [
        GenerationRequest(torch.randint(0, vocab, (n,), generator=g).tolist(), 3, ignore_eos=True) for n in lengths
    ]
    alone, batched = _alone_and_batched(runner, requests)
    assert batched == alone
    assert _compiled_variants() - after_warm_up == set(), "compiled after the warm-up"


def test_the_hashes_triton_makes_before_a_first_launch_are_made_ahead_in_a_fresh_process() -> None:
    """worker/model/kernels.py's hash_ahead, in a process that launched nothing: Triton's own key is
    memoised (made, or read back where an earlier start kept it: worker/triton_key.py; either way
    Triton's own value) and every kernel of ours has its source hash, so the first launch finds both
    made."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from worker.model import kernels\n"
        "from worker.model.paged_kernel import paged_decode_kernel, paged_tile_kernel\n"
        "from triton.runtime import cache\n"
        "own = cache.triton_key\n"
        "ours = lambda: [*kernels._compiled.values(), paged_decode_kernel, paged_tile_kernel]\n"
        "before = (own.cache_info().currsize, [k.hash for k in ours()])\n"
        "kernels.hash_ahead()\n"
        "made = hasattr(cache.triton_key, 'memsvc_read') and cache.triton_key() == own()\n"
        "print(before, made, len(ours()), all(len(k.hash or '') == 64 for k in ours()))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(0,", "[None,", "None])", "True", "6", "True"], done.stdout
