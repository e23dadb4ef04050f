"""Resume anywhere: checkpoints saved on 2 ranks, loaded on 4, saved again, loaded on 2 and in
one process run without the launcher; every dtype resharded; a trained model with its AdamW
state (master weights, moments, beta powers, LR scheduler) and plain values; master-weight
key spellings; warnings naming keys; offload.

Usage: resume.py DIR SCENARIO [case ...]; the scenarios run in this order on one DIR:
  first2   2 ranks (launch): dtype reshards of a Shard(0) save, the trained state saved
           (layout A) and loaded on another layout (B), key spellings, warnings, offload;
           saves the checkpoints "two", "dt_s0", "train2".
  then4    4 ranks (launch): "two", "dt_s0", "train2" loaded (2 -> 4); saves "dt_2d" on a
           [2, 2] mesh and loads it into a 1-D mesh of 2 ranks, sub-meshes and other 2-D
           layouts; saves "four" and "train4" (the state loaded from "train2", saved by 4).
  then2    2 ranks (launch): "four", "dt_2d", "train4" loaded (4 -> 2); saves "four_two".
  single   1 process, no launch: "four", "two", "four_two", "dt_s0", "dt_2d", "train2",
           "train4" loaded into plain tensors, numpy arrays and dist tensors on a 1-rank mesh.

Oracles: tensors from common's position-valued global arrays, each rank's slice derived from
the placements by common.local_slices; the trained state's global values (gathered by paddle
at save time, by the saving job) kept with numpy in DIR/<name>.npz and its plain values in
DIR/<name>.json.

Training on CPU: paddle has no CPU kernel of AdamW for float16 / bfloat16 parameters (nor
matmul, nor slicing or all-gathering them), so the model trains its float32 parameters (fc1,
fc2, sharded) and holds two frozen half-precision parameters (replicated: casting a sharded
one to float32 all-gathers it); AdamW(multi_precision=True) creates their master weights,
moments and beta powers with its own ``_create_accumulators``, and the test gives them
distinct values. Every parameter, accumulator and master weight is built inside one
``paddle.utils.unique_name.guard()``, so the names (the optimizer's keys) agree between jobs.
"""
import json
import logging
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.base.framework import EagerParamBase

import common as c
import paddle_dcp

ROOT, SCENARIO = sys.argv[1], sys.argv[2]
if SCENARIO != "single":
    dist.init_parallel_env()
os.makedirs(ROOT, exist_ok=True)
R = c.rank()
S0, S1 = ("S", 0), ("S", 1)
M2 = c.Mesh([0, 1])


def ck(name):
    return os.path.join(ROOT, name)


def case(fn, *args, **kwargs):
    return lambda: fn(*args, **kwargs)


# ------------------------------------------------------------------------------ plain loads
def save(leaves, name, values=None):
    sd = c.build(leaves, 0, {"tag": name, "epoch": 3, **(values or {})})
    c.check_state(sd, leaves, 0, R, source=True)  # the fixture holds what the oracle says
    paddle_dcp.save_state_dict(sd, ck(name))


def load(leaves, name, offload=False):
    sd = c.build(leaves, 0, {"tag": "", "epoch": 0}, target=True)
    paddle_dcp.load_state_dict(sd, ck(name), offload=offload)
    c.check_state(sd, leaves, 0, R)
    assert sd["tag"] == name and sd["epoch"] == 3, (sd["tag"], sd["epoch"])
    return sd


def load_and_save(leaves, name, new_name):
    """Load ``name`` into ``leaves`` and save what was loaded as ``new_name``."""
    sd = load(leaves, name)
    sd["tag"] = new_name
    paddle_dcp.save_state_dict(sd, ck(new_name))


# every dtype of the issue, shapes that split unevenly over 2 (7: 4 | 3, 5: 3 | 2, 3: 2 | 1)
DTYPES = ["bfloat16", "float16", "float32", "int64", "bool"]
DT_SHAPES = [(7, 5), (5, 3, 2)]


