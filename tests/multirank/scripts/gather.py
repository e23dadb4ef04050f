"""save_gathered: a sharded state dict gathered to one rank, one safetensors file.

Usage: gather.py DIR {two|four|single} [case ...]
  two:    2 ranks, a 1-D mesh: every safetensors dtype, Shard(0) / Shard(1) / Replicate /
          Partial, uneven shapes, an empty shard, scalars, numpy leaves, nested plain values;
          state_type "opt" (keys split across ranks); errors; the memory bound.
  four:   4 ranks: a [2, 2] mesh and a 1-D mesh of 4, gathered to rank 3.
  single: one process without launch: every file the jobs wrote, loaded with
          ``paddle.load(path, safetensors=True)`` and with ``paddle_dcp.load_state_dict``.

Oracle: common's position-valued global arrays; each file is checked tensor by tensor against
them, bit for bit (bfloat16 as its 16-bit patterns).
"""
import ctypes
import gc
import hashlib
import math
import os
import sys
import threading
import time

import numpy as np
import paddle
import paddle.distributed as dist

import common as c
import paddle_dcp

MODE = sys.argv[2]
if MODE == "single":
    ROOT = sys.argv[1]
else:
    ROOT = c.init()
R = c.rank()
ST_DTYPES = ["float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool", "float16", "bfloat16"]


def leaves_two():
    mesh = c.Mesh([0, 1])
    layouts = {
        "s0": ((7, 5), (("S", 0),)),          # 4 + 3 rows
        "s1": ((7, 5), (("S", 1),)),          # 3 + 2 columns
        "r": ((7, 5), ("R",)),
        "s0_vec": ((3,), (("S", 0),)),        # 2 + 1
        "s0_one_row": ((1, 6), (("S", 0),)),  # rank 1 holds an empty shard
        "s2_3d": ((4, 3, 3), (("S", 2),)),
        "plain": ((2, 3), None),
    }
    out = []
    for dtype in ST_DTYPES:
        for name, (shape, spec) in layouts.items():
            out.append(c.Leaf(("model", dtype, name), shape, dtype, mesh if spec else None, spec))
    out += [
        c.Leaf(("partial", "sum"), (5, 4), "float32", mesh, (("P", "sum"),)),
        c.Leaf(("partial", "max_i64"), (3, 4), "int64", mesh, (("P", "max"),)),
        c.Leaf(("scalar",), (), "float32"),
        c.Leaf(("scalar_dist",), (), "int64", mesh, ("R",)),
        c.Leaf(("bufs", 0), (3, 2), "float32"),
        c.Leaf(("bufs", 1), (5, 2), "int32", mesh, (("S", 0),)),
        c.Leaf(("np", "arr"), (4, 3), "float64", kind="numpy"),
        c.Leaf(("np", "flags"), (5,), "bool", kind="numpy"),
        c.Leaf(("empty",), (0, 3), "float32"),
    ]
    for i, leaf in enumerate(out):
        leaf.index = i
    return out


def leaves_four():
    m22 = c.Mesh([[0, 1], [2, 3]], ["a", "b"])
    m4 = c.Mesh([0, 1, 2, 3])
    s0, s1 = ("S", 0), ("S", 1)
    cases = [
        ("s0_s1", (9, 7), m22, (s0, s1)),
        ("r_s1", (6, 5), m22, ("R", s1)),
        ("s1_s0", (5, 7), m22, (s1, s0)),
        ("r_r", (3, 4), m22, ("R", "R")),
        ("m4_s0_7", (7, 3), m4, (s0,)),     # 2 2 2 1
        ("m4_s1_10", (3, 10), m4, (s1,)),
        ("plain", (3, 3), None, None),
    ]
    out = []
    for dtype in ["float32", "bfloat16", "int64", "bool"]:
        for name, shape, mesh, spec in cases:
            out.append(c.Leaf(("model", dtype, name), shape, dtype, mesh, spec))
    for i, leaf in enumerate(out):
        leaf.index = i
    return out


VALUES = {"step": 7, "name": "run", "sched": {"last_epoch": 3, "last_lr": 0.5}, "flags": [True, None, 1.5],
          "tup": (1, "x"), "nan": math.nan}
BLANK = {"step": 0, "name": "", "sched": {"last_epoch": 0, "last_lr": 0.0}, "flags": [False, 0, 0.0],
         "tup": (0, ""), "nan": 0.0}
FILES = {  # file -> (leaves, gather_to, max_grouped_size)
    "two_tiny.safetensors": ("two", 0, 256),
    "two_default.safetensors": ("two", 1, "3G"),
    "two_mid.safetensors": ("two", 0, "1K"),
    "four_tiny.safetensors": ("four", 3, "200"),
    "four_default.safetensors": ("four", 0, "3G"),
}


