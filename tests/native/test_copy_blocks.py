"""copy_blocks: every method moves exactly the bytes asked for, and a bad list moves nothing.

Pools are uint8 tensors cut into fixed-size slots; a block list copies a random byte range of one
slot into another slot of the destination, so destinations never overlap and the expected result is
computed on the CPU from copies taken before the call.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from _util import MiB, as_cpu_bytes, busy_copy_stream, fill_random

from memsvc.errors import InvalidArgument, WrongState
from worker.allocator import CopyMethod, Fence, MemoryAllocator

METHODS = [m.value for m in (CopyMethod.LOOP, CopyMethod.BATCH, CopyMethod.KERNEL, CopyMethod.AUTO)]
DIRECTIONS = ["d2h", "h2d", "d2d", "h2h"]
SLOT = 8192
SLOTS = 64
SENTINEL = 0xA5


def _need(alloc: MemoryAllocator, method: str) -> None:
    if not alloc.has_method(method):
        pytest.skip(f"copy method {method!r} is not available on this backend/build")


def _pool(alloc: MemoryAllocator, where: str, nbytes: int, tag: str) -> torch.Tensor:
    """A uint8 buffer: a pool tensor in ``tag`` ('d') or a page-locked host buffer ('h')."""
    return alloc.empty(nbytes, torch.uint8, tag=tag) if where == "d" else alloc.host_empty(nbytes, torch.uint8)


@dataclass
class Blocks:
    src: list[int]
    dst: list[int]
    sizes: list[int]
    expected: torch.Tensor  # the destination's bytes after the copy


def _random_blocks(
    src: torch.Tensor, dst: torch.Tensor, rng: random.Random, n: int, fixed_size: int | None = None
) -> Blocks:
    """``n`` blocks from random slots of ``src`` to random distinct slots of ``dst``."""
    src_bytes, expected = as_cpu_bytes(src), as_cpu_bytes(dst).clone()
    src_slots = rng.sample(range(src.numel() // SLOT), n)
    dst_slots = rng.sample(range(dst.numel() // SLOT), n)  # distinct: destinations never overlap
    out = Blocks([], [], [], expected)
    for k, (s, d) in enumerate(zip(src_slots, dst_slots, strict=True)):
        if fixed_size is not None:
            off, size = 0, fixed_size
        elif k == 0:
            off, size = 3, 4093  # odd offset, size not a multiple of 16
        elif k == 1:
            off, size = 0, SLOT  # a whole slot
        else:
            off = rng.randrange(SLOT)
            size = rng.randint(1, SLOT - off)
        so, do = s * SLOT + off, d * SLOT + off
        out.src.append(src.data_ptr() + so)
        out.dst.append(dst.data_ptr() + do)
        out.sizes.append(size)
        expected[do : do + size] = src_bytes[so : so + size]
    return out


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("method", METHODS)
def test_random_block_lists_are_byte_identical(
    alloc: MemoryAllocator, gen: torch.Generator, method: str, direction: str
) -> None:
    _need(alloc, method)
    rng = random.Random(f"{method}-{direction}")
    src = _pool(alloc, direction[0], SLOTS * SLOT, "kv_src")
    dst = _pool(alloc, direction[2], SLOTS * SLOT, "kv_dst")
    fill_random(src, gen)
    fill_random(dst, gen)
    for n in (1, 2, 17, SLOTS):
        b = _random_blocks(src, dst, rng, n)
        src_before = as_cpu_bytes(src).clone()
        alloc.copy_blocks(b.src, b.dst, b.sizes, method=method)
        assert torch.equal(as_cpu_bytes(dst), b.expected), f"{n} blocks"
        assert torch.equal(as_cpu_bytes(src), src_before), "the source is only read"


@pytest.mark.parametrize("method", METHODS)
def test_round_trip_device_host_device(alloc: MemoryAllocator, gen: torch.Generator, method: str) -> None:
    _need(alloc, method)
    rng = random.Random(method)
    dev = _pool(alloc, "d", SLOTS * SLOT, "kv_cache")
    host = _pool(alloc, "h", SLOTS * SLOT, "")
    data = fill_random(dev, gen)
    perm = rng.sample(range(SLOTS), SLOTS)
    # swap every slot out to a permuted host slot, wipe the device, and bring them back
    alloc.copy_blocks(
        [dev.data_ptr() + i * SLOT for i in range(SLOTS)],
        [host.data_ptr() + perm[i] * SLOT for i in range(SLOTS)],
        SLOT,
        method=method,
    )
    dev.zero_()
    alloc.copy_blocks(
        [host.data_ptr() + perm[i] * SLOT for i in range(SLOTS)],
        [dev.data_ptr() + i * SLOT for i in range(SLOTS)],
        SLOT,
        method=method,
    )
    assert torch.equal(as_cpu_bytes(dev), data)


@pytest.mark.parametrize("method", METHODS)
def test_torch_tensors_and_one_int_size(alloc: MemoryAllocator, gen: torch.Generator, method: str) -> None:
    _need(alloc, method)
    rng = random.Random(11)
    src = _pool(alloc, "d", SLOTS * SLOT, "kv_cache")
    dst = _pool(alloc, "h", SLOTS * SLOT, "")
    fill_random(src, gen)
    dst.fill_(SENTINEL)
    b = _random_blocks(src, dst, rng, 20, fixed_size=1000)
    alloc.copy_blocks(
        torch.tensor(b.src, dtype=torch.int64), torch.tensor(b.dst, dtype=torch.int64), 1000, method=method
    )
    assert torch.equal(as_cpu_bytes(dst), b.expected)

    b = _random_blocks(dst, src, rng, 20)  # and back, with a tensor of sizes too
    alloc.copy_blocks(
        torch.tensor(b.src, dtype=torch.int64),
        torch.tensor(b.dst, dtype=torch.int64),
        torch.tensor(b.sizes, dtype=torch.int64),
        method=CopyMethod(method),
    )
    assert torch.equal(as_cpu_bytes(src), b.expected)


def test_many_small_blocks_in_shuffled_order(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    n, size = 4096, 48  # 48: not a multiple of the 256-byte allocation alignment or of 32
    src = _pool(alloc, "d", n * size, "kv_cache")
    dst = _pool(alloc, "h", n * size, "")
    data = fill_random(src, gen)
    perm = random.Random(3).sample(range(n), n)
    alloc.copy_blocks(
        [src.data_ptr() + i * size for i in range(n)], [dst.data_ptr() + perm[i] * size for i in range(n)], size
    )
    got = as_cpu_bytes(dst).view(n, size)
    want = data.view(n, size)
    order = torch.tensor(perm)
    assert torch.equal(got[order], want)


def test_large_blocks_split_across_copy_threads(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    # over 128 MiB in all: the host copy splits the byte total over threads, mid-block
    sizes = [50 * MiB + 3, 47 * MiB + 5, 40 * MiB + 11]
    total = sum(sizes) + 3 * 256
    src = _pool(alloc, "d", total, "big")
    dst = _pool(alloc, "h", total, "")
    period = MiB + 17  # random bytes repeating with a period that no block size or offset shares
    pattern = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=gen).repeat(total // period + 1)[:total]
    src.copy_(pattern)
    dst.fill_(SENTINEL)
    offsets = [0, sizes[0] + 256, sizes[0] + sizes[1] + 512]
    # destinations in reverse order: block 2 lands first, block 0 last
    dst_offsets = [sizes[2] + sizes[1] + 512, sizes[2] + 256, 0]
    alloc.copy_blocks([src.data_ptr() + o for o in offsets], [dst.data_ptr() + o for o in dst_offsets], sizes)
    got = as_cpu_bytes(dst)
    for o, d, s in zip(offsets, dst_offsets, sizes, strict=True):
        assert torch.equal(got[d : d + s], pattern[o : o + s])
    gaps = [(sizes[2], sizes[2] + 256), (dst_offsets[0] - 256, dst_offsets[0]), (dst_offsets[0] + sizes[0], total)]
    for lo, hi in gaps:
        assert bool((got[lo:hi] == SENTINEL).all()), "bytes outside the blocks changed"


# ---------------------------------------------------------------- bad lists move nothing


@dataclass
class Setup:
    alloc: MemoryAllocator
    src: torch.Tensor  # pool tensor with random data
    dst: torch.Tensor  # host buffer filled with the sentinel
    dev_dst: torch.Tensor  # pool tensor filled with the sentinel
    good: tuple[int, int, int]  # one valid (src, dst, size) item

    def assert_untouched(self) -> None:
        assert bool((as_cpu_bytes(self.dst) == SENTINEL).all()), "a byte moved into the host buffer"
        assert bool((as_cpu_bytes(self.dev_dst) == SENTINEL).all()), "a byte moved into the pool tensor"


@pytest.fixture
def setup(alloc: MemoryAllocator, gen: torch.Generator) -> Setup:
    src = _pool(alloc, "d", 4 * SLOT, "kv_cache")
    fill_random(src, gen)
    dst = _pool(alloc, "h", 4 * SLOT, "")
    dst.fill_(SENTINEL)
    dev_dst = _pool(alloc, "d", 4 * SLOT, "kv_other")
    dev_dst.fill_(SENTINEL)
    return Setup(alloc, src, dst, dev_dst, (src.data_ptr(), dst.data_ptr(), SLOT))


def _reject(s: Setup, exc: type[Exception], src: object, dst: object, sizes: object) -> None:
    """The call raises ``exc`` for every method and no destination byte changes."""
    for method in METHODS:
        if not s.alloc.has_method(method):
            continue
        with pytest.raises(exc):
            s.alloc.copy_blocks(src, dst, sizes, method=method)
        s.assert_untouched()


def test_overlapping_destinations_are_rejected(setup: Setup) -> None:
    s, (sp, dp, _) = setup, setup.good
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp, dp + 100], [200, 200])
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp, dp], 16)  # the same destination twice
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp + 199, dp], [1, 200])  # last byte of one, first of other
    dd = s.dev_dst.data_ptr()
    _reject(s, InvalidArgument, [sp, sp + 2 * SLOT], [dd + 10, dd], [SLOT, 11])


def test_an_overlap_hidden_among_many_blocks_is_rejected(setup: Setup) -> None:
    s, (sp, dp, _) = setup, setup.good
    n, size = 2048, 16  # 2048 * 16 = 4 slots: the whole host buffer
    rng = random.Random(8)
    dst = [dp + i * size for i in rng.sample(range(n), n)]
    src = [sp + (i % (4 * SLOT // size)) * size for i in range(n)]
    bad = list(dst)
    j = bad.index(dp + 1000 * size)
    bad[j] -= 1  # overlaps the block before it by one byte
    _reject(s, InvalidArgument, src, bad, size)
    s.alloc.copy_blocks(src, dst, size)  # the same list without the overlap is fine
    got = as_cpu_bytes(s.dst).view(n, size)
    want = as_cpu_bytes(s.src).view(n, size)
    assert torch.equal(got[torch.tensor([(d - dp) // size for d in dst])], want)


def test_ranges_outside_allocations_are_rejected(setup: Setup) -> None:
    s, (sp, dp, size) = setup, setup.good
    end_src = sp + s.src.numel()
    end_dst = dp + s.dst.numel()
    cases = [
        ([sp, 4096], [dp, dp + SLOT], [size, 16]),  # a source pointer outside any allocation
        ([sp, sp], [dp, 4096], [size, 16]),  # a destination pointer outside any allocation
        ([sp, end_src], [dp, dp + SLOT], [size, 1]),  # one past the end of the source
        ([sp, end_src - 10], [dp, dp + SLOT], [size, 20]),  # source running past its end
        ([sp, sp], [dp + SLOT, end_dst - 10], [size, 20]),  # destination running past its end
        ([sp, sp - 1], [dp, dp + SLOT], [size, 16]),  # one byte before the source
        ([sp], [dp], [2**62]),  # larger than anything
        ([2**63 - 8], [dp], [16]),
    ]
    for src, dst, sizes in cases:
        _reject(s, InvalidArgument, src, dst, sizes)


def test_a_freed_allocation_is_not_a_valid_endpoint(setup: Setup) -> None:
    s, (sp, dp, size) = setup, setup.good
    gone = s.alloc.empty(SLOT, torch.uint8, tag="kv_cache")
    gone_ptr = gone.data_ptr()
    del gone
    gc.collect()
    _reject(s, InvalidArgument, [sp, gone_ptr], [dp, dp + SLOT], [size, 16])


def test_bad_sizes_are_rejected(setup: Setup) -> None:
    s, (sp, dp, size) = setup, setup.good
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp, dp + SLOT], [size, 0])
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp, dp + SLOT], [size, -16])
    _reject(s, InvalidArgument, [sp], [dp], 0)
    _reject(s, InvalidArgument, [sp], [dp], -1)


def test_mismatched_lengths_are_rejected(setup: Setup) -> None:
    s, (sp, dp, size) = setup, setup.good
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp], [size, size])
    _reject(s, InvalidArgument, [sp], [dp, dp + SLOT], 16)
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp, dp + SLOT], [size])
    _reject(s, InvalidArgument, [sp], [dp], [size, size])


def test_non_integer_entries_are_rejected(setup: Setup) -> None:
    s, (sp, dp, size) = setup, setup.good
    _reject(s, InvalidArgument, [sp, float(sp + SLOT)], [dp, dp + SLOT], [size, 16])
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp, str(dp + SLOT)], [size, 16])
    _reject(s, InvalidArgument, [sp, sp + SLOT], [dp, dp + SLOT], [size, 16.0])
    _reject(s, InvalidArgument, [sp, None], [dp, dp + SLOT], [size, 16])
    _reject(s, InvalidArgument, [sp], [dp], [[size]])
    _reject(s, InvalidArgument, torch.tensor([float(sp)]), [dp], [size])
    _reject(s, InvalidArgument, [sp], [dp], 2**64)  # not representable


def test_unknown_method_is_rejected(setup: Setup) -> None:
    s, (sp, dp, size) = setup, setup.good
    for method in ("fast", "", "LOOP", "memcpy"):
        with pytest.raises(InvalidArgument):
            s.alloc.copy_blocks([sp], [dp], [size], method=method)
    s.assert_untouched()


@pytest.mark.parametrize("action", ["offload", "discard"])
def test_a_block_in_a_slept_tag_is_wrong_state(setup: Setup, action: str) -> None:
    s, (sp, dp, size) = setup, setup.good
    other = s.alloc.empty(SLOT, torch.uint8, tag="kv_cache")  # same tag as the source
    other.fill_(7)
    s.alloc.sleep({"kv_cache": action})
    rnd = s.alloc.host_empty(SLOT, torch.uint8)  # an awake source of random bytes for the valid item
    rnd.copy_(torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)))
    rp, dd = rnd.data_ptr(), s.dev_dst.data_ptr()
    _reject(s, WrongState, [rp, sp], [dd, dp], [SLOT, size])  # source asleep
    _reject(s, WrongState, [rp, rp], [dd, other.data_ptr()], [SLOT, 16])  # destination asleep
    s.alloc.wake_up()
    if action == "offload":  # nothing was written into the slept destination either
        assert bool((as_cpu_bytes(other) == 7).all())
    s.alloc.copy_blocks([sp], [dp], [size])  # awake again: the same block copies
    assert torch.equal(as_cpu_bytes(s.dst)[:size], as_cpu_bytes(s.src)[:size])


def test_empty_list_is_a_no_op(setup: Setup) -> None:
    for method in METHODS:
        if setup.alloc.has_method(method):
            setup.alloc.copy_blocks([], [], [], method=method)
            setup.alloc.copy_blocks(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), 16)
    setup.assert_untouched()


def test_a_source_overlapping_a_destination_is_rejected(alloc: MemoryAllocator) -> None:
    dev = alloc.empty((4096,), torch.uint8, tag="kv")
    dev.copy_(torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8).to(dev.device))
    before = as_cpu_bytes(dev).clone()
    p = dev.data_ptr()
    with pytest.raises(InvalidArgument, match="overlaps a destination"):
        alloc.copy_blocks([p, p + 1024], [p + 2048, p + 1], [100, 50])
    assert torch.equal(as_cpu_bytes(dev), before)


@pytest.mark.parametrize("bad", [None, 7, object()])
def test_pointer_lists_that_are_not_sequences_are_invalid_argument(alloc: MemoryAllocator, bad: object) -> None:
    dev = alloc.empty((64,), torch.uint8, tag="kv")
    with pytest.raises(InvalidArgument):
        alloc.copy_blocks(bad, [dev.data_ptr()], [8])


def test_copy_block_ids_moves_blocks_between_pools_and_rejects_bad_ids(alloc: MemoryAllocator) -> None:
    """The SwapBlocks fast path: ids checked against each pool's bounds and for duplicate destinations
    before anything moves; the right blocks land in the right slots."""
    n, bs = 64, 4096
    dev = alloc.empty((n, bs), torch.uint8, tag="kv")
    host = alloc.host_empty((n, bs), torch.uint8)
    dev.copy_(torch.arange(n * bs, dtype=torch.int64).remainder(253).to(torch.uint8).view(n, bs).to(dev.device))
    host.fill_(7)
    rng = random.Random(3)
    src, dst = rng.sample(range(n), 40), rng.sample(range(n), 40)
    for method in ("loop", "batch", "kernel", "auto"):
        host.fill_(7)
        alloc.copy_block_ids(dev, host, src, dst, method)
        expected = torch.full((n, bs), 7, dtype=torch.uint8)
        expected[dst] = as_cpu_bytes(dev).view(n, bs)[src]
        assert torch.equal(host, expected), method
    before = host.clone()
    for bad_src, bad_dst in (([0, 1], [2, 2]), ([n], [0]), ([0], [n]), ([0, 1], [3])):
        with pytest.raises(InvalidArgument):
            alloc.copy_block_ids(dev, host, bad_src, bad_dst)
    with pytest.raises(InvalidArgument):
        alloc.copy_block_ids(dev, dev, [1, 2], [2, 3])  # block 2 both a source and a destination
    assert torch.equal(host, before)
    # Id arrays of any integer dtype and layout (numpy views, int32, torch tensors) say the same.
    ids = np.arange(2 * 20)
    for s_ids, d_ids in (
        (ids[::2], ids[1::2]),
        (ids[:20].astype(np.int32), ids[20:]),
        (torch.arange(20), ids[::-1][:20]),
    ):
        host.fill_(7)
        alloc.copy_block_ids(dev, host, s_ids, d_ids)
        expected = torch.full((n, bs), 7, dtype=torch.uint8)
        expected[np.asarray(d_ids).tolist()] = as_cpu_bytes(dev).view(n, bs)[np.asarray(s_ids).tolist()]
        assert torch.equal(host, expected), (s_ids, d_ids)
    alloc.sleep({"kv": "offload"})
    with pytest.raises(WrongState):
        alloc.copy_block_ids(dev, host, [0], [0])
    alloc.wake_up()


@pytest.mark.parametrize("method", METHODS)
def test_copies_not_waited_for_run_in_order(alloc: MemoryAllocator, method: str) -> None:
    """copy_block_ids(wait=False) returns a fence once the copy is enqueued. Twelve chained copies
    device -> host -> device, each reading what the one before wrote and overwriting what it read
    (more than the kernel's four descriptor slots), waited only at the end, leave exactly what a
    reference doing them one by one leaves; copies begun after an unwaited, dropped fence too. On cuda
    the chain queues behind a 512 MiB copy, so every descriptor slot is reused while its copy waits."""
    _need(alloc, method)
    n, bs, k = 64, 4096, 24
    pools = {"d": alloc.empty((n, bs), torch.uint8, tag="kv"), "h": alloc.host_empty((n, bs), torch.uint8)}
    gen = torch.Generator().manual_seed(11)
    ref = {name: torch.randint(0, 256, (n, bs), dtype=torch.uint8, generator=gen) for name in pools}
    for name, pool in pools.items():
        pool.copy_(ref[name].to(pool.device))
    rng = random.Random(method)
    fences = []
    busy = busy_copy_stream(alloc)  # the chain below queues behind it: nothing has run when it is enqueued
    for r in range(12):
        src_name, dst_name = ("d", "h") if r % 2 == 0 else ("h", "d")
        src, dst = rng.sample(range(n), k), rng.sample(range(n), k)
        fence = alloc.copy_block_ids(pools[src_name], pools[dst_name], src, dst, method, wait=False)
        assert isinstance(fence, Fence)
        ref[dst_name][dst] = ref[src_name][src]
        fences.append(fence)
    del fences[3]  # dropped unwaited: the copy still runs, in its place
    fences[-1].wait()
    assert fences[-1].done
    fences[-1].wait()  # a second wait returns at once
    for name, pool in pools.items():
        assert torch.equal(as_cpu_bytes(pool).view(n, bs), ref[name]), name
    for fence in fences[:-1]:
        fence.wait()
    assert all(f.done for f in fences)
    del busy
    alloc.copy_block_ids(pools["d"], pools["h"], [0], [1], method, wait=False)
    alloc.copies_wait()
    assert torch.equal(as_cpu_bytes(pools["h"]).view(n, bs)[1], as_cpu_bytes(pools["d"]).view(n, bs)[0])


def test_a_rejected_copy_not_waited_for_returns_no_fence(alloc: MemoryAllocator) -> None:
    """Bad ids fail before anything is enqueued, as with wait=True."""
    dev = alloc.empty((8, 4096), torch.uint8, tag="kv")
    host = alloc.host_empty((8, 4096), torch.uint8)
    host.fill_(5)
    with pytest.raises(InvalidArgument, match="outside the pool"):
        alloc.copy_block_ids(dev, host, [0, 8], [0, 1], wait=False)
    assert int(host.sum()) == 5 * 8 * 4096
