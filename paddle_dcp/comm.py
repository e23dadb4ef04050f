"""Collectives between the ranks of a save or load, carrying plain bytes, with error
agreement: a failure on any rank becomes the same CollectiveError on every rank.

Three implementations of one small interface:
  * :class:`SoloComm`: a world of one (no ``launch``, or a one-rank group).
  * :class:`PaddleComm`: over ``paddle.distributed`` collectives on a process group.
  * :class:`SimComm` (in scripts and tests): every rank in one process, counting bytes.

Only plain bytes cross ranks (never pickles). Variable-length messages travel padded to the
longest one with an 8-byte length in front, which is what the byte counts include.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from .errors import CollectiveError, DcpError

logger = logging.getLogger(__name__)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Comm:
    """The collectives a save or load needs. Ranks are global ranks; ``ranks`` lists the
    group's members in group order."""

    rank: int
    ranks: tuple[int, ...]
    coordinator: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    # -- primitives, implemented by subclasses
    def all_max(self, values: Sequence[int]) -> list[int]:
        raise NotImplementedError

    def gather(self, data: bytes, root: int) -> list[bytes] | None:
        """Every rank's ``data`` at ``root`` (in group order); None elsewhere."""
        raise NotImplementedError

    def scatter(self, parts: Sequence[bytes] | None, root: int) -> bytes:
        """``parts[i]`` (given at ``root``) to the i-th rank of the group."""
        raise NotImplementedError

    def broadcast(self, data: bytes | None, root: int) -> bytes:
        raise NotImplementedError

    def all_gather(self, data: bytes) -> list[bytes]:
        raise NotImplementedError

    # -- point to point, between two ranks that both expect the message
    def send(self, peer: int, data: np.ndarray) -> None:
        """Send the uint8 array ``data`` to ``peer`` (blocks until it is taken)."""
        raise NotImplementedError

    def recv_into(self, peer: int, out: np.ndarray) -> None:
        """Receive exactly ``len(out)`` bytes from ``peer`` into the uint8 array ``out``."""
        raise NotImplementedError

    # -- agreement
    def agree(self, step: str, error: BaseException | None) -> None:
        """Return when no rank failed; else raise CollectiveError(step, failures) on every
        rank (the failing rank chains its own error). In a world of one, re-raise the error."""
        if self.size == 1:
            if error is not None:
                raise error
            return
        failed = self._collective(step, lambda: self.all_max([1 if error is not None else 0])[0])
        if not failed:
            return
        message = describe_error(error).encode()[:4000] if error is not None else b""
        messages = self._collective(step, lambda: self.all_gather(message))
        failures = {self.ranks[i]: m.decode(errors="replace") for i, m in enumerate(messages) if m}
        raise CollectiveError(step, failures) from error

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a local step; on leaving it, every rank learns whether any rank failed."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every failure must be agreed on
            self.agree(name, exc)
            raise
        self.agree(name, None)

    def _collective(self, step: str, fn):
        try:
            return fn()
        except DcpError:
            raise
        except Exception as exc:  # a dead peer, a timeout of the backend
            raise CollectiveError(
                step, {self.rank: f"communication failed ({describe_error(exc)}); another rank may have died"}
            ) from exc

    def call(self, step: str, fn):
        """Run one collective of ``step``, turning backend failures into CollectiveError."""
        return self._collective(step, fn)


