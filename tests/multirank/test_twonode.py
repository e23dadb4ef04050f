"""Two nodes on one machine: two `paddle.distributed.launch --nnodes 2` runs, each in its own
working directory with its own local checkpoint directory; every load needs bytes that only
the other node can read (send/recv between the nodes' ranks)."""
from launcher import NODES, assert_passed, run_two_nodes, script

CASES = ["save", "into_s1", "into_replicate", "into_2d", "into_plain", "file_on_no_node",
         "load_after_restoring_the_file"]


def test_two_nodes_node_local_checkpoints(tmp_path):
    logs = run_two_nodes(script("twonode.py"), 2, tmp_path, timeout=150)
    assert_passed(logs, CASES, 4)
    # on disk: the metadata on one node only (the coordinator's), each node its own ranks' files
    listing = {name: sorted(p.name for p in (tmp_path / name / "ckpt").iterdir()) for name in NODES}
    first = [n for n in NODES if "0.metadata" in listing[n]]
    assert len(first) == 1, listing
    second = [n for n in NODES if n != first[0]][0]
    assert listing[first[0]] == ["0.0.claim", "0.metadata", "0_0.distcp", "1_0.distcp"], listing
    assert listing[second] == ["2_0.distcp", "3_0.distcp"], listing