def leaves_of(name):
    return leaves_two() if name == "two" else leaves_four()


def check_values(sd):
    for k in ("step", "name", "sched", "flags", "tup"):
        assert sd[k] == VALUES[k] and type(sd[k]) is type(VALUES[k]), (k, sd[k], VALUES[k])
    assert math.isnan(sd["nan"]), sd["nan"]


def check_file(path, leaves):
    """paddle.load(path, safetensors=True): a flat dict of CPU tensors, every value the oracle's
    (tensors without elements are in the file's metadata only: safetensors' paddle backend
    cannot load them)."""
    loaded = paddle.load(path, safetensors=True)
    assert isinstance(loaded, dict), type(loaded)
    leaves = [leaf for leaf in leaves if math.prod(leaf.shape) > 0]
    assert sorted(loaded) == sorted(leaf.key for leaf in leaves), sorted(set(loaded) ^ {leaf.key for leaf in leaves})
    for leaf in leaves:
        t = loaded[leaf.key]
        assert isinstance(t, paddle.Tensor) and not t.is_dist(), (leaf.key, type(t))
        assert str(t.dtype).replace("paddle.", "") == leaf.dtype, (leaf.key, t.dtype, leaf.dtype)
        c.assert_same(t.numpy(), c.storage(leaf.glob(0), leaf.dtype), f"paddle.load {leaf.key}")


def plain_leaves(leaves):
    return [c.Leaf(leaf.path, leaf.shape, leaf.dtype, kind=leaf.kind, index=leaf.index) for leaf in leaves]


def load_plain(path, leaves):
    """paddle_dcp.load_state_dict(state_dict, file) into plain tensors and numpy arrays."""
    plain = plain_leaves(leaves)
    sd = c.build(plain, 0, dict(BLANK), target=True)
    paddle_dcp.load_state_dict(sd, path)
    c.check_state(sd, plain, 0, R)
    check_values(sd)


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------ the jobs' cases
def save_files(which):
    def run():
        for name, (kind, to, size) in FILES.items():
            if kind != which:
                continue
            leaves = leaves_of(kind)
            path = os.path.join(ROOT, name)
            sd = c.build(leaves, 0, dict(VALUES))
            paddle_dcp.save_gathered(sd, path, gather_to=to, max_grouped_size=size)
            dist.barrier()
            assert os.path.isfile(path), path
            assert not [f for f in os.listdir(ROOT) if ".tmp." in f], os.listdir(ROOT)
            c.check_state(sd, leaves, 0, R, source=True)  # the state dict is left as it was
            check_values(sd)
    return run


def files_identical(which):
    """The group limit and the gathering rank change nothing in the file."""
    def run():
        names = [n for n, (kind, _, _) in FILES.items() if kind == which]
        digests = {n: sha(os.path.join(ROOT, n)) for n in names}
        assert len(set(digests.values())) == 1, digests
    return run


def check_in_job(which):
    """Every rank reads the file (paddle.load) and loads it into plain tensors."""
    def run():
        leaves = leaves_of(which)
        for name, (kind, _, _) in FILES.items():
            if kind == which:
                check_file(os.path.join(ROOT, name), leaves)
                load_plain(os.path.join(ROOT, name), leaves)
    return run


def load_into_dist_other_layout():
    """Each rank of the job reads the boxes it holds of another layout from the file."""
    mesh = c.Mesh([1, 0])
    out = []
    for leaf in leaves_two():
        spec = (("S", 1),) if len(leaf.shape) >= 2 and c.paddle_accepts(leaf.shape, mesh.shape, (("S", 1),)) else ("R",)
        if leaf.kind == "numpy":
            out.append(leaf)
        else:
            out.append(c.Leaf(leaf.path, leaf.shape, leaf.dtype, mesh, spec, index=leaf.index))
    sd = c.build(out, 0, dict(BLANK), target=True)
    paddle_dcp.load_state_dict(sd, os.path.join(ROOT, "two_tiny.safetensors"))
    c.check_state(sd, out, 0, R)
    check_values(sd)


