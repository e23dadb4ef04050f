"""The node-local tier's restore simulated (paddle_dcp.tools.simulate_tier) on a small job of
4 nodes of 4 ranks, one node lost: what it must find and plan, from the layouts and the
directories' listings alone."""
from __future__ import annotations

import pytest

from paddle_dcp.core.job_layout import JobLayout
from paddle_dcp.core.naming import parse_data_name
from paddle_dcp.tools.simulate import RankLayout, simulate_save
from paddle_dcp.tools.simulate_tier import saved_nodes, simulate_tier_restore

DP, TP = 4, 4  # a node: the TP ranks of one data-parallel replica
NODES = tuple(tuple(range(n * TP, (n + 1) * TP)) for n in range(DP))


def _span(n, k, i):
    step = -(-n // k)
    return min(i * step, n), min((i + 1) * step, n)


def _layouts(dp: int, tp: int) -> dict[int, RankLayout]:
    """Parameters split over tp (replicated over dp), their optimizer state over dp and tp."""
    out = {}
    for rank in range(dp * tp):
        d, t = divmod(rank, tp)
        pieces = []
        for key, rows, cols in (("w", 64, 32), ("v", 48, 16)):
            lo, hi = _span(rows, tp, t)
            pieces.append((key, (rows, cols), "bfloat16", (lo, 0), (hi - lo, cols)))
            inner = _span(hi - lo, dp, d)
            pieces.append((f"opt.{key}", (rows, cols), "float32", (lo + inner[0], 0), (inner[1] - inner[0], cols)))
        out[rank] = RankLayout.flat([p for p in pieces if all(p[4])])
    return out


@pytest.fixture(scope="module")
def saved():
    save = simulate_save(_layouts(DP, TP), unique_id=7)
    dirs = saved_nodes(save.metadata_json, NODES, 1, [JobLayout(DP * TP, None, NODES)] * DP)
    return save.metadata_json, dirs


def _writers(store) -> set[int]:
    return {parse_data_name(n)[0] for n in store.list_names() if parse_data_name(n)}


def _check_plans(sim, layouts, nodes, dirs):
    """Every rank reads as many elements as its targets hold, from a file its own node's directory
    holds or through a rank whose node's directory holds it."""
    dir_of = {r: dirs[j] for j, n in enumerate(nodes) for r in n}
    for rank, plan in sim.plans.items():
        want = sum(p.box.volume for p in layouts[rank].pieces)
        files = plan.meta.files  # the rank's: the whole metadata's, or the part it read or received
        assert sum(c.region_in_target.volume for op in plan.ops for seg in op.segments for c in seg.copies) == want
        served = {id(op) for ops in plan.remote.values() for op in ops}
        for op in (op for op in plan.ops if id(op) not in served):
            assert dir_of[rank] is not None and dir_of[rank].size(files[op.file].name) is not None
        for server, ops in plan.remote.items():
            assert server != rank and all(dir_of[server].size(files[op.file].name) for op in ops)


def test_the_saved_nodes_hold_their_originals_and_one_copy_of_every_file_elsewhere(saved):
    _, dirs = saved
    for j, d in enumerate(dirs):
        assert set(NODES[j]) <= _writers(d)
    for writer in range(DP * TP):
        assert sum(writer in _writers(d) for d in dirs) == 2


def test_a_new_empty_node_takes_every_byte_from_the_nodes_that_hold_copies(saved):
    meta_json, dirs = saved
    layouts = _layouts(DP, TP)
    sim = simulate_tier_restore(meta_json, [dirs[0], None, dirs[2], dirs[3]], NODES, layouts, keep_plans=True)
    assert sim.lost == () and sim.gone == frozenset(NODES[1])  # the record of node 1 is gone with it
    _check_plans(sim, layouts, NODES, [dirs[0], None, dirs[2], dirs[3]])
    assert all(not sim.plans[r].local and sim.plans[r].remote for r in NODES[1])
    assert sim.p2p and set(sim.p2p) >= set(NODES[1])  # its metadata came from helpers
    # a copy of a writer whose original is on a running node is left unchecked: not read
    for j in (0, 2, 3):
        copies = _writers(dirs[j]) - set(NODES[j]) - set(NODES[1])
        assert all(sim.excluded[r] == len(copies) for r in NODES[j])


def test_the_survivors_restore_into_one_replica_fewer(saved):
    meta_json, dirs = saved
    layouts = _layouts(DP - 1, TP)
    running = [dirs[0], dirs[2], dirs[3]]
    nodes = NODES[:3]
    if set().union(*map(_writers, running)) != set(range(DP * TP)):
        pytest.skip("the copies of node 1's files sit on no running node")
    sim = simulate_tier_restore(meta_json, running, nodes, layouts, keep_plans=True)
    assert sim.lost == () and sim.gone == frozenset(NODES[1])
    _check_plans(sim, layouts, nodes, running)
    assert sum(t.collectives for t in sim.traffic.values()) > 0 and sim.coordinator_seconds > 0


@pytest.mark.parametrize("dp", [8, 64])
def test_a_rank_receives_a_few_hundred_bytes_of_planning_whatever_the_job_size(dp):
    """The resume's open, check and load on a job of dp nodes, node 1 new: the coordinator
    gathers, every other rank receives its own answers only (the all-gathers of every rank's
    findings cost each rank dp * TP * (their width) instead), and the same at 8 and 64 nodes."""
    nodes = tuple(tuple(range(n * TP, (n + 1) * TP)) for n in range(dp))
    layouts = _layouts(dp, TP)
    save = simulate_save(layouts, unique_id=7)
    dirs = saved_nodes(save.metadata_json, nodes, 1, [JobLayout(dp * TP, None, nodes)] * dp)
    dirs[1] = None
    sim = simulate_tier_restore(save.metadata_json, dirs, nodes, layouts)
    assert sim.lost == () and sim.gone == frozenset(nodes[1])
    most = max(t.received for r, t in sim.traffic.items() if r != 0)
    assert most <= 1500, (most, sorted(sim.log, key=lambda x: -x[1])[:4])
    assert sim.traffic[0].received > (dp * TP - 1) * 8 * 4  # the coordinator gathered from every rank