def dt_leaves(mesh=None, spec=None, kind="paddle"):
    out = []
    for i, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in DT_SHAPES):
        if kind == "numpy" and dtype == c.BF16:
            continue
        out.append(c.Leaf(("dt", dtype, f"{len(shape)}d"), shape, dtype, mesh, spec, kind, index=i))
    return out


# ------------------------------------------------------------------------------ training
class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(6, 8)  # even splits: paddle's matmul grad rejects uneven ones
        self.fc2 = paddle.nn.Linear(8, 5)
        self.half_w = self.create_parameter([5, 4], dtype="float32")  # made bfloat16 below
        self.half_g = self.create_parameter([4], dtype="float32")     # made float16 below

    def forward(self, x):
        return self.fc2(paddle.nn.functional.relu(self.fc1(x)))


HALF = {"half_w": "bfloat16", "half_g": "float16"}
# mesh ranks and the placements of the float32 parameters; half parameters are replicated
TRAIN_LAYOUTS = {
    "A": ([0, 1], {"fc1.weight": (S1,), "fc1.bias": (S0,), "fc2.weight": (S0,), "fc2.bias": ("R",)}),
    "B": ([1, 0], {"fc1.weight": (S0,), "fc1.bias": ("R",), "fc2.weight": (S1,), "fc2.bias": (S0,)}),
    "C": ([[0, 1], [2, 3]], {"fc1.weight": (S0, S1), "fc1.bias": (S0, "R"), "fc2.weight": ("R", S0),
                             "fc2.bias": ("R", "R")}),
    "S": ([0], {"fc1.weight": (S1,), "fc1.bias": (S0,), "fc2.weight": ("R",), "fc2.bias": ("R",)}),
}


def build_training(layout: str, seed: int, train_steps: int):
    """Model and sharded AdamW on ``layout``: trained ``train_steps`` steps, or (0) with
    fresh states created by ``opt.state_dict()``; half-precision states created by AdamW and
    given values from ``seed``."""
    ids, specs = TRAIN_LAYOUTS[layout]
    mesh = c.Mesh(ids)
    replicate = ["R"] * len(mesh.shape)

    def shard_fn(name, layer, pmesh):
        if name in ("fc1", "fc2"):
            for pname in ("weight", "bias"):
                spec = specs[f"{name}.{pname}"]
                setattr(layer, pname, dist.shard_tensor(getattr(layer, pname), pmesh, c.placements(spec)))
        elif name == "":
            for pname, dtype in HALF.items():
                p = getattr(layer, pname)
                pl = c.placements(replicate)
                d32 = dist.shard_tensor(p, pmesh, pl)
                local = d32._local_value().astype(dtype)
                half = paddle.Tensor(local, dims=list(p.shape), process_mesh=pmesh, placements=pl)
                setattr(layer, pname, EagerParamBase.from_tensor(half, name=p.name, trainable=False))

    with paddle.utils.unique_name.guard():
        paddle.seed(seed)
        model = dist.shard_layer(Net(), mesh.paddle, shard_fn)
        sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
        opt = dist.shard_optimizer(
            paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters(), multi_precision=True)
        )
        if train_steps:
            rng = np.random.RandomState(0)
            for _ in range(train_steps):
                x = dist.shard_tensor(paddle.to_tensor(rng.rand(4, 6).astype("float32")), mesh.paddle,
                                      c.placements(replicate))
                y = dist.shard_tensor(paddle.to_tensor(rng.rand(4, 5).astype("float32")), mesh.paddle,
                                      c.placements(replicate))
                loss = paddle.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.clear_grad()
                sched.step()
        else:
            opt.state_dict()  # creates the float32 parameters' (zero) states
        halves = [getattr(model, n) for n in HALF]
        opt._create_accumulators(paddle.static.default_main_program().global_block(), halves)
    fill_half_states(opt, [p.name for p in halves], seed)
    return model, opt, sched


def fill_half_states(opt, names, seed: int) -> None:
    """Give the half parameters' optimizer states (replicated) values of their own."""
    flat = flat_tensors({"opt": opt.state_dict()})
    mine = {k: t for k, t in flat.items() if any(f".{n}" in k for n in names)}
    assert len(mine) == 4 * len(names) + len(names), sorted(mine)  # 2 moments, 2 pows, master
    for i, (key, t) in enumerate(sorted(mine.items())):
        local = t._local_value()
        value = np.random.RandomState(seed * 100 + i).standard_normal(local.shape).astype(np.float32)
        local.set_value(value)
        c.assert_same(t._local_value().numpy(), value, f"{key} (set)")


