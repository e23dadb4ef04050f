"""The checksum scheme (core/checksums.py): blocks of a piece, seeds that name the piece, and
the check a load and verify run; xxhash itself is the oracle."""
import numpy as np
import pytest
import xxhash

from paddle_dcp.core import checksums
from paddle_dcp.core.load_plan import Segment
from paddle_dcp.errors import IntegrityError
from paddle_dcp.io import storage as dcp_storage

from ..helpers import save_checkpoint


def test_block_checksums_are_xxh3_64_of_each_block_seeded_by_the_piece_and_block_index():
    data = bytes(range(200))
    assert checksums.block_checksums(memoryview(data), 64) == [
        xxhash.xxh3_64_intdigest(data[i : i + 64], seed=k) for k, i in enumerate((0, 64, 128, 192))
    ]
    assert checksums.block_checksums(memoryview(b""), 64) == [xxhash.xxh3_64_intdigest(b"")]
    # the piece seed is the xxh3_64 of "key NUL dtype NUL offsets NUL shape" (docs/format.md)
    seed = xxhash.xxh3_64_intdigest(b"model.w\x00float32\x004,0\x003,5")
    assert checksums.piece_seed("model.w", "float32", (4, 0), (3, 5)) == seed
    assert checksums.block_checksums(memoryview(data), 128, seed) == [
        xxhash.xxh3_64_intdigest(data[:128], seed=seed), xxhash.xxh3_64_intdigest(data[128:], seed=(seed + 1) % 2**64)
    ]
    # a piece moved to another place no longer matches
    assert checksums.piece_seed("model.w", "float32", (0, 0), (3, 5)) != seed


def test_blocks_cover_a_range_of_a_piece_with_indices_from_the_piece_start():
    assert list(checksums.blocks(100, 100 + 150, 100, 64)) == [(0, 100, 64), (1, 164, 64), (2, 228, 22)]
    assert list(checksums.blocks(164 + 64, 250, 100, 64)) == [(2, 228, 22)]
    assert list(checksums.blocks(40, 40, 40, 64)) == [(0, 40, 0)]  # an empty piece: one empty block


def test_check_blocks_passes_the_saved_bytes_and_names_the_file_and_key_of_a_flipped_one(tmp_path):
    """The blocks of a real saved piece: its bytes pass, one flipped bit fails naming the file
    given and the key, and the same bytes checked as another piece (another seed) fail too."""
    from paddle_dcp.io import local

    path = str(tmp_path)
    b = np.arange(300, dtype=np.int64)
    save_checkpoint(path, {"b": b}, {"b": "int64"}, (1,), {"b": (None,)}, block_bytes=64)
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0)
    entry = meta.tensors["model.b"]
    piece = entry.piece(0)
    seg = Segment(piece, piece.byte_offset, piece.byte_offset + b.nbytes, ())
    data = bytearray(b.tobytes())
    checksums.check_blocks(meta, seg, memoryview(bytes(data)), "f")
    data[100] ^= 4
    with pytest.raises(IntegrityError, match=r"^f: bytes \[64, 128\) of tensor 'model.b'"):
        checksums.check_blocks(meta, seg, memoryview(bytes(data)), "f")


def test_failing_returns_the_blocks_whose_hash_differs_and_refuses_a_count_that_does_not_match():
    data = bytes(range(150))
    seed = checksums.piece_seed("w", "uint8", (0,), (150,))
    recorded = [0, 0, 0] + checksums.block_checksums(memoryview(data), 64, seed)  # the piece's blocks from 3 on
    checked = checksums.piece_blocks(seed, recorded, 3, 1000 + 64, 1000 + 150, 1000, 64)
    assert [(at, n) for at, n, _, _ in checked] == [(1064, 64), (1128, 22)]
    view = lambda at, n: memoryview(data)[at - 1000 : at - 1000 + n]  # noqa: E731
    assert checksums.failing(checked, checksums.hashed(checked, view)) == []
    damaged = bytearray(data)
    damaged[140] ^= 1
    bad = checksums.failing(checked, checksums.hashed(checked, lambda at, n: memoryview(damaged)[at - 1000 : at - 1000 + n]))
    assert [(at, n) for at, n, _, _ in bad] == [(1128, 22)]
    with pytest.raises(IntegrityError, match="1 checksums for 2 blocks"):
        checksums.failing(checked, [1])
