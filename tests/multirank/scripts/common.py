"""Shared by the scripts that tests/multirank runs under ``paddle.distributed.launch``.

The oracle lives here: global arrays whose values come from their positions, and each rank's
slice derived from the placements by this module's own arithmetic (it never calls
``paddle_dcp.core.boxes`` or ``paddle_dcp.parallel.placements``).

A layout is written as a spec: a tuple with one entry per mesh dim, each ``"R"`` (Replicate),
``("S", d)`` (Shard(d)), ``("S", d, order)`` (Shard(d, shard_order=order): when several mesh
dims shard one tensor dim, the lowest order splits first; by default they split in mesh-dim
order) or ``("P", "sum" | "max")`` (Partial). ``None`` means a plain (non-dist) paddle tensor.

Partial tensors: the value is the reduction over the partial mesh dims of the ranks' locals.
A source (made to be saved) spreads it: for sum, the ranks off coordinate 0 hold -PARTIAL_OFFSET
and the one at 0 the value plus what cancels them; for max, the others hold the value minus
PARTIAL_OFFSET. A load target must hold what paddle's own Replicate -> Partial gives: the value
at coordinate 0 and 0 elsewhere for sum, the value everywhere for max.

Each case prints ``PASS <name> rank=<r>``; the first failure prints ``FAIL <name> rank=<r>``
with its traceback and ends the process at once, so the launcher stops the others.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import traceback

_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _TESTS not in sys.path:  # the tests' own helpers (metadoc: an independent reader of the metadata)
    sys.path.insert(1, _TESTS)

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.auto_parallel.api import dtensor_from_local

HALF = ("float16", "bfloat16")
PARTIAL_OFFSET = 100
BF16 = "bfloat16"


# ------------------------------------------------------------------------------ the oracle
def global_array(shape, dtype: str, variant: int = 0) -> np.ndarray:
    """The whole tensor as numpy, values from positions.

    Numbers: ``pos + 1000 * (variant // 2)``, negated for odd variants (half types ignore the
    offset so every value stays exactly representable: bfloat16 tensors must have at most 256
    elements, float16 ones at most 2048). bool: ``(pos + variant) % 3 == 0``. bfloat16 is
    returned as float32 (numpy has no bfloat16); :func:`storage` gives its bits.
    """
    shape = tuple(shape)
    pos = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    if dtype == "bool":
        return (pos + variant) % 3 == 0
    sign = -1 if variant % 2 else 1
    if dtype in HALF:
        limit = 256 if dtype == BF16 else 2048
        assert pos.size <= limit, f"{dtype} tensor of {pos.size} elements is not exact"
        return (sign * pos).astype(np.float32 if dtype == BF16 else np.float16)
    values = sign * pos + 1000 * (variant // 2)
    if dtype.startswith("complex"):
        return (values + 1j * (values + 0.5)).astype(dtype)
    return values.astype(dtype)


def storage(array: np.ndarray, dtype: str) -> np.ndarray:
    """The bytes paddle holds for ``array`` as ``dtype``: bfloat16 as its uint16 bit patterns
    (the values are exactly representable, so the low 16 bits of the float32 are zero)."""
    if dtype != BF16:
        return np.asarray(array, order="C")
    bits = np.asarray(array, dtype=np.float32, order="C").view(np.uint32)
    assert not (bits & 0xFFFF).any(), "value not exactly representable in bfloat16"
    return (bits >> 16).astype(np.uint16)


def chunk(extent: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of chunk ``index`` when ``extent`` is cut in ``parts`` chunks of ceil(n/k)."""
    step = -(-extent // parts)
    return min(index * step, extent), min((index + 1) * step, extent)


def local_slices(shape, mesh_shape, coord, spec) -> tuple[slice, ...]:
    """The slice of the global tensor that the rank at ``coord`` holds under ``spec``."""
    if spec is None:
        return tuple(slice(0, n) for n in shape)
    by_dim = {d: [] for d in range(len(shape))}
    for mesh_dim, p in enumerate(spec):
        if p[0] == "S":
            order = p[2] if len(p) > 2 else mesh_dim
            by_dim[p[1]].append((order, mesh_dim))
    out = []
    for d, n in enumerate(shape):
        lo, hi = 0, n
        for _, mesh_dim in sorted(by_dim[d]):
            a, b = chunk(hi - lo, mesh_shape[mesh_dim], coord[mesh_dim])
            lo, hi = lo + a, lo + b
        out.append(slice(lo, hi))
    return tuple(out)


def paddle_accepts(shape, mesh_shape, spec) -> bool:
    """Paddle's shard_tensor crashes when a chunk would start past the end of a dim (5 rows
    over 4 ranks: the 4th chunk starts at 6; ours clamps it to an empty chunk at 5). True when
    no chunk of ``spec`` does."""
    if spec is None:
        return True
    for mesh_dim, p in enumerate(spec):
        if p[0] == "S":
            if p[1] >= len(shape):
                return False
            n, k = shape[p[1]], mesh_shape[mesh_dim]
            if (k - 1) * -(-n // k) > n:
                return False
    return True


class Mesh:
    """A process mesh given as nested lists of ranks, with this rank's coordinate."""

    def __init__(self, ids, names=None):
        self.ids = np.asarray(ids)
        self.shape = tuple(self.ids.shape)
        names = names or ["x", "y", "z"][: self.ids.ndim]
        self.paddle = dist.ProcessMesh(self.ids.tolist(), dim_names=list(names))

    def coord(self, rank: int):
        hit = np.argwhere(self.ids == rank)
        return tuple(int(c) for c in hit[0]) if len(hit) else None


def partial_local(piece: np.ndarray, mesh_shape, coord, spec, source: bool) -> np.ndarray:
    """A rank's local of a Partial tensor whose value (this rank's slice) is ``piece``."""
    sums = [m for m, p in enumerate(spec) if p[0] == "P" and p[1] == "sum"]
    maxes = [m for m, p in enumerate(spec) if p[0] == "P" and p[1] == "max"]
    out = piece.copy()
    if sums:
        others = math.prod(mesh_shape[m] for m in sums) - 1
        first = all(coord[m] == 0 for m in sums)
        if source:
            out = piece + PARTIAL_OFFSET * others if first else np.full_like(piece, -PARTIAL_OFFSET)
        elif not first:
            out = np.zeros_like(piece)
    if maxes and source and not all(coord[m] == 0 for m in maxes):
        out = out - PARTIAL_OFFSET
    return out.astype(piece.dtype)


def expected_local(gl: np.ndarray, dtype: str, mesh: Mesh | None, spec, rank: int,
                   source: bool = False) -> np.ndarray | None:
    """What ``rank`` must hold (in storage dtype), or None when it is outside the mesh;
    ``source``: as made for saving (differs from a load target only for Partial)."""
    if spec is None:
        return storage(gl, dtype)
    coord = mesh.coord(rank)
    if coord is None:
        return None
    piece = gl[local_slices(gl.shape, mesh.shape, coord, spec)]
    if any(p[0] == "P" for p in spec):
        piece = partial_local(piece, mesh.shape, coord, spec, source)
    return storage(piece, dtype)


# ------------------------------------------------------------------------------ paddle side
def placements(spec):
    out = []
    for p in spec:
        if p == "R":
            out.append(dist.Replicate())
        elif p[0] == "P":
            op = {"sum": dist.ReduceType.kRedSum, "max": dist.ReduceType.kRedMax}[p[1]]
            out.append(dist.Partial(op))
        elif len(p) > 2:
            out.append(dist.Shard(p[1], shard_order=p[2]))
        else:
            out.append(dist.Shard(p[1]))
    return out


def _to_paddle(array: np.ndarray, dtype: str):
    if dtype in HALF:
        return paddle.to_tensor(np.asarray(array, dtype=np.float32)).astype(dtype)
    return paddle.to_tensor(array)


def make(gl: np.ndarray, dtype: str, mesh: Mesh | None, spec, fill=None):
    """A paddle tensor of ``dtype`` holding ``gl`` (or the constant ``fill``) laid out by
    ``spec``. Paddle chooses the layout (``shard_tensor``), except for dtypes whose CPU slice
    kernel is missing (float16, bfloat16: sharded as float32, the local value cast; complex:
    built from the oracle's local slice) and for Partial (locals from the oracle, see the
    module doc)."""
    host = gl if fill is None else np.full(gl.shape, fill, dtype=gl.dtype)
    if spec is None:
        return _to_paddle(host, dtype)
    pl = placements(spec)
    if mesh.coord(dist.get_rank()) is None:  # outside the mesh: paddle slices nothing
        return dist.shard_tensor(_to_paddle(host, dtype), mesh.paddle, pl)
    if any(p[0] == "P" for p in spec):  # the locals come from the oracle (see the module doc)
        coord = mesh.coord(dist.get_rank())
        local = host[local_slices(gl.shape, mesh.shape, coord, spec)]
        if fill is None:
            local = partial_local(local, mesh.shape, coord, spec, source=True)
        if gl.ndim == 0:  # paddle.Tensor(dims=[]) would treat the local as the global value
            return dtensor_from_local(_to_paddle(local, dtype), mesh.paddle, pl)
        return paddle.Tensor(_to_paddle(local, dtype), dims=list(gl.shape), process_mesh=mesh.paddle, placements=pl)
    if dtype in HALF:
        t32 = dist.shard_tensor(paddle.to_tensor(host.astype(np.float32)), mesh.paddle, pl)
        local = t32._local_value().astype(dtype)
        return paddle.Tensor(local, dims=list(gl.shape), process_mesh=mesh.paddle, placements=pl)
    if dtype.startswith("complex") and any(p != "R" for p in spec):
        local = host[local_slices(gl.shape, mesh.shape, mesh.coord(dist.get_rank()), spec)]
        return paddle.Tensor(paddle.to_tensor(local), dims=list(gl.shape), process_mesh=mesh.paddle, placements=pl)
    return dist.shard_tensor(paddle.to_tensor(host), mesh.paddle, pl)


def held(t) -> np.ndarray:
    """This rank's local data of a paddle tensor as numpy (bfloat16 as uint16 bits)."""
    if isinstance(t, np.ndarray):
        return t
    local = t._local_value() if t.is_dist() else t
    return local.numpy()


def assert_same(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Bit-for-bit equality: dtype, shape and raw bytes."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.tobytes() != expected.tobytes():  # raw bytes in C order
        a = np.frombuffer(actual.tobytes(), np.uint8)
        bad = np.argwhere(a != np.frombuffer(expected.tobytes(), np.uint8))
        raise AssertionError(
            f"{what}: bytes differ (first differing byte {int(bad[0][0])})\n"
            f"actual:\n{actual}\nexpected:\n{expected}"
        )


def check_tensor(t, gl, dtype, mesh, spec, rank, what, source: bool = False) -> None:
    """``t`` holds on ``rank`` exactly the oracle's slice of ``gl`` (an uninitialised dist
    tensor, paddle's way of holding an empty shard, must correspond to an empty slice)."""
    expected = expected_local(gl, dtype, mesh, spec, rank, source)
    if expected is None:
        return
    if not isinstance(t, np.ndarray) and t.is_dist() and not t._is_initialized():
        assert expected.size == 0, f"{what}: paddle holds nothing, the oracle expects {expected.shape}"
        return
    assert_same(held(t), expected, what)


# ------------------------------------------------------------------------------ running
def rank() -> int:
    return dist.get_rank()


def run_cases(cases, argv=None) -> None:
    """Run ``cases`` (name -> function) in order; ``argv`` may name a subset (default: all).
    Every script's last act: once every case passed, the rank ends without the interpreter's
    teardown (:func:`end_without_teardown`), where paddle now and then kills a rank that has
    passed (in one CI run, rank 0, the store's host, of aoa.py and of paddle_flow.py, both by
    SIGABRT seconds after their last PASS)."""
    argv = list(sys.argv[2:] if argv is None else argv)
    names = [n for n in cases if not argv or n in argv]
    unknown = [n for n in argv if n not in cases]
    r = rank()
    if unknown:
        print(f"FAIL unknown-cases rank={r}: {unknown}", flush=True)
        os._exit(1)
    for name in names:
        try:
            cases[name]()
        except BaseException:  # noqa: BLE001 - report and stop this rank at once
            print(f"FAIL {name} rank={r}\n{traceback.format_exc()}", flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if dist.is_initialized():  # a single process run without launch has no group
            dist.barrier()
        print(f"PASS {name} rank={r}", flush=True)
    end_without_teardown()


def end_without_teardown() -> None:
    """End this rank once every rank got here, skipping the interpreter's teardown. Once in
    five to ten runs a rank of a job with paddle's sharding stages (and a PaddleFormers model)
    was killed by SIGABRT (exit -6, no message) a few seconds after its last PASS, in paddle's
    builtin mode too: paddle's teardown, not a checkpoint (reproduced at 564b143 and after).
    Once in CI (b83dd73), a rank of safetensors_load.py, which runs paddle's own load with its
    resharding communication, was killed by SIGSEGV after its last PASS (not reproduced in 28
    runs since; launches now enable faulthandler, so the next one leaves its stacks). And
    once (361616f) rank 0 of shard_layer_keys.py (a PaddleFormers model) by SIGABRT, 1.3 s after its
    last PASS, no stack printed: the same teardown."""
    if dist.is_initialized():
        dist.barrier()
    _save_coverage()  # what the interpreter's exit would have written (the fake-GPU pass)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _save_coverage() -> None:
    try:
        import coverage
    except ImportError:
        return
    current = coverage.Coverage.current()
    if current is not None:
        current.stop()
        current.save()


def init(argv=None) -> str:
    """Start the process group; returns the scratch directory given as the first argument."""
    dist.init_parallel_env()
    root = (sys.argv if argv is None else argv)[1]
    os.makedirs(root, exist_ok=True)
    return root


# ------------------------------------------------------------------------------ state dicts
class Leaf:
    """A tensor of a test state dict: where it sits, its global shape, dtype and layout.
    ``kind`` is "paddle" (dist or plain paddle tensor) or "numpy" (a numpy array leaf)."""

    def __init__(self, path, shape, dtype, mesh=None, spec=None, kind="paddle", index=0):
        self.path, self.shape, self.dtype = tuple(path), tuple(shape), dtype
        self.mesh, self.spec, self.kind, self.index = mesh, spec, kind, index

    @property
    def key(self) -> str:
        return ".".join(str(p) for p in self.path)

    def glob(self, variant: int) -> np.ndarray:
        return global_array(self.shape, self.dtype, 2 * self.index + variant)

    def tensor(self, variant: int, target: bool = False):
        gl = self.glob(variant)
        fill = sentinel(self.dtype) if target else None
        if self.kind == "numpy":
            return gl.copy() if fill is None else np.full(gl.shape, fill, dtype=gl.dtype)
        return make(gl, self.dtype, self.mesh, self.spec, fill)

    def check(self, value, variant: int, r: int, what: str = "", source: bool = False) -> None:
        check_tensor(value, self.glob(variant), self.dtype, self.mesh, self.spec, r, what or self.key, source)

    def boxes(self, nranks: int) -> set:
        """Distinct non-empty (offsets, shape) the ranks hold: what the checkpoint must list."""
        out = set()
        for r in range(nranks):
            if self.spec is None:
                sl = tuple(slice(0, n) for n in self.shape)
            else:
                coord = self.mesh.coord(r)
                if coord is None:
                    continue
                sl = local_slices(self.shape, self.mesh.shape, coord, self.spec)
            shape = tuple(s.stop - s.start for s in sl)
            if math.prod(shape) > 0:
                out.add((tuple(s.start for s in sl), shape))
        return out


def sentinel(dtype: str):
    """What load targets start as, so a value left unloaded is caught."""
    if dtype == "bool":
        return False
    return 77 if dtype.startswith("uint") else -7


def put(root, path, value) -> None:
    """Set ``root[path]``, creating dicts (str keys) and lists (int keys) on the way."""
    node = root
    for p, nxt in zip(path[:-1], path[1:]):
        fresh = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            while len(node) <= p:
                node.append(None)
            if node[p] is None:
                node[p] = fresh
            node = node[p]
        else:
            node = node.setdefault(p, fresh)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def get(root, path):
    for p in path:
        root = root[p]
    return root


def build(leaves, variant: int, values: dict | None = None, target: bool = False) -> dict:
    sd: dict = {}
    for leaf in leaves:
        put(sd, leaf.path, leaf.tensor(variant, target))
    for k, v in (values or {}).items():
        sd[k] = v
    return sd


def check_state(sd, leaves, variant: int, r: int, source: bool = False) -> None:
    """Every leaf of ``sd`` holds the oracle's values (``source``: as made for saving)."""
    for leaf in leaves:
        leaf.check(get(sd, leaf.path), variant, r, source=source)


def check_pieces(meta, leaves, nranks: int) -> None:
    """The checkpoint lists, for every tensor, its dtype, global shape and each distinct
    non-empty piece the ranks held exactly once (replicated pieces are deduplicated)."""
    assert set(meta.tensors) == {leaf.key for leaf in leaves}, (
        sorted(set(meta.tensors) ^ {leaf.key for leaf in leaves})
    )
    for leaf in leaves:
        entry = meta.tensors[leaf.key]
        assert entry.dtype == leaf.dtype, (leaf.key, entry.dtype, leaf.dtype)
        assert tuple(entry.shape) == leaf.shape, (leaf.key, entry.shape, leaf.shape)
        p = entry.pieces
        saved = [(tuple(int(x) for x in o), tuple(int(x) for x in s)) for o, s in zip(p.offsets, p.shapes)]
        assert len(saved) == len(set(saved)), f"{leaf.key}: a piece is saved twice: {saved}"
        assert set(saved) == leaf.boxes(nranks), (leaf.key, sorted(saved), sorted(leaf.boxes(nranks)))


def tier_leaves(nranks: int) -> list:
    """The state of the node-local tier's tests: rows, columns and a replicated tensor over
    every rank, a bfloat16 one among them."""
    mesh = Mesh(list(range(nranks)))
    return [
        Leaf(("model", "w"), (8, 6), "float32", mesh, (("S", 0),), index=0),
        Leaf(("model", "b"), (6, 4), "bfloat16", mesh, (("S", 1),), index=1),
        Leaf(("model", "r"), (5,), "int64", mesh, ("R",), index=2),
        Leaf(("opt", "m"), (8, 6), "float32", mesh, (("S", 0),), index=3),
    ]


def restore_reported(manager, leaves, r: int):
    """``manager.restore`` into a target state dict of ``leaves``; prints this rank's
    ``last_restore`` as one "RESTORE {json}" line (the tier tests read it from the logs).
    Returns (the step restored, the report, the state dict)."""
    sd = build(leaves, 0, {"step": -1}, target=True)
    got = manager.restore(sd)
    report = manager.last_restore
    print("RESTORE " + json.dumps({"rank": r, "step": report.step, "tier": report.tier, "bytes": report.bytes,
                                   "refused": [list(x) for x in report.refused]}), flush=True)
    return got, report, sd


# name, global shape, dtype; the same values (the index picks them) in every layout
MIXED = [
    ("a", (7, 6), "float32"),
    ("b", (6, 7), "bfloat16"),
    ("c", (9, 4), "int64"),
    ("d", (3, 10), "bool"),
    ("e", (4, 3, 3), "float64"),
    ("f", (1, 6), "float16"),    # one row: over 2 ranks, rank 1 holds an empty shard
    ("g", (10,), "int32"),
    ("h", (), "float32"),
]


def mixed_layout(mesh=None, spec=None, kind="paddle"):
    """Every tensor laid out by ``spec`` on ``mesh``; where the spec does not fit a tensor
    (a dim it lacks, a split paddle refuses, Partial on bool) the tensor is replicated instead. kind="numpy":
    numpy array leaves (bfloat16 has no numpy type: left out, so its load is skipped)."""
    out = []
    for i, (name, shape, dtype) in enumerate(MIXED):
        if kind == "numpy" and dtype == BF16:
            continue
        sp = spec
        partial_bool = dtype == "bool" and spec is not None and any(p[0] == "P" for p in spec)
        if mesh is not None and (partial_bool or not paddle_accepts(shape, mesh.shape, spec)):
            sp = ("R",) * len(mesh.shape)
        out.append(Leaf(("t", name), shape, dtype, mesh if sp else None, sp, kind, index=i))
    return out


# ------------------------------------------------------------------------------ unchanged
def _local_copy(t):
    """(dtype, shape, this rank's local bytes) of a tensor; bytes None for paddle's
    uninitialised (empty) dist shard."""
    if isinstance(t, np.ndarray):
        return str(t.dtype), t.shape, t.copy()
    if t.is_dist() and not t._is_initialized():
        return str(t.dtype), tuple(t.shape), None
    return str(t.dtype), tuple(t.shape), held(t).copy()


def snapshot(node):
    """A deep record of a state dict: every container and tensor by identity, every tensor's
    local value copied, every plain value deep-copied (compare with :func:`assert_unchanged`)."""
    if isinstance(node, dict):
        return ("dict", node, {k: snapshot(v) for k, v in node.items()})
    if isinstance(node, (list, tuple)):
        return (type(node).__name__, node, [snapshot(v) for v in node])
    if isinstance(node, (np.ndarray, paddle.Tensor)):
        return ("tensor", node, _local_copy(node))
    return ("value", type(node), copy.deepcopy(node))


def assert_unchanged(node, snap, where: str = "state_dict") -> None:
    """``node`` is exactly as :func:`snapshot` recorded it: the same containers with the same
    keys, the same tensor objects with the same dtype, shape and local bytes, equal plain
    values of the same types."""
    kind = snap[0]
    if kind == "value":
        assert type(node) is snap[1] and node == snap[2], f"{where}: {node!r} was {snap[2]!r}"
        return
    assert node is snap[1], f"{where}: the {kind} object was replaced by {type(node).__name__}"
    if kind == "tensor":
        dtype, shape, data = _local_copy(node)
        assert (dtype, shape) == snap[2][:2], f"{where}: {dtype} {shape} was {snap[2][:2]}"
        if data is None or snap[2][2] is None:
            assert data is None and snap[2][2] is None, f"{where}: initialised state changed"
        else:
            assert_same(data, snap[2][2], where)
    elif kind == "dict":
        assert list(node) == list(snap[2]), f"{where}: keys {list(node)} were {list(snap[2])}"
        for k, v in node.items():
            assert_unchanged(v, snap[2][k], f"{where}.{k}")
    else:
        assert len(node) == len(snap[2]), f"{where}: length {len(node)} was {len(snap[2])}"
        for i, v in enumerate(node):
            assert_unchanged(v, snap[2][i], f"{where}[{i}]")