def flat_tensors(node, prefix=""):
    """Flat key ("a.b.c", as paddle_dcp joins them) -> tensor of a nested dict."""
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_tensors(v, key + "."))
        elif isinstance(v, paddle.Tensor):
            out[key] = v
    return out


def flat_values(node, prefix=""):
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_values(v, key + "."))
        elif not isinstance(v, paddle.Tensor):
            out[key] = v
    return out


META = {"name": "x", "lrs": [0.1, 0.2], "none": None, "flag": True}
BLANK_META = {"name": "", "lrs": [0.0, 0.0], "none": 5, "flag": False}


def train_state(model, opt, saved: bool):
    return {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 3 if saved else 0,
            "meta": dict(META) if saved else {**BLANK_META, "lrs": [0.0, 0.0]}}


def spec_of(t):
    out = []
    for p in t.placements:
        if p.is_replicated():
            out.append("R")
        else:
            assert p.is_shard(), p
            out.append(("S", p.get_dim()))
    return tuple(out)


def global_value(t) -> np.ndarray:
    """The whole tensor, gathered by paddle (bfloat16 as its uint16 bits)."""
    if not t.is_dist():
        return t.numpy()
    if all(p.is_replicated() for p in t.placements):
        return t._local_value().numpy()
    whole = dist.reshard(t, t.process_mesh, [dist.Replicate()] * len(t.placements))
    return whole._local_value().numpy()


def record(state, name):
    """Keep the saved state's global values (npz) and plain values (json), from rank 0."""
    tensors = {k: global_value(t) for k, t in flat_tensors(state).items()}
    if R == 0:
        np.savez(ck(f"{name}.npz"), **tensors)
        with open(ck(f"{name}.json"), "w") as f:
            json.dump(flat_values(state), f)


def expected_local(t, gl: np.ndarray):
    """The slice of the saved global value ``gl`` this rank must hold of ``t``, by its
    placements (None: outside its mesh)."""
    if not t.is_dist():
        return gl
    mesh = np.asarray(t.process_mesh.process_ids).reshape(list(t.process_mesh.shape))
    hit = np.argwhere(mesh == R)
    if not len(hit):
        return None
    return gl[c.local_slices(gl.shape, mesh.shape, tuple(int(x) for x in hit[0]), spec_of(t))]


def local_of(t):
    if t.is_dist():
        return t._local_value().numpy() if t._is_initialized() else None
    return t.numpy()


def assert_not_loaded_yet(state, name, key_of=lambda k: k):
    """Before the load: no tensor of the fresh state already holds its saved value (so each
    comparison after it shows a value that the load put there)."""
    saved = np.load(ck(f"{name}.npz"))
    same = []
    for key, t in flat_tensors(state).items():
        expected, local = expected_local(t, saved[key_of(key)]), local_of(t)
        if expected is not None and expected.size and local is not None and local.tobytes() == expected.tobytes():
            same.append(key)
    assert not same, f"fresh tensors that already hold the saved value: {same}"


def check_train_state(state, name, key_of=lambda k: k):
    """Every tensor of ``state`` holds on this rank the slice its placements give of the saved
    global value (``key_of``: the saved key of a state key), its gathered value equals the
    saved one, and every plain value equals the saved one."""
    saved = np.load(ck(f"{name}.npz"))
    with open(ck(f"{name}.json")) as f:
        saved_values = json.load(f)
    tensors = flat_tensors(state)
    assert sorted(key_of(k) for k in tensors) == sorted(saved.files), (sorted(tensors), sorted(saved.files))
    for key, t in tensors.items():
        gl = saved[key_of(key)]
        # gathered by paddle (a collective of the tensor's mesh, on every rank in the same
        # order; paddle cannot all-gather half precision on the CPU: those are replicated)
        half = str(t.dtype) in ("paddle.bfloat16", "paddle.float16")
        if not (half and t.is_dist() and not all(p.is_replicated() for p in t.placements)):
            c.assert_same(global_value(t), gl, f"{key} (gathered)")
        expected, local = expected_local(t, gl), local_of(t)
        if expected is None:
            continue
        if local is None:  # paddle's empty shard
            assert expected.size == 0, (key, expected.shape)
            continue
        c.assert_same(local, expected, key)
    values = flat_values(state)
    assert values == saved_values, (values, saved_values)
    for k, v in saved_values.items():
        assert type(values[k]) is type(v), (k, values[k], v)


