"""The node-local tier on two "nodes" (two launches with --nnodes 2, each in its own working
directory): a node's whole local directory deleted (the node was replaced), then the job
restarts and restores the newest step from the copies on the other node, bit-exact; with that
step's copies damaged too, the next older restorable step; without copies, the global tier;
the same script restarted on the node left, with fewer copies. The tensors are checked
against numpy oracles inside the workers (scripts/tiers.py).

Under the fake GPU (`scripts/test.sh --fake-gpu`) the kill points that only a crash's timing
tells apart run once, in the normal suite: what survives a kill does not depend on where the
tensors live. The async kill (staged from the device) and every restore run in both."""
import json
import os
import re
import shutil

import pytest

from launcher import NODES, assert_passed, run_launch, run_two_nodes, script


def restores(logs: str) -> dict[int, dict]:
    """rank -> its last_restore, as the workers printed it."""
    out = {}
    for line in logs.splitlines():
        if line.startswith("RESTORE "):
            doc = json.loads(line[len("RESTORE "):])
            out[doc["rank"]] = doc
    return out


def run(tmp_path, nproc: int, *args, name: str = "tiers.py", timeout: float = 240) -> str:
    for node in NODES:  # each launch's own logs only (a launcher appends to the files it finds)
        shutil.rmtree(tmp_path / node / "log", ignore_errors=True)
    return run_two_nodes(script(name), nproc, tmp_path, args=(str(tmp_path / "global"), *args), timeout=timeout)


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


def trained(logs: str) -> dict[int, dict]:
    """rank -> what the training script did (its TRAIN line)."""
    docs = [json.loads(line[len("TRAIN "):]) for line in logs.splitlines() if line.startswith("TRAIN ")]
    out = {d["rank"]: d for d in docs}
    assert len(out) == len(docs), docs
    return out


def warnings(logs: str) -> dict[int, list[str]]:
    """rank -> the messages of the warnings the library logged on it."""
    out: dict[int, list[str]] = {}
    for rank, message in re.findall(r"^LOG rank=(\d+) WARNING paddle_dcp\S*: (.*)$", logs, re.M):
        out.setdefault(int(rank), []).append(message)
    return out


FEWER_NODES = ("local tier local: replicas=1 asks for a copy of each file on another node, but this job has 1 node "
               "(every rank sees the same local directory): files saved now have no copy on another node (0 copies), "
               "until the job runs on 2 nodes or more")


def test_the_same_script_on_the_node_left_restores_the_newest_step_and_saves_with_fewer_copies(tmp_path):
    """Issue 39, point 1: trained on 2 nodes x 2 ranks with replicas=1 (steps 1..4), node 1
    lost; the same script with the same arguments on the node left, 2 ranks, opens with one
    warning on every rank, restores step 4 (its originals and node 1's copies, both there) into
    2 ranks, bit-exact, and saves steps 5..8, which load back bit-exact; again on 1 rank, the
    same from step 8. The values are checked against the numpy oracle in the workers."""
    args = (str(tmp_path / "global"), "train", 1)
    logs = run_two_nodes(script("tiers.py"), 2, tmp_path, args=args, timeout=240)
    assert_passed(logs, ["train_1"], 4)
    assert warnings(logs) == {}, warnings(logs)  # 2 nodes hold 1 copy
    assert [d["restored"] for d in trained(logs).values()] == [None] * 4
    lost, left = node_of(tmp_path, 2), node_of(tmp_path, 0)
    assert lost != left
    shutil.rmtree(tmp_path / lost / "local")

    for nproc, restored, saved in ((2, 4, [5, 6, 7, 8]), (1, 8, [9, 10, 11, 12])):
        logs = run_launch(script("tiers.py"), nproc, tmp_path / left, args=args, timeout=240)
        assert_passed(logs, ["train_1"], nproc)
        assert warnings(logs) == {r: [FEWER_NODES] for r in range(nproc)}, warnings(logs)
        done = trained(logs)
        assert sorted(done) == list(range(nproc)), done
        for d in done.values():
            assert d["world"] == nproc and d["restored"]["step"] == restored and d["restored"]["tier"] == "local", d
            assert d["restored"]["refused"] == [] and d["restored"]["bytes"]["peer"] == d["restored"]["bytes"]["global"] == 0, d
            assert d["saved"] == saved and d["reloaded"] == [saved[-1], "local"], d
        held = sorted(n for n in os.listdir(tmp_path / left / "local") if n.endswith((".metadata", ".distcp")))
        assert held == sorted([f"{s}.metadata" for s in saved[-2:]] + [f"{r}_{s}.distcp" for s in saved[-2:]
                                                                      for r in range(nproc)]), held


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


