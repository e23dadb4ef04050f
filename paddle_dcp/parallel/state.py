"""What paddle_dcp keeps in this process between calls that the caller can see and reset, in
one object: :data:`STATE` (``paddle_dcp.process_state()``). Kept elsewhere, and not reset by
it: the async saves still running (:mod:`paddle_dcp.async_save`, which ``paddle_dcp.close``
waits for), paddle's own functions while they are patched (:mod:`paddle_dcp.patching`), and
the object-storage clients (:mod:`paddle_dcp.io.objects`).

- ``save_plans``: the plan of the last save of each layout, so the next save of the same layout
  sends no summary (keyed by the group's ranks, coordinator, replicas and file layout);
- ``traffic``: the planning bytes of the last save and load of this process (``"save"``,
  ``"load"``), which the tests compare with the simulation's prediction;
- ``staging``: the host memory async saves stage pieces into (pinned on a GPU), reused from one
  save to the next;
- ``groups``: the gloo groups and point-to-point connections paddle_dcp made.

``reset()`` (what ``paddle_dcp.close()`` does once the async saves are done) forgets and frees
them all; the next call makes what it needs again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .device import StagingArena
from .groups import Groups


@dataclass(eq=False)
class ProcessState:
    """paddle_dcp's state in this process (see the module docstring)."""

    save_plans: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)
    staging: StagingArena = field(default_factory=StagingArena)
    groups: Groups = field(default_factory=Groups)

    def reset(self) -> None:
        """Forget the plans and the traffic, free the staging memory, release the groups and
        connections. Every rank of a group calls it (a group made again is made by all its
        members); pending async saves must have finished (``paddle_dcp.close`` waits)."""
        self.save_plans.clear()
        self.traffic.clear()
        self.staging.release()
        self.groups.close()


STATE = ProcessState()