def train_save(name):
    model, opt, _ = build_training("A", seed=2024, train_steps=2)
    state = train_state(model, opt, saved=True)
    flat = flat_tensors(state)
    assert len([k for k in flat if ".master_weights." in k]) == 2, sorted(flat)
    assert state["opt"]["LR_Scheduler"]["last_epoch"] == 2, state["opt"]["LR_Scheduler"]
    record(state, name)
    paddle_dcp.save_state_dict(state, ck(name))


def train_load(layout, name, save_as=None):
    """A fresh model and optimizer on ``layout`` (other initial values) load checkpoint
    ``name``; save what was loaded as ``save_as``."""
    model, opt, sched = build_training(layout, seed=7, train_steps=0)
    state = train_state(model, opt, saved=False)
    assert_not_loaded_yet(state, name)
    paddle_dcp.load_state_dict(state, ck(name))
    check_train_state(state, name)
    print(f"rank {R}: {len(flat_tensors(state))} tensors of {name} loaded on layout {layout}", flush=True)
    # paddle takes the loaded state (the LR scheduler's from its plain values), and the loaded
    # tensors are the model's and the optimizer's own
    opt.set_state_dict(state["opt"])
    assert sched.last_epoch == 2 and sched.last_lr == 0.025, (sched.last_epoch, sched.last_lr)
    check_train_state({"model": model.state_dict(), "opt": opt.state_dict(),
                       "epoch": state["epoch"], "meta": state["meta"]}, name)
    if save_as:
        record(state, save_as)
        paddle_dcp.save_state_dict(state, ck(save_as))


def train_load_static_spelling(layout, name):
    """The optimizer's master weights under paddle's static-graph spelling
    (``opt.<param>_fp32_master_0``) load from the saved ``opt.master_weights.<param>``."""
    model, opt, _ = build_training(layout, seed=7, train_steps=0)
    state = train_state(model, opt, saved=False)
    masters = state["opt"].pop("master_weights")
    for pname, t in masters.items():
        state["opt"][f"{pname}_fp32_master_0"] = t
    saved_key = {f"opt.{pname}_fp32_master_0": f"opt.master_weights.{pname}" for pname in masters}
    assert len(saved_key) == len(HALF), saved_key
    assert_not_loaded_yet(state, name, lambda k: saved_key.get(k, k))
    paddle_dcp.load_state_dict(state, ck(name))
    check_train_state(state, name, lambda k: saved_key.get(k, k))


