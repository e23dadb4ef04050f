"""PaddleFormers as the client of paddle.distributed's checkpoints, routed to paddle_dcp.

``pformers.py ROOT LIB PHASE``: LIB is ``dcp`` (under ``paddle_dcp.patch_paddle()``) or
``builtin`` (paddle's own functions, their GPU staging patched out as scripts/bench/io_worker.py
does, to show the harness and its oracles work). Every file goes under ``ROOT/LIB``.

Phases (one launch each, 2 ranks, CPU, a tiny Llama built from a config: no download):

- ``pretrained``: ``save_pretrained`` (safetensors) of a randomly initialised tensor-parallel
  (degree 2) model, then ``from_pretrained`` into a new one (paddle.distributed's
  ``load_state_dict(..., aoa_config=..., safetensors=True)``): every parameter equals the saved
  one; under ``dcp`` also paddle's built-in result.
- ``train``: a Trainer run (data parallel 2 with sharding stage 1: PaddleFormers' flex
  checkpoint; tensor parallel cannot train on CPU, see docs/guide.md) of 6 steps, saving at 3
  and 6; each rank dumps the model and optimizer pieces it saved at step 3 (the oracle). Under
  ``dcp`` also: what the Trainer reads through ``paddle.load(".../0.metadata")`` (routed to
  ``read_state_dict_metadata``) equals paddle's own pickled metadata of the same state.
- ``resume``: a new run resumed from ``checkpoint-3``: its losses equal the uninterrupted run's.
- ``tp_reshard``: a Trainer of tensor-parallel degree 2 takes ``checkpoint-3`` through its own
  resume path (``_load_flex_checkpoint``: the metadata read, init_optimizer, the loads with
  comm_method / aoa_config / offload): every model and optimizer piece equals the oracle's;
  then its own ``_save_flex_model_state`` / ``_save_flex_optimizer_state`` write ``tp2-3``.
  It also writes ``hf-3`` with ``save_pretrained`` (safetensors).
- ``resume_tp``: a data-parallel run resumed from ``tp2-3`` (saved with tensor parallel 2):
  its losses equal the uninterrupted run's.
- ``hf_load``: a data-parallel Trainer with ``load_from_hf`` takes ``hf-3`` through its resume
  path (``load_state_dict(..., aoa_config=..., safetensors=True, comm_method=...,
  worker_groups=...)``): every model piece equals the oracle's.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

try:  # pyarrow (for `datasets`) may need a newer numpy than the one installed; unused here
    import pyarrow  # noqa: F401
except ImportError:
    sys.modules["datasets"] = None

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

from common import end_without_teardown, run_cases  # noqa: E402

ROOT, LIB, PHASE = sys.argv[1], sys.argv[2], sys.argv[3]
HERE = os.path.join(ROOT, LIB)
STEPS, SAVE_AT = 6, 3
BUILTIN = {}  # paddle's own functions, kept before any patch


def tiny_config(tp: int):
    from paddleformers.transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tensor_model_parallel_size=tp,
        fuse_rms_norm=False,  # no CPU kernel for fused_rms_norm_ext
        dtype="float32",
    )


class on_host:
    """paddle's load (and its full_param gather, which save_pretrained uses) moves each chunk it
    broadcasts to a GPU with Tensor.cuda(): a CPU build raises "No available device found.";
    within this block Tensor.cuda returns the tensor itself."""

    def __enter__(self):
        self.cuda = paddle.Tensor.cuda
        paddle.Tensor.cuda = lambda self, *a, **k: self

    def __exit__(self, *exc):
        paddle.Tensor.cuda = self.cuda


def route():
    """Route paddle's calls to the library under test (for the rest of the process)."""
    BUILTIN.update(load_state_dict=dist.load_state_dict, save_state_dict=dist.save_state_dict, load=paddle.load)
    if LIB == "dcp":
        import paddle_dcp

        patch = paddle_dcp.patch_paddle()
        assert dist.load_state_dict.__wrapped__ is paddle_dcp.load_state_dict  # with paddle's contract
        return patch
    on_host().__enter__()
    return None


