"""The disk tier: a sleeping tag's backup in a file under the offload directory (native/disk.c).

Every test runs on the host backend and, where a GPU is present, on cuda: sleep to disk and wake
give back every byte at the same addresses, across staging chunks and with holes between
allocations; an offloaded tag moves to disk (the demotion that frees host RAM) and a tag on disk
can be discarded; a corrupted file fails the wake's checksum; a full disk (a file-size limit in a
child process, so nothing else in the test session is limited) fails the sleep and keeps the data
where it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _util import MiB, as_cpu_bytes, fill_random, host_held_once_trimmed
from conftest import AllocatorFactory

from memsvc.errors import BackendError, IntegrityError, InvalidArgument, OutOfMemory, WrongState
from memsvc.vocabulary import SLEEP_RULES, TagState, sleep_acts_on
from worker import _native
from worker.allocator import Action, MemoryAllocator

# Across several 4 MiB staging chunks, with odd sizes so the last chunk is partly filled.
SIZES = [1, 4095, 3 * MiB + 7, 9 * MiB + 1, 257]


def _fill(alloc: MemoryAllocator, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for n in SIZES:
        t = alloc.empty(n, torch.uint8, tag="weights")
        out.append((t, fill_random(t, gen)))
    return out


def _intact(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for t, want in pairs:
        assert torch.equal(as_cpu_bytes(t), want)


def _offload_files(directory: Path) -> list[str]:
    """This process's open files in ``directory`` (the tier's files are unlinked: /proc still shows them)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(fd)
    return found


@pytest.fixture
def disk_alloc(backend: str, make_allocator: AllocatorFactory, tmp_path: Path) -> MemoryAllocator:
    return make_allocator(backend, checksum=True, offload_dir=str(tmp_path))


def test_sleep_to_disk_and_wake_restore_every_byte_at_the_same_addresses(
    disk_alloc: MemoryAllocator, gen: torch.Generator, tmp_path: Path
) -> None:
    alloc = disk_alloc
    pairs = _fill(alloc, gen)
    hole = alloc.empty(2 * MiB, torch.uint8, tag="weights")  # freed while awake: a gap between allocations
    del hole
    addresses = [t.data_ptr() for t, _ in pairs]
    data = sum(SIZES)

    alloc.sleep({"weights": Action.OFFLOAD_DISK})
    s = alloc.stats()
    tag = s.tags["weights"]
    assert tag.state == "on_disk" and tag.mapped_bytes == 0
    assert tag.disk_bytes == data and tag.offloaded_bytes == 0
    assert s.counters["disk_held_bytes"] >= data and s.counters["bytes_to_disk"] == s.counters["disk_held_bytes"]
    assert host_held_once_trimmed(alloc, 0) == 0  # the staging ring went back (trimmed off the sleep's path)
    assert os.listdir(tmp_path) == []  # unlinked: nothing is left behind if the process dies
    assert len(_offload_files(tmp_path)) == 1

    alloc.wake_up()
    s = alloc.stats()
    assert s.tags["weights"].state == "awake" and s.tags["weights"].disk_bytes == 0
    assert [t.data_ptr() for t, _ in pairs] == addresses
    _intact(pairs)
    assert s.counters["bytes_verified"] == data
    assert s.counters["disk_held_bytes"] == 0 and s.counters["bytes_from_disk"] == s.counters["bytes_to_disk"]
    assert _offload_files(tmp_path) == []


def test_chunks_read_in_several_requests_each_and_more_chunks_than_staging_slots(
    backend: str, make_allocator: AllocatorFactory, gen: torch.Generator, tmp_path: Path
) -> None:
    """32 MiB chunks are read and written as two 16 MiB requests each, from eight threads that run
    ahead of the copies into the next free staging slot (three): 7 chunks, so every slot is reused."""
    alloc = make_allocator(backend, checksum=True, offload_dir=str(tmp_path), host_chunk_bytes=32 * MiB)
    t = alloc.empty(200 * MiB + 12345, torch.uint8, tag="weights")
    want = fill_random(t, gen)
    alloc.sleep({"weights": Action.OFFLOAD_DISK})
    assert alloc.stats().tags["weights"].disk_bytes == 200 * MiB + 12345
    alloc.wake_up()
    assert torch.equal(as_cpu_bytes(t), want)
    assert alloc.stats().counters["bytes_verified"] == 200 * MiB + 12345


