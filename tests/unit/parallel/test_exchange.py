"""Pairwise messages (parallel/wire.py framing) and exchange's order of pairs, over a fake comm
whose sends block until taken (tests/unit/parallel/fakes.py): an order that could deadlock fails."""
from __future__ import annotations


import numpy as np
import pytest

from paddle_dcp.parallel import exchange, wire
from paddle_dcp.parallel.requests import Pairwise
from paddle_dcp.errors import CollectiveError, CollectiveMismatchError, DcpError, MismatchError

from .fakes import ThreadWorld


def test_pad_and_unpad_round_trip_and_refuse_a_length_beyond_the_buffer():
    for data in (b"", b"x", bytes(range(200))):
        buf = wire.pad(data, 256)
        assert len(buf) == 256 + 8 and int.from_bytes(buf[:8].tobytes(), "little") == len(data)
        assert wire.unpad(buf) == data
    bad = wire.pad(b"abc", 3)
    bad[:8] = np.frombuffer((100).to_bytes(8, "little"), np.uint8)
    with pytest.raises(CollectiveError):
        wire.unpad(bad)


def test_messages_keep_their_bytes_and_order_and_a_failed_answer_carries_no_error():
    """A rank that cannot answer sends only the FAILED status (its error travels in the step's
    agreement, parallel/agree.py): the receiver gets None and the pair stays in step."""
    sent = [b"", b"hello", bytes(range(256)) * 3]

    def rank(comm):
        if comm.rank == 0:
            for m in sent:
                wire.send_message(comm, 1, m)
            wire.send_failed(comm, 1)
            wire.send_message(comm, 1, b"after")
            return None
        return [wire.recv_message(comm, 0) for _ in range(len(sent) + 2)]

    world = ThreadWorld(2)
    results = world.run(rank)
    assert results[1] == sent + [None, b"after"]
    # each message: a 16-byte header, then its bytes (none for an empty one or a FAILED one)
    assert [n for _, _, n in world.sent][:7] == [16, 16, 5, 16, 768, 16, 16]


def test_a_failed_status_with_bytes_is_a_malformed_header():
    def rank(comm):
        if comm.rank == 0:
            comm.send(1, np.array([wire.FAILED, 5], dtype="<i8").view(np.uint8))
            return None
        return wire.recv_message(comm, 0)

    results = ThreadWorld(2).run(rank)
    assert isinstance(results[1], DcpError) and f"malformed message header ({wire.FAILED}, 5)" in str(results[1])


def test_a_malformed_header_is_refused():
    def rank(comm):
        if comm.rank == 0:
            comm.send(1, np.array([7, 3], dtype="<i8").view(np.uint8))
            return None
        return wire.recv_message(comm, 0)

    results = ThreadWorld(2).run(rank)
    assert isinstance(results[1], DcpError) and "malformed message header (7, 3)" in str(results[1])


@pytest.mark.parametrize("size", [2, 4, 5])
def test_every_rank_asking_every_other_completes(size):
    """Each rank is the helper of the next and a client of the previous one, the worst case
    for an order of pairs: all ranks wait on one another, and the global order still ends."""
    def rank(comm):
        me = comm.rank
        helper = (me + 1) % size
        clients = [(me - 1) % size]
        return exchange.ask_for_metadata(
            comm, helper, f"from {me}".encode(), clients, lambda client, q: q + f" answered by {me}".encode()
        )

    results = ThreadWorld(size).run(rank)
    assert results == {r: f"from {r} answered by {(r + 1) % size}".encode() for r in range(size)}


def pairwise(comm, step: str, fn):
    """``fn(comm)`` as a protocol's pairwise step: run, then agreed on by every rank."""
    return comm.execute(Pairwise(step, fn))


def test_a_failing_answer_reaches_every_rank_through_the_agreement():
    def rank(comm):
        def answer(client, question):
            raise MismatchError("no such tensor")

        if comm.rank == 0:
            return pairwise(comm, "metadata", lambda c: exchange.ask_for_metadata(c, None, b"", [1, 2], answer))
        return pairwise(comm, "metadata", lambda c: exchange.ask_for_metadata(c, 0, b"question", [], answer))

    results = ThreadWorld(3).run(rank)
    for r in range(3):  # the same error everywhere, its class carried as data
        assert type(results[r]) is CollectiveMismatchError, results[r]
        assert results[r].step == "metadata" and list(results[r].errors) == [0]
        assert results[r].errors[0].kind == "MismatchError" and "no such tensor" in results[r].errors[0].message


def test_a_malformed_range_from_a_peer_is_a_collective_error_naming_the_peer():
    """A request no correct rank sends (a bug, another version) is the peer's failure, not a
    storage error of the file: both sides raise a CollectiveError naming the asking rank."""
    import json

    class Reader:
        def read_into(self, name, start, out):
            raise AssertionError("no byte is read for a malformed request")

        def close(self):
            pass

    class Store:
        def range_reader(self):
            return Reader()

    def rank(comm):
        if comm.rank == 0:
            return exchange._serve(comm, 1, Store())
        wire.send_message(comm, 0, json.dumps([["0_0.distcp", 5, 2]]).encode())
        return wire.recv_message(comm, 0)

    results = ThreadWorld(2).run(rank)
    assert isinstance(results[0], CollectiveError) and list(results[0].failures) == [1], results[0]
    assert "malformed range [5, 2) of '0_0.distcp'" in str(results[0])
    assert results[1] is None  # the client learns only that rank 0 could not answer


