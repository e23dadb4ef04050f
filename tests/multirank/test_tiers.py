"""The node-local tier on two "nodes" (two launches with --nnodes 2, each in its own working
directory): a node's whole local directory deleted (the node was replaced), then the job
restarts and restores the newest step from the copies on the other node, bit-exact; with that
step's copies damaged too, the next older restorable step; without copies, the global tier.
The tensors are checked against numpy oracles inside the workers (scripts/tiers.py)."""
import json
import os
import shutil

import pytest

from launcher import NODES, assert_passed, run_two_nodes, script


def restores(logs: str) -> dict[int, dict]:
    """rank -> its last_restore, as the workers printed it."""
    out = {}
    for line in logs.splitlines():
        if line.startswith("RESTORE "):
            doc = json.loads(line[len("RESTORE "):])
            out[doc["rank"]] = doc
    return out


def run(tmp_path, nproc: int, *args) -> str:
    for node in NODES:  # each launch's own logs only (a launcher appends to the files it finds)
        shutil.rmtree(tmp_path / node / "log", ignore_errors=True)
    return run_two_nodes(script("tiers.py"), nproc, tmp_path, args=(str(tmp_path / "global"), *args), timeout=240)


def wipe(tmp_path, node: str) -> None:
    shutil.rmtree(tmp_path / node / "local")


def damage_step(tmp_path, node: str, step: int) -> list[str]:
    """Flip a byte in every data file of ``step`` the node's local directory holds."""
    local = tmp_path / node / "local"
    names = sorted(n for n in os.listdir(local) if n.endswith(f"_{step}.distcp"))
    for name in names:
        with open(local / name, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0x5A]))
    return names


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_lost_node_is_restored_from_the_copies_on_the_other_node(tmp_path, nproc):
    ranks = 2 * nproc
    assert_passed(run(tmp_path, nproc, "save", 1), ["save_1"], ranks)
    for node in NODES:  # every node: the two newest steps, every rank's data file (originals and copies)
        names = sorted(os.listdir(tmp_path / node / "local"))
        for step in (3, 4):
            assert f"{step}.metadata" in names and all(f"{r}_{step}.distcp" in names for r in range(ranks)), names
        assert not any(n.startswith(("1.", "2.")) or "_1." in n or "_2." in n for n in names), names
    wipe(tmp_path, NODES[1])
    logs = run(tmp_path, nproc, "restore", 1, 4, "local")
    assert_passed(logs, ["restore_4_local"], ranks)
    done = restores(logs)
    assert sorted(done) == list(range(ranks))
    assert all(d["refused"] == [] and d["bytes"]["global"] == 0 for d in done.values())
    # the wiped node's ranks took their bytes from the other node's copies
    assert sum(d["bytes"]["peer"] > 0 for d in done.values()) >= nproc, done

    # that step's copies damaged as well: the next older step, whole on the other node
    assert damage_step(tmp_path, NODES[0], 4)
    logs = run(tmp_path, nproc, "restore", 1, 3, "local")
    assert_passed(logs, ["restore_3_local"], ranks)
    for d in restores(logs).values():
        assert [r[:2] for r in d["refused"]] == [["local", 4]] and "no intact copy" in d["refused"][0][2], d


def test_without_copies_a_lost_node_takes_its_files_from_the_global_tier(tmp_path):
    """Step 4 is on the local tier only: lost with the node. Step 3 is on both: the lost
    node's ranks copy their files back from the global tier, the other node's read their own."""
    assert_passed(run(tmp_path, 1, "save", 0), ["save_0"], 2)
    wipe(tmp_path, NODES[0])
    logs = run(tmp_path, 1, "restore", 0, 3, "local")
    assert_passed(logs, ["restore_3_local"], 2)
    done = restores(logs)
    for d in done.values():
        assert [r[:2] for r in d["refused"]] == [["local", 4]] and "no intact copy" in d["refused"][0][2], d
    assert sorted(d["bytes"]["global"] > 0 for d in done.values()) == [False, True], done  # the lost node's rank only
    assert all(d["bytes"]["local"] + d["bytes"]["peer"] > 0 for d in done.values()), done