def local(t) -> np.ndarray:
    return np.array(t.numpy(), copy=True)


def assert_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    if not np.array_equal(actual, expected):
        bad = int((actual != expected).sum())
        raise AssertionError(f"{what}: {bad} of {actual.size} elements differ")


# ------------------------------------------------------------------------------ pretrained
def pretrained():
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1, "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    from paddleformers.transformers import LlamaForCausalLM

    paddle.seed(11)
    saved = LlamaForCausalLM(tiny_config(2))
    path = os.path.join(HERE, "pretrained")
    with on_host():  # PaddleFormers' own writer (paddle's full_param gather): not under test
        saved.save_pretrained(path)  # safetensors, each tensor whole (HF names, transposed weights)
    dist.barrier()
    expected = {k: local(v) for k, v in saved.state_dict().items()}
    assert any(f.endswith(".safetensors") for f in os.listdir(path)), os.listdir(path)

    def load():
        paddle.seed(99)  # different random weights: a parameter left unloaded is seen
        return LlamaForCausalLM.from_pretrained(path, tensor_model_parallel_size=2, fuse_rms_norm=False, dtype="float32")

    def from_pretrained_routed():
        patch = route()
        try:
            got = {k: local(v) for k, v in load().state_dict().items()}
        finally:
            if patch is not None:
                patch.undo()
        assert sorted(got) == sorted(expected)
        for k in expected:
            assert_equal(got[k], expected[k], k)
        if LIB == "dcp":  # and paddle's own result, from the same files
            assert dist.load_state_dict is BUILTIN["load_state_dict"]
            with on_host():
                theirs = load().state_dict()
            for k in expected:
                assert_equal(got[k], local(theirs[k]), f"{k} (vs paddle's built-in)")

    run_cases({"from_pretrained_routed": from_pretrained_routed}, [])


# ------------------------------------------------------------------------------ the Trainer
class Data(paddle.io.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = ((np.arange(16) * (i + 1) + i) % 128).astype("int64")
        return {"input_ids": x, "labels": x}


def trainer(tp: int, out: str, callbacks=(), **more):
    from paddleformers.trainer import Trainer, TrainingArguments
    from paddleformers.transformers import LlamaForCausalLM

    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, save_steps=SAVE_AT, save_strategy="steps", logging_steps=1, seed=7,
        per_device_train_batch_size=2, learning_rate=1e-2, device="cpu", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, save_total_limit=None,
        save_checkpoint_format="flex_checkpoint", load_checkpoint_format="flex_checkpoint",
        tensor_model_parallel_size=tp,
        sharding="stage1" if tp == 1 else "",  # data parallel 2 as sharding stage 1 (init_optimizer reads the metadata)
        split_param=False,  # sharding v2 needs amp_master_grad, i.e. bf16 / fp16: no CPU matmul for them
        bf16=False, fp16=False, amp_master_grad=False,
        max_grad_norm=0.0,  # > 0 fails in _wrap_distributed_optimizer ('AdamW' object has no attribute '_inner_opt')
        **more,
    )
    paddle.seed(1)
    model = LlamaForCausalLM(tiny_config(args.tensor_model_parallel_size))
    return Trainer(model=model, args=args, train_dataset=Data(), callbacks=list(callbacks))


def sharded_pieces(tr) -> dict:
    """flat key -> (local array, global offset, global shape) of what the Trainer saves."""
    model_sd = tr.model.sharded_state_dict()
    out = {}
    for sd in (model_sd, tr.optimizer.sharded_state_dict(model_sd)):
        for k, w in sd.items():
            out[k] = (local(w.local_tensor), tuple(w.global_offset), tuple(w.global_shape))
    return out