def test_lanes_deal_each_range_to_the_least_loaded_connection_the_same_on_both_sides():
    request = [["a", 0, 100], ["a", 100, 150], ["b", 0, 60], ["b", 60, 61], ["c", 5, 2], ["d", "x", 9]]
    small = exchange.lanes_of(request, 2)
    assert small == [[0, 1, 2, 3, 4, 5]]  # 211 bytes: one connection is enough
    big = [[n, 0, s] for n, s in zip("abcde", [40 << 20, 10 << 20, 20 << 20, 30 << 20, 1])]
    assert exchange.lanes_of(big, 2) == [[0, 4], [1, 2, 3]]  # 40 MiB + 1 against 60 MiB: greedy, in order
    assert exchange.lanes_of(big, 1) == [[0, 1, 2, 3, 4]] and exchange.lanes_of([], 2) == [[]]
    assert exchange.lanes_of(big[:1], 2) == [[0]]


class _Op:
    def __init__(self, file, start, stop):
        self.file, self.start, self.stop, self.nbytes = file, start, stop, stop - start


def test_a_pair_moves_its_ranges_over_two_connections_and_stays_in_step_after_a_failed_range(monkeypatch):
    """Rank 1 fetches ranges of rank 0's files: with many bytes they cross on two lanes at
    once, every range lands where asked, and a range rank 0 cannot read (FAILED on its lane)
    costs that lane's later ranges only, the error raised by the server after serving."""
    from paddle_dcp.errors import StorageError

    monkeypatch.setattr(exchange, "LANE_BYTES", 1)
    rng = np.random.default_rng(3)
    files = {"f0": rng.integers(0, 255, 5000, dtype=np.uint8), "f1": rng.integers(0, 255, 3000, dtype=np.uint8)}

    class Reader:
        def read_into(self, name, start, out):
            if name == "f1" and start == 2000:
                raise StorageError("f1 is cut short")
            out[:] = files[name][start : start + len(out)].data

        def close(self):
            pass

    class Store:
        def range_reader(self):
            return Reader()

    def run(ops):
        def rank(comm):
            if comm.rank == 0:
                return exchange.fetch_remote(comm, Store(), {}, [1], lambda i: f"f{i}", None)
            got = {}

            def run_op(op, fetch):
                out = np.empty(op.nbytes, np.uint8)
                fetch(op, out.data)
                got[(op.file, op.start)] = out

            try:
                exchange.fetch_remote(comm, Store(), {0: ops}, [], lambda i: f"f{i}", run_op)
            except DcpError as exc:
                return got, exc
            return got, None

        world = ThreadWorld(2)
        return world.run(rank), world.lanes_used

    ops = [_Op(0, 0, 1000), _Op(0, 1000, 4000), _Op(1, 0, 2000), _Op(0, 4000, 5000)]
    results, lanes = run(ops)
    got, error = results[1]
    assert results[0] == 0 and error is None and lanes == {0, 1}
    for op in ops:
        np.testing.assert_array_equal(got[(op.file, op.start)], files[f"f{op.file}"][op.start : op.stop])
    ops = [_Op(0, 0, 1000), _Op(1, 2000, 3000), _Op(0, 1000, 2000), _Op(0, 2000, 2500)]
    results, _ = run(ops)
    assert isinstance(results[0], StorageError) and "cut short" in str(results[0])
    got, error = results[1]
    assert error is None  # the client learns only that the server failed: its error comes at the agreement
    lane_of = {i: lane for lane, part in enumerate(exchange.lanes_of([["", o.start, o.stop] for o in ops], 2)) for i in part}
    assert {k for k in got} == {(o.file, o.start) for i, o in enumerate(ops) if lane_of[i] != lane_of[1]}


def test_a_block_a_peer_hashes_differently_is_an_integrity_error_naming_its_file_peer_and_bytes():
    """check_remote: the server hashes the blocks the client names, the client compares them
    with the checksums it was given (xxhash of the saved bytes as the oracle): intact bytes
    pass; one flipped byte on the server fails naming the file, the server and the block."""
    import types

    import xxhash

    from paddle_dcp.errors import IntegrityError

    saved = bytes(range(200))
    seed = 77
    blocks = [(at, min(64, 200 - at), seed + k, xxhash.xxh3_64_intdigest(saved[at : at + 64], seed=seed + k))
              for k, at in enumerate(range(0, 200, 64))]

    class Store:
        def __init__(self, data):
            self.data = data

        def range_reader(self):
            data = self.data

            class Reader:
                def read_into(self, name, start, out):
                    assert name == "0_0.distcp"
                    out[:] = data[start : start + len(out)]

                def close(self):
                    pass

            return Reader()

    def run(on_server: bytes):
        def rank(comm):
            op = types.SimpleNamespace(file=0)
            servers, clients = ({1: [op]}, []) if comm.rank == 0 else ({}, [0])
            return exchange.check_remote(comm, Store(on_server), servers, clients, lambda o: blocks, lambda i: "0_0.distcp")

        return ThreadWorld(2).run(rank)

    assert run(saved) == {0: None, 1: None}
    damaged = bytearray(saved)
    damaged[130] ^= 1
    results = run(bytes(damaged))
    assert isinstance(results[0], IntegrityError), results[0]
    assert str(results[0]).startswith("0_0.distcp on rank 1: bytes [128, 192) fail their checksum")
    assert results[1] is None
