"""The suite scale-elastic (scripts/bench/elastic.py): the nodes of a job, the nodes of a
data-parallel replica, which saved node's directory each node of a resumed job has, the
layouts the nodes record, and a case's figures."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import elastic  # noqa: E402

from paddle_dcp.parallel.comm import Traffic  # noqa: E402
from paddle_dcp.tools.simulate_tier import TierRestoreSim  # noqa: E402


def test_the_nodes_are_consecutive_ranks_and_a_replica_has_one_node_per_stage():
    assert elastic.nodes_of_job(6, 2) == ((0, 1), (2, 3), (4, 5))
    # pp 3, dp 4: node = pp_i * 4 + dp_i; node 6 is stage 1, replica 2
    assert elastic.replica_nodes(6, 3, 4) == (2, 6, 10)


def _held(nodes: int, per: int, copy_to) -> list[set]:
    """Node i holds its own writers and a copy of node j's where copy_to(j) == i."""
    held = [set(range(i * per, (i + 1) * per)) for i in range(nodes)]
    for j in range(nodes):
        held[copy_to(j)] |= set(range(j * per, (j + 1) * per))
    return held


def test_the_same_job_keeps_every_directory_and_a_new_node_takes_the_lost_ones_place():
    held = _held(4, 2, lambda j: (j + 1) % 4)
    assert elastic.resume("same", held, 1, 2, 2) == (2, [0, 1, 2, 3])
    assert elastic.resume("new-node", held, 1, 2, 2) == (2, [0, None, 2, 3])
    with pytest.raises(ValueError):
        elastic.resume("bigger", held, 1, 2, 2)


def test_the_survivors_drop_the_lost_nodes_replica_when_every_file_keeps_a_copy():
    # pp 2, dp 4: replicas are nodes {d, d + 4}; copies on the next node
    held = _held(8, 2, lambda j: (j + 1) % 8)
    assert elastic.resume("survivors", held, 1, 2, 4) == (3, [0, 2, 3, 4, 6, 7])


def test_the_survivors_idle_another_node_when_the_replicas_would_take_a_files_last_copy():
    # node 1's copies are on node 5, its replica partner: node 5 must run; the lowest node
    # that can idle instead (node 0: its copy is on node 2) idles
    held = _held(8, 1, lambda j: 5 if j == 1 else (j + 2) % 8)
    dp, running = elastic.resume("survivors", held, 1, 2, 4)
    assert dp == 3 and 1 not in running and 5 in running and len(running) == 6
    assert set().union(*(held[i] for i in running)) == set(range(8))


def test_each_node_records_the_job_and_its_stages_mesh():
    class Job:
        ranks, dp, tp = 8, 2, 2
    layouts = elastic.recorded(Job, elastic.nodes_of_job(8, 2))
    assert [l.meshes[0].process_ids for l in layouts] == [(0, 1, 2, 3)] * 2 + [(4, 5, 6, 7)] * 2
    assert all(l.world_size == 8 and l.nodes == ((0, 1), (2, 3), (4, 5), (6, 7)) for l in layouts)


def test_a_cases_figures_leave_the_coordinator_out_of_the_ranks_maxima():
    sim = TierRestoreSim(
        traffic={0: Traffic(900, 5000, 9), 1: Traffic(40, 300, 9), 2: Traffic(60, 200, 9)},
        p2p={2: Traffic(10, 700)}, coordinator_seconds=0.5, open_seconds=0.1, check_seconds=0.2, load_seconds=0.2,
        remote_servers={0: 1, 1: 3, 2: 0}, gone=frozenset({4, 5}),
        log=[("check 0 AllGather", 200, 4000), ("load 1 Gather", 10, 1000)])
    row = elastic.row("new-node", sim, 3)
    assert (row["rank_recv_bytes_max"], row["rank_send_bytes_max"], row["coord_recv_bytes"]) == (300, 60, 5000)
    assert row["p2p_recv_bytes_max"] == 700 and row["remote_servers_max"] == 3 and row["files_from_lost_node"] == 2
    assert row["top_recv"][0] == ["check 0 AllGather", 200] and row["goal_met"] is True