# ------------------------------------------------------------------------------ key spellings
class Records(logging.Handler):
    """The paddle_dcp logger's records while in a ``with`` block."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        logging.getLogger("paddle_dcp").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("paddle_dcp").removeHandler(self)
        return False

    def warnings(self):
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


def named(messages, key):
    """The warnings that name ``key`` as a key (quoted, as in a list of keys)."""
    return [m for m in messages if repr(key) in m]


MW_NAMES = ["w", "linear_0.w_0"]  # a parameter name with dots, as paddle's are


def mw_leaves(spelling: str, spec):
    out = []
    for i, pname in enumerate(MW_NAMES):
        path = ("opt", "master_weights", pname) if spelling == "dynamic" else ("opt", f"{pname}_fp32_master_0")
        out.append(c.Leaf(path, (7, 5) if i == 0 else (6, 4), "float32", M2, spec, index=i))
    out.append(c.Leaf(("opt", "m"), (7, 5), "float32", M2, spec, index=2))
    return out


def mw_save():
    save(mw_leaves("dynamic", (S0,)), "mw_dynamic")
    save(mw_leaves("static", (S1,)), "mw_static")


def mw_load(target_spelling, name):
    """Master weights saved under one spelling load into the other (mw_name_compatibility on,
    the default): values equal, no warning."""
    with Records() as rec:
        load(mw_leaves(target_spelling, ("R",)), name)
    assert not rec.warnings(), rec.warnings()


def mw_off():
    """mw_name_compatibility=False: the master weights' keys do not match, so they are left
    untouched, and warnings name them (the state dict's and the checkpoint's)."""
    leaves = mw_leaves("static", (S1,))
    sd = c.build(leaves, 0, {"tag": "", "epoch": 0}, target=True)
    before = {leaf.key: c.snapshot(c.get(sd, leaf.path)) for leaf in leaves[:2]}
    try:  # strict (the default): the unmatched master weights are an error
        paddle_dcp.load_state_dict(sd, ck("mw_dynamic"), mw_name_compatibility=False)
        raise AssertionError("a strict load with unmatched master weights returned")
    except paddle_dcp.MismatchError as exc:
        assert all(f"opt.{pname}_fp32_master_0" in str(exc) for pname in MW_NAMES), str(exc)
    with Records() as rec:
        paddle_dcp.load_state_dict(sd, ck("mw_dynamic"), mw_name_compatibility=False, strict=False)
    for leaf in leaves[:2]:
        c.assert_unchanged(c.get(sd, leaf.path), before[leaf.key], leaf.key)
    leaves[2].check(sd["opt"]["m"], 0, R)
    assert sd["tag"] == "mw_dynamic", sd["tag"]
    messages = rec.warnings()
    for pname in MW_NAMES:
        assert named(messages, f"opt.{pname}_fp32_master_0"), messages
        assert named(messages, f"opt.master_weights.{pname}"), messages
    assert not named(messages, "opt.m"), messages


def mw_off_through_paddles_call():
    """Code written for paddle, routed by patch_paddle(): paddle's contract. With
    mw_name_compatibility=False the master weights' keys do not match, and a key a static
    program adds (``learning_rate_0``) is not in the checkpoint: no error, a warning naming
    each, those targets unchanged, the rest loaded. patch_paddle(strict=True): our error."""
    leaves = mw_leaves("static", (S1,))
    sd = c.build(leaves, 0, {"tag": "", "epoch": 0}, target=True)
    sd["learning_rate_0"] = paddle.full([1], 0.25)
    before = {leaf.key: c.snapshot(c.get(sd, leaf.path)) for leaf in leaves[:2]}
    with paddle_dcp.patch_paddle():
        with Records() as rec:
            dist.load_state_dict(sd, ck("mw_dynamic"), mw_name_compatibility=False)
    for leaf in leaves[:2]:
        c.assert_unchanged(c.get(sd, leaf.path), before[leaf.key], leaf.key)
    leaves[2].check(sd["opt"]["m"], 0, R)
    assert sd["learning_rate_0"].numpy().tolist() == [0.25] and sd["tag"] == "mw_dynamic"
    messages = rec.warnings()
    for name in [f"opt.{p}_fp32_master_0" for p in MW_NAMES] + ["learning_rate_0"]:
        assert named(messages, name), (name, messages)
    with paddle_dcp.patch_paddle(strict=True):
        try:
            dist.load_state_dict(sd, ck("mw_dynamic"), mw_name_compatibility=False)
            raise AssertionError("patch_paddle(strict=True) let missing keys pass")
        except paddle_dcp.MismatchError as exc:
            assert "learning_rate_0" in str(exc), str(exc)


def warnings_name_keys():
    """With strict=False, a key of the state dict missing from the checkpoint (a tensor and a
    value) is left as it was and a warning names it; a checkpoint key absent from the state dict (a tensor and a
    value) is not loaded and a warning names it; the keys in both load without a warning."""
    saved = [c.Leaf(("model", "w"), (7, 5), "float32", M2, (S0,), index=0),
             c.Leaf(("model", "stale"), (3, 4), "int64", M2, (S1,), index=1)]
    save(saved, "keys", {"stale_value": "old"})
    kept = c.Leaf(("model", "w"), (7, 5), "float32", M2, (S1,), index=0)
    extra = c.Leaf(("model", "extra"), (4, 4), "bfloat16", M2, (S0,), index=2)
    sd = c.build([kept, extra], 0, {"tag": "", "epoch": 0, "extra_value": 9}, target=True)
    before = c.snapshot(sd["model"]["extra"])
    with Records() as rec:
        paddle_dcp.load_state_dict(sd, ck("keys"), strict=False)
    kept.check(sd["model"]["w"], 0, R)
    assert sd["epoch"] == 3 and sd["tag"] == "keys", (sd["epoch"], sd["tag"])
    c.assert_unchanged(sd["model"]["extra"], before, "model.extra")
    assert sd["extra_value"] == 9 and "stale" not in sd["model"] and "stale_value" not in sd, sd.keys()
    messages = rec.warnings()
    for key in ("model.extra", "extra_value", "model.stale", "stale_value"):
        assert named(messages, key), (key, messages)
    for key in ("model.w", "epoch", "tag"):
        assert not named(messages, key), (key, messages)
    print(f"rank {R}: warnings {messages}", flush=True)


# ------------------------------------------------------------------------------ offload
def local_tensor(t):
    return t if isinstance(t, np.ndarray) else (t._local_value() if t.is_dist() else t)


def offload(leaves, name):
    """offload=True, paddle's meaning: the state dict's own tensors are filled in place and stay
    where they are (the same objects, on the same place: on the fake GPU, the device), dist
    tensors keep their mesh and placements, and the values are the oracle's."""
    sd = c.build(leaves, 0, {"tag": "", "epoch": 0}, target=True)
    before = {}
    for leaf in leaves:
        t = c.get(sd, leaf.path)
        before[leaf.key] = (t, None if isinstance(t, np.ndarray) else str(local_tensor(t).place))
    paddle_dcp.load_state_dict(sd, ck(name), offload=True)
    c.check_state(sd, leaves, 0, R)
    for leaf in leaves:
        t = c.get(sd, leaf.path)
        tensor, place = before[leaf.key]
        assert t is tensor, f"{leaf.key}: the state dict's tensor was replaced"
        if not isinstance(t, np.ndarray):
            assert str(local_tensor(t).place) == place, (leaf.key, local_tensor(t).place, place)
        if leaf.spec is not None:
            assert t.is_dist() and spec_of(t) == tuple(leaf.spec), (leaf.key, t.placements, leaf.spec)
            assert list(t.process_mesh.process_ids) == leaf.mesh.ids.reshape(-1).tolist(), leaf.key