def opt_union():
    """state_type="opt": ranks hold different keys (an optimizer state split by key); the file
    holds their union, plain values from the gathering rank."""
    mesh = c.Mesh([0, 1])
    shared = c.Leaf(("shared",), (6, 4), "float32", mesh, (("S", 0),), index=1)
    own = {r: c.Leaf(("acc", f"p{r}_moment1"), (3, 2), "float32", index=10 + r) for r in range(2)}
    sd = {"shared": shared.tensor(0), "acc": {f"p{R}_moment1": own[R].tensor(0)},
          "LR_Scheduler": {"last_epoch": 10 + R}, f"only_{R}": R}
    path = os.path.join(ROOT, "opt.safetensors")
    paddle_dcp.save_gathered(sd, path, gather_to=1, state_type="opt", max_grouped_size="64")
    dist.barrier()
    loaded = paddle.load(path, safetensors=True)
    assert sorted(loaded) == ["acc.p0_moment1", "acc.p1_moment1", "shared"], sorted(loaded)
    for leaf in [shared] + list(own.values()):
        c.assert_same(loaded[leaf.key].numpy(), leaf.glob(0), leaf.key)
    target = {"shared": paddle.zeros([6, 4]), "acc": {f"p{r}_moment1": paddle.zeros([3, 2]) for r in range(2)},
              "LR_Scheduler": {"last_epoch": -1}, "only_0": None, "only_1": None}
    paddle_dcp.load_state_dict(target, path)
    assert target["LR_Scheduler"] == {"last_epoch": 11}, target["LR_Scheduler"]  # rank 1's, it gathered
    assert target["only_0"] == 0 and target["only_1"] == 1, target
    for leaf in list(own.values()):
        c.assert_same(target["acc"][leaf.path[1]].numpy(), leaf.glob(0), leaf.key)


def params_needs_same_keys():
    """state_type="params" with keys that differ between ranks: every rank raises the same
    error, which points to state_type="opt"; no file is left behind."""
    sd = {"w": paddle.ones([2]), f"only_{R}": paddle.ones([2])}
    path = os.path.join(ROOT, "bad", "params.safetensors")
    try:
        paddle_dcp.save_gathered(sd, path)
    except paddle_dcp.CollectiveError as exc:
        assert list(exc.failures) == [0], exc.failures
        assert "MismatchError" in exc.failures[0] and "state_type='opt'" in exc.failures[0], exc.failures
    else:
        raise AssertionError("no error")
    assert not os.path.exists(path)


def complex_refused():
    sd = {"z": paddle.to_tensor(np.ones(3, np.complex64))}
    path = os.path.join(ROOT, "bad", "complex.safetensors")
    try:
        paddle_dcp.save_gathered(sd, path, gather_to=1)
    except paddle_dcp.CollectiveError as exc:
        assert "FormatError" in exc.failures[1] and "complex64" in exc.failures[1], exc.failures
    else:
        raise AssertionError("no error")
    assert not os.path.exists(path)


def bad_arguments():
    for kwargs, text in [({"max_grouped_size": "3X"}, "max_grouped_size"), ({"max_grouped_size": 0}, "positive"),
                         ({"state_type": "model"}, "state_type"), ({"gather_to": [0]}, "gather_to")]:
        try:
            paddle_dcp.save_gathered({"w": paddle.ones([2])}, os.path.join(ROOT, "bad", "x"), **kwargs)
        except paddle_dcp.DcpError as exc:
            assert text in str(exc), (kwargs, exc)
        else:
            raise AssertionError(f"no error for {kwargs}")


# ------------------------------------------------------------------------------ memory
MEM_ROWS, MEM_COLS, MEM_TENSORS = 1024, 4096, 16  # 16 tensors of 16 MiB: 256 MiB of float32
MIB = 1 << 20


def mem_value(i, box):
    """Tensor i's elements in ``box`` (rows, cols): position + i, exact in float32."""
    (r0, c0), (nr, nc) = box
    rows = np.arange(r0, r0 + nr, dtype=np.int64)[:, None] * MEM_COLS
    return (rows + np.arange(c0, c0 + nc, dtype=np.int64)[None, :] + i).astype(np.float32)


def mem_state():
    """Built local piece by local piece: no global array ever exists in a rank's memory."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    sd = {}
    for i in range(MEM_TENSORS):
        spec = [dist.Shard(0)] if i % 3 == 0 else [dist.Shard(1)] if i % 3 == 1 else [dist.Replicate()]
        if i % 3 == 0:
            box = ((R * MEM_ROWS // 2, 0), (MEM_ROWS // 2, MEM_COLS))
        elif i % 3 == 1:
            box = ((0, R * MEM_COLS // 2), (MEM_ROWS, MEM_COLS // 2))
        else:
            box = ((0, 0), (MEM_ROWS, MEM_COLS))
        local = paddle.to_tensor(mem_value(i, box))
        sd[f"layer{i}.weight"] = paddle.Tensor(local, dims=[MEM_ROWS, MEM_COLS], process_mesh=mesh, placements=spec)
    return sd


def rss():
    import psutil

    return psutil.Process().memory_info().rss


class PeakRss:
    """The peak resident set size while the block runs, sampled every millisecond by a thread
    (and, where the kernel allows resetting it, the kernel's own peak, VmHWM)."""

    def __enter__(self):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.hwm = self._reset_hwm()
        self.base = rss()
        self.peak = self.base
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    @staticmethod
    def _reset_hwm():
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _vm_hwm():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss())
        if self.hwm:
            self.peak = max(self.peak, self._vm_hwm())
        self.growth = self.peak - self.base
        return False


