"""get_state_dict / set_state_dict: train, save, resume on another layout and rank count.

Usage: train_resume.py DIR {train2|resume4|resume1} [case ...]
  train2:  2 ranks, fc1 column-parallel and fc2 row-parallel over a mesh of 2. Trains N steps,
           saves ``get_state_dict(model, opt)`` (plus the step) with save_state_dict and with
           save_gathered, then trains M more steps: the uninterrupted run (the reference).
           Then, in the same job, a fresh model (built later, so paddle names its parameters
           differently) on the reversed mesh, with the same matmul split: loads, trains M steps
           and must match the reference bit for bit.
  resume4: 4 ranks, a [2, 2] mesh with both dims sharding the weights (other matmul splits);
           a fresh model whose parameter names differ; loads, trains M steps, matches the
           reference to float32 rounding (max |diff| <= 1e-5 of the largest value).
  resume1: one process without launch, plain model and plain AdamW: the same; and the
           gathered file loaded into it; and master weights (multi_precision) round trip.

The resumed jobs never call paddle.utils.unique_name.guard: their parameters' names differ
from the saving job's, and only the structured keys connect them.
"""
import copy
import json
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import common as c
import paddle_dcp

MODE = sys.argv[2]
if MODE == "resume1":
    ROOT = sys.argv[1]
else:
    ROOT = c.init()
R = c.rank()
N, M = 4, 3
CKPT = os.path.join(ROOT, "ckpt")
GATHERED = os.path.join(ROOT, "trained.safetensors")
KINDS = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(32, 64)
        self.fc2 = paddle.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(paddle.nn.functional.relu(self.fc1(x)))


def layouts():
    S, Rp = dist.Shard, dist.Replicate
    return {
        # (mesh ids, dim names, placements per parameter; missing: replicated)
        "train": ([0, 1], ["mp"], {"fc1.weight": [S(1)], "fc1.bias": [S(0)], "fc2.weight": [S(0)]}),
        "reversed": ([1, 0], ["mp"], {"fc1.weight": [S(1)], "fc1.bias": [S(0)], "fc2.weight": [S(0)]}),
        "other2": ([0, 1], ["mp"], {"fc1.weight": [S(0)], "fc2.weight": [S(1)], "fc2.bias": [S(0)]}),
        "grid": ([[0, 1], [2, 3]], ["dp", "mp"], {
            "fc1.weight": [S(0), S(1)], "fc1.bias": [Rp(), S(0)],
            "fc2.weight": [S(1), S(0)], "fc2.bias": [S(0), Rp()],
        }),
    }


def build(layout, seed, extra_layers=0):
    """A fresh model and optimizer. ``extra_layers`` Linear layers are made first, so the
    model's parameters get other names (linear_2... instead of linear_0...)."""
    for _ in range(extra_layers):
        paddle.nn.Linear(2, 2)
    paddle.seed(seed)
    model = MLP()
    sched = paddle.optimizer.lr.StepDecay(0.01, step_size=2, gamma=0.5)
    if layout is None:  # one process: plain tensors, plain optimizer
        return model, paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters()), sched, None
    ids, names, specs = layouts()[layout]
    mesh = dist.ProcessMesh(ids, dim_names=names)

    def shard_fn(name, layer, pmesh):
        if name not in ("fc1", "fc2"):
            return
        for pname in ("weight", "bias"):
            pl = specs.get(f"{name}.{pname}", [dist.Replicate()] * len(names))
            setattr(layer, pname, dist.shard_tensor(getattr(layer, pname), pmesh, pl))

    model = dist.shard_layer(model, mesh, shard_fn)
    opt = dist.shard_optimizer(paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters()))
    return model, opt, sched, mesh


