"""The allocator's contract: tagged pools that sleep and wake at the same addresses.

Every test runs on the host backend (CPU memory behind mmap/memfd); those taking ``alloc`` also run
on cuda where a device is present. Random data comes from a seeded generator.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable

import pytest
import torch
from _util import MiB, as_cpu_bytes, fill_random, host_held_once_trimmed, random_bytes
from conftest import HOST_CAPACITY, HOST_CHUNK, AllocatorFactory

from memsvc.errors import (
    InvalidArgument,
    NotFound,
    OutOfMemory,
    Unavailable,
    WrongState,
)
from worker import _native
from worker.allocator import (
    Action,
    AllocatorConfig,
    AllocatorStats,
    MemoryAllocator,
    close_allocator,
    get_allocator,
)

# Sizes from a few bytes to beyond one arena extent (2 MiB) and one host chunk (4 MiB in the tests).
SIZES = [1, 3, 7, 255, 256, 257, 4096, 3 * MiB, 9 * MiB, 20 * MiB]


def _tensor(alloc: MemoryAllocator, nbytes: int, tag: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 pool tensor of ``nbytes`` in ``tag`` filled with random bytes, and a CPU copy of them."""
    t = alloc.empty(nbytes, torch.uint8, tag=tag)
    return t, fill_random(t, gen)


def _unchanged(before: AllocatorStats, after: AllocatorStats) -> None:
    """Assert that nothing observable in the stats moved (timings aside)."""
    assert after.device_free_bytes == before.device_free_bytes
    assert after.tags == before.tags
    keys = {k for k in before.counters if not k.endswith("_seconds")}
    assert {k: after.counters[k] for k in keys} == {k: before.counters[k] for k in keys}


# ---------------------------------------------------------------- addresses and bytes survive


@pytest.mark.parametrize("nbytes", SIZES)
def test_offload_keeps_address_and_bytes(alloc: MemoryAllocator, gen: torch.Generator, nbytes: int) -> None:
    t, data = _tensor(alloc, nbytes, "weights", gen)
    ptr = t.data_ptr()
    before = alloc.stats()

    alloc.sleep({"weights": Action.OFFLOAD})
    asleep = alloc.stats()
    tag = asleep.tags["weights"]
    assert tag.state == "offloaded"
    assert tag.mapped_bytes == 0
    assert tag.offloaded_bytes == nbytes == tag.allocated_bytes
    assert tag.discarded_bytes == 0
    assert asleep.counters["bytes_offloaded"] == before.counters["bytes_offloaded"] + nbytes
    assert asleep.counters["sleeps"] == before.counters["sleeps"] + 1

    alloc.wake_up()
    awake = alloc.stats()
    assert t.data_ptr() == ptr
    assert alloc.lookup(ptr, nbytes) == (ptr, "weights")
    assert torch.equal(as_cpu_bytes(t), data)
    assert awake.tags["weights"].state == "awake"
    assert awake.tags["weights"].mapped_bytes == before.tags["weights"].mapped_bytes
    assert awake.tags["weights"].offloaded_bytes == 0
    assert awake.counters["bytes_restored"] == before.counters["bytes_restored"] + nbytes
    assert awake.counters["wakes"] == before.counters["wakes"] + 1


def test_many_mixed_tensors_in_one_tag(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    rng = random.Random(7)
    dtypes = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool]
    live: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for i in range(160):
        n = rng.choice([1, 2, 3, 5, 17, 100, 255, 257, 1000, 4099]) if i % 3 else rng.randint(1, 600_000)
        dtype = rng.choice(dtypes)
        t = alloc.empty((n,), dtype, tag="weights")
        live.append((t, fill_random(t, gen), t.data_ptr()))
    # free every fourth tensor so the tag's live data has holes between runs
    live = [x for i, x in enumerate(live) if i % 4]
    gc.collect()
    ptrs = [p for _, _, p in live]
    for _, _, p in live:
        assert p % 256 == 0, "sub-allocations are 256-byte aligned"
        assert alloc.lookup(p)[1] == "weights"
    spans = sorted((p, p + t.numel() * t.element_size()) for t, _, p in live)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    allocated = sum(t.numel() * t.element_size() for t, _, _ in live)
    assert alloc.stats().tags["weights"].allocated_bytes == allocated
    assert alloc.stats().tags["weights"].allocations == len(live)

    alloc.sleep({"weights": "offload"})
    assert alloc.stats().tags["weights"].offloaded_bytes == allocated
    alloc.wake_up()

    assert [t.data_ptr() for t, _, _ in live] == ptrs
    for t, data, _ in live:
        assert torch.equal(as_cpu_bytes(t), data)