def memory_bound():
    """The gathering rank's peak RSS growth is bounded by the group limit, not by the size of
    the checkpoint; with a limit above the checkpoint's size it is at least the one group."""
    sd = mem_state()
    total = MEM_TENSORS * MEM_ROWS * MEM_COLS * 4
    results = {}
    for label, limit in [("16M", 16 * MIB), ("1G", 1 << 30)]:
        path = os.path.join(ROOT, f"mem_{label}.safetensors")
        with PeakRss() as peak:
            paddle_dcp.save_gathered(sd, path, max_grouped_size=limit)
        results[label] = peak.growth
        dist.barrier()
        if R == 0:
            print(f"MEMORY rank=0 limit={label} checkpoint={total // MIB}MiB peak_rss_growth="
                  f"{peak.growth / MIB:.1f}MiB (vmhwm={'yes' if peak.hwm else 'no'})", flush=True)
    # on the fake GPU "device" tensors (paddle's own temporaries included) live in host memory
    # too, so the resident set is no measure of host memory there: its bounds are checked by
    # the fake's own accounting (scripts gpu_rules.py); the file's contents are checked below
    if R == 0 and os.environ.get("PADDLE_DCP_FAKE_GPU") != "1":
        assert results["16M"] < 3 * 16 * MIB + 16 * MIB, results  # one group + staging + slack
        assert results["1G"] >= 0.95 * total, results              # the one group is the whole file
    if R == 0:
        from safetensors import safe_open

        with safe_open(os.path.join(ROOT, "mem_16M.safetensors"), framework="numpy") as f:
            assert sorted(f.keys()) == sorted(sd), sorted(f.keys())
            for i in range(MEM_TENSORS):
                got = f.get_tensor(f"layer{i}.weight")
                assert np.array_equal(got, mem_value(i, ((0, 0), (MEM_ROWS, MEM_COLS)))), i
        assert sha(os.path.join(ROOT, "mem_16M.safetensors")) == sha(os.path.join(ROOT, "mem_1G.safetensors"))
    dist.barrier()
    for label in ("16M", "1G"):
        if R == 0:
            os.unlink(os.path.join(ROOT, f"mem_{label}.safetensors"))


# ------------------------------------------------------------------------------ one process
def single_files():
    """Every file, in one process without launch: paddle.load(path, safetensors=True), and
    paddle_dcp.load_state_dict into plain tensors and numpy arrays."""
    for name, (kind, _, _) in FILES.items():
        path = os.path.join(ROOT, name)
        leaves = leaves_of(kind)
        check_file(path, leaves)
        load_plain(path, leaves)


def single_header_checks():
    """The header's rules, on damaged copies of a file: every damage is a FormatError naming
    the file, raised before the state dict changes."""
    src = os.path.join(ROOT, "two_tiny.safetensors")
    data = open(src, "rb").read()
    n = int.from_bytes(data[:8], "little")
    leaves = plain_leaves(leaves_two())
    cases = {
        "truncated": data[:-1],
        "header_too_long": (n + 10**9).to_bytes(8, "little") + data[8:],
        "not_json": data[:8] + b"x" + data[9 : 8 + n] + data[8 + n :],
        "unknown_dtype": data[:8] + data[8 : 8 + n].replace(b'"F32"', b'"F31"', 1) + data[8 + n :],
        "shifted_offsets": data[:8] + data[8 : 8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[1,', 1) + data[8 + n :],
    }
    for label, blob in cases.items():
        bad = os.path.join(ROOT, f"bad_{label}.safetensors")
        with open(bad, "wb") as f:
            f.write(blob)
        sd = c.build(leaves, 0, dict(BLANK), target=True)
        snap = c.snapshot(sd)
        try:
            paddle_dcp.load_state_dict(sd, bad)
        except paddle_dcp.FormatError as exc:
            assert bad in str(exc), (label, exc)
        else:
            raise AssertionError(f"{label}: no error")
        c.assert_unchanged(sd, snap)


if MODE == "two":
    CASES = {
        "save_files": save_files("two"),
        "files_identical": files_identical("two"),
        "check_in_job": check_in_job("two"),
        "load_into_dist_other_layout": load_into_dist_other_layout,
        "opt_union": opt_union,
        "params_needs_same_keys": params_needs_same_keys,
        "complex_refused": complex_refused,
        "bad_arguments": bad_arguments,
        "memory_bound": memory_bound,
    }
elif MODE == "four":
    CASES = {
        "save_files": save_files("four"),
        "files_identical": files_identical("four"),
        "check_in_job": check_in_job("four"),
    }
else:
    CASES = {"single_files": single_files, "single_header_checks": single_header_checks}

if __name__ == "__main__":
    c.run_cases(CASES, sys.argv[3:])