# ------------------------------------------------------------------------------ kills (issue 29, point 4)
CHUNK = 32  # replicate.CHUNK in scripts/tiers_crash.py
KILL_POINTS = {  # where the victim (the last rank) dies while step 3 is saved -> the step restored after
    "save_before": 2, "save_writing": 2, "copy_receiving": 2, "copy_sending": 2, "retention": 3,
    "retention_stopped": 3, "publish_stopped": 3,
}


def node_of(tmp_path, rank: int) -> str:
    """The node whose local directory holds ``rank``'s marker."""
    return next(n for n in NODES if (tmp_path / n / "local" / f"paddle_dcp_node.{rank}").exists())


def checkpoint_files(tmp_path, node: str) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path / node / "local") if not n.startswith(("paddle_dcp_node.", "paddle_dcp_tier.")))


def crash_and_resume(tmp_path, nproc: int, point: str, mode: str = "sync") -> tuple[str, str]:
    """Steps 1 and 2 saved, then the last rank dies (os._exit) at ``point`` of step 3's save
    (scripts/tiers_crash.py): the other ranks' saves raise instead of waiting (the crash
    launch ends within its timeout), or, for the ``*_stopped`` points, they are stopped as
    paddle's launcher would; then a new job restores the newest step complete before the
    kill, bit-exact, saves step 3 again (or 4) and restores steps 3 and 4. Returns (the
    victim's node, the other node)."""
    ranks, victim = 2 * nproc, 2 * nproc - 1
    extra = ("async",) if mode == "async" else ()
    logs = run(tmp_path, nproc, "crash", point, *extra, name="tiers_crash.py", timeout=120)
    assert re.findall(r"^VICTIM rank=(\d+) point=(\S+)$", logs, re.M) == [(str(victim), point)], logs[-3000:]
    survivors = dict(re.findall(r"^SURVIVOR rank=(\d+) raised=(\S+)", logs, re.M))
    stopped = sorted(int(r) for r in re.findall(r"^STOPPED rank=(\d+)$", logs, re.M))
    others = [r for r in range(ranks) if r != victim]
    if point.endswith("_stopped"):
        assert (survivors, stopped) == ({}, others), logs[-3000:]
    else:
        assert survivors == {str(r): "True" for r in others} and not stopped, logs[-3000:]

    there, other = node_of(tmp_path, victim), node_of(tmp_path, 0)
    assert there != other
    for node in NODES:  # no node holds step 3's metadata unless its publish was reached
        names = checkpoint_files(tmp_path, node)
        published = point.startswith("retention") or (point == "publish_stopped" and node == there)
        assert ("3.metadata" in names) == published, (node, names)
        assert "2.metadata" in names, (node, names)
    if point == "copy_receiving":  # the victim died mid-copy: the file copied has more chunks than that
        assert os.path.getsize(tmp_path / other / "local" / "0_3.distcp") > 3 * CHUNK
    if point == "copy_sending":
        assert os.path.getsize(tmp_path / there / "local" / f"{victim}_3.distcp") > 4 * CHUNK
    if point.startswith("retention"):  # on the victim's node, step 1's metadata is gone, its data files are not
        names = checkpoint_files(tmp_path, there)
        assert "1.metadata" not in names and any(n.endswith("_1.distcp") for n in names), names
        assert ("1.metadata" in checkpoint_files(tmp_path, other)) == (point == "retention_stopped")

    logs = run(tmp_path, nproc, "resume", point, *extra, name="tiers_crash.py", timeout=180)
    assert_passed(logs, [f"resume_{point}"], ranks)
    done = restores(logs)
    assert sorted(done) == list(range(ranks))
    for d in done.values():
        assert (d["step"], d["tier"], d["refused"]) == (KILL_POINTS[point], "local", []), d
    return there, other


