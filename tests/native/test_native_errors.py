"""What the native extension tells its callers, as data: the tag actions are the proto's numbers, a failed
checksum names its allocation in the exception's metadata, and running out of host memory is OutOfMemory
(never the builtin MemoryError, which clients would see as INTERNAL).

These drive ``worker._native`` directly on the host backend, without torch.
"""

from __future__ import annotations

import ctypes
import re

import pytest

from memsvc.errors import IntegrityError, InvalidArgument, OutOfMemory, WrongState
from memsvc.v1 import common_pb2 as common_pb
from worker import _native

MiB = 1 << 20


def _capsule_data(capsule: object) -> int:
    """The data pointer of an unconsumed DLPack capsule (DLManagedTensor starts with DLTensor.data)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    managed = get(capsule, b"dltensor")
    data = ctypes.c_void_p.from_address(managed).value
    assert data
    return data


def test_tag_actions_are_the_proto_numbers() -> None:
    """The native sleep takes TagAction values as they are: each one does what its proto name says,
    and the values the proto does not define are refused."""
    a = _native.Allocator(_native.BACKEND_HOST, 0, host_capacity=16 * MiB)
    try:
        for tag in ("kept", "offloaded", "discarded"):
            a.alloc(tag, 4096)
        for code in (common_pb.TAG_ACTION_UNSPECIFIED, max(common_pb.TagAction.values()) + 1, -1):
            with pytest.raises(InvalidArgument, match=f"unknown action {code}"):
                a.sleep([("kept", code)])
        assert {s["state"] for s in a.tag_stats()} == {"awake"}, "a refused sleep changed nothing"
        a.sleep(
            [
                ("kept", common_pb.TAG_ACTION_KEEP),
                ("offloaded", common_pb.TAG_ACTION_OFFLOAD),
                ("discarded", common_pb.TAG_ACTION_DISCARD),
            ]
        )
        assert {s["tag"]: s["state"] for s in a.tag_stats()} == {
            "kept": "awake",
            "offloaded": "offloaded",
            "discarded": "discarded",
        }
    finally:
        a.close()


def test_failed_checksum_names_the_allocation_in_metadata() -> None:
    """The host copy is corrupted where it lies: a host buffer's chunk, freed into the pool (the reserve
    keeps it) and then reused by the offload, so its address is known."""
    a = _native.Allocator(
        _native.BACKEND_HOST,
        0,
        host_capacity=16 * MiB,
        host_chunk_bytes=4 * MiB,
        host_reserve_bytes=8 * MiB,
        checksum=True,
    )
    try:
        capsule = a.host_tensor(4 * MiB, [4 * MiB], 1, 8)
        chunk = _capsule_data(capsule)
        del capsule  # never consumed: its destructor frees the buffer into the pool
        size = MiB + 100
        addr = a.alloc("weights", size)
        ctypes.memset(addr, 7, size)
        a.sleep([("weights", common_pb.TAG_ACTION_OFFLOAD)])
        assert ctypes.string_at(chunk, 64) == b"\x07" * 64, "the offload did not reuse the freed chunk"
        ctypes.memset(chunk + 100, 8, 1)
        with pytest.raises(IntegrityError) as ei:
            a.wake()
        assert ei.value.metadata == {"tag": "weights", "allocation": f"{addr:#x}", "allocationBytes": str(size)}
        pattern = rf"tag 'weights': allocation {addr:#x} \({size} bytes\) failed its checksum on wake "
        pattern += r"\(0x[0-9a-f]{16} != 0x[0-9a-f]{16}\)"
        assert re.fullmatch(pattern, str(ei.value)), str(ei.value)
        assert a.tag_stats()[0]["state"] == "awake"
        with pytest.raises(WrongState) as later:  # the next error carries no stale detail
            a.wake()
        assert later.value.metadata == {}
    finally:
        a.close()


def test_out_of_host_memory_is_out_of_memory() -> None:
    ids = bytearray(8)  # one id, 0, as a little-endian int64 buffer
    owner = memoryview(bytearray(b"\xff" * 8)).cast("q")  # one free destination block
    with pytest.raises(OutOfMemory, match="out of host memory"):
        _native.kv_check(memoryview(ids).cast("q"), memoryview(ids).cast("q"), 1 << 62, 1, owner)
