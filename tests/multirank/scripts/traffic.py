"""Save and load a flat state dict on 4 ranks and print each rank's planning traffic, for the
test that checks paddle_dcp.tools.simulate's prediction of it (issue: planning at scale).

argv: WORKDIR. Prints ``TRAFFIC {"rank": r, "save": [sent, received], "load": [...]}``.
"""
import json
import os
import sys

import common as c
import paddle_dcp

from traffic_layout import LAYOUT

root = c.init()
r = c.rank()


def state(target: bool) -> dict:
    sd = {}
    for i, (key, shape, dtype, ids, spec) in enumerate(LAYOUT):
        leaf = c.Leaf((key,), shape, dtype, c.Mesh(ids), spec, index=i)
        sd[key] = leaf.tensor(0, target=target)
    return sd


def run():
    path = os.path.join(root, "ckpt")
    paddle_dcp.save_state_dict(state(False), path)
    save = paddle_dcp.process_state().traffic["save"]
    paddle_dcp.load_state_dict(state(True), path)
    load = paddle_dcp.process_state().traffic["load"]
    print("TRAFFIC " + json.dumps({"rank": r, "save": [save.sent, save.received], "load": [load.sent, load.received]}), flush=True)


c.run_cases({"traffic": run}, sys.argv[2:])
