"""Collectives between the ranks of a save or load, carrying plain bytes, with error
agreement: a failure on any rank becomes the same CollectiveError on every rank.

Implementations of one small interface:
  * :class:`SoloComm`: a world of one (no ``launch``, or a one-rank group).
  * :class:`PaddleComm`: over ``paddle.distributed`` collectives on a process group.
  * ``ThreadComm`` (tests/unit/parallel/fakes.py): ranks that are threads of one process.

Every rank of a simulated job is driven by :class:`~paddle_dcp.parallel.simworld.SimWorld`
instead, which counts each rank's bytes with this module's cost functions.

Only plain bytes cross ranks (never pickles). Variable-length messages travel padded to the
longest one with an 8-byte length in front, which is what the byte counts include.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .requests import Agree, AllGather, AllMax, Broadcast, Gather, Pairwise, ReduceAmong, Reduction, Scatter
from .state import STATE
from .agree import agree, communication_failed
from .wire import pad as _pad, unpad as _unpad
from ..errors import ArgumentError, DcpError

logger = logging.getLogger(__name__)


@dataclass
class Traffic:
    """Bytes this rank sent to and received from other ranks in planning messages and
    agreements (payload bytes of each collective; point-to-point data not included), and the
    number of collectives it took part in (counted by the simulation)."""

    sent: int = 0
    received: int = 0
    collectives: int = 0

    def add(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received


# Bytes one rank sends and receives in each collective, for messages padded to `width` bytes
# plus the 8-byte length: the real comm and the simulation count with the same functions.
def cost_all_max(count: int, size: int) -> tuple[int, int]:
    return (8 * count, 8 * count) if size > 1 else (0, 0)


def cost_gather(width: int, size: int, root: bool) -> tuple[int, int]:
    return (0, (size - 1) * (width + 8)) if root else (width + 8, 0)


def cost_scatter(width: int, size: int, root: bool) -> tuple[int, int]:
    return ((size - 1) * (width + 8), 0) if root else (0, width + 8)


def cost_all_gather(width: int, size: int) -> tuple[int, int]:
    return ((size - 1) * (width + 8), (size - 1) * (width + 8))


class Comm:
    """The collectives a save or load needs. Ranks are global ranks; ``ranks`` lists the
    group's members in group order. Subclasses implement the fixed-size primitives
    (``_all_max``, ``_gather``, ``_scatter``, ``_broadcast``, ``_all_gather``, on uint8
    arrays of equal length); this class turns them into byte messages of any length and
    counts the traffic."""

    rank: int
    ranks: tuple[int, ...]
    coordinator: int
    traffic: Traffic
    lanes: int = 1  # connections a pair may move bytes over at once (see lane())

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    # -- byte messages
    def all_max(self, values: Sequence[int]) -> list[int]:
        self.traffic.add(*cost_all_max(len(values), self.size))
        return self._all_max(list(values))

    def gather(self, data: bytes, root: int) -> list[bytes] | None:
        """Every rank's ``data`` at ``root`` (in group order); None elsewhere."""
        width = self.all_max([len(data)])[0]
        self.traffic.add(*cost_gather(width, self.size, self.rank == root))
        out = self._gather(_pad(data, width), root)
        return None if out is None else [_unpad(b) for b in out]

    def scatter(self, parts: Sequence[bytes] | None, root: int) -> bytes:
        """``parts[i]`` (given at ``root``) to the i-th rank of the group."""
        width = self.all_max([max((len(p) for p in parts), default=0) if self.rank == root else 0])[0]
        self.traffic.add(*cost_scatter(width, self.size, self.rank == root))
        padded = [_pad(p, width) for p in parts] if self.rank == root else None
        return _unpad(self._scatter(padded, width, root))

    def broadcast(self, data: bytes | None, root: int) -> bytes:
        width = self.all_max([len(data) if self.rank == root else 0])[0]
        self.traffic.add(*cost_scatter(width, self.size, self.rank == root))
        return _unpad(self._broadcast(_pad(data if self.rank == root else b"", width), root))

    def all_gather(self, data: bytes) -> list[bytes]:
        width = self.all_max([len(data)])[0]
        self.traffic.add(*cost_all_gather(width, self.size))
        return [_unpad(b) for b in self._all_gather(_pad(data, width))]

    # -- primitives
    def _all_max(self, values: list[int]) -> list[int]:
        raise NotImplementedError

    def _gather(self, buf: np.ndarray, root: int) -> list[np.ndarray] | None:
        raise NotImplementedError

    def _scatter(self, bufs: list[np.ndarray] | None, width: int, root: int) -> np.ndarray:
        raise NotImplementedError

    def _broadcast(self, buf: np.ndarray, root: int) -> np.ndarray:
        raise NotImplementedError

    def _all_gather(self, buf: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    # -- point to point, between two ranks that both expect the message
    def send(self, peer: int, data: np.ndarray) -> None:
        """Send the uint8 array ``data`` to ``peer`` (blocks until it is taken)."""
        raise NotImplementedError

    def recv_into(self, peer: int, out: np.ndarray) -> None:
        """Receive exactly ``len(out)`` bytes from ``peer`` into the uint8 array ``out``."""
        raise NotImplementedError

    def lane(self, index: int) -> "Comm":
        """A view of this comm whose point-to-point messages travel on connection ``index``
        of each pair (0: this comm's own), apart from the others' (``index < lanes``)."""
        if index != 0:
            raise ValueError(f"this comm has {self.lanes} lane(s), not {index + 1}")
        return self

    def begin_pairwise(self) -> None:
        """A pairwise step starts (on every rank of the group): make what its point-to-point
        messages need."""

    def end_pairwise(self) -> None:
        """A pairwise step is over: release what its point-to-point messages used."""

    # -- agreement
    def agree(self, step: str, error: BaseException | None, values: Sequence[int] = (), star: bool = False) -> list[int]:
        """The step's agreement (:func:`paddle_dcp.parallel.agree.agree`): the maximum over the
        ranks of ``values``, or the same CollectiveError on every rank."""
        return agree(self, step, error, values, star)

    def _collective(self, step: str, fn):
        try:
            return fn()
        except DcpError:
            raise
        except Exception as exc:  # a dead peer, a timeout of the backend
            raise communication_failed(step, self.rank, exc) from exc

    def call(self, step: str, fn):
        """Run one collective of ``step``, turning backend failures into CollectiveError."""
        return self._collective(step, fn)

    def execute(self, request):
        """Carry out one request of a protocol (see :mod:`paddle_dcp.parallel.protocol`)."""
        if isinstance(request, Agree):
            return self.agree(request.step, request.error, request.values, request.star)
        if isinstance(request, Pairwise):
            try:
                self.begin_pairwise()
                value, error = request.fn(self), None
            except Exception as exc:  # noqa: BLE001 - agreed on below
                value, error = None, exc
            finally:
                if not request.star:  # else the agreement still needs the connections
                    self.end_pairwise()
            self.agree(request.step, error, star=request.star)
            return value
        if isinstance(request, ReduceAmong):
            try:
                for reduction in request.reductions:
                    self.reduce(reduction)
                error = None
            except Exception as exc:  # noqa: BLE001 - agreed on below
                error = exc
            self.agree(request.step, error)
            return None
        step = type(request).__name__.lower()
        if isinstance(request, AllMax):
            return self.call(step, lambda: self.all_max(request.values))
        if isinstance(request, Gather):
            return self.call(step, lambda: self.gather(request.data, request.root))
        if isinstance(request, Scatter):
            return self.call(step, lambda: self.scatter(request.parts, request.root))
        if isinstance(request, Broadcast):
            return self.call(step, lambda: self.broadcast(request.data, request.root))
        if isinstance(request, AllGather):
            return self.call(step, lambda: self.all_gather(request.data))
        raise TypeError(f"unknown protocol request {request!r}")

    def reduce(self, reduction: Reduction) -> None:
        """One :class:`~paddle_dcp.parallel.requests.Reduction`: its collective, then its finish."""
        self.reduce_among(reduction.members, reduction.array, reduction.collective_op)
        reduction.finish()

    def reduce_among(self, members: Sequence[int], array: np.ndarray, op: str) -> None:
        """All-reduce the host ``array`` in place among the ranks ``members`` (this rank
        included), with ``op`` one of sum, max, min, prod. Here only among this rank alone."""
        if set(members) != {self.rank}:
            raise NotImplementedError(f"{type(self).__name__} cannot reduce among ranks {sorted(set(members))}")


class SoloComm(Comm):
    """A world of one: every collective returns its own input."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.ranks = (rank,)
        self.coordinator = rank
        self.traffic = Traffic()

    def _all_max(self, values):
        return list(values)

    def _gather(self, buf, root):
        return [buf]

    def _scatter(self, bufs, width, root):
        return bufs[0]

    def _broadcast(self, buf, root):
        return buf

    def _all_gather(self, buf):
        return [buf]


class PaddleComm(Comm):
    """Collectives over a gloo process group of paddle_dcp's own, with the members of the
    paddle process group it is given (the job's when None), on host memory.

    Control traffic (ids, plans, metadata, agreements) never runs on an NCCL group: that takes
    device tensors only, and its collectives must stay on the caller's thread (an async save's
    run on the writer thread). In a gloo job the caller's thread uses the given group itself;
    otherwise, and for an async save's writer thread always, a gloo group is made once per
    process for those members and purpose (see :data:`~paddle_dcp.parallel.state.STATE`); ``purpose`` keeps an async
    save's group (``"background"``) apart from the caller's (``"control"``): gloo matches
    messages by a counter per group, so two threads must never share one.
    """

    def __init__(self, group=None, coordinator: int = 0, purpose: str = "control"):
        import paddle.distributed as dist

        self.group = group
        self.rank = dist.get_rank()
        if group is None:
            self.ranks = tuple(range(dist.get_world_size()))
        else:
            self.ranks = tuple(int(r) for r in group.ranks)
        if self.rank not in self.ranks:
            raise ArgumentError(f"rank {self.rank} is not a member of the process group {self.ranks}")
        if coordinator not in self.ranks:
            raise ArgumentError(f"coordinator_rank {coordinator} is not a member of the process group {self.ranks}")
        self.coordinator = coordinator
        self.purpose = purpose
        self.traffic = Traffic()
        given = _gloo_group(group) if purpose == "control" else None
        self._pg = given if given is not None else STATE.groups.get(self.rank, self.ranks, purpose)

    def _index(self, rank: int) -> int:
        return self.ranks.index(rank)

    def _all_max(self, values):
        from paddle.base import core

        array = np.asarray(values, dtype=np.int64)
        self._pg.all_reduce(host_tensor(array), core.ReduceOp.MAX, True).wait()
        return [int(x) for x in array]

    def _gather(self, buf, root):
        mine = host_tensor(buf)
        if self.rank != root:  # the list is paddle's shape only: one tensor, never filled
            self._pg.gather(mine, [mine] * self.size, self._index(root), True).wait()
            return None
        outs = [np.zeros_like(buf) for _ in self.ranks]
        self._pg.gather(mine, [host_tensor(o) for o in outs], self._index(root), True).wait()
        return outs

    def _scatter(self, bufs, width, root):
        out = np.zeros(width + 8, np.uint8)
        mine = host_tensor(out)
        ins = [host_tensor(b) for b in bufs] if self.rank == root else [mine] * self.size
        self._pg.scatter(mine, ins, self._index(root), True).wait()
        return out

    def _broadcast(self, buf, root):
        buf = np.array(buf, copy=True)
        self._pg.broadcast(host_tensor(buf), self._index(root), True).wait()
        return buf

    def _all_gather(self, buf):
        outs = [np.empty_like(buf) for _ in self.ranks]
        self._pg.all_gather([host_tensor(o) for o in outs], host_tensor(buf), True).wait()
        return outs

    def private(self) -> "PaddleComm":
        """A comm over the same ranks through a gloo group of their own (a background
        save's collectives must not interleave with the caller's)."""
        return PaddleComm(self.group, self.coordinator, purpose="background")

    def reduce_among(self, members: Sequence[int], array: np.ndarray, op: str) -> None:
        """All-reduce the host ``array`` in place among the ranks ``members`` (this rank
        included), with ``op`` one of sum, max, min, prod, over a gloo group of those ranks."""
        from paddle.base import core

        members = tuple(sorted(members))
        if len(members) == 1:
            return
        ops = {"sum": core.ReduceOp.SUM, "max": core.ReduceOp.MAX, "min": core.ReduceOp.MIN, "prod": core.ReduceOp.PRODUCT}
        STATE.groups.get(self.rank, members, "reduce").all_reduce(host_tensor(array), ops[op], True).wait()

    def send(self, peer, data):
        STATE.groups.transport(self.rank).send(peer, self.purpose, data)

    def recv_into(self, peer, out):
        STATE.groups.transport(self.rank).recv_into(peer, self.purpose, out)

    lanes = 2

    def lane(self, index: int) -> "Comm":
        return self if index == 0 else _Lane(self, index)

    def begin_pairwise(self) -> None:
        """The group's ranks learn where the others listen: one all-gather, the first time
        this comm (its purpose, its ranks) pairs up in this process (a store lookup per peer would cost ~90 ms)."""
        transport = STATE.groups.transport(self.rank)
        key = (self.purpose, tuple(self.ranks))  # this comm's: each comm pairs up in its own order
        if not transport.knows(key):
            every = self.call("point to point addresses", lambda: self.all_gather(transport.address().encode()))
            transport.learn(key, self.ranks, [b.decode() for b in every])

    def end_pairwise(self) -> None:
        STATE.groups.transport(self.rank).end_step(self.purpose)


class _Lane(Comm):
    """Point-to-point messages of a PaddleComm on a connection of their own (channel
    ``purpose/index``), closed with the comm's at the end of the pairwise step."""

    def __init__(self, comm: "PaddleComm", index: int):
        self.rank, self.ranks, self.coordinator, self.traffic = comm.rank, comm.ranks, comm.coordinator, comm.traffic
        self.channel = f"{comm.purpose}/{index}"

    def send(self, peer, data):
        STATE.groups.transport(self.rank).send(peer, self.channel, data)

    def recv_into(self, peer, out):
        STATE.groups.transport(self.rank).recv_into(peer, self.channel, out)


def _gloo_group(group):
    """The process group of ``group`` (the job's when None) when it is a gloo group, which
    the caller's thread may use for control traffic as it is (a gloo job: no group to make);
    None for an NCCL group (or any other backend)."""
    from paddle.base import core
    from paddle.distributed import collective

    pg = (collective._get_global_group() if group is None else group).process_group
    return pg if isinstance(pg, core.ProcessGroupGloo) else None


def host_tensor(array: np.ndarray):
    """A paddle tensor over ``array``'s own host memory (zero copy), for a gloo collective."""
    import paddle

    if not array.flags.writeable:  # numpy < 2 cannot export read-only memory through DLPack
        array = array.copy()
    return paddle.utils.dlpack.from_dlpack(np.ascontiguousarray(array))


def make_comm(process_group=None, coordinator_rank: int = 0) -> Comm:
    """The comm for a call: paddle's when a job of several ranks runs, else a world of one."""
    try:
        import paddle.distributed as dist
    except ImportError:  # pragma: no cover - the core works without paddle
        return SoloComm()
    if process_group is None and dist.get_world_size() <= 1:
        return SoloComm(dist.get_rank() if dist.get_world_size() == 1 else 0)
    if process_group is None and not dist.is_initialized():
        dist.init_parallel_env()
    return PaddleComm(process_group, coordinator_rank)