def test_repeated_cycles_keep_bytes(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    a, a_data = _tensor(alloc, 5 * MiB + 13, "weights", gen)
    b, b_data = _tensor(alloc, 999, "weights", gen)
    for cycle in range(4):
        alloc.sleep({"weights": "offload"})
        alloc.wake_up(["weights"])
        assert torch.equal(as_cpu_bytes(a), a_data), f"cycle {cycle}"
        assert torch.equal(as_cpu_bytes(b), b_data), f"cycle {cycle}"
        b_data = fill_random(b, gen)  # change between cycles: the next offload must take the new bytes
    assert alloc.stats().counters["sleeps"] == 4


def test_small_tensors_share_one_mapping(alloc: MemoryAllocator) -> None:
    ts = [alloc.empty(1000, torch.uint8, tag="small") for _ in range(100)]
    s = alloc.stats().tags["small"]
    assert s.mapped_bytes == alloc.granularity
    assert s.allocations == len(ts)
    assert s.allocated_bytes == 100 * 1000


def test_each_tag_has_its_own_range(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    a, _ = _tensor(alloc, 100, "a", gen)
    b, _ = _tensor(alloc, 100, "b", gen)
    assert alloc.lookup(a.data_ptr()) == (a.data_ptr(), "a")
    assert alloc.lookup(b.data_ptr()) == (b.data_ptr(), "b")
    assert abs(a.data_ptr() - b.data_ptr()) >= alloc.config.arena_va_bytes
    with pytest.raises(NotFound):
        alloc.lookup(a.data_ptr() + 100)  # one byte past the end of a
    with pytest.raises(NotFound):
        alloc.lookup(a.data_ptr(), 101)  # range running past the end


# ---------------------------------------------------------------- KEEP, DISCARD, partial wake


def test_keep_tags_untouched_while_others_sleep(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    keep, keep_data = _tensor(alloc, 3 * MiB, "keep", gen)
    unnamed, unnamed_data = _tensor(alloc, 4097, "unnamed", gen)
    _tensor(alloc, 3 * MiB, "weights", gen)
    _tensor(alloc, 3 * MiB, "kv_cache", gen)
    before = alloc.stats()

    alloc.sleep({"keep": Action.KEEP, "weights": Action.OFFLOAD, "kv_cache": Action.DISCARD})
    asleep = alloc.stats()
    for tag in ("keep", "unnamed"):
        assert asleep.tags[tag] == before.tags[tag]
    # still mapped and readable while the others sleep
    assert torch.equal(as_cpu_bytes(keep), keep_data)
    assert torch.equal(as_cpu_bytes(unnamed), unnamed_data)
    keep_data = fill_random(keep, gen)  # and writable
    assert asleep.tags["weights"].state == "offloaded"
    assert asleep.tags["kv_cache"].state == "discarded"

    alloc.wake_up()
    after = alloc.stats()
    assert after.tags["keep"] == before.tags["keep"]
    assert torch.equal(as_cpu_bytes(keep), keep_data)
    assert torch.equal(as_cpu_bytes(unnamed), unnamed_data)


def test_discard_returns_memory_to_the_device(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    kv, _ = _tensor(alloc, 6 * MiB + 5, "kv_cache", gen)
    ptr = kv.data_ptr()
    before = alloc.stats()
    mapped = before.tags["kv_cache"].mapped_bytes
    assert mapped >= 6 * MiB + 5

    alloc.sleep({"kv_cache": "discard"})
    asleep = alloc.stats()
    tag = asleep.tags["kv_cache"]
    assert asleep.device_free_bytes == before.device_free_bytes + mapped
    assert (tag.state, tag.mapped_bytes, tag.offloaded_bytes) == ("discarded", 0, 0)
    assert tag.discarded_bytes == 6 * MiB + 5 == tag.allocated_bytes
    assert asleep.counters["bytes_offloaded"] == before.counters["bytes_offloaded"]
    assert asleep.counters["host_held_bytes"] == 0

    alloc.wake_up()
    awake = alloc.stats()
    assert awake.device_free_bytes == before.device_free_bytes
    assert awake.tags["kv_cache"].mapped_bytes == mapped
    assert awake.tags["kv_cache"].discarded_bytes == 0
    assert awake.counters["bytes_restored"] == before.counters["bytes_restored"]
    assert kv.data_ptr() == ptr
    data = fill_random(kv, gen)  # the range is usable memory again
    assert torch.equal(as_cpu_bytes(kv), data)


def test_offload_returns_memory_to_the_device(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    _tensor(alloc, 9 * MiB, "weights", gen)
    before = alloc.stats()
    mapped = before.tags["weights"].mapped_bytes
    alloc.sleep({"weights": "offload"})
    assert alloc.stats().device_free_bytes == before.device_free_bytes + mapped
    alloc.wake_up()
    assert alloc.stats().device_free_bytes == before.device_free_bytes


def test_partial_wake_by_tag(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    w, w_data = _tensor(alloc, 3 * MiB + 1, "weights", gen)
    kv, _ = _tensor(alloc, 2 * MiB, "kv_cache", gen)
    opt, opt_data = _tensor(alloc, 12345, "optimizer", gen)
    alloc.sleep({"weights": "offload", "kv_cache": "discard", "optimizer": "offload"})

    alloc.wake_up(["weights"])
    s = alloc.stats()
    assert s.tags["weights"].state == "awake"
    assert torch.equal(as_cpu_bytes(w), w_data)
    assert (s.tags["kv_cache"].state, s.tags["kv_cache"].mapped_bytes) == ("discarded", 0)
    assert (s.tags["optimizer"].state, s.tags["optimizer"].mapped_bytes) == ("offloaded", 0)
    assert s.tags["optimizer"].offloaded_bytes == 12345
    with pytest.raises(WrongState):
        alloc.empty(1, torch.uint8, tag="kv_cache")

    alloc.wake_up()
    s = alloc.stats()
    assert {t.state for t in s.tags.values()} == {"awake"}
    assert torch.equal(as_cpu_bytes(opt), opt_data)
    assert torch.equal(as_cpu_bytes(w), w_data)
    assert s.counters["wakes"] == 2
    kv.fill_(3)
    assert int(kv.sum().item()) == 3 * 2 * MiB


def test_sleep_with_only_keep_changes_nothing(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    _tensor(alloc, 100, "weights", gen)
    before = alloc.stats()
    alloc.sleep({"weights": "keep"})
    assert alloc.stats().tags == before.tags
    with pytest.raises(WrongState):
        alloc.wake_up()  # a KEEP leaves nothing asleep


# ---------------------------------------------------------------- errors that change nothing


@pytest.mark.parametrize(("first", "second"), [("offload", "offload"), ("discard", "discard"), ("discard", "offload")])
def test_sleeping_a_tag_twice_is_wrong_state(
    alloc: MemoryAllocator, gen: torch.Generator, first: str, second: str
) -> None:
    t, data = _tensor(alloc, 5 * MiB, "weights", gen)
    alloc.sleep({"weights": first})
    before = alloc.stats()
    with pytest.raises(WrongState):
        alloc.sleep({"weights": second})
    _unchanged(before, alloc.stats())
    alloc.wake_up()
    if first == "offload":
        assert torch.equal(as_cpu_bytes(t), data)


def test_an_offloaded_tag_can_be_demoted_to_discard(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    t, _ = _tensor(alloc, 9 * MiB + 5, "weights", gen)
    ptr = t.data_ptr()
    alloc.sleep({"weights": "offload"})
    offloaded = alloc.stats()
    assert offloaded.counters["host_held_bytes"] >= 9 * MiB + 5

    alloc.sleep({"weights": "discard"})  # level 1 -> level 2: the host copy goes too
    s = alloc.stats()
    tag = s.tags["weights"]
    assert (tag.state, tag.mapped_bytes, tag.offloaded_bytes) == ("discarded", 0, 0)
    assert tag.discarded_bytes == 9 * MiB + 5 == tag.allocated_bytes
    assert s.device_free_bytes == offloaded.device_free_bytes
    assert s.counters["sleeps"] == offloaded.counters["sleeps"] + 1
    assert host_held_once_trimmed(alloc, 0) == 0

    alloc.wake_up()
    s = alloc.stats()
    assert s.tags["weights"].state == "awake"
    assert s.tags["weights"].mapped_bytes == offloaded.tags["weights"].layout_bytes
    assert s.counters["bytes_restored"] == offloaded.counters["bytes_restored"]  # nothing to restore
    assert t.data_ptr() == ptr
    data = fill_random(t, gen)
    assert torch.equal(as_cpu_bytes(t), data)


def test_wake_when_nothing_is_asleep_is_wrong_state(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    t, data = _tensor(alloc, 1000, "weights", gen)
    before = alloc.stats()
    with pytest.raises(WrongState):
        alloc.wake_up()
    with pytest.raises(WrongState):
        alloc.wake_up(["weights"])
    _unchanged(before, alloc.stats())
    assert torch.equal(as_cpu_bytes(t), data)


def test_waking_an_awake_tag_is_wrong_state_and_wakes_nothing(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    _tensor(alloc, 1000, "awake", gen)
    _tensor(alloc, 1000, "asleep", gen)
    alloc.sleep({"asleep": "offload"})
    before = alloc.stats()
    with pytest.raises(WrongState):
        alloc.wake_up(["asleep", "awake"])
    _unchanged(before, alloc.stats())
    assert alloc.stats().tags["asleep"].state == "offloaded"


def test_unknown_tag_is_not_found(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    _tensor(alloc, 1000, "weights", gen)
    alloc.sleep({"weights": "discard"})
    before = alloc.stats()
    with pytest.raises(NotFound):
        alloc.sleep({"nope": "offload"})
    with pytest.raises(NotFound):
        alloc.sleep({"nope": "keep"})
    with pytest.raises(NotFound):
        alloc.wake_up(["nope"])
    with pytest.raises(NotFound):
        alloc.wake_up(["weights", "nope"])  # the known tag is not woken either
    _unchanged(before, alloc.stats())
    assert "nope" not in alloc.stats().tags


def test_bad_action_is_invalid_argument(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    t, data = _tensor(alloc, 1000, "weights", gen)
    before = alloc.stats()
    for bad in ("sleep", "", "OFFLOAD ", 1, None):
        with pytest.raises(InvalidArgument):
            alloc.sleep({"weights": bad})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument):
        alloc.sleep({"weights": "offload", "other": "nap"})
    _unchanged(before, alloc.stats())
    assert torch.equal(as_cpu_bytes(t), data)


def test_bad_wake_arguments_are_invalid(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    _tensor(alloc, 1000, "weights", gen)
    alloc.sleep({"weights": "offload"})
    before = alloc.stats()
    with pytest.raises(InvalidArgument):
        alloc.wake_up("weights")  # a string, not a list of tags
    with pytest.raises(InvalidArgument):
        alloc.wake_up(["weights", "weights"])
    with pytest.raises(InvalidArgument):
        alloc.wake_up([""])
    _unchanged(before, alloc.stats())


def test_sleep_is_all_or_nothing_on_unknown_tag(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    a, a_data = _tensor(alloc, 5 * MiB, "a", gen)
    before = alloc.stats()
    with pytest.raises(NotFound):
        alloc.sleep({"a": "offload", "nope": "discard"})
    _unchanged(before, alloc.stats())
    assert alloc.stats().tags["a"].state == "awake"
    assert alloc.stats().counters["host_held_bytes"] == 0
    assert torch.equal(as_cpu_bytes(a), a_data)


def test_sleep_is_all_or_nothing_on_a_sleeping_tag(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    a, a_data = _tensor(alloc, 3 * MiB, "a", gen)
    _tensor(alloc, 1000, "b", gen)
    alloc.sleep({"b": "offload"})
    before = alloc.stats()
    with pytest.raises(WrongState):
        alloc.sleep({"a": "discard", "b": "offload"})
    _unchanged(before, alloc.stats())
    assert torch.equal(as_cpu_bytes(a), a_data)


def test_out_of_memory_changes_nothing(host_alloc: MemoryAllocator, gen: torch.Generator) -> None:
    a, a_data = _tensor(host_alloc, 3 * MiB, "weights", gen)
    b, b_data = _tensor(host_alloc, 7, "weights", gen)
    before = host_alloc.stats()
    assert before.device_total_bytes == HOST_CAPACITY
    with pytest.raises(OutOfMemory):
        host_alloc.empty(HOST_CAPACITY, torch.uint8, tag="weights")
    with pytest.raises(OutOfMemory):
        host_alloc.empty((before.device_free_bytes + host_alloc.granularity,), torch.uint8, tag="weights")
    after = host_alloc.stats()
    _unchanged(before, after)
    assert after.device_total_bytes == HOST_CAPACITY
    assert torch.equal(as_cpu_bytes(a), a_data)
    assert torch.equal(as_cpu_bytes(b), b_data)
    # what is left can still be used
    c = host_alloc.empty(8 * MiB, torch.uint8, tag="weights")
    c.fill_(1)
    assert int(c.sum().item()) == 8 * MiB


def test_out_of_memory_fills_to_capacity_and_wake_fails_cleanly(
    make_allocator: AllocatorFactory, gen: torch.Generator
) -> None:
    cap = 16 * MiB
    alloc = make_allocator("host", host_capacity_bytes=cap)
    w, w_data = _tensor(alloc, 8 * MiB, "weights", gen)
    alloc.sleep({"weights": "offload"})
    # while weights sleep their memory is someone else's
    other = alloc.empty(10 * MiB, torch.uint8, tag="other")
    before = alloc.stats()
    with pytest.raises(OutOfMemory):
        alloc.wake_up()
    _unchanged(before, alloc.stats())  # backup kept, still asleep
    assert alloc.stats().tags["weights"].state == "offloaded"
    del other
    gc.collect()
    alloc.wake_up()
    assert torch.equal(as_cpu_bytes(w), w_data)


def test_wake_out_of_memory_keeps_every_named_tag_asleep(
    make_allocator: AllocatorFactory, gen: torch.Generator
) -> None:
    alloc = make_allocator("host", host_capacity_bytes=16 * MiB)
    a, a_data = _tensor(alloc, 3 * MiB, "a", gen)
    a2, a2_data = _tensor(alloc, 3 * MiB, "a", gen)
    b, b_data = _tensor(alloc, 6 * MiB, "b", gen)
    alloc.sleep({"a": "offload", "b": "offload"})
    squatter = alloc.empty(8 * MiB, torch.uint8, tag="c")  # room for one of the two tags, not both
    before = alloc.stats()
    with pytest.raises(OutOfMemory):
        alloc.wake_up()  # "a" maps back first, then "b" fails: "a" must be dropped again
    after = alloc.stats()
    assert after.device_free_bytes == before.device_free_bytes
    for tag in ("a", "b"):
        t0, t1 = before.tags[tag], after.tags[tag]
        assert (t1.state, t1.mapped_bytes, t1.offloaded_bytes, t1.allocated_bytes) == (
            "offloaded",
            0,
            t0.offloaded_bytes,
            t0.allocated_bytes,
        )
    assert after.counters["wakes"] == before.counters["wakes"]
    del squatter
    gc.collect()
    alloc.wake_up()
    for t, data in ((a, a_data), (a2, a2_data), (b, b_data)):
        assert torch.equal(as_cpu_bytes(t), data)


# Most sizes outgrow the arena's free tail, so the arena grows by six extents (4, 4, 4, 2, 2 and
# 8 MiB), and tensors start and end mid-extent: their host pieces straddle extent boundaries, and
# the 4 MiB host chunks cut them at other places again. The last tensor is the only one in the
# last extent.
MANY_EXTENT_SIZES = [
    3 * MiB + 5,
    3 * MiB + 77,
    1000,
    5 * MiB + 999,
    700_001,
    2 * MiB + 3,
    4097,
    1_234_567,
    9 * MiB + 11,
]


@pytest.mark.parametrize("checksum", [False, True])
def test_wake_restores_a_tag_of_many_extents(
    make_allocator: AllocatorFactory, backend: str, gen: torch.Generator, checksum: bool
) -> None:
    alloc = make_allocator(backend, checksum=checksum)
    live = [_tensor(alloc, n, "w", gen) for n in MANY_EXTENT_SIZES]
    before = alloc.stats().tags["w"]
    assert before.extents > 3
    del live[3], live[5]  # holes: the backup holds several runs, cut at the holes
    gc.collect()
    tail, _ = live.pop()  # the last tensor goes while asleep: its own extent is not mapped back
    ptrs = [t.data_ptr() for t, _ in live]
    alloc.sleep({"w": "offload"})
    del tail
    gc.collect()
    offloaded = alloc.stats().tags["w"].offloaded_bytes

    alloc.wake_up()
    after = alloc.stats()
    w = after.tags["w"]
    assert (w.state, w.mapped_bytes, w.offloaded_bytes) == ("awake", w.layout_bytes, 0)
    assert 3 < w.extents == before.extents - 1
    assert w.layout_bytes < before.layout_bytes
    assert after.counters["bytes_restored"] == offloaded
    assert [t.data_ptr() for t, _ in live] == ptrs
    for t, data in live:
        assert torch.equal(as_cpu_bytes(t), data)
    if checksum:
        assert after.counters["bytes_verified"] == sum(t.numel() for t, _ in live)


def test_wake_out_of_memory_midway_through_a_tags_extents(
    make_allocator: AllocatorFactory, gen: torch.Generator
) -> None:
    cap = 40 * MiB
    alloc = make_allocator("host", host_capacity_bytes=cap)
    kv, _ = _tensor(alloc, 1000, "kv", gen)  # woken first, fully mapped, and must be dropped again
    live = [_tensor(alloc, n, "w", gen) for n in MANY_EXTENT_SIZES]
    s = alloc.stats().tags
    assert s["w"].extents > 3
    layout = s["kv"].layout_bytes + s["w"].layout_bytes
    alloc.sleep({"kv": "discard", "w": "offload"})
    # room for "kv" and about half of "w": the wake maps and fills w's first extents, then fails
    squat = cap - s["kv"].layout_bytes - s["w"].layout_bytes // 2 // alloc.granularity * alloc.granularity
    squatter = alloc.empty(squat, torch.uint8, tag="other")
    before = alloc.stats()
    assert s["kv"].layout_bytes + 4 * MiB <= before.device_free_bytes < layout
    with pytest.raises(OutOfMemory):
        alloc.wake_up()
    after = alloc.stats()
    assert after.device_free_bytes == before.device_free_bytes
    for tag, state in (("kv", "discarded"), ("w", "offloaded")):
        t0, t1 = before.tags[tag], after.tags[tag]
        assert (t1.state, t1.mapped_bytes) == (state, 0)
        assert (t1.offloaded_bytes, t1.allocated_bytes, t1.extents) == (
            t0.offloaded_bytes,
            t0.allocated_bytes,
            t0.extents,
        )
    assert after.counters["wakes"] == before.counters["wakes"]
    assert after.counters["bytes_restored"] == before.counters["bytes_restored"]

    del squatter
    gc.collect()
    alloc.wake_up()
    w = alloc.stats().tags["w"]
    assert (w.state, w.mapped_bytes) == ("awake", w.layout_bytes)
    for t, data in live:
        assert torch.equal(as_cpu_bytes(t), data)
    assert alloc.stats().tags["kv"].state == "awake"
    del kv


def test_transition_timings_are_counted(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    first = alloc.stats().counters
    assert first["last_sleep_unmap_seconds"] == 0.0 == first["last_wake_map_seconds"]
    t, data = _tensor(alloc, 9 * MiB + 3, "w", gen)
    alloc.sleep({"w": "offload"})
    alloc.wake_up()
    c = alloc.stats().counters
    # the unmap calls are part of the sleep, the map calls part of the wake (overlapping its copies)
    assert 0.0 <= c["last_sleep_unmap_seconds"] <= c["last_sleep_seconds"]
    assert 0.0 <= c["last_wake_map_seconds"] <= c["last_wake_seconds"]
    assert torch.equal(as_cpu_bytes(t), data)


def test_out_of_memory_in_a_new_tag_leaves_no_tag(host_alloc: MemoryAllocator) -> None:
    before = host_alloc.stats()
    with pytest.raises(OutOfMemory):
        host_alloc.empty(HOST_CAPACITY + 1, torch.uint8, tag="too_big")
    assert "too_big" not in host_alloc.stats().tags
    _unchanged(before, host_alloc.stats())


@pytest.mark.parametrize("action", ["offload", "discard"])
def test_allocating_in_a_slept_tag_is_wrong_state(alloc: MemoryAllocator, gen: torch.Generator, action: str) -> None:
    _tensor(alloc, 1000, "weights", gen)
    alloc.sleep({"weights": action})
    before = alloc.stats()
    with pytest.raises(WrongState):
        alloc.empty(10, torch.uint8, tag="weights")
    with pytest.raises(WrongState):
        alloc.empty((4 * MiB,), torch.float32, tag="weights")
    with pytest.raises(WrongState), alloc.use_memory_pool("weights"):
        pass
    _unchanged(before, alloc.stats())
    alloc.wake_up()
    alloc.empty(10, torch.uint8, tag="weights")


def test_zero_size_tensors(alloc: MemoryAllocator) -> None:
    before = alloc.stats()
    shapes: list[int | tuple[int, ...]] = [0, (0,), (3, 0), (0, 5, 7)]
    for shape in shapes:
        t = alloc.empty(shape, torch.float32, tag="weights")
        assert t.numel() == 0
        assert t.shape == ((shape,) if isinstance(shape, int) else shape)
        assert t.dtype == torch.float32
        assert t.device == alloc.torch_device
    assert alloc.stats().tags == before.tags  # nothing was allocated from a pool
    h = alloc.host_empty((0, 4), torch.uint8)
    assert h.shape == (0, 4)


def test_bad_shapes_are_invalid(alloc: MemoryAllocator) -> None:
    before = alloc.stats()
    for shape in [-1, (4, -1), (-3,), (2.0,), ("4",), (True,)]:
        with pytest.raises(InvalidArgument):
            alloc.empty(shape, torch.uint8, tag="weights")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            alloc.host_empty(shape, torch.uint8)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        alloc.empty(4, torch.complex64, tag="weights")
    _unchanged(before, alloc.stats())


def test_shape_and_dtype_are_what_was_asked(alloc: MemoryAllocator) -> None:
    t = alloc.empty((3, 5, 7), torch.bfloat16, tag="weights")
    assert (t.shape, t.dtype, t.device, t.is_contiguous()) == ((3, 5, 7), torch.bfloat16, alloc.torch_device, True)
    assert alloc.stats().tags["weights"].allocated_bytes == 3 * 5 * 7 * 2
    h = alloc.host_empty((2, 3), torch.int64)
    assert (h.shape, h.dtype, h.device) == ((2, 3), torch.int64, torch.device("cpu"))


@pytest.mark.parametrize("tag", ["x" * 64, "x" * 200, "é" * 32, ""])
def test_bad_tag_names_are_invalid(alloc: MemoryAllocator, tag: str) -> None:
    before = alloc.stats()
    with pytest.raises(InvalidArgument):
        alloc.empty(16, torch.uint8, tag=tag)
    with pytest.raises(InvalidArgument):
        alloc.sleep({tag: "offload"})
    with pytest.raises(InvalidArgument):
        alloc.wake_up([tag])
    with pytest.raises(InvalidArgument), alloc.use_memory_pool(tag):
        pass
    _unchanged(before, alloc.stats())


def test_longest_tag_name_is_accepted(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    for tag in ("y" * 63, "é" * 31 + "z"):
        assert len(tag.encode()) == 63
        t, data = _tensor(alloc, 300, tag, gen)
        alloc.sleep({tag: "offload"})
        assert alloc.stats().tags[tag].state == "offloaded"
        alloc.wake_up([tag])
        assert torch.equal(as_cpu_bytes(t), data)


def test_bad_config_is_invalid(make_allocator: AllocatorFactory) -> None:
    with pytest.raises(InvalidArgument):
        make_allocator("tpu")
    with pytest.raises(InvalidArgument):
        make_allocator("host", device=-1)
    with pytest.raises(InvalidArgument):
        make_allocator("host", host_capacity_bytes=0)
    with pytest.raises(InvalidArgument):
        make_allocator("host", granularity_bytes=1000)  # not a multiple of the page size


# ---------------------------------------------------------------- freeing


def test_freeing_the_tail_returns_memory(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    free0 = alloc.stats().device_free_bytes
    small, small_data = _tensor(alloc, 1000, "weights", gen)
    one = alloc.stats()
    assert one.tags["weights"].mapped_bytes == alloc.granularity
    assert one.device_free_bytes == free0 - alloc.granularity

    big, _ = _tensor(alloc, 9 * MiB, "weights", gen)  # grows the arena by new extents at the tail
    assert alloc.stats().device_free_bytes < one.device_free_bytes
    del big
    gc.collect()
    s = alloc.stats()
    assert s.device_free_bytes == one.device_free_bytes
    assert s.tags["weights"].mapped_bytes == alloc.granularity
    assert s.tags["weights"].allocations == 1
    assert torch.equal(as_cpu_bytes(small), small_data)

    del small
    gc.collect()
    s = alloc.stats()
    assert s.device_free_bytes == free0
    assert (s.tags["weights"].mapped_bytes, s.tags["weights"].allocated_bytes) == (0, 0)


def test_freed_space_is_reused(alloc: MemoryAllocator) -> None:
    a = alloc.empty(4096, torch.uint8, tag="weights")
    ptr = a.data_ptr()
    keep = alloc.empty(4096, torch.uint8, tag="weights")
    del a
    gc.collect()
    b = alloc.empty(4000, torch.uint8, tag="weights")  # first fit: the hole a left
    assert b.data_ptr() == ptr
    assert keep.data_ptr() != ptr


@pytest.mark.parametrize("action", ["offload", "discard"])
@pytest.mark.parametrize("checksum", [False, True])
def test_tensor_freed_while_asleep(
    make_allocator: AllocatorFactory, backend: str, gen: torch.Generator, action: str, checksum: bool
) -> None:
    alloc = make_allocator(backend, checksum=checksum)
    a, a_data = _tensor(alloc, 3 * MiB, "weights", gen)
    b, _ = _tensor(alloc, 5000, "weights", gen)
    c, c_data = _tensor(alloc, 6 * MiB + 3, "weights", gen)
    alloc.sleep({"weights": action})
    del b
    gc.collect()
    s = alloc.stats().tags["weights"]
    assert (s.state, s.allocations, s.allocated_bytes) == (action + "ed", 2, 3 * MiB + 6 * MiB + 3)

    alloc.wake_up()
    s = alloc.stats().tags["weights"]
    assert (s.state, s.allocations) == ("awake", 2)
    if action == "offload":
        assert torch.equal(as_cpu_bytes(a), a_data)
        assert torch.equal(as_cpu_bytes(c), c_data)
        if checksum:
            assert alloc.stats().counters["bytes_verified"] == 3 * MiB + 6 * MiB + 3
    d, d_data = _tensor(alloc, 5000, "weights", gen)  # the hole is usable again
    assert torch.equal(as_cpu_bytes(d), d_data)


def test_tail_freed_while_asleep_is_not_mapped_back(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    small, small_data = _tensor(alloc, 1000, "weights", gen)
    free_small = alloc.stats().device_free_bytes
    big, _ = _tensor(alloc, 9 * MiB, "weights", gen)
    alloc.sleep({"weights": "offload"})
    del big
    gc.collect()
    alloc.wake_up()
    assert torch.equal(as_cpu_bytes(small), small_data)
    assert alloc.stats().device_free_bytes == free_small


def test_freeing_the_tail_after_a_wake_returns_memory(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    small, small_data = _tensor(alloc, 1000, "weights", gen)
    free_small = alloc.stats().device_free_bytes
    big, _ = _tensor(alloc, 9 * MiB, "weights", gen)
    alloc.sleep({"weights": "offload"})
    alloc.wake_up()
    del big
    gc.collect()
    assert torch.equal(as_cpu_bytes(small), small_data)
    assert alloc.stats().device_free_bytes == free_small


def test_tensors_outlive_a_closed_allocator(
    make_allocator: AllocatorFactory, backend: str, gen: torch.Generator
) -> None:
    alloc = make_allocator(backend)
    t, data = _tensor(alloc, 3 * MiB, "weights", gen)
    alloc.close()
    assert torch.equal(as_cpu_bytes(t), data)
    data = fill_random(t, gen)
    assert torch.equal(as_cpu_bytes(t), data)
    with pytest.raises(WrongState):
        alloc.stats()
    with pytest.raises(WrongState):
        alloc.empty(1, torch.uint8, tag="weights")
    with pytest.raises(WrongState):
        alloc.sleep({"weights": "offload"})
    del t
    gc.collect()


def test_process_allocator_is_one_per_configuration(backend: str) -> None:
    cfg = AllocatorConfig(backend=backend, host_capacity_bytes=HOST_CAPACITY, host_chunk_bytes=4 * MiB)  # type: ignore[arg-type]
    try:
        a = get_allocator(cfg)
        assert get_allocator(cfg) is a
        assert get_allocator() is a
        with pytest.raises(WrongState):
            get_allocator(AllocatorConfig(backend=backend, host_capacity_bytes=2 * HOST_CAPACITY))  # type: ignore[arg-type]
        close_allocator()
        b = get_allocator(cfg)
        assert b is not a
    finally:
        close_allocator()


# ---------------------------------------------------------------- checksums


def test_checksum_verifies_every_offloaded_byte(
    make_allocator: AllocatorFactory, backend: str, gen: torch.Generator
) -> None:
    alloc = make_allocator(backend, checksum=True)
    sizes = [1, 7, 257, 3 * MiB, 9 * MiB + 1]
    tensors = [_tensor(alloc, n, "weights", gen) for n in sizes]
    _tensor(alloc, 2 * MiB, "kv_cache", gen)
    alloc.sleep({"weights": "offload", "kv_cache": "discard"})
    assert alloc.stats().counters["bytes_verified"] == 0
    alloc.wake_up()
    assert alloc.stats().counters["bytes_verified"] == sum(sizes)  # discarded bytes are not verified
    for t, data in tensors:
        assert torch.equal(as_cpu_bytes(t), data)
    alloc.sleep({"weights": "offload"})
    alloc.wake_up()
    assert alloc.stats().counters["bytes_verified"] == 2 * sum(sizes)


def test_checksum_can_be_switched(make_allocator: AllocatorFactory, backend: str, gen: torch.Generator) -> None:
    alloc = make_allocator(backend)
    t, data = _tensor(alloc, 5 * MiB, "weights", gen)
    alloc.sleep({"weights": "offload"})
    alloc.wake_up()
    assert alloc.stats().counters["bytes_verified"] == 0
    alloc.set_checksum(True)
    alloc.sleep({"weights": "offload"})
    alloc.wake_up()
    assert alloc.stats().counters["bytes_verified"] == 5 * MiB
    alloc.set_checksum(False)
    alloc.sleep({"weights": "offload"})
    alloc.wake_up()
    assert alloc.stats().counters["bytes_verified"] == 5 * MiB
    assert torch.equal(as_cpu_bytes(t), data)


def test_enabling_checksum_while_asleep_does_not_fail_the_wake(
    make_allocator: AllocatorFactory, backend: str, gen: torch.Generator
) -> None:
    alloc = make_allocator(backend)
    t, data = _tensor(alloc, 1000, "weights", gen)
    alloc.sleep({"weights": "offload"})
    alloc.set_checksum(True)
    alloc.wake_up()
    assert torch.equal(as_cpu_bytes(t), data)


MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_checksum(data: bytes) -> int:
    """The documented offload checksum: sum of mix64(w_i ^ i*golden) over little-endian words, mod 2**64."""
    padded = data + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        total += _mix64(w ^ ((i * GOLDEN) & MASK))
    return total & MASK


def test_native_checksum_matches_the_reference() -> None:
    rng = random.Random(99)
    assert _native.checksum(b"") == 0
    for n in list(range(0, 101)) + [rng.randint(101, 5000) for _ in range(20)]:
        data = rng.randbytes(n)
        assert _native.checksum(data) == reference_checksum(data), n
    zeros = bytes(64)
    assert _native.checksum(zeros) == reference_checksum(zeros) != 0  # position-dependent even for zeros
    assert _native.checksum(bytearray(b"abc")) == reference_checksum(b"abc")
    assert _native.checksum(memoryview(b"abcdefghij")) == reference_checksum(b"abcdefghij")


def test_checksum_detects_swapped_words_and_single_bits() -> None:
    rng = random.Random(5)
    for _ in range(50):
        nwords = rng.randint(2, 20)
        words = [rng.randbytes(8) for _ in range(nwords)]
        i, j = rng.sample(range(nwords), 2)
        if words[i] == words[j]:
            continue
        swapped = list(words)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        assert _native.checksum(b"".join(words)) != _native.checksum(b"".join(swapped))
        flipped = bytearray(b"".join(words))
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        assert _native.checksum(bytes(flipped)) != _native.checksum(b"".join(words))


# ---------------------------------------------------------------- threads


def _run_threads(workers: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(len(workers))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                start.wait()
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(w)) for w in workers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def test_concurrent_alloc_and_free_in_different_tags(alloc: MemoryAllocator) -> None:
    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(k)
            tag = f"tag{k}"
            live: list[tuple[torch.Tensor, int]] = []
            for step in range(300):
                if live and (len(live) >= 12 or rng.random() < 0.4):
                    t, val = live.pop(rng.randrange(len(live)))
                    assert bool((t == val).all()), f"{tag}: data of a live tensor changed"
                    del t
                else:
                    n = rng.choice([1, 100, 4096, 70_000, 3 * MiB])
                    val = (k * 31 + step) % 251
                    t = alloc.empty(n, torch.uint8, tag=tag)
                    t.fill_(val)
                    assert alloc.lookup(t.data_ptr(), n) == (t.data_ptr(), tag)
                    live.append((t, val))
            for t, val in live:
                assert bool((t == val).all())

        return run

    def observer() -> None:
        for _ in range(200):
            s = alloc.stats()
            for st in s.tags.values():
                assert st.allocated_bytes <= st.mapped_bytes

    _run_threads([worker(k) for k in range(4)] + [observer])
    gc.collect()
    s = alloc.stats()
    for k in range(4):
        assert s.tags[f"tag{k}"].allocations == 0
        assert s.tags[f"tag{k}"].mapped_bytes == 0
    if alloc.backend == "host":
        assert s.device_free_bytes == s.device_total_bytes


def test_concurrent_allocs_while_another_tag_cycles(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    w, w_data = _tensor(alloc, 9 * MiB + 77, "weights", gen)

    def cycler() -> None:
        for _ in range(8):
            alloc.sleep({"weights": "offload"})
            alloc.wake_up(["weights"])
            assert torch.equal(as_cpu_bytes(w), w_data)

    def allocator(k: int) -> Callable[[], None]:
        def run() -> None:
            held = []
            for i in range(150):
                t = alloc.empty(1000 + 37 * i, torch.uint8, tag=f"kv{k}")
                t.fill_(i % 200)
                held.append((t, i % 200))
                if len(held) > 10:
                    t0, v0 = held.pop(0)
                    assert bool((t0 == v0).all())

        return run

    _run_threads([cycler, allocator(0), allocator(1)])
    assert alloc.stats().counters["sleeps"] == 8
    assert torch.equal(as_cpu_bytes(w), w_data)


# ---------------------------------------------------------------- host staging reserve


def test_host_reserve_reuses_chunks(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    t, data = _tensor(alloc, 20 * MiB, "weights", gen)  # five 4 MiB chunks
    alloc.set_host_reserve(1 << 30)
    alloc.sleep({"weights": "offload"})
    first = alloc.stats().counters
    assert first["host_held_bytes"] >= 20 * MiB
    assert first["host_reserve_bytes"] == 1 << 30
    alloc.wake_up()
    kept = alloc.stats().counters
    assert kept["host_held_bytes"] == first["host_held_bytes"] > 0  # kept for the next sleep

    alloc.sleep({"weights": "offload"})
    second = alloc.stats().counters
    assert second["host_chunks_reused"] - first["host_chunks_reused"] == 5
    assert second["host_chunks_created"] == first["host_chunks_created"]
    alloc.wake_up()
    assert torch.equal(as_cpu_bytes(t), data)
    assert alloc.stats().counters["host_held_bytes"] > 0

    alloc.set_host_reserve(0)  # dropping the reserve releases what it held
    assert alloc.stats().counters["host_held_bytes"] == 0


def test_no_host_reserve_releases_everything_on_wake(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    t, data = _tensor(alloc, 9 * MiB, "weights", gen)
    assert alloc.stats().counters["host_reserve_bytes"] == 0
    for _ in range(2):
        alloc.sleep({"weights": "offload"})
        assert alloc.stats().counters["host_held_bytes"] >= 9 * MiB
        alloc.wake_up()
        assert host_held_once_trimmed(alloc, 0) == 0
    assert alloc.stats().counters["host_chunks_reused"] == 0  # nothing was kept to reuse
    assert torch.equal(as_cpu_bytes(t), data)


def test_negative_host_reserve_is_invalid(alloc: MemoryAllocator) -> None:
    with pytest.raises(InvalidArgument):
        alloc.set_host_reserve(-1)
    assert alloc.stats().counters["host_reserve_bytes"] == 0


@pytest.mark.parametrize("nbytes", [20 * MiB, 13 * MiB + 5])
def test_prepinned_host_memory_serves_the_first_sleep(
    alloc: MemoryAllocator, gen: torch.Generator, nbytes: int
) -> None:
    pinned = 20 * MiB  # five 4 MiB chunks
    alloc.prepin_host(pinned)
    c0 = alloc.stats().counters
    assert c0["host_held_bytes"] >= pinned
    assert c0["host_reserve_bytes"] >= pinned
    assert c0["host_chunks_created"] > 0
    alloc.prepin_host(pinned)  # already there: nothing more to do
    assert alloc.stats().counters["host_chunks_created"] == c0["host_chunks_created"]

    t, data = _tensor(alloc, nbytes, "w", gen)
    alloc.sleep({"w": "offload"})
    c1 = alloc.stats().counters
    assert c1["host_chunks_created"] == c0["host_chunks_created"]  # the first sleep made no chunk
    assert c1["host_chunks_reused"] - c0["host_chunks_reused"] == -(-nbytes // (4 * MiB))
    alloc.wake_up()
    assert torch.equal(as_cpu_bytes(t), data)
    assert host_held_once_trimmed(alloc, int(c0["host_held_bytes"])) == c0["host_held_bytes"]  # kept by the reserve


def test_prepin_beside_sleep_and_wake_cycles(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    w, w_data = _tensor(alloc, 9 * MiB + 77, "weights", gen)
    kv, kv_data = _tensor(alloc, 3 * MiB + 1, "kv", gen)

    def cycler() -> None:
        for _ in range(6):
            alloc.sleep({"weights": "offload"})
            alloc.wake_up(["weights"])
            assert torch.equal(as_cpu_bytes(w), w_data)

    def prepinner() -> None:
        for n in (8 * MiB, 16 * MiB, 0, 4 * MiB + 1, 24 * MiB, 12 * MiB):
            alloc.prepin_host(n)

    def reader() -> None:
        for _ in range(50):
            assert torch.equal(as_cpu_bytes(kv), kv_data)
            alloc.stats()

    _run_threads([cycler, prepinner, reader])
    c = alloc.stats().counters
    assert c["sleeps"] == c["wakes"] == 6
    assert c["host_reserve_bytes"] >= 24 * MiB
    assert c["host_held_bytes"] >= 24 * MiB
    assert torch.equal(as_cpu_bytes(w), w_data)
    alloc.sleep({"weights": "offload"})  # three chunks from the pool, none new
    created = alloc.stats().counters["host_chunks_created"]
    alloc.wake_up()
    assert alloc.stats().counters["host_chunks_created"] == created
    assert torch.equal(as_cpu_bytes(w), w_data)


def test_prepin_racing_a_first_sleep_pins_no_more_than_the_sleep_needs(
    alloc: MemoryAllocator, gen: torch.Generator
) -> None:
    """The worker starts a prepin after the load; an early sleep may run beside it. The sleep takes
    prepinned chunks and makes the rest; the prepin stops once the pool grew by its size, whoever
    made the chunks, instead of replacing every chunk the sleep took. In the worst interleaving (the
    sleep never finds a prepinned chunk ready) both still make a full set: at most twice the size,
    plus the prepin's chunk in flight."""
    w, w_data = _tensor(alloc, 32 * MiB, "weights", gen)
    chunk = HOST_CHUNK
    barrier = threading.Barrier(2)

    def prepinner() -> None:
        barrier.wait()
        alloc.prepin_host(32 * MiB)

    def sleeper() -> None:
        barrier.wait()
        alloc.sleep({"weights": "offload"})

    _run_threads([prepinner, sleeper])
    held = alloc.stats().counters["host_held_bytes"]
    assert 32 * MiB <= held <= 2 * 32 * MiB + chunk, held
    alloc.wake_up()
    assert torch.equal(as_cpu_bytes(w), w_data)


def test_close_stops_a_running_prepin(make_allocator: AllocatorFactory) -> None:
    """close() stops a prepin on another thread at its next chunk (the worker joins it on shutdown):
    a 4 GiB prepin closed after 50 ms ends long before 4 GiB could have been pinned here."""
    probe = make_allocator("host")
    t0 = time.monotonic()
    probe.prepin_host(64 * MiB)
    full_4g = (time.monotonic() - t0) * 64  # what the whole 4 GiB would take at this machine's rate
    probe.close()

    a = make_allocator("host")
    started = threading.Event()
    errors: list[BaseException] = []

    def prepin() -> None:
        started.set()
        try:
            a.prepin_host(4096 * MiB)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=prepin)
    t.start()
    started.wait()
    time.sleep(0.05)
    t0 = time.monotonic()
    a.close()
    t.join(timeout=max(30.0, 2 * full_4g))
    took = time.monotonic() - t0
    assert not t.is_alive() and not errors, errors
    assert took < full_4g / 4, (took, full_4g)


@pytest.mark.parametrize("nbytes", [-1, -(1 << 40), 1.5, "4096", None, True, 1 << 64])
def test_bad_prepin_is_invalid_argument(host_alloc: MemoryAllocator, nbytes: object) -> None:
    before = host_alloc.stats()
    with pytest.raises(InvalidArgument):
        host_alloc.prepin_host(nbytes)  # type: ignore[arg-type]
    _unchanged(before, host_alloc.stats())
    with pytest.raises(InvalidArgument):
        host_alloc._native.prepin_host(-1)  # the native call checks too


def test_prepin_of_zero_is_a_no_op(host_alloc: MemoryAllocator) -> None:
    before = host_alloc.stats()
    host_alloc.prepin_host(0)
    _unchanged(before, host_alloc.stats())
    assert before.counters["host_held_bytes"] == 0


def test_prepin_never_lowers_the_host_reserve(host_alloc: MemoryAllocator) -> None:
    host_alloc.set_host_reserve(64 * MiB)
    host_alloc.prepin_host(8 * MiB)
    c = host_alloc.stats().counters
    assert c["host_reserve_bytes"] == 64 * MiB
    assert c["host_held_bytes"] == 8 * MiB


def test_host_buffers_hold_and_release_host_memory(alloc: MemoryAllocator, gen: torch.Generator) -> None:
    h = alloc.host_empty(3 * MiB + 5, torch.uint8)
    data = random_bytes(3 * MiB + 5, gen)
    h.copy_(data)
    assert alloc.stats().counters["host_held_bytes"] >= 3 * MiB + 5
    assert alloc.lookup(h.data_ptr(), 3 * MiB + 5) == (h.data_ptr(), "")
    assert torch.equal(h, data)
    del h
    gc.collect()
    assert alloc.stats().counters["host_held_bytes"] == 0


@pytest.mark.parametrize("tag", ["", "x" * 64, "nul\0tag"])
def test_bad_tag_names_are_invalid_argument_everywhere(host_alloc: MemoryAllocator, tag: str) -> None:
    for call in (
        lambda: host_alloc.empty((4,), torch.uint8, tag),
        lambda: host_alloc.empty((0,), torch.uint8, tag),
        lambda: host_alloc.sleep({tag: "offload"}),
        lambda: host_alloc.wake_up([tag]),
    ):
        with pytest.raises(InvalidArgument):
            call()
    assert host_alloc.stats().tags == {}


def test_zero_size_tensor_in_a_slept_tag_is_wrong_state(host_alloc: MemoryAllocator, gen: torch.Generator) -> None:
    _tensor(host_alloc, 100, "weights", gen)
    host_alloc.sleep({"weights": "offload"})
    with pytest.raises(WrongState):
        host_alloc.empty((0, 5), torch.float32, "weights")


def test_a_shape_larger_than_any_device_is_invalid_argument(host_alloc: MemoryAllocator) -> None:
    with pytest.raises(InvalidArgument):
        host_alloc.empty((1 << 40, 1 << 40), torch.float32, "weights")
    assert host_alloc.stats().tags == {}


def test_waking_an_empty_tag_list_is_invalid_argument(host_alloc: MemoryAllocator, gen: torch.Generator) -> None:
    _tensor(host_alloc, 100, "weights", gen)
    host_alloc.sleep({"weights": "offload"})
    wakes = host_alloc.stats().counters["wakes"]
    with pytest.raises(InvalidArgument):
        host_alloc.wake_up([])
    assert host_alloc.stats().tags["weights"].state == "offloaded"
    assert host_alloc.stats().counters["wakes"] == wakes


def test_an_arena_that_cannot_be_reserved_is_out_of_memory_not_a_crash(make_allocator: AllocatorFactory) -> None:
    a = make_allocator("host", arena_va_bytes=1 << 47)  # more address space than a process has
    with pytest.raises(OutOfMemory):
        a.empty((16,), torch.uint8, "weights")
    assert a.stats().tags == {}


def test_checksums_from_before_a_demotion_are_not_verified_later(host_alloc: MemoryAllocator) -> None:
    t = host_alloc.empty((4096,), torch.uint8, "w")
    t.fill_(1)
    host_alloc.set_checksum(True)
    host_alloc.sleep({"w": "offload"})
    host_alloc.sleep({"w": "discard"})  # demoted: the summed host copy is gone
    host_alloc.wake_up()
    t.fill_(2)
    host_alloc.set_checksum(False)
    host_alloc.sleep({"w": "offload"})
    host_alloc.wake_up()  # must not compare against the sum of the discarded copy
    assert int(t.min()) == 2 and int(t.max()) == 2


def test_the_host_backend_has_no_device_stream_to_give(host_alloc: MemoryAllocator) -> None:
    with pytest.raises(Unavailable, match="no device streams"):
        host_alloc.new_stream()
    assert host_alloc.stats().tags == {}, "nothing was made"