def train(model, opt, sched, mesh, steps, start):
    losses = []
    for step in range(start, start + steps):
        rng = np.random.RandomState(step)
        x = paddle.to_tensor(rng.rand(16, 32).astype("float32"))
        y = paddle.to_tensor(rng.rand(16, 8).astype("float32"))
        if mesh is not None:
            rep = [dist.Replicate()] * len(mesh.shape)
            x, y = dist.shard_tensor(x, mesh, rep), dist.shard_tensor(y, mesh, rep)
        loss = paddle.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        losses.append(float(loss))
    return losses


def whole(t) -> np.ndarray:
    if isinstance(t, paddle.Tensor) and t.is_dist():
        t = dist.reshard(t, t.process_mesh, [dist.Replicate()] * len(t.placements))._local_value()
    return t.numpy().copy()


def flat_tensors(state) -> dict:
    out = {}
    for part in ("model", "optim"):
        for k, v in state[part].items():
            if isinstance(v, paddle.Tensor):
                out[f"{part}.{k}"] = whole(v)
    return out


def params_of(model) -> dict:
    return {k: whole(p) for k, p in model.named_parameters()}


def expected_keys():
    return {f"model.{p}" for p in PARAMS} | {f"optim.{p}.{k}" for p in PARAMS for k in KINDS}


def fresh_state_checks(model, opt):
    """get_state_dict on a fresh optimizer creates its states (zero moments, beta powers at
    beta) without changing any parameter, keyed by structured names."""
    before = params_of(model)
    state = paddle_dcp.get_state_dict(model, opt)
    after = params_of(model)
    for k in before:
        c.assert_same(after[k], before[k], f"{k} after get_state_dict")
    flat = flat_tensors(state)
    assert set(flat) == expected_keys(), sorted(set(flat) ^ expected_keys())
    for p in PARAMS:
        assert not flat[f"optim.{p}.moment1"].any() and not flat[f"optim.{p}.moment2"].any(), p
        assert np.allclose(flat[f"optim.{p}.beta1_pow_acc"], 0.9) and np.allclose(flat[f"optim.{p}.beta2_pow_acc"], 0.999), p
    assert state["optim"]["LR_Scheduler"] == {"last_epoch": 0, "last_lr": 0.01}, state["optim"]["LR_Scheduler"]
    assert not any("linear_" in k for k in state["optim"]), sorted(state["optim"])
    return state


def resume(layout, extra_layers, exact):
    """A fresh model (other initial values, other parameter names) on ``layout`` loads the
    checkpoint through get_state_dict / set_state_dict, trains M steps, and matches the
    uninterrupted run."""
    model, opt, sched, mesh = build(layout, seed=7, extra_layers=extra_layers)
    names = {p.name for p in model.parameters()}
    original = set(json.load(open(os.path.join(ROOT, "names.json"))))
    assert not names & original, (names, original)  # the names differ: only structured keys connect them
    state = fresh_state_checks(model, opt)
    state["step"] = 0
    paddle_dcp.load_state_dict(state, CKPT)
    paddle_dcp.set_state_dict(model, opt, state)
    assert state["step"] == N, state["step"]
    assert sched.last_epoch == N and sched() == 0.0025, (sched.last_epoch, sched())
    saved = np.load(os.path.join(ROOT, "saved.npz"))
    loaded = flat_tensors(paddle_dcp.get_state_dict(model, opt))
    assert set(saved.files) == set(loaded), sorted(set(saved.files) ^ set(loaded))
    for k in saved.files:
        c.assert_same(loaded[k], saved[k], f"{k} loaded")
    losses = train(model, opt, sched, mesh, M, start=state["step"])
    ref = np.load(os.path.join(ROOT, "reference.npz"))
    ref_losses = json.load(open(os.path.join(ROOT, "losses.json")))["reference"]
    got = params_of(model)
    worst = 0.0
    for k in PARAMS:
        diff = float(np.max(np.abs(got[k] - ref[k]))) / float(np.max(np.abs(ref[k])))
        worst = max(worst, diff)
        if exact:
            c.assert_same(got[k], ref[k], f"{k} after {N}+{M} steps")
    loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses))
    if R == 0:
        print(f"RESUME {MODE}/{layout} rank=0: parameters after {N}+{M} steps vs uninterrupted: "
              f"max |diff| / max |value| = {worst:.3e}; max loss difference {loss_gap:.3e}", flush=True)
    if exact:
        assert worst == 0.0 and loss_gap == 0.0, (worst, loss_gap)
    assert worst <= 1e-5, worst
    return model, opt


