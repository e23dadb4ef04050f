"""A fake GPU for paddle's CPU wheel: tensors report a GPU place, and paddle's GPU rules hold.

``install()`` patches paddle at its own level, so paddle's code and ours see the same places:

* ``paddle.Tensor.place`` reports ``Place(gpu:N)`` for every tensor, except those made in host
  memory by paddle's own calls: ``_copy_to`` a CPU or pinned place (``cpu()``, ``pin_memory()``,
  ``to("cpu")``), a creation call given ``CPUPlace()`` / ``CUDAPinnedPlace()`` (``empty``,
  ``zeros``, ``full``, ``to_tensor`` ...), or ``from_dlpack`` of host memory. The bytes live in
  host memory whatever the place says; the rules below keep the code honest about them.
* Pinning: only into ``CUDAPinnedPlace()`` (or from a GPU place); ``pin_memory=True`` with a CPU
  place raises paddle's own ``Pinning memory is not supported`` error.
* No host view of device memory: ``data_ptr()`` of a tensor on the GPU raises.
* NCCL: the job's process group and every group ``new_group`` makes stand for NCCL groups: they
  accept only tensors on the GPU, and only from the thread that made them (NCCL collectives stay
  on the caller's thread). Groups made with ``core.ProcessGroupGloo.create`` are gloo groups and
  take host tensors, from any thread.
* Accounting: bytes on the device made by creation calls and copies to the device, pinned bytes,
  current and peak (freed when the tensor is collected), and the bytes copied each way.
  ``paddle.device.cuda.max_memory_allocated()`` and friends report it. Tensors that paddle's
  operators produce are not counted (only what creation calls and copies make).

What it does not prove: timing, streams, real device memory limits, NCCL's own behaviour.
Enabled in processes started with ``PADDLE_DCP_FAKE_GPU=1`` and ``tests/worker_site`` on
``PYTHONPATH`` (``sitecustomize`` there calls :func:`install`), or by calling :func:`install`.
"""
from __future__ import annotations

import os
import threading
import weakref

ENV = "PADDLE_DCP_FAKE_GPU"
_MARK = "_fakegpu_kind"  # in a tensor's __dict__: "cpu" or "pinned"; absent: on the GPU


class Accounting:
    """Bytes the fake device and the pinned host memory hold now and at their peak."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.current = {"gpu": 0, "pinned": 0}
        self.peak = {"gpu": 0, "pinned": 0}
        self.copied = {"d2h": 0, "h2d": 0}
        self.allocations = {"gpu": 0, "pinned": 0}

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = dict(self.current)

    def alloc(self, tensor, kind: str) -> None:
        if kind not in self.current:
            return
        nbytes = _nbytes(tensor)
        with self.lock:
            self.current[kind] += nbytes
            self.peak[kind] = max(self.peak[kind], self.current[kind])
            self.allocations[kind] += 1
        weakref.finalize(tensor, self._free, kind, nbytes)

    def _free(self, kind: str, nbytes: int) -> None:
        with self.lock:
            self.current[kind] -= nbytes

    def copy(self, src: str, dst: str, nbytes: int) -> None:
        if src == "gpu" and dst != "gpu":
            self.copied["d2h"] += nbytes
        elif src != "gpu" and dst == "gpu":
            self.copied["h2d"] += nbytes


ACCOUNT = Accounting()
_STATE: dict = {}


def _nbytes(tensor) -> int:
    try:
        return int(tensor._numel()) * int(tensor.element_size())
    except Exception:  # noqa: BLE001 - an uninitialized tensor
        return 0


class FakePlace:
    """A place paddle's Python code takes for a GPU or pinned place."""

    kind = "gpu"

    def __init__(self, device_id: int = 0):
        self.device_id = int(device_id)

    def is_gpu_place(self) -> bool:
        return self.kind == "gpu"

    def is_cuda_pinned_place(self) -> bool:
        return self.kind == "pinned"

    def is_cpu_place(self) -> bool:
        return False

    def is_xpu_place(self) -> bool:
        return False

    is_xpu_pinned_place = is_custom_place = is_ipu_place = is_xpu_place

    def gpu_device_id(self) -> int:
        return self.device_id

    get_device_id = gpu_device_id

    def _equals(self, other) -> bool:
        return kind_of_place(other) == self.kind and getattr(other, "device_id", self.device_id) == self.device_id

    def __eq__(self, other) -> bool:
        return self._equals(other)

    def __hash__(self) -> int:
        return hash((self.kind, self.device_id))

    def __repr__(self) -> str:
        return f"Place(gpu:{self.device_id})" if self.kind == "gpu" else "Place(gpu_pinned)"


class FakeCUDAPlace(FakePlace):
    kind = "gpu"


class FakeCUDAPinnedPlace(FakePlace):
    kind = "pinned"

    def __init__(self):
        super().__init__(0)


def kind_of_place(place) -> str:
    """"gpu", "pinned" or "cpu" for any place paddle takes (a place object or a string)."""
    if place is None:
        return "gpu"
    if isinstance(place, FakePlace):
        return place.kind
    if isinstance(place, str):
        name = place.lower().replace("cuda", "gpu")
        return "pinned" if name == "gpu_pinned" else ("gpu" if name.startswith("gpu") else "cpu")
    return "cpu"