class SoloComm(Comm):
    """A world of one: every collective returns its own input."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.ranks = (rank,)
        self.coordinator = rank

    def all_max(self, values):
        return list(values)

    def gather(self, data, root):
        return [bytes(data)]

    def scatter(self, parts, root):
        return bytes(parts[0])

    def broadcast(self, data, root):
        return bytes(data)

    def all_gather(self, data):
        return [bytes(data)]


def _pad(data: bytes, width: int) -> np.ndarray:
    out = np.zeros(width + 8, dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(data)), dtype=np.uint8)
    out[8 : 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def _unpad(buf: np.ndarray) -> bytes:
    (n,) = struct.unpack("<Q", buf[:8].tobytes())
    if n > len(buf) - 8:
        raise CollectiveError("message", {-1: "a message is longer than its buffer"})
    return buf[8 : 8 + n].tobytes()


class PaddleComm(Comm):
    """Collectives over a paddle.distributed process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group=None, coordinator: int = 0):
        import paddle.distributed as dist

        from . import device

        self._dist = dist
        self._tensor = device.message_tensor
        self.group = group
        self.rank = dist.get_rank()
        if group is None:
            self.ranks = tuple(range(dist.get_world_size()))
        else:
            self.ranks = tuple(int(r) for r in group.ranks)
        if self.rank not in self.ranks:
            raise DcpError(f"rank {self.rank} is not a member of the process group {self.ranks}")
        if coordinator not in self.ranks:
            raise DcpError(f"coordinator_rank {coordinator} is not a member of the process group {self.ranks}")
        self.coordinator = coordinator

    def all_max(self, values):
        t = self._tensor(np.asarray(values, dtype=np.int64))
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in t.numpy()]

    def gather(self, data, root):
        width = self.all_max([len(data)])[0]
        out = [] if self.rank == root else None
        gather_list = [self._tensor(np.zeros(width + 8, np.uint8)) for _ in self.ranks] if self.rank == root else []
        self._dist.gather(self._tensor(_pad(data, width)), gather_list, dst=root, group=self.group)
        if self.rank != root:
            return None
        for t in gather_list:
            out.append(_unpad(t.numpy()))
        return out

    def scatter(self, parts, root):
        width = self.all_max([max((len(p) for p in parts), default=0) if self.rank == root else 0])[0]
        out = self._tensor(np.zeros(width + 8, np.uint8))
        tensors = [self._tensor(_pad(p, width)) for p in parts] if self.rank == root else None
        self._dist.scatter(out, tensors, src=root, group=self.group)
        return _unpad(out.numpy())

    def broadcast(self, data, root):
        width = self.all_max([len(data) if self.rank == root else 0])[0]
        buf = self._tensor(_pad(data if self.rank == root else b"", width))
        self._dist.broadcast(buf, src=root, group=self.group)
        return _unpad(buf.numpy())

    def all_gather(self, data):
        width = self.all_max([len(data)])[0]
        out = []
        self._dist.all_gather(out, self._tensor(_pad(data, width)), group=self.group)
        return [_unpad(t.numpy()) for t in out]

    def _pair(self, peer: int):
        """(process group of this rank and ``peer`` alone, peer's index in it).

        Point-to-point messages go through such pair groups, never through the shared group:
        gloo matches messages by a counter of operations per group, so traffic between two
        ranks must not advance the counter of a group that others use. Each pair group has a
        store of its own (hosted by the lower rank, announced through the job's store), since
        gloo groups created at the same time through one store can connect to wrong peers.
        """
        a, b = sorted((self.rank, peer))
        entry = _PAIRS.get((a, b))
        if entry is None:
            entry = _PAIRS[(a, b)] = (_make_pair_group(self.rank, a, b), 1 if self.rank == a else 0)
        return entry

    def send(self, peer, data):
        from . import device

        group, index = self._pair(peer)
        group.send(device.wire_tensor(data), index, True).wait()

    def recv_into(self, peer, out):
        from . import device

        group, index = self._pair(peer)
        with device.wire_buffer(out) as t:
            group.recv(t, index, True).wait()


def _host() -> str:
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    return endpoint.rsplit(":", 1)[0] if ":" in endpoint else "127.0.0.1"


def _make_pair_group(rank: int, a: int, b: int):
    from paddle.base import core
    from paddle.distributed import collective

    job_store = collective._default_store
    key = f"paddle_dcp/pair/{a}/{b}"
    timeout = int(os.environ.get("PADDLE_DCP_PAIR_TIMEOUT", "600"))
    if rank == a:
        host = _host()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        job_store.set(key, f"{host}:{port}".encode())
        store = core.TCPStore(host, port, True, 2, timeout)
    else:
        host, port = bytes(job_store.get(key)).decode().rsplit(":", 1)
        store = core.TCPStore(host, int(port), False, 2, timeout)
    index = 0 if rank == a else 1
    if collective._default_backend == "nccl":
        from paddle.distributed.parallel import _get_global_env

        return core.ProcessGroupNCCL.create(store, index, 2, _PAIR_GID, _get_global_env().pg_timeout, 0, None)
    return core.ProcessGroupGloo.create(store, index, 2, _PAIR_GID)


_PAIRS: dict[tuple[int, int], object] = {}
_PAIR_GID = 1 << 20


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