# ------------------------------------------------------------------------------ 2 ranks
def train_save_reference():
    model, opt, sched, mesh = build("train", seed=2024)
    if R == 0:
        json.dump([p.name for p in model.parameters()], open(os.path.join(ROOT, "names.json"), "w"))
    losses = train(model, opt, sched, mesh, N, start=0)
    state = paddle_dcp.get_state_dict(model, opt)
    state["step"] = N
    paddle_dcp.save_state_dict(state, CKPT)
    paddle_dcp.save_gathered(state, GATHERED, max_grouped_size="16K")
    saved = flat_tensors(state)
    meta = paddle_dcp.read_metadata(CKPT)
    assert set(meta.tensors) == set(saved), sorted(set(meta.tensors) ^ set(saved))
    reference = train(model, opt, sched, mesh, M, start=N)
    final = params_of(model)  # a collective: every rank
    if R == 0:
        np.savez(os.path.join(ROOT, "saved.npz"), **saved)
        np.savez(os.path.join(ROOT, "reference.npz"), **final)
        json.dump({"losses": losses, "reference": reference}, open(os.path.join(ROOT, "losses.json"), "w"))


def resume_same_split_exact():
    resume("reversed", extra_layers=0, exact=True)


def set_from_other_placements():
    """set_state_dict with tensors that are not the live ones: dist tensors of the same mesh
    in other placements are resharded, plain whole tensors sliced; another mesh is refused."""
    model, opt, sched, mesh = build("other2", seed=11)
    source = paddle_dcp.get_state_dict(model, opt)
    paddle_dcp.load_state_dict(source, CKPT)
    target_model, target_opt, target_sched, _ = build("train", seed=12)
    paddle_dcp.set_state_dict(target_model, target_opt, source)
    saved = np.load(os.path.join(ROOT, "saved.npz"))
    got = flat_tensors(paddle_dcp.get_state_dict(target_model, target_opt))
    for k in saved.files:
        c.assert_same(got[k], saved[k], f"{k} copied")
    assert target_sched.last_epoch == N, target_sched.last_epoch
    plain = {"model": {k: paddle.to_tensor(v) for k, v in saved.items() if k.startswith("model.")}}
    plain["model"] = {k[len("model."):]: v for k, v in plain["model"].items()}
    third, third_opt, _, _ = build("train", seed=13)
    paddle_dcp.set_state_dict(third, None, plain)
    for k, v in params_of(third).items():
        c.assert_same(v, saved[f"model.{k}"], f"{k} from whole tensors")
    other_mesh, other_opt, _, _ = build("reversed", seed=14)
    try:
        paddle_dcp.set_state_dict(other_mesh, other_opt, source)
    except paddle_dcp.MismatchError as exc:
        assert "mesh" in str(exc), exc
    else:
        raise AssertionError("no error for another mesh")


# ------------------------------------------------------------------------------ 4 ranks, 1 process
def resume_grid_4():
    resume("grid", extra_layers=3, exact=False)


def resume_single():
    resume(None, extra_layers=1, exact=False)


