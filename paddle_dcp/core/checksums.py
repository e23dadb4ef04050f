"""The checksum scheme: every block of a piece hashed with a seed that names the piece.

A piece's bytes are cut in blocks of ``block_bytes`` (the last one shorter; an empty piece is
one empty block); block ``k`` of a piece is checksummed with xxh3_64 seeded by the piece's
seed plus ``k``, and the piece's seed is the xxh3_64 of its identity (key, dtype, global offset,
local shape). The save computes them (``DataFileWriter.write``), the metadata stores them, a
load, a peer's answer and ``verify`` compare them in one place (:func:`failing`) before a byte
is used.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence, Tuple, Union

import numpy as np
import xxhash

from ..errors import IntegrityError
from .load_plan import Segment
from .metadata import Metadata, SavedPiece

Buffer = Union[bytes, bytearray, memoryview]  # what xxhash hashes

_MASK64 = (1 << 64) - 1


def piece_seed(key: str, dtype: str, offsets: Iterable[int], shape: Iterable[int]) -> int:
    """The checksum seed of a piece: the xxh3_64 of its identity (key, dtype, global offset,
    local shape), so a block's checksum holds only for these bytes at this place: a piece
    moved, relabelled or reinterpreted in an edited metadata fails its checksums."""
    ident = f"{key}\0{dtype}\0{','.join(map(str, offsets))}\0{','.join(map(str, shape))}"
    return xxhash.xxh3_64_intdigest(ident.encode())


def checksum(buf: Buffer, seed: int = 0) -> int:
    return xxhash.xxh3_64_intdigest(buf, seed=seed)


def block_checksum(buf: Buffer, seed: int, index: int) -> int:
    """The checksum of block ``index`` of a piece whose seed is ``seed``."""
    return checksum(buf, (seed + index) & _MASK64)


def blocks(start: int, stop: int, piece_start: int, block_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(index in the piece, offset, length) of every checksum block that bytes [start, stop)
    of a piece starting at ``piece_start`` cover (``start`` on a block boundary); an empty
    range is one empty block."""
    first = (start - piece_start) // block_bytes
    for k, at in enumerate(range(start, max(stop, start + 1), block_bytes)):
        yield first + k, at, min(block_bytes, stop - at)


def block_checksums(buf: memoryview, block_bytes: int, seed: int = 0) -> list[int]:
    """The checksum of every ``block_bytes`` block of a piece's bytes ``buf`` (one for an
    empty buffer)."""
    return [block_checksum(buf[at : at + n], seed, k) for k, at, n in blocks(0, len(buf), 0, block_bytes)]


def seed_of(meta: Metadata, piece: SavedPiece) -> int:
    return piece_seed(piece.key, meta.tensors[piece.key].dtype, piece.box.offsets, piece.box.shape)


Block = Tuple[int, int, int, int]  # (file offset, length, the block's seed, its recorded checksum)


def piece_blocks(
    seed: int, recorded: Sequence[int] | np.ndarray, first_block: int, start: int, stop: int, piece_start: int, block_bytes: int
) -> list[Block]:
    """Every checksum block that bytes [start, stop) of a piece (its seed, its blocks'
    ``recorded`` checksums from ``first_block`` on, starting at ``piece_start``) cover."""
    return [
        (at, n, (seed + k) & _MASK64, int(recorded[first_block + k]))
        for k, at, n in blocks(start, stop, piece_start, block_bytes)
    ]


def segment_blocks(meta: Metadata, seg: Segment, stop: int | None = None) -> list[Block]:
    """Every checksum block a segment covers (up to ``stop``, its end by default)."""
    piece = seg.piece
    sums = meta.tensors[piece.key].pieces.checksums
    end = seg.stop if stop is None else stop
    return piece_blocks(seed_of(meta, piece), sums, piece.first_block, seg.start, end, piece.byte_offset, meta.block_bytes)


def hashed(checked: Iterable[Block], view: Callable[[int, int], Buffer]) -> list[int]:
    """The checksum of each block's bytes, ``view(offset, length)`` (each view is hashed
    before the next is asked for: it may reuse one buffer)."""
    return [checksum(view(at, n), seed) for at, n, seed, _ in checked]


def failing(checked: Sequence[Block], sums: Sequence[int] | np.ndarray) -> list[Block]:
    """The blocks whose checksum in ``sums`` (one per block, in order) is not the recorded one:
    the one comparison every check of bytes against the metadata makes (a load, a peer's
    answer, ``verify``)."""
    if len(sums) != len(checked):
        raise IntegrityError(f"{len(sums)} checksums for {len(checked)} blocks")
    return [b for b, have in zip(checked, sums) if int(have) != b[3]]


def check_blocks(meta: Metadata, seg: Segment, data: memoryview, where: str) -> None:
    """Check the checksums of the whole blocks of ``seg`` held in ``data`` (``where``: the
    file, as the IntegrityError names it)."""
    piece = seg.piece
    into = seg.start - piece.byte_offset
    if len(data) <= meta.block_bytes and into % meta.block_bytes == 0:  # one block (a small piece)
        k = into // meta.block_bytes
        recorded = int(meta.tensors[piece.key].pieces.checksums[piece.first_block + k])
        if block_checksum(data, seed_of(meta, piece), k) == recorded:
            return
    checked = segment_blocks(meta, seg, seg.start + len(data))
    bad = failing(checked, hashed(checked, lambda at, n: data[at - seg.start : at - seg.start + n]))
    if bad:
        at, n = bad[0][:2]
        piece = seg.piece
        raise IntegrityError(
            f"{where}: bytes [{at}, {at + n}) of tensor "
            f"{piece.key!r} (piece at offset {piece.box.offsets}) fail their checksum: the "
            f"file is damaged or does not belong to this metadata"
        )