def run_training(resume_from=None) -> list:
    from paddleformers.trainer import TrainerCallback

    losses, holder = [], {}

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append([state.global_step, logs["loss"]])

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == SAVE_AT and resume_from is None:
                dump = sharded_pieces(holder["trainer"])
                np.savez(os.path.join(HERE, f"oracle_{dist.get_rank()}.npz"),
                         **{f"{k}|{','.join(map(str, off))}|{','.join(map(str, gs))}": a
                            for k, (a, off, gs) in dump.items()})

    tr = trainer(1, os.path.join(HERE, "run"), [Record()])
    holder["trainer"] = tr
    tr.train(resume_from_checkpoint=resume_from)
    return losses, tr


def oracle() -> dict:
    """flat key -> the whole tensor, assembled from every rank's dump at step 3."""
    pieces: dict = {}
    for r in range(2):
        with np.load(os.path.join(HERE, f"oracle_{r}.npz")) as f:
            for name in f.files:
                key, off, gs = name.split("|")
                pieces.setdefault(key, []).append((f[name], tuple(int(x) for x in off.split(",") if x),
                                                   tuple(int(x) for x in gs.split(",") if x)))
    whole = {}
    for key, ps in pieces.items():
        gs = ps[0][2]
        full = np.full(gs, np.nan, dtype=ps[0][0].dtype) if ps[0][0].dtype.kind == "f" else np.zeros(gs, ps[0][0].dtype)
        for a, off, _ in ps:
            full[tuple(slice(o, o + n) for o, n in zip(off, a.shape))] = a
        if full.dtype.kind == "f":
            assert not np.isnan(full).any(), f"{key}: the dumps do not cover it"
        whole[key] = full
    return whole


def losses_file(name: str) -> str:
    return os.path.join(HERE, f"losses_{name}_{dist.get_rank()}.json")


def train():
    def train_and_save():
        route()
        losses, state["trainer"] = run_training()
        assert [s for s, _ in losses] == list(range(1, STEPS + 1)), losses
        with open(losses_file("full"), "w") as f:
            json.dump(losses, f)
        ckpt = os.path.join(HERE, "run", f"checkpoint-{SAVE_AT}")
        for part in ("model_state", "optimizer_state", "master_weight"):
            names = os.listdir(os.path.join(ckpt, part))
            assert [n for n in names if n.endswith(".metadata")] == ["0.metadata"], (part, names)

    def metadata_same_as_paddles():
        """What the Trainer reads from the metadata of checkpoint-6 (paddle.load, routed)
        against paddle's own metadata of the same state saved by paddle's own save."""
        tr = state["trainer"]
        ckpt = os.path.join(HERE, "run", f"checkpoint-{STEPS}")
        model_sd = tr.model.sharded_state_dict()
        for part, sd in (("model_state", model_sd), ("optimizer_state", tr.optimizer.sharded_state_dict(model_sd))):
            theirs_dir = os.path.join(HERE, f"paddle_{part}")
            with on_host():
                BUILTIN["save_state_dict"](sd, theirs_dir)
            dist.barrier()
            ours_meta = paddle.load(os.path.join(ckpt, part, "0.metadata"))
            theirs_meta = BUILTIN["load"](os.path.join(theirs_dir, "0.metadata"))  # a pickle
            ours, theirs = ours_meta.state_dict_metadata, theirs_meta.state_dict_metadata
            assert ours_meta.flat_mapping == theirs_meta.flat_mapping, part

            def geometry(sdm):
                return {k: {(tuple(m.global_offset), tuple(m.local_shape), m.dtype, tuple(m.global_shape)) for m in v}
                        for k, v in sdm.items()}

            assert geometry(ours) == geometry(theirs), part
            assert len(ours) > 10, (part, len(ours))

    state = {}
    cases = {"train_and_save": train_and_save}
    if LIB == "dcp":
        cases["metadata_same_as_paddles"] = metadata_same_as_paddles
    run_cases(cases, [])


def resumed_losses_match(source: str, name: str):
    route()
    losses, _ = run_training(resume_from=source)
    with open(losses_file(name), "w") as f:
        json.dump(losses, f)
    with open(losses_file("full")) as f:
        full = json.load(f)
    assert losses == full[SAVE_AT:], f"resumed {losses}, uninterrupted {full[SAVE_AT:]}"