def kind_of(tensor) -> str:
    return tensor.__dict__.get(_MARK, "gpu") if hasattr(tensor, "__dict__") else "gpu"


def mark(tensor, kind: str, count: bool = True):
    """Record where ``tensor`` lives (a tensor made in host memory by paddle's own calls)."""
    if kind != "gpu":
        tensor.__dict__[_MARK] = kind
    else:
        tensor.__dict__.pop(_MARK, None)
    if count:
        ACCOUNT.alloc(tensor, kind)
    return tensor


def device_id() -> int:
    return int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")) or 0)


def _place_of(self):
    kind = kind_of(self)
    if kind == "cpu":
        return _STATE["place"].__get__(self)
    return FakeCUDAPinnedPlace() if kind == "pinned" else FakeCUDAPlace(device_id())


def _data_ptr(self):
    if kind_of(self) == "gpu":
        raise RuntimeError(
            "fake GPU: data_ptr() of a tensor on Place(gpu) is a device address; host code must not "
            "read it (copy to host memory with paddle's calls first)"
        )
    return _STATE["data_ptr"](self)


def _copy_to_of(original):
    """``_copy_to`` of a tensor class (parameters have their own): the copy is made in host
    memory and marked with the place asked for."""

    def _copy_to(self, place, blocking=True):
        import paddle

        dst = kind_of_place(place)
        out = original(self, paddle.CPUPlace(), blocking)
        ACCOUNT.copy(kind_of(self), dst, _nbytes(out))
        return mark(out, dst)

    return _copy_to


def _numpy(self, *args, **kwargs):
    out = _STATE["numpy"](self, *args, **kwargs)
    if kind_of(self) == "gpu":
        ACCOUNT.copy("gpu", "cpu", out.nbytes)
    return out


def _creation(fn, place_arg: str, position: int | None, like: bool = False):
    """Wrap a paddle creation call: a fake place becomes a host allocation marked as such;
    pin_memory follows paddle's rule (only into a pinned or GPU place). Without a place, the
    current device (the GPU), or for ``*_like`` calls the place of the tensor given."""

    def create(*args, **kwargs):
        import paddle

        if not paddle.in_dynamic_mode():  # building a static program (a DistModel): no tensors yet
            return fn(*args, **kwargs)
        args = list(args)
        if position is not None and len(args) > position:
            device = args.pop(position)
        else:
            device = kwargs.pop(place_arg, None)
        pin = bool(kwargs.pop("pin_memory", False))
        if device is None and like:
            kind = kind_of(args[0] if args else kwargs["x"])
        else:
            kind = kind_of_place(device)
        if pin and kind == "cpu":
            raise RuntimeError(f"Pinning memory is not supported for {device}.")
        kind = "pinned" if pin else kind
        kwargs[place_arg] = paddle.CPUPlace()
        out = fn(*args, **kwargs)
        if place_arg == "place" and kind == "gpu":  # to_tensor of host data: a copy to the device
            ACCOUNT.copy("cpu", "gpu", _nbytes(out))
        return mark(out, kind)

    create.__wrapped__ = fn
    return create


# Tensor methods whose result lives where their input does (views, or copies on the same
# place): paddle's operators on a host tensor give host tensors on a GPU build too.
_SAME_PLACE = ("__getitem__", "reshape", "view", "flatten", "detach", "clone", "contiguous", "astype", "cast",
               "squeeze", "unsqueeze", "transpose")


