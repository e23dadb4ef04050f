"""Where a load puts what it reads: the kinds of target (a state-dict tensor this rank fills,
as a numpy array in place or through a paddle tensor's host buffer, or nothing), the boxes of
each target and the host arrays they land in, and the batches a load of host buffers is cut
into. The one home of these for the directory load (:mod:`~paddle_dcp.parallel.loadwork`),
the single-file and Hugging Face load (:mod:`paddle_dcp.singlefile`) and the training helpers
(:mod:`paddle_dcp.training`); the device-specific half of a target (host buffers, pinned
staging) is :mod:`~paddle_dcp.parallel.device`'s.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..core.boxes import Box
from ..core.dtypes import itemsize
from ..errors import MismatchError
from .device import PinnedStage, TargetBuffer, needs_host_copy


def key_targets(held, buffer) -> list[tuple[Box, np.ndarray]]:
    """What this rank fills of one state-dict tensor: every box (in_global) with the host array
    it lands in, a view of the tensor's buffer (the one place a key's targets are built). A
    flattened ShardedWeight fills the boxes its range covers, each a segment of its flat local
    tensor; any other tensor fills its one box."""
    if held.parts is not None:
        flat = buffer.array.reshape(-1)
        return [(box, flat[at : at + box.volume].reshape(box.shape)) for box, at in held.parts]
    box = held.piece.box
    return [(box, buffer.array.reshape(box.shape))]


class LoadTarget(Protocol):
    """Where one state-dict tensor of this rank is loaded: ``array``, the host buffer the
    reads fill (None: this rank loads nothing into it); ``fill``, a constant instead of read
    bytes (a Partial tensor's other ranks); ``finish``, the buffer handed to the caller's
    tensor once every read is done. :class:`NoTarget`, :class:`NumpyTarget` and
    :class:`~paddle_dcp.parallel.device.TargetBuffer` are the kinds."""

    array: np.ndarray | None

    def fill(self, value: Any) -> None: ...

    def finish(self, stage: PinnedStage | None = None) -> None: ...


def target_buffer(held, offload: bool) -> LoadTarget:
    """Where this rank's part of one state-dict tensor is loaded: the numpy array itself, or
    a paddle tensor's host buffer (:class:`~paddle_dcp.parallel.device.TargetBuffer`)."""
    if isinstance(held.local, np.ndarray):
        return NumpyTarget(held.local, held.piece.key)
    return TargetBuffer(held.local, offload)


class NoTarget:
    """The buffer of a tensor this rank loads nothing into."""

    array = None

    def fill(self, value: Any) -> None:
        pass

    def finish(self, stage: PinnedStage | None = None) -> None:
        pass


class NumpyTarget:
    """A numpy array of the state dict, loaded in place."""

    def __init__(self, array: np.ndarray, key: str):
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise MismatchError(f"{key}: numpy arrays loaded in place must be C-contiguous and writable")
        self.array = array

    def fill(self, value: Any) -> None:
        self.array[...] = value

    def finish(self, stage: PinnedStage | None = None) -> None:
        pass


def host_batches(held: list, limit: int) -> list[list]:
    """``held`` in consecutive batches whose host buffers (tensors not in host memory, on a
    device) take at most ``limit`` bytes each, a larger tensor alone; tensors in host memory
    need none. At least one batch."""
    batches: list[list] = [[]]
    size = 0
    for h in held:
        on_device = h.local is not None and needs_host_copy(h.local)
        n = int(np.prod(h.local.shape)) * itemsize(h.piece.dtype) if on_device else 0  # TargetBuffer's array
        if n and batches[-1] and size + n > limit:
            batches.append([])
            size = 0
        batches[-1].append(h)
        size += n
    return batches
