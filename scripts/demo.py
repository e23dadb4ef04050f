"""The main job, on CPU ranks: train a sharded model, save it with paddle_dcp, and resume it in
fresh jobs, on other layouts, that load the checkpoint and continue exactly where it stopped.

``bash scripts/demo.sh`` runs the phases, each a fresh job:
  train          2 ranks, layout "train": train STEPS steps with a CheckpointManager saving
                 every step asynchronously (max_to_keep=2: steps STEPS-1 and STEPS stay), then
                 train MORE steps to record the losses of an uninterrupted run
  resume-other   2 ranks, layout "resume": other placements, so the load reshards
  resume-single  1 process without launch, every tensor whole

Each resume builds a fresh model and optimizer, restores the manager's latest step, checks that every loaded value equals
the saved one bit for bit (the train phase keeps the global values with numpy), trains MORE
steps and compares the losses with the uninterrupted run. The "resume" layout reverses the
mesh (every shard moves to the other rank) and replicates fc1's bias, but splits the matmuls
as "train" does, so its floating-point arithmetic is the same and its losses must agree
bit for bit. One process computes the matmuls unsplit, so its losses may differ from the
2-rank run by float32 rounding (a few units in the last place), though it starts from the
same bits; the demo requires agreement to 1e-6 there and prints the difference.
"""
import argparse
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist

import paddle_dcp

STEPS, MORE = 5, 3
LAYOUTS = {  # mesh ranks, and placements of the parameters over the mesh dim "mp"
    # tensor parallel: fc1 column-parallel, fc2 row-parallel
    "train": ([0, 1], {"fc1": {"weight": [dist.Shard(1)], "bias": [dist.Shard(0)]}, "fc2": {"weight": [dist.Shard(0)]}}),
    # the same split on the reversed mesh (every shard moves to the other rank); fc1's bias replicated
    "resume": ([1, 0], {"fc1": {"weight": [dist.Shard(1)]}, "fc2": {"weight": [dist.Shard(0)]}}),
    "single": ([0], {}),
}


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(32, 64)
        self.fc2 = paddle.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(paddle.nn.functional.relu(self.fc1(x)))


def build(mesh, seed, layout):
    paddle.seed(seed)

    def shard_fn(name, layer, mesh):
        if name not in ("fc1", "fc2"):
            return
        for pname in ("weight", "bias"):
            placements = LAYOUTS[layout][1].get(name, {}).get(pname, [dist.Replicate()])
            setattr(layer, pname, dist.shard_tensor(getattr(layer, pname), mesh, placements))

    model = dist.shard_layer(MLP(), mesh, shard_fn)
    sched = paddle.optimizer.lr.StepDecay(0.01, step_size=2, gamma=0.5)
    opt = dist.shard_optimizer(paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters()))
    return model, opt, sched


def batches(mesh, steps, start):
    for step in range(start, start + steps):
        rng = np.random.RandomState(step)
        x = paddle.to_tensor(rng.rand(16, 32).astype("float32"))
        y = paddle.to_tensor(rng.rand(16, 8).astype("float32"))
        yield dist.shard_tensor(x, mesh, [dist.Replicate()]), dist.shard_tensor(y, mesh, [dist.Replicate()])


def train(model, opt, sched, mesh, steps, start, after_step=None):
    """Train ``steps`` steps; ``after_step(steps_done, loss)`` runs after each one."""
    losses = []
    for step, (x, y) in enumerate(batches(mesh, steps, start), start + 1):
        loss = paddle.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        losses.append(float(loss))
        if after_step is not None:
            after_step(step, losses[-1])
    return losses


def state_of(model, opt, step):
    return {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}


def full_values(state):
    """Flat key -> global numpy value of every tensor (gathered), for the oracle."""
    out = {}
    for group in ("model", "opt"):
        for key, t in state[group].items():
            if isinstance(t, paddle.Tensor):
                if t.is_dist():
                    t = dist.reshard(t, t.process_mesh, [dist.Replicate()] * len(t.placements))._local_value()
                out[f"{group}.{key}"] = t.numpy()
    return out


def placements_of(state):
    return {
        f"model.{k}": str([str(p) for p in t.placements]) for k, t in state["model"].items() if t.is_dist()
    }


