"""The three forms a SwapBlocks request can name its blocks in, checked before any per-block work.

Shared by the worker (which then decodes the ids) and the manager (which passes the request on): a
request with two forms, lengths that differ or more than MAX_SWAP_PAIRS blocks is refused by its
field lengths alone, so an oversized request costs neither side a pass over its blocks.
"""

from __future__ import annotations

from memsvc.errors import InvalidArgument
from memsvc.runtime.limits import MAX_SWAP_PAIRS

U32LE_BYTES = 4


def swap_block_count(pairs: int, src_blocks: int, dst_blocks: int, src_u32le: int, dst_u32le: int) -> int:
    """The number of blocks a request moves, from its field lengths (``*_u32le`` in bytes)."""
    forms = [
        name
        for name, given in (
            ("pairs", pairs),
            ("src_blocks + dst_blocks", src_blocks or dst_blocks),
            ("src_blocks_u32le + dst_blocks_u32le", src_u32le or dst_u32le),
        )
        if given
    ]
    if len(forms) > 1:
        raise InvalidArgument(f"give the blocks in one form, not as {' and as '.join(forms)}")
    if src_u32le or dst_u32le:
        if src_u32le % U32LE_BYTES or dst_u32le % U32LE_BYTES:
            raise InvalidArgument(
                f"src_blocks_u32le and dst_blocks_u32le hold 4 bytes per block id, got {src_u32le} and "
                f"{dst_u32le} bytes"
            )
        n, n_dst = src_u32le // U32LE_BYTES, dst_u32le // U32LE_BYTES
        if n != n_dst:
            raise InvalidArgument(f"src_blocks_u32le has {n} ids but dst_blocks_u32le has {n_dst}")
    elif src_blocks or dst_blocks:
        n = src_blocks
        if src_blocks != dst_blocks:
            raise InvalidArgument(f"src_blocks has {src_blocks} ids but dst_blocks has {dst_blocks}")
    else:
        n = pairs
    if n > MAX_SWAP_PAIRS:
        raise InvalidArgument(f"at most {MAX_SWAP_PAIRS} blocks per call, got {n}")
    return n


__all__ = ["U32LE_BYTES", "swap_block_count"]
