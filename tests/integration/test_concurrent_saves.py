"""Two jobs saving to one directory at the same moment (issue 38, point 6): every save that
reports success is a checkpoint of its own that loads exactly its values, and no two saves'
files mix. Each job is a process of its own (one rank each, numpy state); the rounds start
together through files in the directory beside the checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp.io.storage import listing_of

ROUNDS = 12
JOB = r"""
import json, os, sys, time
import numpy as np
import paddle_dcp
from paddle_dcp.errors import DcpError

ck, sync, job, rounds, explicit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
other = 1 - job
for i in range(rounds):
    open(os.path.join(sync, f"{i}.{job}"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(sync, f"{i}.{other}")):
        if time.monotonic() > deadline:
            sys.exit("the other job never came")
        time.sleep(0.0002)
    state = {"w": np.full((64, 48), job * 1000 + i, np.float32), "b": np.arange(300, dtype=np.int64) * (job + 1) + i,
             "job": job, "round": i}
    try:
        paddle_dcp.save_state_dict(state, ck, unique_id=7 if explicit else None)
        print(json.dumps([i, "ok"]), flush=True)
    except DcpError as exc:
        print(json.dumps([i, type(exc).__name__, str(exc)]), flush=True)
"""


def expected(job: int, i: int) -> dict:
    return {"w": np.full((64, 48), job * 1000 + i, np.float32), "b": np.arange(300, dtype=np.int64) * (job + 1) + i}


def run_jobs(tmp_path, explicit: bool) -> tuple[str, list[list]]:
    ck, sync = str(tmp_path / "ck"), str(tmp_path / "sync")
    os.makedirs(sync)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, str(script), ck, sync, str(j), str(ROUNDS), "1" if explicit else "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for j in (0, 1)]
    outcomes = []
    for j, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        outcomes.append([json.loads(line) for line in out.splitlines() if line.startswith("[")])
    return ck, outcomes


def load(ck: str, uid: int) -> dict:
    sd = {"w": np.zeros((64, 48), np.float32), "b": np.zeros(300, np.int64), "job": -1, "round": -1}
    paddle_dcp.load_state_dict(sd, ck, unique_id=uid)
    return sd


def test_two_jobs_saving_without_ids_at_once_each_get_a_checkpoint_of_their_own(tmp_path):
    ck, outcomes = run_jobs(tmp_path, explicit=False)
    succeeded = {(j, i) for j in (0, 1) for i, status, *_ in outcomes[j] if status == "ok"}
    assert len(succeeded) == 2 * ROUNDS, outcomes  # a save without an id never has to give up
    listing = listing_of(os.listdir(ck))
    found = {}
    for uid in sorted(listing.complete):
        sd = load(ck, uid)
        key = (sd["job"], sd["round"])
        assert key not in found, f"checkpoints {found.get(key)} and {uid} are both {key}"
        found[key] = uid
        want = expected(*key)
        assert sd["w"].tobytes() == want["w"].tobytes() and sd["b"].tobytes() == want["b"].tobytes(), (uid, key)
    assert set(found) == succeeded  # every save that said it succeeded is there, whole
    assert not listing.temporary


def test_two_jobs_saving_one_id_at_once_never_leave_it_mixed(tmp_path):
    """Both save checkpoint 7 over and over: a save either succeeds or raises a StorageError
    that says a newer save of the id took over; the checkpoint 7 left is whole, and is one
    that said it succeeded."""
    ck, outcomes = run_jobs(tmp_path, explicit=True)
    for j in (0, 1):
        for i, status, *text in outcomes[j]:
            assert status in ("ok", "StorageError"), (j, i, status, text)
            if status != "ok":
                assert "being saved again" in text[0], text
    sd = load(ck, 7)
    key = (sd["job"], sd["round"])
    want = expected(*key)
    assert sd["w"].tobytes() == want["w"].tobytes() and sd["b"].tobytes() == want["b"].tobytes(), key
    assert [key[1], "ok"] in outcomes[key[0]]
