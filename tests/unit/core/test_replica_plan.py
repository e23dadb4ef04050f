"""Where copies of node-local data go (core/replica_plan.py): every copy on another node than its
original and the copies of one rank on distinct nodes, the nodes' loads balanced, the same
answer for any order of the input; fewer nodes than the copies asked for keep one copy on every
other node, and say so; nodes learned from what each rank sees."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.core.replica_plan import copies_warning, copy_holders, nodes_of
from paddle_dcp.errors import ArgumentError

from ..helpers import fast


def split(sizes: list[int]) -> list[tuple[int, ...]]:
    """Nodes of consecutive ranks with the given sizes."""
    out, at = [], 0
    for n in sizes:
        out.append(tuple(range(at, at + n)))
        at += n
    return out


@fast(200)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=7), st.data())
def test_every_copy_lands_on_another_node_and_each_rank_s_copies_on_distinct_nodes(sizes, data):
    """Any replicas, more than the other nodes too (a job restarted on the nodes left): each
    rank's copies go to as many distinct other nodes as it asked for, or to every other node."""
    nodes = split(sizes)
    replicas = data.draw(st.integers(0, len(nodes) + 2))
    nbytes = data.draw(st.dictionaries(st.integers(0, sum(sizes) - 1), st.integers(0, 1000)))
    holders = copy_holders(nodes, replicas, nbytes or None)
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    assert sorted(holders) == sorted(node_of)
    for rank, held_by in holders.items():
        homes = [node_of[h] for h in held_by]
        assert node_of[rank] not in homes and len(set(homes)) == len(homes)
        other_nodes = {i for i in range(len(nodes)) if i != node_of[rank]}
        assert len(homes) == replicas if replicas <= len(other_nodes) else set(homes) == other_nodes
    assert copy_holders(list(reversed(nodes)), replicas, nbytes or None) == holders  # order does not matter


@fast(200)
@given(st.integers(2, 6), st.integers(1, 4), st.data())
def test_nodes_of_equal_size_receive_equal_shares(count, size, data):
    nodes = split([size] * count)
    replicas = data.draw(st.integers(1, count - 1))
    received: dict[int, int] = {}
    for held_by in copy_holders(nodes, replicas).values():
        for h in held_by:
            received[h // size] = received.get(h // size, 0) + 1
    assert set(received) == set(range(count))
    assert max(received.values()) - min(received.values()) <= 1
    assert sum(received.values()) == count * size * replicas


def test_bytes_weigh_more_than_counts():
    """Rank 0 writes 100 bytes, the others 1: the node that takes rank 0's copy takes no other."""
    nodes = [(0, 1), (2, 3), (4, 5)]
    holders = copy_holders(nodes, 1, {0: 100, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1})
    loads = {0: 0, 1: 0, 2: 0}
    for rank, held_by in holders.items():
        loads[held_by[0] // 2] += 100 if rank == 0 else 1
    assert loads == {0: 3, 1: 100, 2: 2}


def test_fewer_nodes_than_copies_keep_what_they_can_and_only_a_bad_replicas_is_refused():
    """The job that lost a node opens with the script's own replicas: a single node keeps no
    copy, two nodes one; only a replicas no job can meet is an error."""
    assert copy_holders([(0, 1, 2, 3)], 1) == {0: (), 1: (), 2: (), 3: ()}
    assert copy_holders([(0, 1)], 0) == {0: (), 1: ()}
    assert copy_holders([(0,), (1,)], 2) == {0: (1,), 1: (0,)}
    assert copy_holders([(0, 1), (2, 3)], 3) == {0: (2,), 1: (3,), 2: (0,), 3: (1,)}
    for bad in (-1, 1.5, True, "1", None):
        with pytest.raises(ArgumentError, match=f"replicas must be a non-negative int, got {bad!r}"):
            copy_holders([(0,), (1,)], bad)
        with pytest.raises(ArgumentError, match="replicas must be a non-negative int"):
            copies_warning(bad, 2)


def test_the_warning_says_the_copies_asked_the_nodes_there_are_and_the_copies_each_file_gets():
    assert copies_warning(1, 1) == (
        "replicas=1 asks for a copy of each file on another node, but this job has 1 node (every rank sees "
        "the same local directory): files saved now have no copy on another node (0 copies), until the job "
        "runs on 2 nodes or more")
    assert copies_warning(3, 2) == (
        "replicas=3 asks for copies of each file on 3 other nodes, but this job has 2 nodes: files saved now "
        "have 1 copy (one on every other node), until the job runs on 4 nodes or more")
    assert "have 2 copies (one on every other node)" in copies_warning(4, 3)
    assert [copies_warning(r, n) for r, n in ((0, 1), (0, 3), (1, 2), (2, 3), (2, 5))] == [None] * 5


def test_nodes_are_the_ranks_that_see_each_other():
    assert nodes_of({0: [0, 2], 1: [1, 3], 2: [2, 0], 3: [1, 3]}) == ((0, 2), (1, 3))
    assert nodes_of({0: [0], 1: [1]}) == ((0,), (1,))
    with pytest.raises(ArgumentError, match="different sets of ranks"):
        nodes_of({0: [0, 1], 1: [1]})  # 0 sees 1's marker, 1 does not see 0's
    with pytest.raises(ArgumentError, match="does not see its own marker"):
        nodes_of({0: [1], 1: [0, 1]})