# ------------------------------------------------------------------------------ scenarios
layout = c.mixed_layout

if SCENARIO == "first2":
    swapped = c.Mesh([1, 0])
    CASES = {
        "dtypes_save_s0": case(save, dt_leaves(M2, (S0,)), "dt_s0"),
        "dtypes_s0_into_replicate": case(load, dt_leaves(M2, ("R",)), "dt_s0"),
        "dtypes_s0_into_s1": case(load, dt_leaves(M2, (S1,)), "dt_s0"),
        "dtypes_s0_into_swapped_s1": case(load, dt_leaves(swapped, (S1,)), "dt_s0"),
        "dtypes_s0_into_swapped_s0": case(load, dt_leaves(swapped, (S0,)), "dt_s0"),
        "save_two": case(save, layout(M2, (S0,)), "two"),
        "train_save": case(train_save, "train2"),
        "train_into_other_layout": case(train_load, "B", "train2"),
        "train_into_static_mw_spelling": case(train_load_static_spelling, "B", "train2"),
        "mw_save": mw_save,
        "mw_dynamic_into_static": case(mw_load, "static", "mw_dynamic"),
        "mw_static_into_dynamic": case(mw_load, "dynamic", "mw_static"),
        "mw_off_leaves_keys_and_warns": mw_off,
        "mw_off_through_paddles_call": mw_off_through_paddles_call,
        "warnings_name_keys": warnings_name_keys,
        "offload_dist_s1": case(offload, layout(swapped, (S1,)), "two"),
        "offload_dtypes_s1": case(offload, dt_leaves(M2, (S1,)), "dt_s0"),
        "offload_plain": case(offload, layout(), "two"),
    }
