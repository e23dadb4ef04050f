"""paddle_dcp's own links between ranks (point-to-point connections for node-local transfers,
groups of the members of a partial mesh dim, a background save's private group): several of
them in one process, all working, and no group per pair.

argv: WORKDIR
"""
import sys

import numpy as np

import common as c
from paddle_dcp.parallel.comm import PaddleComm
from paddle_dcp.parallel.state import STATE

GROUPS = STATE.groups

c.init()


def pairs_and_groups():
    comm = PaddleComm()
    r = comm.rank
    for peer in range(4):  # a connection with every other rank
        if peer == r:
            continue
        buf = np.zeros(16, np.uint8)
        if r < peer:
            comm.send(peer, np.full(16, r, np.uint8))
            comm.recv_into(peer, buf)
        else:
            comm.recv_into(peer, buf)
            comm.send(peer, np.full(16, r, np.uint8))
        assert (buf == peer).all(), (r, peer, buf)
    comm.end_pairwise()
    assert GROUPS.transport(r).open_connections() == 0
    t = np.array([float(r)])
    comm.reduce_among([0, 1, 2, 3], t, "sum")
    assert t.item() == 6, t.item()
    low = r - r % 2
    t = np.array([float(r)])
    comm.reduce_among([low, low + 1], t, "max")
    assert t.item() == low + 1, t.item()
    assert comm.private().all_max([r]) == [3]
    low_pair = "-".join(map(str, (low, low + 1)))
    # the control group too where the job's group is not gloo (an NCCL job: the fake GPU)
    made = set(GROUPS.names()) - {"0-1-2-3/control"}
    assert made == {"0-1-2-3/background", "0-1-2-3/reduce", f"{low_pair}/reduce"}, GROUPS.names()


c.run_cases({"pairs_and_groups": pairs_and_groups}, sys.argv[2:])