def summary(ckpt):
    meta = paddle_dcp.read_metadata(ckpt)
    lines = [f"checkpoint {meta.unique_id} in {ckpt}:"]
    lines.append(f"  {'key':<40} {'shape':<9} {'dtype':<8} pieces (file @ global_offset + local_shape)")
    for key, entry in meta.tensors.items():
        p = entry.pieces
        pieces = ", ".join(
            f"{meta.files[f].name}@{tuple(o.tolist())}+{tuple(s.tolist())}" for o, s, f in zip(p.offsets, p.shapes, p.files)
        )
        lines.append(f"  {key:<40} {str(list(entry.shape)):<9} {entry.dtype:<8} {pieces}")
    for key, value in meta.values().items():
        lines.append(f"  {key:<40} = {value!r}")
    for f in meta.files:
        lines.append(f"  {f.name}: {f.nbytes} bytes")
    md = os.path.join(ckpt, f"{meta.unique_id}.metadata")
    lines.append(f"  {os.path.basename(md)}: {os.path.getsize(md)} bytes")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["train", "resume-other", "resume-single"])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    if args.phase != "resume-single":
        dist.init_parallel_env()
    rank = dist.get_rank()
    layout = {"train": "train", "resume-other": "resume", "resume-single": "single"}[args.phase]
    mesh = dist.ProcessMesh(LAYOUTS[layout][0], dim_names=["mp"])
    report = []
    if args.phase == "train":
        model, opt, sched = build(mesh, seed=2024, layout=layout)
        with paddle_dcp.CheckpointManager(args.ckpt, max_to_keep=2, async_save=True) as manager:
            # each save returns once the state is copied to host memory; the next step changes it
            losses = train(model, opt, sched, mesh, STEPS, start=0, after_step=lambda step, loss: manager.save(
                step, state_of(model, opt, step), metrics={"loss": loss}))
            state = state_of(model, opt, STEPS)
            saved = full_values(state)
            manager.wait()
            kept = manager.all_steps()
        reference = train(model, opt, sched, mesh, MORE, start=STEPS)
        if rank == 0:
            np.savez(os.path.join(args.work, "saved.npz"), **saved)
            with open(os.path.join(args.work, "reference.json"), "w") as f:
                json.dump({"losses": losses, "reference": reference}, f)
            report.append(f"train: 2 ranks, mesh {mesh.process_ids}, {STEPS} steps, loss {losses[0]:.5f} -> {losses[-1]:.5f}; "
                          f"saved every step (async), the manager kept steps {kept}: {sorted(os.listdir(args.ckpt))}")
            report += [f"  {k}: {v}" for k, v in placements_of(state).items()]
            report += summary(args.ckpt)
    else:
        model, opt, sched = build(mesh, seed=7, layout=layout)  # other initial weights
        state = state_of(model, opt, 0)  # the optimizer creates its (zero) states here
        with paddle_dcp.CheckpointManager(args.ckpt, max_to_keep=2) as manager:
            restored, kept = manager.restore(state), manager.all_steps()
        opt.set_state_dict(state["opt"])  # applies the LR scheduler's state too
        saved = np.load(os.path.join(args.work, "saved.npz"))
        loaded = full_values(state)
        bad = [k for k in saved.files if not np.array_equal(saved[k], loaded[k])] + (["step"] if restored != STEPS else [])
        ref = json.load(open(os.path.join(args.work, "reference.json")))
        resumed = train(model, opt, sched, mesh, MORE, start=state["step"])
        gap = max(abs(a - b) for a, b in zip(resumed, ref["reference"]))
        same = gap == 0.0 if layout == "resume" else gap <= 1e-6
        if rank == 0:
            where = f"{dist.get_world_size()} ranks" if args.phase == "resume-other" else "1 process, no launch"
            report.append(f"{args.phase}: {where}, mesh {mesh.process_ids}; restored step {restored} of {kept}")
            report += [f"  {k}: {v}" for k, v in placements_of(state).items()]
            report.append(
                f"  loaded {len(saved.files)} tensors and step={state['step']}: "
                + ("all equal to the saved values" if not bad else f"MISMATCH in {bad}")
            )
            for i, (a, b) in enumerate(zip(ref["reference"], resumed)):
                report.append(f"  step {STEPS + i}: uninterrupted loss {a!r}, resumed loss {b!r}, difference {abs(a - b):.1e}")
            report.append(f"  {args.phase}: OK" if not bad and same else f"  {args.phase}: FAILED")
    if rank == 0:
        with open(os.path.join(args.work, f"{args.phase}.txt"), "w") as f:
            f.write("\n".join(report) + "\n")
    if args.phase != "train" and (bad or not same):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
