"""Where bytes meet paddle's memory: host views of tensors, device copies, message tensors.

The only module with device-specific lines. A CPU tensor is viewed in place (no copy); a
tensor on a GPU is copied to host memory once, whole (pinned where paddle offers it), and a
loaded piece is assembled in host memory and copied to the target's place once.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math

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
    """A writable numpy view of a host tensor's own memory, in storage dtype."""
    dtype = storage_dtype(dtype_name_)
    shape = tuple(int(s) for s in tensor.shape)
    count = math.prod(shape)
    if count == 0:
        return np.empty(shape, dtype=dtype)
    if not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous")
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(tensor.data_ptr())
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
            sources = [None if _on_device(t) else host_bytes(t).array for t in tensors]
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
        if _on_device(t):
            device.append(_device_key(t))
        else:
            name = name_of_numpy(t.dtype) if isinstance(t, np.ndarray) else dtype_name(t)
            host += _aligned(math.prod(int(s) for s in t.shape) * storage_dtype(name).itemsize, align)
    return host, device


def _pinned_empty(shape: tuple, dtype):
    import paddle

    return paddle.empty(list(shape), dtype=dtype, device=paddle.CPUPlace(), pin_memory=_has_pinned())


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _on_device(tensor) -> bool:
    return not isinstance(tensor, np.ndarray) and not is_host(tensor)


class TargetBuffer:
    """The host array a load fills for one target tensor, and how it reaches the tensor.

    On the CPU the array is the tensor's own memory. Elsewhere it is a host buffer whose
    contents are copied to the tensor's place by :meth:`finish`; with ``offload`` the host
    tensor itself becomes the loaded value (``replacement``, made a dist tensor again by
    ``wrap`` when the target was one).
    """

    def __init__(self, tensor, offload: bool = False, wrap=None):
        self.tensor = tensor
        self.replacement = None
        name = dtype_name(tensor)
        if is_host(tensor) and tensor.is_contiguous():
            self.host = tensor
        else:  # assembled in host memory, never in device memory
            import paddle

            pinned = _has_pinned() and not offload
            self.host = paddle.empty(tensor.shape, dtype=tensor.dtype, device=paddle.CPUPlace(), pin_memory=pinned)
            if offload:
                self.replacement = wrap(self.host) if wrap is not None else self.host
        self.array = _view(self.host, name)

    def fill(self, value) -> None:
        """Set every element to ``value`` (in the tensor's dtype, bfloat16 included)."""
        import paddle

        constant = paddle.full(self.host.shape, value, dtype=self.host.dtype)
        self.array[...] = _view(constant, dtype_name(constant))

    def finish(self) -> None:
        """Copy the filled host buffer to the tensor's place, when it is not the tensor."""
        if self.host is self.tensor or self.replacement is not None:
            return
        self.tensor.copy_(self.host.to(self.tensor.place), False)


def _has_pinned() -> bool:
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


def _on_gpu() -> bool:
    import paddle

    return "gpu" in str(paddle.get_device())


def wire_tensor(array: np.ndarray):
    """A tensor to send ``array``'s bytes: the array's own memory on the CPU (zero copy),
    a device copy for NCCL."""
    import paddle

    if _on_gpu():
        return paddle.to_tensor(array)
    if not array.flags.writeable:  # numpy < 2 cannot export read-only memory through DLPack
        array = array.copy()
    return paddle.utils.dlpack.from_dlpack(np.ascontiguousarray(array))


class wire_buffer:
    """A tensor to receive into ``out`` (uint8): ``out``'s own memory on the CPU; on a GPU a
    device buffer copied into ``out`` when the context ends."""

    def __init__(self, out: np.ndarray):
        self.out = out

    def __enter__(self):
        import paddle

        if _on_gpu():
            self.tensor = paddle.empty([len(self.out)], dtype="uint8")
        else:
            self.tensor = paddle.utils.dlpack.from_dlpack(self.out)
        return self.tensor

    def __exit__(self, *exc):
        if exc[0] is None and _on_gpu():
            self.out[...] = self.tensor.numpy()
        return False


def message_tensor(array: np.ndarray):
    """A paddle tensor for a collective: on the CPU for gloo, on the current GPU for NCCL."""
    import paddle

    return paddle.to_tensor(array)
