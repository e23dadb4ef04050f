"""What the suite io measures, shared by its driver, its worker and its report: the libraries,
the phases (and --phases/--ranks parsed) and the targets."""
from __future__ import annotations

import os

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "io_worker.py")
LIBS = ("ours", "paddle", "torch")
PHASES = ("save", "save-async", "save-durable", "load", "load-noverify", "reshard")
# paddle_dcp's own options, measured against its plain save and load (no peer has them)
OURS_ONLY = ("save-async", "save-durable", "load-noverify")
# ...except that torch DCP's async_save runs in the save-async phase too, for comparison
ASYNC_PEERS = ("torch",)
SAVES = ("save", "save-async", "save-durable")
LIB_TITLE = {
    "ours": "paddle_dcp",
    "paddle": "paddle built-in",
    "torch": "torch DCP",
}
# issue 5, point 2: ours / peer at least this, per phase and peer
TARGETS = {
    "save": {"paddle": 3.0, "torch": 3.0},
    "load": {"torch": 2.0},
    "reshard": {"paddle": 4.0, "torch": 2.5},
}


def parse_phases(text: str, ranks: list) -> list:
    """'save,load,reshard@4' -> [(ranks, phase)], in run order: every plain phase at each of
    ``ranks``, a phase@R at R only."""
    wanted = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, at = item.partition("@")
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; choose from {', '.join(PHASES)} (optionally @RANKS)")
        for r in ([int(at)] if at else ranks):
            if (r, name) not in wanted:
                wanted.append((r, name))
    return sorted(wanted, key=lambda rp: (rp[0], PHASES.index(rp[1])))


def parse_ranks(text: str) -> list:
    out = sorted({int(x) for x in text.split(",") if x.strip()})
    if not out or out[0] < 1:
        raise ValueError(f"--ranks {text!r}: give rank counts >= 1, e.g. 2 or 2,4")
    return out
