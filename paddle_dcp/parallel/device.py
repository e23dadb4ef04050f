"""Where bytes meet paddle's memory: host views of tensors, copies between host and device.

The only module with device-specific lines, following paddle's GPU rules as its Python sources
state them: host code views only host memory (``data_ptr()`` of a CPU or pinned tensor, never
of a device tensor); pinned memory is made only in ``paddle.CUDAPinnedPlace()`` (paddle refuses
``CPUPlace`` with ``pin_memory=True``); the caller's tensors are filled in place with paddle's
copy calls (``copy_``, slice assignment), never replaced. A CPU tensor is viewed in place (no
copy); a tensor on a GPU is copied to host memory once, whole, to pinned memory; a loaded piece
is assembled in host memory and copied into its tensor through a bounded, reused pinned area.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import os

import numpy as np

from ..core.dtypes import name_of_numpy, storage_dtype

logger = logging.getLogger(__name__)


def dtype_name(tensor) -> str:
    """The format's dtype name of a paddle tensor (``paddle.float32`` -> ``float32``)."""
    return str(tensor.dtype).replace("paddle.", "")


@functools.lru_cache(maxsize=None)
def host_only_build() -> bool:
    """True for a paddle build that can place tensors in host memory only (the CPU wheel):
    then no tensor's place needs asking (``Tensor.place`` of a dist tensor's local value costs
    about 90 us)."""
    import paddle

    try:
        accelerated = (
            paddle.is_compiled_with_cuda()
            or paddle.is_compiled_with_rocm()
            or paddle.is_compiled_with_xpu()
            or bool(paddle.device.get_all_custom_device_type())
        )
    except Exception:  # noqa: BLE001 - an unknown build: ask every tensor
        return False
    return not accelerated


def is_host(tensor) -> bool:
    if host_only_build():
        return True
    place = tensor.place
    return bool(place.is_cpu_place() or place.is_cuda_pinned_place())


def _view(tensor, dtype_name_: str) -> np.ndarray:
    """A writable numpy view of a host tensor's own memory, in storage dtype, which keeps the
    tensor alive (a host copy of a device tensor lives as long as any view of it)."""
    dtype = storage_dtype(dtype_name_)
    shape = tuple(int(s) for s in tensor.shape)
    count = math.prod(shape)
    if count == 0:
        return np.empty(shape, dtype=dtype)
    if not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous")
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(tensor.data_ptr())
    raw.owner = tensor  # the view keeps the tensor's memory alive, however it is sliced or passed on
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


class HostBytes:
    """Host memory holding a tensor's bytes for writing; keeps what it views alive."""

    def __init__(self, array: np.ndarray, owner):
        self.array = array
        self._owner = owner


def host_bytes(tensor) -> HostBytes:
    """The bytes of a (local, dense) tensor in host memory: the tensor's own memory on the
    CPU, else one copy (to pinned memory when the build has it); staged bytes as they are."""
    if isinstance(tensor, HostBytes):
        return tensor
    if isinstance(tensor, np.ndarray):
        from ..core.dtypes import name_of_numpy

        return HostBytes(np.ascontiguousarray(tensor, dtype=storage_dtype(name_of_numpy(tensor.dtype))), tensor)
    name = dtype_name(tensor)
    if is_host(tensor) and tensor.is_contiguous():
        return HostBytes(_view(tensor, name), tensor)
    if not is_host(tensor):
        host = tensor.pin_memory() if _has_pinned() else tensor.cpu()
    else:
        host = tensor.contiguous()
    return HostBytes(_view(host, name), host)


def needs_host_copy(value) -> bool:
    """True when writing ``value`` (a local tensor, staged bytes or an array) copies it to
    host memory first (a tensor on a device)."""
    return not isinstance(value, (np.ndarray, HostBytes)) and not is_host(value)


def staged_copy(tensor):
    """A host copy of a local tensor's bytes that outlives later changes to the tensor (an
    async save writes it in the background): one device-to-host copy on a GPU (to pinned
    memory where paddle has it), one memcpy on the CPU. (An async save stages through a
    :class:`StagingArena` instead, which reuses its memory.)"""
    if isinstance(tensor, np.ndarray):
        return np.array(tensor, copy=True, order="C")
    if is_host(tensor):
        return tensor.clone()
    return tensor.pin_memory() if _has_pinned() else tensor.cpu()