def gathered_into_single():
    """The file save_gathered wrote from the 2-rank job loads into a plain model's
    get_state_dict in one process, every value as saved, the step and the LR scheduler too."""
    model, opt, sched, _ = build(None, seed=5, extra_layers=2)
    state = paddle_dcp.get_state_dict(model, opt)
    state["step"] = 0
    paddle_dcp.load_state_dict(state, GATHERED)
    paddle_dcp.set_state_dict(model, opt, state)
    saved = np.load(os.path.join(ROOT, "saved.npz"))
    got = flat_tensors(state)
    for k in saved.files:
        c.assert_same(got[k], saved[k], f"{k} from the gathered file")
    assert state["step"] == N and sched.last_epoch == N, (state["step"], sched.last_epoch)
    flat = paddle.load(GATHERED, safetensors=True)
    assert set(flat) == set(saved.files), sorted(set(flat) ^ set(saved.files))


class Mixed(paddle.nn.Layer):
    """A float32 layer that trains, and a bfloat16 parameter (no CPU kernel trains it: it gets
    no gradient) whose optimizer states, master weight included, AdamW(multi_precision=True)
    creates in get_state_dict."""

    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 3)
        self.half = self.create_parameter([5, 2], dtype="bfloat16")

    def forward(self, x):
        return self.fc(x)


def master_weights_round_trip():
    def make(extra):
        for _ in range(extra):
            paddle.nn.Linear(2, 2)
        model = Mixed()
        opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=model.parameters(), multi_precision=True)
        return model, opt

    model, opt = make(0)
    loss = model(paddle.rand([2, 4])).sum()
    loss.backward()
    opt.step()
    opt.clear_grad()
    state = paddle_dcp.get_state_dict(model, opt)
    keys = set(state["optim"])
    assert {"half.master_weight", "half.moment1", "half.beta2_pow_acc", "fc.weight.moment2"} <= keys, sorted(keys)
    assert not any(k.startswith("fc.") and k.endswith("master_weight") for k in keys), sorted(keys)
    rng = np.random.RandomState(3)
    for key in ("half.master_weight", "half.moment1", "half.moment2"):
        t = state["optim"][key]
        t.set_value(rng.standard_normal(t.shape).astype("float32"))
    path = os.path.join(ROOT, "mw")
    paddle_dcp.save_state_dict(state, path)
    saved = {k: whole(v) for k, v in state["optim"].items() if isinstance(v, paddle.Tensor)}

    fresh, fresh_opt = make(3)  # other names
    fresh_state = paddle_dcp.get_state_dict(fresh, fresh_opt)
    assert set(fresh_state["optim"]) == keys, sorted(set(fresh_state["optim"]) ^ keys)
    paddle_dcp.load_state_dict(fresh_state, path)
    paddle_dcp.set_state_dict(fresh, fresh_opt, fresh_state)
    for k, v in saved.items():
        c.assert_same(whole(fresh_state["optim"][k]), v, k)
    # set_state_dict from copies (not the live tensors): values are copied in
    third, third_opt = make(1)
    copies = {"model": {k: v.clone() for k, v in state["model"].items()},
              "optim": {k: (v.clone() if isinstance(v, paddle.Tensor) else copy.deepcopy(v)) for k, v in state["optim"].items()}}
    paddle_dcp.set_state_dict(third, third_opt, copies)
    got = paddle_dcp.get_state_dict(third, third_opt)
    for k, v in saved.items():
        c.assert_same(whole(got["optim"][k]), v, f"{k} (copied)")
    for k, v in state["model"].items():
        c.assert_same(whole(got["model"][k]), whole(v), f"model.{k} (copied)")


if MODE == "train2":
    CASES = {
        "train_save_reference": train_save_reference,
        "resume_same_split_exact": resume_same_split_exact,
        "set_from_other_placements": set_from_other_placements,
    }
elif MODE == "resume4":
    CASES = {"resume_grid_4": resume_grid_4}
else:
    CASES = {
        "resume_single": resume_single,
        "gathered_into_single": gathered_into_single,
        "master_weights_round_trip": master_weights_round_trip,
    }

if __name__ == "__main__":
    c.run_cases(CASES, sys.argv[3:])
    c.end_without_teardown()  # every case passed on this rank (see its docstring)