@pytest.mark.parametrize(
    "nproc, point, mode",
    [(1, p, "sync") for p in KILL_POINTS if p != "publish_stopped"]
    + [(2, "copy_receiving", "sync"), pytest.param(1, "copy_sending", "async", marks=pytest.mark.device)],
)
def test_a_rank_killed_while_a_local_step_is_saved(tmp_path, nproc, point, mode):
    """The newest step complete before the kill restores, later saves work (crash_and_resume),
    and each node keeps only the two newest steps' files: no temporary file, no older step,
    one generation of step 3 (the first when the crash left no claim of it, else the next)
    and the claims beside the coordinator's files."""
    crash_and_resume(tmp_path, nproc, point, mode)
    ranks = 2 * nproc
    files = {node: checkpoint_files(tmp_path, node) for node in NODES}
    third = {n.split("_", 1)[1].rsplit(".", 1)[0] for f in files.values() for n in f if n.endswith(".distcp") and "_3" in n}
    assert len(third) == 1, files  # one generation of step 3: "3", or "3.1" when the crash left a claim of 3.0
    gen = third.pop().partition(".")[2] or "0"
    want = sorted([f"{s}.metadata" for s in (3, 4)] + [f"{r}_{s}.distcp" for s in (f"3.{gen}" if gen != "0" else "3", 4)
                                                        for r in range(ranks)])  # fmt: skip
    claims = sorted(n for f in files.values() for n in f if n.endswith(".claim"))
    assert set(claims) == {f"3.{gen}.claim", "4.0.claim"}, files  # the coordinator's, on its node
    for node in NODES:
        assert [n for n in files[node] if not n.endswith(".claim")] == want, (node, files[node])


def test_a_step_published_on_one_node_before_a_kill_survives_the_loss_of_that_node(tmp_path):
    """The victim dies just after writing 3.metadata on its node, every copy committed; the
    other node's rank is stopped before it writes its own. The restart restores step 3 (from
    the victim's node and the copies) and goes on to step 4. Then the victim's node is lost:
    with one copy of every data file on the other node, step 3 should still restore."""
    there, other = crash_and_resume(tmp_path, 1, "publish_stopped")
    held = checkpoint_files(tmp_path, other)
    assert all(f"{r}_3.distcp" in held for r in range(2)), held
    assert "3.metadata" in held, held  # written there again when the restarted job opened the tier
    wipe(tmp_path, there)
    logs = run(tmp_path, 1, "restore", 3, name="tiers_crash.py", timeout=120)
    assert_passed(logs, ["restore_3"], 2)
    # the other node recorded the step before its copies, though its metadata came at the
    # restart: the report names the victim's file as taken from a copy, and the saving nodes
    lost = re.findall(r"^LOST rank=(\d+) (.*) (.*)$", logs, re.M)
    assert sorted((int(r), json.loads(f), json.loads(n)) for r, f, n in lost) == [
        (r, ["1_3.distcp"], [[0], [1]]) for r in range(2)], lost


# ------------------------------------------------------------------------------ elastic restores (issue 39, points 2 and 3)
ELASTIC = "elastic.py"