def resume():
    run_cases({"resume_losses_equal": lambda: resumed_losses_match(
        os.path.join(HERE, "run", f"checkpoint-{SAVE_AT}"), "resume")}, [])


def tp_reshard():
    source = os.path.join(HERE, "run", f"checkpoint-{SAVE_AT}")
    target = os.path.join(HERE, "run", f"tp2-{SAVE_AT}")
    state = {}

    def tp2_loads_dp_checkpoint():
        route()
        tr = trainer(2, os.path.join(HERE, "tp2"))
        assert tr.args.tensor_model_parallel_size == 2
        tr.create_optimizer_and_scheduler(num_training_steps=STEPS)
        tr.model_wrapped = tr._wrap_model(tr.model_wrapped)  # as train() does before it resumes
        tr._load_flex_checkpoint(source)  # the Trainer's own resume path
        whole = oracle()
        got = sharded_pieces(tr)
        assert sorted(got) == sorted(whole), sorted(set(got) ^ set(whole))
        for key, (a, off, gs) in got.items():
            assert gs == whole[key].shape, (key, gs, whole[key].shape)
            want = whole[key][tuple(slice(o, o + n) for o, n in zip(off, a.shape))]
            assert_equal(a, want, key)
        assert any(whole[k].shape != got[k][0].shape for k in got), "nothing was split by tensor parallel"
        state["trainer"] = tr

    def tp2_saves_with_its_own_functions():
        tr = state["trainer"]
        if dist.get_rank() == 0:  # the rest of the checkpoint (trainer state, scheduler, rng) as it was
            skip = shutil.ignore_patterns("model_state", "optimizer_state", "master_weight", "saved_signal_*")
            shutil.copytree(source, target, ignore=skip)
        dist.barrier()
        tr._save_flex_model_state(target)
        tr._save_flex_optimizer_state(target)

    def tp2_save_pretrained():
        with on_host():  # PaddleFormers' own writer (paddle's full_param gather): not under test
            state["trainer"].model.save_pretrained(os.path.join(HERE, f"hf-{SAVE_AT}"))

    run_cases({"tp2_loads_dp_checkpoint": tp2_loads_dp_checkpoint,
               "tp2_saves_with_its_own_functions": tp2_saves_with_its_own_functions,
               "tp2_save_pretrained": tp2_save_pretrained}, [])


def hf_load():
    def trainer_loads_hf_directory():
        route()
        tr = trainer(1, os.path.join(HERE, "hf"), load_from_hf=True, ignore_load_lr_and_optim=True)
        tr.create_optimizer_and_scheduler(num_training_steps=STEPS)
        tr.model_wrapped = tr._wrap_model(tr.model_wrapped)
        tr._load_flex_checkpoint(os.path.join(HERE, f"hf-{SAVE_AT}"))  # aoa_config + safetensors=True
        whole = oracle()
        model = {k: w for k, w in tr.model.sharded_state_dict().items()}
        assert len(model) > 10 and all(k in whole for k in model), sorted(set(model) - set(whole))
        for key, w in model.items():
            a = local(w.local_tensor)
            want = whole[key][tuple(slice(o, o + n) for o, n in zip(w.global_offset, a.shape))]
            assert_equal(a, want, key)

    run_cases({"trainer_loads_hf_directory": trainer_loads_hf_directory}, [])


def resume_tp():
    run_cases({"resume_from_tp2_losses_equal": lambda: resumed_losses_match(
        os.path.join(HERE, "run", f"tp2-{SAVE_AT}"), "resume_tp")}, [])


if __name__ == "__main__":
    os.makedirs(HERE, exist_ok=True)
    {"pretrained": pretrained, "train": train, "resume": resume, "tp_reshard": tp_reshard,
     "resume_tp": resume_tp, "hf_load": hf_load}[PHASE]()
    # every case passed on this rank (run_cases ends the process at the first failure)
    end_without_teardown()