def test_an_offloaded_tag_moves_to_disk_and_a_tag_on_disk_can_be_discarded(
    disk_alloc: MemoryAllocator, gen: torch.Generator, tmp_path: Path
) -> None:
    alloc = disk_alloc
    pairs = _fill(alloc, gen)
    kv = alloc.empty(3 * MiB, torch.uint8, tag="kv_cache")
    alloc.sleep({"weights": Action.OFFLOAD, "kv_cache": Action.OFFLOAD})
    assert alloc.stats().tags["weights"].offloaded_bytes == sum(SIZES)

    alloc.sleep({"weights": Action.OFFLOAD_DISK})  # the demotion: host copy to disk, nothing woken
    s = alloc.stats()
    assert s.tags["weights"].state == "on_disk" and s.tags["weights"].offloaded_bytes == 0
    assert s.tags["weights"].disk_bytes == sum(SIZES) and s.tags["weights"].mapped_bytes == 0
    assert s.tags["kv_cache"].state == "offloaded"  # not named: where it was

    alloc.wake_up(["weights"])
    _intact(pairs)
    alloc.sleep({"weights": Action.OFFLOAD_DISK})
    alloc.sleep({"weights": Action.DISCARD})  # level 2 from disk: the file goes
    s = alloc.stats()
    assert s.tags["weights"].state == "discarded" and s.counters["disk_held_bytes"] == 0
    assert _offload_files(tmp_path) == []
    with pytest.raises(WrongState, match="already asleep"):
        alloc.sleep({"kv_cache": Action.KEEP, "weights": Action.OFFLOAD})
    alloc.wake_up()
    assert kv.data_ptr() == alloc.lookup(kv.data_ptr())[0]


def _corrupt(directory: Path, offset: int) -> None:
    """Flip a byte of the tier's (only) file through a second, buffered handle on it."""
    (fd,) = _offload_files(directory)
    raw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        block = bytearray(os.pread(raw, 4096, offset))
        block[100] ^= 0x5A
        os.pwrite(raw, bytes(block), offset)
        os.fsync(raw)
    finally:
        os.close(raw)


@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "checksums-off"])
def test_a_corrupted_file_fails_the_wake_checksum_even_with_checksums_off(
    backend: str, make_allocator: AllocatorFactory, gen: torch.Generator, tmp_path: Path, checksum: bool
) -> None:
    """A file is a copy nothing else checks: with a disk tier every kept tag is summed (sleep.c)."""
    alloc = make_allocator(backend, checksum=checksum, offload_dir=str(tmp_path))
    pairs = _fill(alloc, gen)
    alloc.sleep({"weights": Action.OFFLOAD})  # summed at this sleep, so a later demotion is covered too
    alloc.sleep({"weights": Action.OFFLOAD_DISK})
    _corrupt(tmp_path, 5 * MiB)
    with pytest.raises(IntegrityError, match="failed its checksum") as err:
        alloc.wake_up()
    assert err.value.metadata["tag"] == "weights"
    s = alloc.stats()  # awake with the bad bytes reported (the worker reloads weights from their source)
    assert s.tags["weights"].state == "awake" and s.counters["disk_held_bytes"] == 0
    assert _offload_files(tmp_path) == []
    assert sum(not torch.equal(as_cpu_bytes(t), want) for t, want in pairs) == 1  # the one flipped byte's


def test_a_wake_that_cannot_read_the_file_leaves_the_tag_on_disk(
    disk_alloc: MemoryAllocator, gen: torch.Generator, tmp_path: Path
) -> None:
    alloc = disk_alloc
    pairs = _fill(alloc, gen)
    alloc.sleep({"weights": Action.OFFLOAD_DISK})
    held = alloc.stats().counters["disk_held_bytes"]
    (fd,) = _offload_files(tmp_path)
    raw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # cut short under the worker
    try:
        os.ftruncate(raw, 6 * MiB)
    finally:
        os.close(raw)
    with pytest.raises(BackendError, match="reading a backup back"):
        alloc.wake_up()
    s = alloc.stats()
    assert s.tags["weights"].state == "on_disk" and s.tags["weights"].mapped_bytes == 0
    assert s.counters["disk_held_bytes"] == held and len(_offload_files(tmp_path)) == 1
    alloc.sleep({"weights": Action.DISCARD})  # what is lost can still be let go
    assert alloc.stats().counters["disk_held_bytes"] == 0 and _offload_files(tmp_path) == []
    alloc.wake_up()
    assert [t.data_ptr() for t, _ in pairs] == [alloc.lookup(t.data_ptr())[0] for t, _ in pairs]