def job_from(saved, dst, nodes: dict) -> "os.PathLike":
    """A job directory ``dst`` made of what the saved job left: a copy of its global tier, and
    for each (node of the new job: node of the saved job, or None for a new empty node) a copy
    of that node's local directory."""
    shutil.copytree(saved / "global", dst / "global")
    for new, old in nodes.items():
        (dst / new).mkdir(parents=True)
        if old is not None:
            shutil.copytree(saved / old / "local", dst / new / "local")
    return dst


def reports(logs: str) -> dict[int, dict]:
    """rank -> its last_restore (dataclasses.asdict), as elastic.py printed it."""
    docs = [json.loads(line[len("REPORT "):]) for line in logs.splitlines() if line.startswith("REPORT ")]
    out = {d.pop("rank"): d for d in docs}
    assert len(out) == len(docs), docs
    return out


def flip(path) -> None:
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x5A]))


def layout(world: int, mesh: tuple[int, int], nodes) -> dict:
    """A JobLayout as asdict gives it: ``world`` ranks, one mesh of that shape over them in C
    order (elastic.py's), the ranks of each node."""
    return {"world_size": world, "meshes": [{"shape": list(mesh), "process_ids": list(range(world)),
                                             "dim_names": ["x", "y"]}], "nodes": [list(n) for n in nodes]}


def elastic_restore(job, nproc: int, mesh: str, step: int, tier: str, two_nodes: bool = False) -> dict[int, dict]:
    """elastic.py's restore on ``job`` (its "nodeA" and "nodeB" as two nodes, or its "node"
    alone); returns rank -> last_restore."""
    args = (job / "global", "restore", mesh, step, tier)
    if two_nodes:
        logs = run_two_nodes(script(ELASTIC), nproc, job, args=args, timeout=240)
    else:
        logs = run_launch(script(ELASTIC), nproc, job / "node", args=args, timeout=180)
    ranks = (2 if two_nodes else 1) * nproc
    assert_passed(logs, [f"restore_{step}_{tier}"], ranks)
    done = reports(logs)
    assert sorted(done) == list(range(ranks)), done
    return done


