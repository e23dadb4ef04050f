"""What a protocol asks of the ranks' communication: the requests a save or load generator
yields (:mod:`paddle_dcp.parallel.protocol`) and a comm carries out (:meth:`Comm.execute` for a real
rank, :meth:`SimWorld.run` for every rank of a simulated job). Plain data: both sides import it,
neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class AllMax:
    values: tuple[int, ...]


@dataclass(frozen=True)
class Gather:
    data: bytes
    root: int


@dataclass(frozen=True)
class Scatter:
    parts: Sequence[bytes] | None
    root: int


@dataclass(frozen=True)
class Broadcast:
    data: bytes
    root: int


@dataclass(frozen=True)
class AllGather:
    data: bytes


@dataclass(frozen=True)
class Agree:
    """The end of a local step: did it fail on any rank? With ``values``, the same all-reduce
    also returns their maximum over the ranks (one collective instead of two). With ``star``,
    the agreement goes point to point through the coordinator (see
    :mod:`paddle_dcp.parallel.agree`)."""

    step: str
    error: BaseException | None
    values: tuple[int, ...] = ()
    star: bool = False


@dataclass(frozen=True)
class Pairwise:
    """Point-to-point work between some ranks (node-local loading, a gathered save's transfer):
    ``fn(comm)`` runs on the rank, its result or error is returned and then agreed on (with
    ``star``, point to point through the coordinator: see :mod:`paddle_dcp.parallel.agree`)."""

    step: str
    fn: Callable[[Any], Any]
    star: bool = False


@dataclass(frozen=True, eq=False)
class Reduction:
    """One all-reduce of a host array, in place, among the ranks ``members`` (this rank one of
    them): a Partial tensor's local piece over one of its partial mesh dims. ``op``: sum, max,
    min, prod, or avg (a sum, then divided by the number of members: ``//`` for integers)."""

    members: tuple[int, ...]
    array: np.ndarray
    op: str

    @property
    def collective_op(self) -> str:
        """The reduction the members' collective does (avg is a sum, divided after)."""
        return "sum" if self.op == "avg" else self.op

    def finish(self) -> None:
        """After the collective: an average divided by the number of members, in place."""
        if self.op == "avg":
            n = len(set(self.members))
            divide = np.divide if self.array.dtype.kind == "f" else np.floor_divide
            divide(self.array, n, out=self.array)


def combine(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """What a collective ``op`` (sum, max, min, prod) of ``arrays`` gives, in their dtype (a
    comm that reduces in one process: the simulation's, the tests')."""
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    out = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        fn(out, a, out=out)
    return out


@dataclass(frozen=True)
class ReduceAmong:
    """Every rank's reductions (its Partial tensors', :class:`Reduction`), run in order — the
    members of each list theirs in the same order — then agreed on like a local step. Every
    rank takes part, with nothing to reduce too: whatever could fail before the collectives
    (the host copies, the reduce types) failed in the step before and was agreed on there, so
    no rank is left waiting in a group whose other member never came."""

    step: str
    reductions: tuple[Reduction, ...]


@dataclass(frozen=True)
class Detach:
    """The rest of the protocol may go on in the background (async save): every rank's state
    is staged to host memory and nothing below reads the caller's tensors."""


Request = AllMax | Gather | Scatter | Broadcast | AllGather | Agree | Pairwise | ReduceAmong | Detach