def test_a_wake_without_device_room_leaves_the_tag_on_disk_and_a_later_one_restores_it(
    make_allocator: AllocatorFactory, gen: torch.Generator, tmp_path: Path
) -> None:
    alloc = make_allocator("host", checksum=True, offload_dir=str(tmp_path))
    pairs = _fill(alloc, gen)
    alloc.sleep({"weights": Action.OFFLOAD_DISK})
    filler = alloc.empty(int(alloc.stats().device_free_bytes) - MiB, torch.uint8, tag="other")
    with pytest.raises(OutOfMemory):
        alloc.wake_up(["weights"])
    assert alloc.stats().tags["weights"].state == "on_disk"
    del filler
    alloc.wake_up(["weights"])
    _intact(pairs)


def test_the_native_sleep_rule_and_the_vocabularys_copy_are_the_same_table() -> None:
    """The manager, which has no native layer, decides by memsvc.vocabulary.SLEEP_RULES; the worker's
    native layer by msv_sleep_rule (native/sleep.c). Every state and action, entry by entry."""
    native = _native.sleep_rules()
    python = {(state.value, int(action)): after and after.value for (state, action), after in SLEEP_RULES.items()}
    assert native == python
    assert len(native) == len(TagState) * len(Action)


def test_the_native_sleep_and_the_vocabulary_agree_on_what_a_sleep_does_to_each_state(
    make_allocator: AllocatorFactory, tmp_path: Path
) -> None:
    """vocabulary.sleep_acts_on is what the worker and the in-memory worker decide by; msv_sleep
    (native/sleep.c) is what happens."""
    alloc = make_allocator("host", offload_dir=str(tmp_path))
    keep = alloc.empty(MiB, torch.uint8, tag="t")
    put = {TagState.OFFLOADED: Action.OFFLOAD, TagState.ON_DISK: Action.OFFLOAD_DISK}
    put[TagState.DISCARDED] = Action.DISCARD
    for state in TagState:
        for action in (Action.OFFLOAD, Action.OFFLOAD_DISK, Action.DISCARD):
            if state != TagState.AWAKE:
                alloc.sleep({"t": put[state]})
            try:
                alloc.sleep({"t": action})
                acted = True
            except WrongState:
                acted = False
            assert acted == sleep_acts_on(state, action), (state, action)
            if alloc.stats().tags["t"].state != "awake":
                alloc.wake_up(["t"])
    assert keep.numel() == MiB


def test_without_a_disk_tier_offload_disk_is_refused_and_changes_nothing(
    backend: str, make_allocator: AllocatorFactory, gen: torch.Generator, tmp_path: Path
) -> None:
    alloc = make_allocator(backend)
    pairs = _fill(alloc, gen)
    with pytest.raises(WrongState, match="no disk tier"):
        alloc.sleep({"weights": Action.OFFLOAD_DISK})
    assert alloc.stats().tags["weights"].state == "awake"
    _intact(pairs)
    with pytest.raises(InvalidArgument, match="does not exist"):
        make_allocator(backend, offload_dir=str(tmp_path / "missing"))


_DISK_FULL = textwrap.dedent(
    """
    import resource, sys, torch
    from memsvc.errors import OutOfMemory
    from worker.allocator import Action, AllocatorConfig, MemoryAllocator

    MiB = 1 << 20
    alloc = MemoryAllocator(AllocatorConfig(backend=sys.argv[1], host_capacity_bytes=256 * MiB,
                                            host_chunk_bytes=4 * MiB, checksum=True, offload_dir=sys.argv[2]))
    t = alloc.empty(10 * MiB, torch.uint8, tag="weights")
    want = torch.randint(0, 256, (10 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    t.copy_(want)
    # Files may grow to 6 MiB: the second staging chunk's write fails (EFBIG; Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (6 * MiB, resource.RLIM_INFINITY))
    for action in ("sleep", "demote"):
        if action == "demote":
            alloc.sleep({"weights": Action.OFFLOAD})
        try:
            alloc.sleep({"weights": Action.OFFLOAD_DISK})
        except OutOfMemory as e:
            assert "is full" in str(e), e
        else:
            raise SystemExit(f"{action}: a full disk did not fail the sleep")
        s = alloc.stats()
        state = s.tags["weights"].state
        assert state == ("awake" if action == "sleep" else "offloaded"), state
        assert s.counters["disk_held_bytes"] == 0
        if action == "demote":
            # the host backend's device memory is a memfd, which the same limit would stop growing
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            alloc.wake_up()
        assert torch.equal(t.cpu(), want), action
    print("ok")
    """
)


def test_a_full_disk_fails_the_sleep_and_keeps_the_data_where_it_was(backend: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, backend, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
