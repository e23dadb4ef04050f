"""Whole files copied between ranks (parallel/replicate.py), on ranks that are threads with
real comms and point to point that blocks until taken (tests/unit/parallel/fakes.py): every
copy holds the original's bytes, none appears before the caller commits, an order of pairs
that could deadlock would fail, and a sender that cannot read its file fails the step on
every rank while its receiver is left with nothing."""
from __future__ import annotations

import numpy as np
import pytest

from paddle_dcp.errors import CollectiveError
from paddle_dcp.parallel import replicate
from paddle_dcp.parallel.requests import Pairwise

from ..io.memory_storage import MemoryStorage
from .fakes import ThreadWorld

SIZE = 4


def blob(rank: int, n: int) -> bytes:
    return np.random.default_rng(rank).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_every_rank_sends_its_file_to_the_next_two_and_receives_two(monkeypatch, chunk):
    monkeypatch.setattr(replicate, "CHUNK", chunk)
    sizes = {0: 0, 1: 17, 2: 64, 3: 1000}
    stores = {r: MemoryStorage(f"node{r}", {f"{r}_3.distcp": blob(r, sizes[r])}) for r in range(SIZE)}
    holders = {r: [(r + 1) % SIZE, (r + 2) % SIZE] for r in range(SIZE)}

    def rank(comm):
        me = comm.rank
        sends = {h: f"{me}_3.distcp" for h in holders[me]}
        receives = {r: f"{r}_3.distcp" for r, hs in holders.items() if me in hs}
        writers = replicate.copy_files(comm, stores[me], sends, receives)
        assert sorted(stores[me].blobs) == [f"{me}_3.distcp"]  # nothing appears before the commit
        for w in writers:
            w.commit()
        return sorted(stores[me].blobs)

    results = ThreadWorld(SIZE).run(rank)
    for me in range(SIZE):
        assert results[me] == sorted({f"{me}_3.distcp"} | {f"{r}_3.distcp" for r, hs in holders.items() if me in hs})
        for name, data in stores[me].blobs.items():
            assert data == blob(int(name.split("_")[0]), sizes[int(name.split("_")[0])])


def test_a_sender_without_its_file_fails_the_step_everywhere_and_its_receiver_keeps_nothing():
    stores = {0: MemoryStorage("a", {}), 1: MemoryStorage("b", {"1_3.distcp": b"ok"})}

    def rank(comm):
        me, other = comm.rank, 1 - comm.rank
        step = Pairwise("copy", lambda c: replicate.copy_files(c, stores[me], {other: f"{me}_3.distcp"},
                                                               {other: f"{other}_3.distcp"}))
        writers = comm.execute(step)
        for w in writers:
            w.commit()

    results = ThreadWorld(2).run(rank)
    for r in (0, 1):
        assert isinstance(results[r], CollectiveError) and list(results[r].errors) == [0], results[r]
        assert "0_3.distcp is missing" in results[r].errors[0].message
    assert sorted(stores[1].blobs) == ["1_3.distcp"] and sorted(stores[0].blobs) == []


def test_a_sender_whose_read_fails_midway_sends_no_more_bytes_and_its_receiver_keeps_nothing(monkeypatch):
    """The copy's chunks travel through parallel/transfer: after the read of chunk 2 fails, the
    sender sends FAILED headers only, both ranks learn the error at the agreement, the
    receiver's copy never appears and the sender's other copy (to rank 0) is dropped too."""
    monkeypatch.setattr(replicate, "CHUNK", 10)
    data = blob(1, 95)
    stores = {0: MemoryStorage("a", {"0_3.distcp": blob(0, 30)}), 1: MemoryStorage("b", {"1_3.distcp": data})}
    real = stores[1].range_reader

    def failing_reader():
        reader = real()
        read_into = reader.read_into

        def read(name, start, out):
            if start >= 20:
                raise OSError("disk gone")
            read_into(name, start, out)

        reader.read_into = read
        return reader

    stores[1].range_reader = failing_reader

    def rank(comm):
        me, other = comm.rank, 1 - comm.rank
        step = Pairwise("copy", lambda c: replicate.copy_files(c, stores[me], {other: f"{me}_3.distcp"},
                                                               {other: f"{other}_3.distcp"}))
        for w in comm.execute(step):
            w.commit()

    world = ThreadWorld(2)
    results = world.run(rank)
    for r in (0, 1):
        assert isinstance(results[r], CollectiveError) and list(results[r].errors) == [1], results[r]
        assert "disk gone" in results[r].errors[1].message
    assert sorted(stores[0].blobs) == ["0_3.distcp"] and sorted(stores[1].blobs) == ["1_3.distcp"]
    chunks = [n for s, r, n in world.sent if s == 1 and r == 0 and n not in (16,)]
    assert chunks[1:] == [10, 10]  # the header, two chunks, then nothing but FAILED headers
