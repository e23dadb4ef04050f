"""PaddleFormers as the client (2 CPU ranks, a tiny Llama from a config): from_pretrained of
safetensors into a tensor-parallel model, and a Trainer's flex checkpoint saved and resumed,
on the same layout and on another tensor-parallel degree, with paddle's calls routed to
paddle_dcp by patch_paddle (scripts/pformers.py says what each phase checks).

The ``builtin`` tests run the same scripts with paddle's own functions: they show that the
harness and its oracles work on CPU, so that the ``dcp`` ones fail only for paddle_dcp.

What cannot run on CPU (paddle 3.3.1 CPU, paddleformers 1.2.0), hence the Trainer's own
checkpoint functions driven directly for tensor parallel:

- ``Trainer.train`` with ``tensor_model_parallel_size=2``: with ``max_grad_norm > 0`` (the
  default) ``_wrap_distributed_optimizer`` raises ``AttributeError: 'AdamW' object has no
  attribute '_inner_opt'`` (so does sharding stage 1); with ``max_grad_norm=0`` the first
  forward raises ``AssertionError: Only support xpu, gpu and custom_device now, but this is
  cpu`` (fleet's ``broadcast_input_data`` in ``TensorParallel._pre_forward``), and the model's
  own forward under fleet's mp group raises ``NotImplementedError: (Unimplemented)
  ProcessGroupGLOO does not support all_reduce with sync_op and use_calc_stream flag``
  (``VocabParallelEmbedding`` -> ``mp_ops._mp_allreduce``).
- The default sharding (stage 1 with ``split_param``) asserts ``amp_master_grad``, which needs
  bf16 / fp16 training; ``fuse_rms_norm`` (the default) has no CPU kernel
  (``fused_rms_norm_ext``).

What runs: ``Trainer.train`` on 2 ranks with data parallel 2 as sharding stage 1
(``split_param=False``, ``max_grad_norm=0``), save and resume included; a tensor-parallel-2
Trainer built, its optimizer created and wrapped, then ``_load_flex_checkpoint`` (its resume
path), ``_save_flex_model_state`` and ``_save_flex_optimizer_state``; ``save_pretrained`` and
``from_pretrained`` of a tensor-parallel-2 model."""
import pytest

pytest.importorskip("paddleformers")

from launcher import assert_passed, run_launch, script  # noqa: E402

PFORMERS = script("pformers.py")
CASES = {
    "train": ["train_and_save"],
    "resume": ["resume_losses_equal"],
    "tp_reshard": ["tp2_loads_dp_checkpoint", "tp2_saves_with_its_own_functions", "tp2_save_pretrained"],
    "resume_tp": ["resume_from_tp2_losses_equal"],
    "hf_load": ["trainer_loads_hf_directory"],
    "pretrained": ["from_pretrained_routed"],
}


def cases(lib, name):
    return CASES[name] + (["metadata_same_as_paddles"] if lib == "dcp" and name == "train" else [])


def phases(tmp_path, lib, names, timeout=240):
    """Run the phases in order, one launch each, every case passing on both ranks."""
    work = tmp_path / "work"
    for name in names:
        args = [work, lib, name]
        assert_passed(run_launch(PFORMERS, 2, tmp_path, args=args, timeout=timeout), cases(lib, name), 2)
    return work / lib


def check_trainer_files(root):
    ckpt = root / "run" / "checkpoint-3"
    for part in ("model_state", "optimizer_state", "master_weight"):
        assert (ckpt / part / "0.metadata").is_file(), part


def test_from_pretrained_into_tensor_parallel_dcp(tmp_path):
    phases(tmp_path, "dcp", ["pretrained"])


def test_from_pretrained_into_tensor_parallel_builtin(tmp_path):
    phases(tmp_path, "builtin", ["pretrained"])


def test_trainer_resume_same_layout_and_other_tensor_parallel_degree_dcp(tmp_path):
    root = phases(tmp_path, "dcp", ["train", "resume", "tp_reshard", "resume_tp", "hf_load"])
    check_trainer_files(root)
    meta = (root / "run" / "checkpoint-3" / "model_state" / "0.metadata").read_bytes()
    assert meta.lstrip().startswith(b"{"), "the checkpoint is paddle_dcp's (JSON metadata)"


def test_trainer_resume_same_layout_and_other_tensor_parallel_degree_builtin(tmp_path):
    root = phases(tmp_path, "builtin", ["train", "resume", "tp_reshard", "resume_tp", "hf_load"])
    check_trainer_files(root)


@pytest.mark.device
def test_one_layout_into_shard_layer_tensor_parallel(tmp_path):
    """A model saved whole, loaded into the same model made tensor-parallel with dist.shard_layer:
    paddle's shard_layer adds its rotary buffers to the keys (the error says so and how to allow
    them); under patch_paddle the keys are the same and a strict load fills every parameter."""
    logs = run_launch(script("shard_layer_keys.py"), 2, tmp_path, args=[tmp_path / "work"], timeout=240)
    assert_passed(logs, ["paddles_shard_layer", "patched_shard_layer"], 2)