def test_a_step_saved_on_2x2_restores_onto_other_layouts(tmp_path):
    """Issue 39, points 2 and 3: one job of 2 nodes x 2 ranks on a (2, 2) mesh saves steps
    1..4 (local 3, 4; global 2, 4; replicas=1); then copies of what it left restore, into
    meshes of other shapes, checked against the numpy oracle in the workers:
    - node a lost, the job restarted on node b alone as 1 node x 2 ranks, mesh (1, 2): step 4
      from b's originals and its copies of a's files;
    - node b lost and replaced by an empty node, 2 nodes x 1 rank, mesh (2, 1): step 4, the
      new node's rank taking every byte from the other node;
    - node b lost, the job restarted on node a as 1 rank: step 4, every byte from node a;
    - the same with a's copies of b's files damaged: step 4, b's files (only those) from the
      global tier;
    - the same, and the global tier's copy of one of b's files damaged, mesh (2, 1) on one
      node: the older step 3, whole on node a.
    Each last_restore names the layout saved on (4 ranks, the (2, 2) mesh, its nodes), the
    one restored into, and the lost node's files."""
    saved = tmp_path / "saved"
    logs = run_two_nodes(script(ELASTIC), 2, saved, args=(saved / "global", "save", "2x2"), timeout=240)
    assert_passed(logs, ["save"], 4)
    a, b = node_of(saved, 0), node_of(saved, 2)
    assert a != b
    saved_on = layout(4, (2, 2), [(0, 1), (2, 3)])
    of_a, of_b = [f"{r}_4.distcp" for r in (0, 1)], [f"{r}_4.distcp" for r in (2, 3)]

    done = elastic_restore(job_from(saved, tmp_path / "1x2", {"node": b}), 2, "1x2", 4, "local")
    for d in done.values():
        assert (d["refused"], d["bytes"]["peer"], d["bytes"]["global"]) == ([], 0, 0), d
        assert d["saved_on"] == saved_on and d["restored_into"] == layout(2, (1, 2), [(0, 1)]), d
        assert d["from_lost_nodes"] == of_a, d

    done = elastic_restore(job_from(saved, tmp_path / "2x1", {"nodeA": a, "nodeB": None}), 1, "2x1", 4, "local",
                           two_nodes=True)
    # the rank on the kept node reads its own node's files, the new node's rank takes them from it
    assert sorted((d["bytes"]["local"] > 0, d["bytes"]["peer"] > 0) for d in done.values()) == [(False, True), (True, False)]
    for d in done.values():
        assert (d["refused"], d["bytes"]["global"]) == ([], 0), d
        assert d["saved_on"] == saved_on and d["restored_into"] == layout(2, (2, 1), [(0,), (1,)]), d
        assert d["from_lost_nodes"] == of_b, d

    done = elastic_restore(job_from(saved, tmp_path / "1x1-whole", {"node": a}), 1, "1x1", 4, "local")
    d = done[0]  # one rank: every byte from node a, its originals and its copies of b's files
    assert (d["refused"], d["bytes"]["peer"], d["bytes"]["global"]) == ([], 0, 0) and d["bytes"]["local"] > 0, d
    assert d["restored_into"] == layout(1, (1, 1), [(0,)]) and d["from_lost_nodes"] == of_b, d

    job = job_from(saved, tmp_path / "1x1", {"node": a})
    for name in of_b:  # node a's copies of node b's files
        flip(job / "node" / "local" / name)
    done = elastic_restore(job, 1, "1x1", 4, "local")
    d = done[0]
    assert d["refused"] == [] and d["bytes"]["peer"] == 0 and d["bytes"]["local"] > 0, d
    assert d["bytes"]["global"] == sum(os.path.getsize(saved / "global" / n) for n in of_b), d  # b's files, no other
    assert d["saved_on"] == saved_on and d["restored_into"] == layout(1, (1, 1), [(0,)]), d
    assert d["from_lost_nodes"] == of_b, d

    job = job_from(saved, tmp_path / "older", {"node": a})
    for name in of_b:
        flip(job / "node" / "local" / name)
    flip(job / "global" / of_b[0])
    done = elastic_restore(job, 2, "2x1", 3, "local")
    for d in done.values():
        assert [r[:2] for r in d["refused"]] == [["local", 4], ["global", 4]], d
        assert (d["bytes"]["peer"], d["bytes"]["global"]) == (0, 0), d
        assert d["saved_on"] == saved_on and d["restored_into"] == layout(2, (2, 1), [(0, 1)]), d
        assert d["from_lost_nodes"] == [f"{r}_3.distcp" for r in (2, 3)], d


def test_a_step_saved_on_1x2_restores_onto_2x2(tmp_path):
    """Issue 39, point 2: 1 node x 2 ranks on a (1, 2) mesh saves (no copies: one node); the
    job restarts on 2 nodes x 2 ranks, mesh (2, 2), the second node new: step 4, the new
    node's ranks taking every byte from the first; no node was lost."""
    saved = tmp_path / "saved"
    (saved / "node").mkdir(parents=True)
    logs = run_launch(script(ELASTIC), 2, saved / "node", args=(saved / "global", "save", "1x2"), timeout=180)
    assert_passed(logs, ["save"], 2)
    done = elastic_restore(job_from(saved, tmp_path / "2x2", {"nodeA": "node", "nodeB": None}), 2, "2x2", 4, "local",
                           two_nodes=True)
    got = sorted((d["bytes"]["local"] > 0, d["bytes"]["peer"] > 0) for d in done.values())
    assert got == [(False, True)] * 2 + [(True, False)] * 2, done
    for d in done.values():
        assert (d["refused"], d["bytes"]["global"], d["from_lost_nodes"]) == ([], 0, []), d
        assert d["saved_on"] == layout(2, (1, 2), [(0, 1)]), d
        assert d["restored_into"] == layout(4, (2, 2), [(0, 1), (2, 3)]), d
