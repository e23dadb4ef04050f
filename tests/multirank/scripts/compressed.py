"""Optimizer moments saved quantized by paddle ranks and loaded into other layouts and another
rank count, every value compared bit for bit with the reference quantizer of the unit tests
(tests/unit/helpers.py, written from docs/format.md): each saved piece dequantized on its own.

Master weights derived on load ride along: two float32 master weights saved as "derived", one
keyed as paddle's optimizer keys it (``opt.master_weights.<param.name>``, found by the
parameter's name), one as flex checkpoints do (``opt.q.w_0``, found by its key), each sharded on
the other axis than its bfloat16 parameter; a load gives each its parameter's values as
float32, on any layout.

Usage: compressed.py WORK PHASE
  save2 (2 ranks): float32 moment1 Shard(0) (37 x 300: rows 19 | 18) saved int8, bfloat16
        moment2 Shard(1) (33 x 70: columns 35 | 35) saved int4, a float32 weight Shard(1) saved
        plain, the master weights derived; then loaded on the same ranks with the shards swapped.
  load1 (1 rank): the same checkpoint into whole tensors (a rank count change).
"""
import sys

import numpy as np

import common as c
import paddle_dcp
from tests.unit.helpers import dequantized, from_float32, to_float32

WORK, PHASE = c.init(), sys.argv[2]
R = c.rank()
POLICY = {"moment1": "int8", "moment2": "int4", paddle_dcp.MASTER_WEIGHTS: "derived"}
# key -> (shape, dtype, the save's Shard dim, encoding or None)
TENSORS = {
    "opt.w_moment1_0": ((37, 300), "float32", 0, "int8"),
    "opt.w_moment2_0": ((33, 70), "bfloat16", 1, "int4"),
    "model.w": ((37, 300), "float32", 1, None),
    "model.p": ((37, 300), c.BF16, 0, None),
    "opt.master_weights.linear_9.w_0": ((37, 300), "float32", 1, "derived"),
    "model.q": ((33, 70), c.BF16, 1, None),
    "opt.q.w_0": ((33, 70), "float32", 0, "derived"),
}
NAMES = {"model.p": "linear_9.w_0"}  # paddle's name of a parameter (the others keep theirs)
SOURCES = {"opt.master_weights.linear_9.w_0": "model.p", "opt.q.w_0": "model.q"}


def values(key: str) -> np.ndarray:
    """The global tensor (float32; bfloat16 ones exactly representable), from a seed."""
    shape, dtype, _, _ = TENSORS[key]
    rng = np.random.default_rng(len(key))
    v = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 1, size=(shape[0], 1))).astype(np.float32)
    return (v.view(np.uint32) & 0xFFFF0000).view(np.float32) if dtype == c.BF16 else v


def loaded(key: str) -> np.ndarray:
    """The global tensor a load gives (float32 values): each piece the 2-rank save wrote
    (rows or columns cut in two, as paddle cuts them) dequantized on its own."""
    shape, dtype, dim, encoding = TENSORS[key]
    gl = values(key)
    if encoding == "derived":  # the parameter's values (bfloat16-exact), as float32
        return values(SOURCES[key])
    if encoding is None:
        return gl
    out = np.empty_like(gl)
    for i in range(2):
        lo, hi = c.chunk(shape[dim], 2, i)
        box = (slice(lo, hi), slice(None)) if dim == 0 else (slice(None), slice(lo, hi))
        piece = to_float32(c.storage(gl[box], dtype), dtype)
        out[box] = to_float32(from_float32(dequantized(piece, encoding), dtype), dtype)
    return out


def state(mesh, spec_of, target: bool) -> dict:
    sd: dict = {}
    for key, (_, dtype, dim, _) in TENSORS.items():
        t = c.make(values(key), dtype, mesh, spec_of(dim), fill=-7.0 if target else None)
        if key in NAMES:
            t.name = NAMES[key]
        c.put(sd, key.split(".", 2 if key.startswith("opt.master_weights.") else -1), t)
    return sd


def check(sd, mesh, spec_of) -> None:
    for key, (_, dtype, dim, _) in TENSORS.items():
        path = key.split(".", 2 if key.startswith("opt.master_weights.") else -1)
        c.check_tensor(c.get(sd, path), loaded(key), dtype, mesh, spec_of(dim), R, key)


def save2() -> None:
    mesh = c.Mesh([0, 1])
    paddle_dcp.save_state_dict(state(mesh, lambda d: (("S", d),), False), WORK, compress=POLICY)
    meta = paddle_dcp.read_metadata(WORK)
    assert {k: e.encoding for k, e in meta.tensors.items()} == {k: t[3] for k, t in TENSORS.items()}
    assert {k: e.source for k, e in meta.tensors.items() if e.derived} == SOURCES


def swapped2() -> None:
    mesh = c.Mesh([0, 1])
    spec_of = lambda d: (("S", 1 - d),)  # noqa: E731
    sd = state(mesh, spec_of, True)
    paddle_dcp.load_state_dict(sd, WORK)
    check(sd, mesh, spec_of)


def whole1() -> None:
    sd = state(None, lambda d: None, True)
    paddle_dcp.load_state_dict(sd, WORK)
    check(sd, None, lambda d: None)


CASES = {"save2": {"save2": save2, "swapped2": swapped2}, "load1": {"whole1": whole1}}[PHASE]
c.run_cases(CASES, [])
