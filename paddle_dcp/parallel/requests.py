"""What a protocol asks of the ranks' communication: the requests a save or load generator
yields (:mod:`paddle_dcp.parallel.protocol`) and a comm carries out (:meth:`Comm.execute` for a real
rank, :meth:`SimWorld.run` for every rank of a simulated job). Plain data: both sides import it,
neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


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


@dataclass(frozen=True)
class Detach:
    """The rest of the protocol may go on in the background (async save): every rank's state
    is staged to host memory and nothing below reads the caller's tensors."""


Request = AllMax | Gather | Scatter | Broadcast | AllGather | Agree | Pairwise | Detach