class StagingArena:
    """Host memory an async save copies its pieces into, kept from one save to the next.

    Host tensors are copied into views of one large numpy buffer: memory allocated once,
    already touched by the previous save (a copy into it runs at memcpy speed, not at the
    speed of page faults), and large enough for the kernel to back it with huge pages.
    Tensors on a GPU are copied into pinned host tensors kept by (shape, dtype) where paddle
    has pinned memory. The arena holds the bytes of the last save this process staged (its
    share of the checkpoint) until :meth:`release`; a save that finds it in use (another
    save still writing) stages into fresh memory instead. :meth:`reserve` makes (and touches)
    the memory for given tensors ahead of the save that needs it.
    """

    ALIGN = 64  # bytes: every staged piece starts on a cache line

    def __init__(self):
        self.buf = np.empty(0, dtype=np.uint8)
        self.pinned: dict[tuple, list] = {}
        self.busy = False

    def stage(self, tensors: list) -> list:
        """Host copies of ``tensors`` (:class:`HostBytes` views of the arena, or pinned
        tensors), valid until :meth:`done`."""
        if self.busy:  # never overwrite bytes a save still writes
            return [staged_copy(t) for t in tensors]
        self.busy = True
        try:
            sources = [None if needs_host_copy(t) else host_bytes(t).array for t in tensors]
            total = sum(_aligned(a.nbytes, self.ALIGN) for a in sources if a is not None)
            if len(self.buf) < total:
                self.buf = np.empty(total, dtype=np.uint8)  # the old one goes once unreferenced
            out, at, pinned = [], 0, {}
            for tensor, src in zip(tensors, sources):
                if src is None:
                    out.append(self._device_copy(tensor, pinned))
                    continue
                view = self.buf[at : at + src.nbytes].view(src.dtype).reshape(src.shape)
                np.copyto(view, src, casting="no")
                out.append(HostBytes(view, self.buf))
                at += _aligned(src.nbytes, self.ALIGN)
            self.pinned = pinned
            return out
        except BaseException:
            self.busy = False
            raise

    def fits(self, tensors: list) -> bool:
        """True when :meth:`stage` would copy ``tensors`` into memory it already has."""
        if self.busy:
            return False
        host, device = _split_sizes(tensors, self.ALIGN)
        free = {key: len(bufs) for key, bufs in self.pinned.items()}
        for key in device:
            free[key] = free.get(key, 0) - 1
        return host <= len(self.buf) and all(n >= 0 for n in free.values())

    def reserve(self, tensors: list) -> None:
        """Allocate and touch the memory :meth:`stage` needs for ``tensors`` (the same shapes
        and dtypes), so that it copies at memory speed; a no-op when it fits already."""
        if self.busy or self.fits(tensors):
            return
        host, device = _split_sizes(tensors, self.ALIGN)
        if host > len(self.buf):
            self.buf = np.empty(0, dtype=np.uint8)  # the old one first: never both at once
            self.buf = np.empty(host, dtype=np.uint8)
            self.buf[::4096] = 0  # every page touched now, not during the save that needs it
        pinned: dict[tuple, list] = {}
        for key in device:
            free = self.pinned.get(key) or []
            pinned.setdefault(key, []).append(free.pop() if free else _pinned_empty(*key))
        if device:
            self.pinned = pinned

    def _device_copy(self, tensor, used: dict):
        """A pinned host copy of a device tensor, into a buffer of the last save when one of
        its shape and dtype is free."""
        key = _device_key(tensor)
        free = self.pinned.get(key) or []
        if free:
            host = free.pop()
            host.copy_(tensor, True)
        else:
            host = tensor.pin_memory() if _has_pinned() else tensor.cpu()
        used.setdefault(key, []).append(host)
        return host

    def done(self) -> None:
        """The save that staged into the arena has finished writing: it may be reused."""
        self.busy = False

    def release(self) -> None:
        """Give the memory back (the next async save allocates it again)."""
        if not self.busy:
            self.buf, self.pinned = np.empty(0, dtype=np.uint8), {}


def _device_key(tensor) -> tuple:
    return tuple(int(s) for s in tensor.shape), tensor.dtype


def _split_sizes(tensors: list, align: int) -> tuple[int, list[tuple]]:
    """(arena bytes the host tensors take, the (shape, dtype) of every device tensor)."""
    host, device = 0, []
    for t in tensors:
        if needs_host_copy(t):
            device.append(_device_key(t))
        else:
            name = name_of_numpy(t.dtype) if isinstance(t, np.ndarray) else dtype_name(t)
            host += _aligned(math.prod(int(s) for s in t.shape) * storage_dtype(name).itemsize, align)
    return host, device


def _pinned_empty(shape: tuple, dtype):
    """Host memory for a device copy: pinned (paddle pins only into CUDAPinnedPlace) where the
    build has a GPU, else pageable."""
    import paddle

    place = paddle.CUDAPinnedPlace() if _has_pinned() else paddle.CPUPlace()
    return paddle.empty(list(shape), dtype=dtype, device=place)


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