def _same_place(method):
    def call(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        kind = kind_of(self)
        if kind != "gpu" and hasattr(out, "__dict__") and out is not self:
            mark(out, "cpu" if kind == "pinned" and method.__name__ not in ("__getitem__", "reshape", "view") else kind,
                 count=False)
        return out

    call.__name__ = getattr(method, "__name__", "method")
    return call


def _from_dlpack(dlpack):
    return mark(_STATE["from_dlpack"](dlpack), "cpu", count=False)


class NcclGuard:
    """A process group standing for an NCCL group: device tensors only, and only from the
    main thread (NCCL collectives stay on the caller's thread: a second thread issuing them
    beside the training loop's can deadlock). ``CALLS`` counts the collectives run on such
    groups, by name."""

    CALLS: dict = {}
    _QUERIES = ("rank", "size", "name")

    def __init__(self, pg):
        self._pg = pg

    def __getattr__(self, name):
        attr = getattr(self._pg, name)
        if name in self._QUERIES or not callable(attr):
            return attr

        def call(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    f"fake GPU: NCCL collective {name} called from thread {threading.current_thread().name}; "
                    "NCCL collectives stay on the caller's (main) thread"
                )
            for tensor in _tensors(list(args) + list(kwargs.values())):
                if kind_of(tensor) != "gpu":
                    raise RuntimeError(
                        f"fake GPU: NCCL collective {name} given a tensor in host memory ({tensor.place}); "
                        "NCCL takes device tensors only"
                    )
            NcclGuard.CALLS[name] = NcclGuard.CALLS.get(name, 0) + 1
            return attr(*args, **kwargs)

        return call


class FakeNCCLConfig:
    """``core.NCCLConfig`` (fleet builds one per hybrid group): options a gloo group ignores."""

    @staticmethod
    def create(**options):
        return None


class FakeProcessGroupNCCL:
    """``core.ProcessGroupNCCL``: a gloo group underneath, guarded as NCCL."""

    @staticmethod
    def create(store, rank, world_size, group_id, *options):
        from paddle.base import core

        return NcclGuard(core.ProcessGroupGloo.create(store, rank, world_size, group_id))


def _tensors(values):
    import paddle

    for v in values:
        if isinstance(v, paddle.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def guard_group(group):
    """Make a paddle Group stand for an NCCL group (idempotent)."""
    if group is not None and not isinstance(group._pg, NcclGuard):
        group._pg = NcclGuard(group._pg)
    return group


def _patch_groups():
    """The job's group and every group new_group makes are NCCL groups (gloo underneath)."""
    import paddle.distributed as dist
    from paddle.base import core
    from paddle.distributed import collective, parallel

    core.ProcessGroupNCCL = FakeProcessGroupNCCL
    if not hasattr(core, "NCCLConfig"):
        core.NCCLConfig = FakeNCCLConfig
    if not hasattr(core, "nccl_version"):  # NCCL 2.0: too old for paddle's avg reduce (gloo has none)
        core.nccl_version = lambda: 2000
    init = dist.init_parallel_env

    def init_parallel_env(*args, **kwargs):
        out = init(*args, **kwargs)
        _as_nccl_job()
        return out

    dist.init_parallel_env = parallel.init_parallel_env = init_parallel_env
    if collective._group_map:  # already initialized
        _as_nccl_job()


def _as_nccl_job():
    from paddle.distributed import collective

    guard_group(collective._get_global_group())
    collective._default_backend = "nccl"


def _patch_device_queries():
    import paddle

    count = int(os.environ.get("PADDLE_DCP_FAKE_GPU_COUNT", "8"))
    cuda = paddle.device.cuda
    paddle.is_compiled_with_cuda = paddle.device.is_compiled_with_cuda = lambda: True
    cuda.device_count = lambda: count
    paddle.get_device = paddle.device.get_device = lambda: f"gpu:{device_id()}"
    cuda.memory_allocated = lambda device=None: ACCOUNT.current["gpu"]
    cuda.max_memory_allocated = lambda device=None: ACCOUNT.peak["gpu"]
    cuda.reset_max_memory_allocated = lambda device=None: ACCOUNT.reset_peak()
    cuda.synchronize = paddle.device.synchronize = lambda device=None: None
    core = paddle.base.core  # paddle's host-memory counter: pinned bytes, the part the fake knows of
    core.host_memory_stat_peak_value = lambda stat, device: ACCOUNT.peak["pinned"]
    core.host_memory_stat_current_value = lambda stat, device: ACCOUNT.current["pinned"]
    core.host_memory_stat_reset_peak_value = lambda stat, device: ACCOUNT.reset_peak()
    if not hasattr(paddle.base.core, "get_cuda_device_count"):  # paddle.seed seeds no CUDA generator
        paddle.base.core.get_cuda_device_count = lambda: 0


def install() -> None:
    """Patch paddle (imported here) so that this process runs as on a GPU; idempotent."""
    if _STATE:
        return
    import paddle
    import paddle.utils.dlpack as dlpack
    from paddle.base import core

    tensor = paddle.Tensor
    _STATE.update(
        place=tensor.__dict__["place"], data_ptr=tensor.data_ptr, numpy=tensor.numpy,
        from_dlpack=dlpack.from_dlpack,
    )
    tensor.place = property(_place_of)
    tensor.data_ptr = _data_ptr
    tensor._copy_to = _copy_to_of(tensor._copy_to)
    param = paddle.base.framework.EagerParamBase
    if "_copy_to" in param.__dict__:
        param._copy_to = _copy_to_of(param._copy_to)
    tensor.numpy = _numpy
    for name in _SAME_PLACE:
        if hasattr(tensor, name):
            setattr(tensor, name, _same_place(getattr(tensor, name)))
    dlpack.from_dlpack = paddle.from_dlpack = _from_dlpack
    equals = core.Place._equals  # a real (CPU) place compared with a fake one: never equal
    core.Place._equals = lambda self, other: False if isinstance(other, FakePlace) else equals(self, other)
    for module in (paddle, core, paddle.base, paddle.framework):
        module.CUDAPlace = FakeCUDAPlace
        module.CUDAPinnedPlace = FakeCUDAPinnedPlace
    for name in ("empty", "zeros", "ones", "full"):
        setattr(paddle, name, _creation(getattr(paddle, name), "device", None))
    for name in ("empty_like", "zeros_like", "ones_like", "full_like"):
        setattr(paddle, name, _creation(getattr(paddle, name), "device", None, like=True))
    paddle.to_tensor = _creation(paddle.to_tensor, "place", 2)
    _patch_device_queries()
    _patch_groups()


def installed() -> bool:
    return bool(_STATE)
