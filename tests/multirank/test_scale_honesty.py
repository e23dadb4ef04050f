"""The simulation of thousands of ranks (paddle_dcp.tools.simulate, scripts/bench/scale.py)
predicts the planning traffic of a real job: a real 4-rank save and load report the bytes each
rank sent and received; the simulation of the same layout must give the same counts within 10%."""
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from launcher import assert_passed, run_launch, script

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))


def _chunk(extent, parts, index):
    step = -(-extent // parts)
    return min(index * step, extent), min((index + 1) * step, extent)


def _box(shape, ids, spec, rank):
    """The rank's (offsets, shape) under spec, by the test's own arithmetic; None outside."""
    ids = np.asarray(ids)
    hit = np.argwhere(ids == rank)
    if not len(hit):
        return None
    coord = tuple(int(x) for x in hit[0])
    offsets, sizes = [], []
    for d, n in enumerate(shape):
        lo, hi = 0, n
        for mesh_dim, p in enumerate(spec):
            if p[0] == "S" and p[1] == d:
                a, b = _chunk(hi - lo, ids.shape[mesh_dim], coord[mesh_dim])
                lo, hi = lo + a, lo + b
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def test_simulation_predicts_the_traffic_of_a_real_4_rank_job(tmp_path):
    from paddle_dcp.core.save_plan import LocalPiece
    from paddle_dcp.core.boxes import Box
    from paddle_dcp.tools.simulate import RankLayout, simulate_load, simulate_save
    from traffic_layout import LAYOUT

    logs = run_launch(script("traffic.py"), 4, tmp_path, args=[tmp_path / "work"])
    assert_passed(logs, ["traffic"], 4)
    real = {}
    for line in re.findall(r"^TRAFFIC (.*)$", logs, re.M):
        row = json.loads(line)
        real[row["rank"]] = row
    assert sorted(real) == [0, 1, 2, 3]

    layouts = {}
    for r in range(4):
        pieces = []
        for key, shape, dtype, ids, spec in LAYOUT:
            box = _box(shape, ids, spec, r)
            pieces.append(LocalPiece(key, dtype, shape, None if box is None else Box(*box)))
        layouts[r] = RankLayout({"d": [[key, {"t": 0}] for key, *_ in LAYOUT]}, pieces)
    save = simulate_save(layouts)
    load = simulate_load(layouts, save.metadata_json)
    for r in range(4):
        for phase, sim in (("save", save.traffic[r]), ("load", load.traffic[r])):
            sent, received = real[r][phase]
            for what, want, got in (("sent", sent, sim.sent), ("received", received, sim.received)):
                assert math.isclose(got, want, rel_tol=0.10), (
                    f"rank {r} {phase} {what}: real {want} bytes, simulated {got}"
                )
