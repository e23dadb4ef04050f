"""Where the copies of each rank's node-local checkpoint data go: to ranks of other nodes
only, spread so that no node receives more than its share.

A node is the set of ranks that see the same files in the local directory (learned, never
configured: see :func:`nodes_of`). With ``replicas`` copies, every rank's data file is kept, as
it is, by ``replicas`` ranks of ``replicas`` distinct other nodes. Pieces of the same data
never share a node with their original, so losing one node loses no data while
``replicas >= 1``. A job with fewer nodes than ``replicas + 1`` (one restarted on the nodes
left after a loss) keeps one copy on every other node, and none on a single node:
:func:`copies_per_file` decides, :func:`copies_warning` says so.

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


def check_replicas(replicas: object) -> None:
    """Refuse a ``replicas`` no job can meet.

    Raises:
        ArgumentError: ``replicas`` is not an int of 0 or more (a bool is refused too).
    """
    if type(replicas) is not int or replicas < 0:
        raise ArgumentError(f"replicas must be a non-negative int, got {replicas!r}")


def copies_per_file(replicas: int, node_count: int) -> int:
    """The copies each rank's data file gets on a job of ``node_count`` nodes: ``replicas``,
    or one on every other node when there are fewer (each copy must be on another node than
    its original, and the copies of one file on distinct nodes).

    Raises:
        ArgumentError: a bad ``replicas`` (:func:`check_replicas`).
    """
    check_replicas(replicas)
    return min(replicas, max(node_count - 1, 0))


def copies_warning(replicas: int, node_count: int) -> str | None:
    """What a job of ``node_count`` nodes that cannot keep ``replicas`` copies of each file
    should say (None when it can): the copies asked for, the nodes there are, and the copies
    each file saved now gets."""
    copies = copies_per_file(replicas, node_count)
    if copies == replicas:
        return None
    asked = "a copy of each file on another node" if replicas == 1 else f"copies of each file on {replicas} other nodes"
    nodes = "1 node (every rank sees the same local directory)" if node_count == 1 else f"{node_count} nodes"
    now = "no copy on another node (0 copies)" if copies == 0 else (
        f"{copies} {'copy' if copies == 1 else 'copies'} (one on every other node)")
    return (f"replicas={replicas} asks for {asked}, but this job has {nodes}: files saved now have {now}, "
            f"until the job runs on {replicas + 1} nodes or more")


def copy_holders(
    nodes: Sequence[Sequence[int]], replicas: int, nbytes: Mapping[int, int] | None = None
) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks that keep a copy of its local data, one on each of
    :func:`copies_per_file` other nodes (``replicas``, or every other node when there are fewer;
    empty tuples with ``replicas`` 0 or a single node).

    Args:
        nodes: the ranks of each node (:func:`nodes_of`).
        replicas: copies of each rank's data asked for, 0 or more.
        nbytes: bytes of each rank's data (default: all equal).

    Raises:
        ArgumentError: a bad ``replicas`` (:func:`check_replicas`).
    """
    nodes = [tuple(sorted(n)) for n in sorted(nodes, key=min)]
    copies = copies_per_file(replicas, len(nodes))
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    weight = {r: (1 if nbytes is None else int(nbytes.get(r, 0))) for r in node_of}
    node_load = [0] * len(nodes)
    rank_load = {r: 0 for r in node_of}
    holders: dict[int, tuple[int, ...]] = {}
    slot = {r: (n.index(r), node_of[r]) for n in nodes for r in n}  # equal weights: the nodes take turns
    for rank in sorted(node_of, key=lambda r: (-weight[r], slot[r])):
        home = node_of[rank]
        others = [i for i in range(len(nodes)) if i != home]
        chosen = sorted(others, key=lambda i: (node_load[i], (i - home) % len(nodes), nodes[i][0]))[:copies]
        picked = []
        for i in chosen:
            holder = min(nodes[i], key=lambda r: (rank_load[r], r))
            node_load[i] += weight[rank]
            rank_load[holder] += weight[rank]
            picked.append(holder)
        holders[rank] = tuple(picked)
    return dict(sorted(holders.items()))
