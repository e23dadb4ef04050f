"""Where the copies of each rank's node-local checkpoint data go: to ranks of other nodes
only, spread so that no node receives more than its share.

A node is the set of ranks that see the same files in the local directory (learned, never
configured: see :func:`nodes_of`). With ``replicas`` copies, every rank's data file is kept, as
it is, by ``replicas`` ranks of ``replicas`` distinct other nodes. Pieces of the same data
never share a node with their original, so losing one node loses no data while
``replicas >= 1``.

Placement is greedy and deterministic (every rank computes the same answer): ranks in
descending order of bytes (ties: the nodes take turns), each copy to the other node that has received the
fewest bytes so far (ties by distance along the ring of nodes, then by its first rank), and
inside it to the rank that has received the fewest. With equal files, every node receives
the same number of copies, give or take one.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..errors import ArgumentError


def nodes_of(seen: Mapping[int, Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """The nodes, from what each rank sees: ``seen[r]`` lists the ranks whose marker files
    rank r finds in its local directory (itself included). Ranks that see each other share a
    node; the nodes come sorted by their lowest rank.

    Raises:
        ArgumentError: the sightings are not those of separate directories (rank r sees s but
            s does not see r, or two ranks see different sets): the local directory is not
            local to a node, nor shared by all.
    """
    nodes: dict[frozenset, None] = {}
    for rank, ranks in seen.items():
        group = frozenset(ranks)
        if rank not in group:
            raise ArgumentError(f"rank {rank} does not see its own marker in the local directory")
        for other in group:
            if frozenset(seen.get(other, ())) != group:
                raise ArgumentError(
                    f"ranks {rank} and {other} see different sets of ranks in the local directory "
                    f"({sorted(group)} and {sorted(seen.get(other, ()))}): it must be one directory per node"
                )
        nodes[group] = None
    return tuple(sorted((tuple(sorted(g)) for g in nodes), key=lambda n: n[0]))


def copy_holders(
    nodes: Sequence[Sequence[int]], replicas: int, nbytes: Mapping[int, int] | None = None
) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks that keep a copy of its local data, one on each of ``replicas`` other
    nodes (empty tuples with ``replicas`` 0).

    Args:
        nodes: the ranks of each node (:func:`nodes_of`).
        replicas: copies of each rank's data, 0 or more.
        nbytes: bytes of each rank's data (default: all equal).

    Raises:
        ArgumentError: more copies than other nodes (a single node with ``replicas`` above 0).
    """
    if type(replicas) is not int or replicas < 0:
        raise ArgumentError(f"replicas must be a non-negative int, got {replicas!r}")
    nodes = [tuple(sorted(n)) for n in sorted(nodes, key=min)]
    if replicas > len(nodes) - 1:
        raise ArgumentError(
            f"replicas={replicas} needs {replicas + 1} nodes (each copy on another node than its "
            f"original), and the local directory shows {len(nodes)}"
            + ("; every rank sees the same local directory, so there is no other node" if len(nodes) == 1 else "")
        )
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    weight = {r: (1 if nbytes is None else int(nbytes.get(r, 0))) for r in node_of}
    node_load = [0] * len(nodes)
    rank_load = {r: 0 for r in node_of}
    holders: dict[int, tuple[int, ...]] = {}
    slot = {r: (n.index(r), node_of[r]) for n in nodes for r in n}  # equal weights: the nodes take turns
    for rank in sorted(node_of, key=lambda r: (-weight[r], slot[r])):
        home = node_of[rank]
        others = [i for i in range(len(nodes)) if i != home]
        chosen = sorted(others, key=lambda i: (node_load[i], (i - home) % len(nodes), nodes[i][0]))[:replicas]
        picked = []
        for i in chosen:
            holder = min(nodes[i], key=lambda r: (rank_load[r], r))
            node_load[i] += weight[rank]
            rank_load[holder] += weight[rank]
            picked.append(holder)
        holders[rank] = tuple(picked)
    return dict(sorted(holders.items()))