elif SCENARIO == "then4":
    m22, m4 = c.Mesh([[0, 1], [2, 3]]), c.Mesh([0, 1, 2, 3])
    CASES = {
        "two_into_2d": case(load, layout(m22, (S0, S1)), "two"),
        "two_into_1d_s1": case(load, layout(m4, (S1,)), "two"),
        "dtypes_s0_into_2d": case(load, dt_leaves(m22, (S1, S0)), "dt_s0"),
        "dtypes_save_2d": case(save, dt_leaves(m22, (S0, S1)), "dt_2d"),
        "dtypes_2d_into_1d_of_2_low": case(load, dt_leaves(c.Mesh([0, 1]), (S1,)), "dt_2d"),
        "dtypes_2d_into_1d_of_2_high": case(load, dt_leaves(c.Mesh([3, 2]), (S0,)), "dt_2d"),
        "dtypes_2d_into_submesh": case(load, dt_leaves(c.Mesh([3, 1]), (S1,)), "dt_2d"),
        "dtypes_2d_into_one_rank": case(load, dt_leaves(c.Mesh([2]), (S0,)), "dt_2d"),
        "dtypes_2d_into_2d_transposed": case(load, dt_leaves(c.Mesh([[3, 2], [1, 0]]), (S1, S0)), "dt_2d"),
        "dtypes_2d_into_replicate": case(load, dt_leaves(m22, ("R", "R")), "dt_2d"),
        "train2_into_4_and_save": case(train_load, "C", "train2", save_as="train4"),
        "save_four": case(save, layout(m22, (S1, S0)), "four"),
    }
elif SCENARIO == "then2":
    swapped = c.Mesh([1, 0])
    CASES = {
        "four_into_s0": case(load, layout(M2, (S0,)), "four"),
        "four_into_s1": case(load, layout(swapped, (S1,)), "four"),
        "four_into_replicate": case(load, layout(M2, ("R",)), "four"),
        "dtypes_2d_into_s0": case(load, dt_leaves(M2, (S0,)), "dt_2d"),
        "dtypes_2d_into_s1": case(load, dt_leaves(swapped, (S1,)), "dt_2d"),
        "dtypes_2d_into_replicate": case(load, dt_leaves(M2, ("R",)), "dt_2d"),
        "train4_into_2": case(train_load, "B", "train4"),
        "four_into_s1_saved_as_four_two": case(load_and_save, layout(M2, (S1,)), "four", "four_two"),
    }
elif SCENARIO == "single":
    one = c.Mesh([0])
    CASES = {
        "four_into_plain": case(load, layout(), "four"),
        "four_into_numpy": case(load, layout(kind="numpy"), "four"),
        "four_into_one_rank_mesh": case(load, layout(one, (S1,)), "four"),
        "two_into_plain": case(load, layout(), "two"),
        "two_into_numpy": case(load, layout(kind="numpy"), "two"),
        "two_into_one_rank_mesh": case(load, layout(one, (S0,)), "two"),
        "four_two_into_plain": case(load, layout(), "four_two"),
        "four_two_into_one_rank_mesh": case(load, layout(one, ("R",)), "four_two"),
        "dtypes_s0_into_plain": case(load, dt_leaves(), "dt_s0"),
        "dtypes_s0_into_numpy": case(load, dt_leaves(kind="numpy"), "dt_s0"),
        "dtypes_2d_into_one_rank_mesh": case(load, dt_leaves(one, (S1,)), "dt_2d"),
        "train2_into_single": case(train_load, "S", "train2"),
        "train4_into_single": case(train_load, "S", "train4"),
        "offload_single_one_rank_mesh": case(offload, layout(one, (S0,)), "two"),
        "offload_single_plain": case(offload, dt_leaves(), "dt_2d"),
    }
else:
    raise SystemExit(f"unknown scenario {SCENARIO}")

c.run_cases(CASES, sys.argv[3:])