class TargetBuffer:
    """The host array a load fills for one target tensor, and how it reaches the tensor.

    On the CPU the array is the tensor's own memory. Elsewhere (a tensor on a GPU, or a host
    tensor that is not contiguous) it is pageable host memory, copied into the caller's tensor
    in place by :meth:`finish`: through a bounded, reused pinned area (:class:`PinnedStage`),
    or straight from pageable memory with ``offload`` (no pinned memory at all). The tensor
    stays where it is: never replaced, never copied whole to the device a second time.
    """

    def __init__(self, tensor, offload: bool = False):
        self.tensor = tensor
        self.offload = offload
        self.name = dtype_name(tensor)
        self.in_place = is_host(tensor) and tensor.is_contiguous()  # the array is the tensor's memory
        if self.in_place:
            self.array = _view(tensor, self.name)
        else:  # assembled in host memory, never in device memory
            self.array = np.empty(tuple(int(s) for s in tensor.shape), dtype=storage_dtype(self.name))

    def fill(self, value) -> None:
        """Set every element to ``value`` (in the tensor's dtype, bfloat16 included)."""
        import paddle

        constant = paddle.full([1], value, dtype=self.tensor.dtype, device=paddle.CPUPlace())
        self.array[...] = _view(constant, self.name)[0]

    def finish(self, stage: "PinnedStage | None" = None) -> None:
        """Copy the filled host array into the tensor, in place, when it is not the tensor."""
        if self.array.size == 0 or self.in_place:
            return
        if stage is None or self.offload or not _has_pinned():
            _copy_rows(self.tensor, _host_tensor(self.array, self.tensor.dtype))
        else:
            stage.copy_into(self.tensor, self.array)


class PinnedStage:
    """A bounded pinned host area a load copies its pieces through to the device, reused
    from one piece to the next and freed by :meth:`close` (or when collected).

    A piece larger than the area goes in runs of whole rows of its first dimension (one row
    at least), so no copy on the device is larger than the area. The size is
    ``PADDLE_DCP_PINNED_STAGING_MB`` (default 64 MiB)."""

    DEFAULT_MB = 64

    def __init__(self, nbytes: int | None = None):
        if nbytes is None:
            nbytes = int(float(os.environ.get("PADDLE_DCP_PINNED_STAGING_MB", self.DEFAULT_MB)) * (1 << 20))
        self.nbytes = max(1, int(nbytes))
        self.areas: dict = {}  # dtype -> a pinned 1-D tensor of self.nbytes bytes

    def _area(self, dtype, count: int):
        area = self.areas.get(dtype)
        if area is None or int(area.shape[0]) < count:
            self.areas.pop(dtype, None)
            itemsize = storage_dtype(str(dtype).replace("paddle.", "")).itemsize
            area = _pinned_empty((max(count, self.nbytes // itemsize),), dtype)
            self.areas[dtype] = area
        return area

    def copy_into(self, tensor, array: np.ndarray) -> None:
        """Copy the host ``array`` (storage dtype, ``tensor``'s shape) into ``tensor``."""
        rows = array.reshape(array.shape[0] if array.ndim else 1, -1)
        step = max(1, self.nbytes // max(1, rows[0].nbytes))
        name = dtype_name(tensor)
        for start in range(0, rows.shape[0], step):
            part = rows[start : start + step]
            chunk = self._area(tensor.dtype, part.size)[: part.size]
            _view(chunk, name)[...] = part.reshape(-1)
            shape = list(tensor.shape) if len(part) == len(rows) else [len(part)] + list(tensor.shape[1:])
            _copy_rows(tensor, chunk.reshape(shape), start)

    def close(self) -> None:
        self.areas = {}

    def __enter__(self) -> "PinnedStage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_tensor(array: np.ndarray, dtype):
    """A pageable host paddle tensor of ``dtype`` holding a copy of ``array`` (storage dtype)."""
    import paddle

    out = paddle.empty(list(array.shape), dtype=dtype, device=paddle.CPUPlace())
    _view(out, dtype_name(out))[...] = array
    return out


def _copy_rows(tensor, source, start: int = 0) -> None:
    """Copy the host tensor ``source`` into ``tensor`` in place, at rows ``start`` on of its
    first dimension (the whole tensor when the shapes agree): paddle's own copy calls."""
    import paddle

    if list(source.shape) == list(tensor.shape):
        tensor.copy_(source, True)
        return
    with paddle.no_grad():
        tensor[start : start + int(source.shape[0])] = source


def _has_pinned() -> bool:
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0
