"""Servers of the files a rank cannot read (parallel.servers): the coordinator's answers,
against the holders worked out from the lists by brute force."""
from __future__ import annotations

import pytest

from paddle_dcp.core.metadata import FileEntry
from paddle_dcp.core.naming import data_file_name
from paddle_dcp.parallel import servers, wire
from paddle_dcp.parallel.loadwork import LoadPlan
from paddle_dcp.errors import StorageError


def lists_of(nodes, held):
    """Each rank's list: the writers its node holds (generation 0)."""
    return [{"0": wire.rle(held[i])} for i, node in enumerate(nodes) for _ in node]


def brute_holders(ranks, held_of_rank, gen, writer):
    return [r for r in ranks if writer in held_of_rank[r]]


def test_each_rank_is_answered_by_a_rank_that_lists_the_file_spread_by_its_own_rank():
    nodes = [tuple(range(n * 4, n * 4 + 4)) for n in range(4)]
    held = [set(nodes[n]) | set(nodes[(n + 1) % 4]) for n in range(4)]  # originals and the next node's copies
    held[1] = set()  # a new empty node
    ranks = [r for n in nodes for r in n]
    held_of_rank = {r: held[i] for i, n in enumerate(nodes) for r in n}
    asks = {r: [data_file_name(w, 0) for w in range(16) if w not in held_of_rank[r] and (w + r) % 3 == 0] for r in ranks}
    parts = servers.assign(ranks, lists_of(nodes, held), [servers.asking(asks[r], ()) for r in ranks])
    answers = {r: servers.answered(p) for r, p in zip(ranks, parts)}
    clients = {r: set() for r in ranks}
    for r in ranks:
        for name in asks[r]:
            w = servers.file_key(name)[1]
            able = [h for h in brute_holders(ranks, held_of_rank, 0, w) if h != r]
            assert answers[r].servers[(0, w)] == able[r % len(able)]
            clients[able[r % len(able)]].add(r)
        assert set(answers[r].servers) == {servers.file_key(n) for n in asks[r]}
    assert {r: set(a.clients) for r, a in answers.items()} == clients
    # a rank's answer stays small: a few runs per server
    assert max(len(p) for p in parts) < 200


def test_a_rank_takes_a_file_from_its_near_ranks_when_one_lists_it():
    ranks = [0, 1, 2, 3]
    lists = [{"0": [[0, 3]]}, {"0": [[0, 3]]}, {}, {"0": [[0, 3]]}]
    parts = servers.assign(ranks, lists, [servers.asking([], ())] * 2 + [servers.asking([data_file_name(1, 0)], (3,))]
                           + [servers.asking([], ())])
    assert servers.answered(parts[2]).servers == {(0, 1): 3}
    assert servers.answered(parts[3]).clients == (2,)


def test_a_file_no_other_rank_lists_gets_no_server_and_the_plan_refuses_it_naming_file_and_keys():
    ranks = [0, 1]
    lists = [{"0": [[0, 0]]}, {"0": [[1, 1]]}]
    parts = servers.assign(ranks, lists, [servers.asking([data_file_name(5, 0)], ()), servers.asking([], ())])
    answer = servers.answered(parts[0])
    assert answer.servers == {} and servers.answered(parts[1]).clients == ()

    class Op:
        file, segments = 0, ()

    class Meta:
        files = (FileEntry(data_file_name(5, 0), 8),)
        unique_id = 9

    with pytest.raises(StorageError, match=r"5_0\.distcp of checkpoint 9"):
        LoadPlan(meta=Meta(), elsewhere=(Op(),)).served(answer)


def test_lists_none_means_every_rank_sees_the_same_files_and_none_serves_another():
    parts = servers.assign([0, 1], None, [servers.asking([data_file_name(0, 0)], ()), servers.asking([], ())])
    assert servers.answered(parts[0]).servers == {}


def test_names_that_are_not_data_files_are_not_asked_for():
    assert wire.decode_json(servers.asking(["model.safetensors", data_file_name(3, 7, 2)], (5, 6))) == {
        "f": {"2": [[3, 3]]}, "near": [[5, 6]]}
