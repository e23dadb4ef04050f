"""convert --to hf --aoa-config: a checkpoint with the model's names (fused qkv, transposed
weights, other names) exported under the Hugging Face names its load-direction config reads.
The expected directory is built here with numpy from the statements' meaning; the round trip
loads it back through load_state_dict(aoa_config=...) and compares bit for bit."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

paddle = pytest.importorskip("paddle")

import paddle_dcp  # noqa: E402
from paddle_dcp.tools import cli, consolidate  # noqa: E402

D, HEADS, KV, HD, FF, VOCAB = 4, 4, 2, 2, 6, 5  # hidden, heads, key/value heads, head dim, ffn, vocab
LAYERS = 2
QKV = "llama.layers.{}.self_attn.qkv_proj.weight"
DOWN = "llama.layers.{}.mlp.down_proj.weight"

STATEMENTS = [
    "model.layers.$LAYER_ID.self_attn.q_proj.weight^T, model.layers.$LAYER_ID.self_attn.k_proj.weight^T, "
    "model.layers.$LAYER_ID.self_attn.v_proj.weight^T -> llama.layers.$LAYER_ID.self_attn.qkv_proj.weight, "
    f"fused_qkv, num_heads={HEADS}, num_key_value_groups={KV}",
    "model.layers.$LAYER_ID.mlp.down_proj.weight^T -> llama.layers.$LAYER_ID.mlp.down_proj.weight",
    "model.embed_tokens.weight -> llama.embed_tokens.weight",
    "model.norm.weight -> llama.norm.weight, src_dtype='float32', dst_dtype='bfloat16'",
]


def model_state(seed: int = 0) -> dict:
    """The model's own tensors (numpy, float32) and the norm as bfloat16 bit patterns."""
    rng = np.random.default_rng(seed)
    sd = {}
    for i in range(LAYERS):
        sd[QKV.format(i)] = rng.standard_normal((D, (HEADS + 2 * KV) * HD)).astype(np.float32)
        sd[DOWN.format(i)] = rng.standard_normal((FF, D)).astype(np.float32)
    sd["llama.embed_tokens.weight"] = rng.standard_normal((VOCAB, D)).astype(np.float32)
    sd["lm_head.weight"] = rng.standard_normal((D, VOCAB)).astype(np.float32)  # no statement: kept
    norm = rng.standard_normal(D).astype(np.float32)
    sd["llama.norm.weight"] = (norm.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
    return sd


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def hf_oracle(sd: dict) -> dict:
    """The Hugging Face tensors, from what fused_qkv means: along axis 1 of the model's qkv,
    for each key/value group its query heads, then its key head, then its value head."""
    out = {}
    per = HEADS // KV
    for i in range(LAYERS):
        heads = np.split(sd[QKV.format(i)], HEADS + 2 * KV, axis=1)
        q, k, v = [], [], []
        for g in range(KV):
            group = heads[g * (per + 2):(g + 1) * (per + 2)]
            q += group[:per]
            k.append(group[per])
            v.append(group[per + 1])
        for name, parts in (("q", q), ("k", k), ("v", v)):
            out[f"model.layers.{i}.self_attn.{name}_proj.weight"] = np.concatenate(parts, axis=1).T
        out[f"model.layers.{i}.mlp.down_proj.weight"] = sd[DOWN.format(i)].T
    out["model.embed_tokens.weight"] = sd["llama.embed_tokens.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"]
    out["model.norm.weight"] = bf16_values(sd["llama.norm.weight"])
    return out


def save_checkpoint(path, sd):
    state = {k: v for k, v in sd.items() if v.dtype != np.uint16}
    state["llama.norm.weight"] = paddle.to_tensor(sd["llama.norm.weight"]).view(paddle.bfloat16)
    paddle_dcp.save_state_dict(state, str(path))


@pytest.fixture
def exported(tmp_path):
    sd = model_state()
    save_checkpoint(tmp_path / "ck", sd)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"aoa_statements": STATEMENTS}))
    return sd, tmp_path / "ck", cfg


def read_directory(out) -> dict:
    got = {}
    index = out / "model.safetensors.index.json"
    files = sorted(out.glob("*.safetensors"))
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == [f.name for f in files]
    for f in files:
        for k, v in load_file(str(f)).items():
            assert k not in got
            got[k] = v
            if index.exists():
                assert weight_map[k] == f.name
    return got


@pytest.mark.parametrize("slab", [None, 16])  # 16 bytes: every output built one row at a time
def test_export_writes_the_hugging_face_names_and_values(exported, tmp_path, monkeypatch, capsys, slab):
    sd, ck, cfg = exported
    if slab:
        monkeypatch.setattr(consolidate, "SLAB_BYTES", slab)
    out = tmp_path / "hf"
    argv = ["convert", str(ck), str(out), "--to", "hf", "--aoa-config", str(cfg), "--max-shard-size", "200", "--progress"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "convert 0" in captured.err and "named by" in captured.out
    got = read_directory(out)
    want = hf_oracle(sd)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert len(list(out.glob("*.safetensors"))) > 1 and not list(out.glob("*.tmp*"))
    # the round trip: the directory loads back through the same config into the model's names
    target = {k: np.zeros(v.shape, np.float32) for k, v in sd.items() if v.dtype != np.uint16}
    target["llama.norm.weight"] = paddle.zeros([D], dtype="bfloat16")
    paddle_dcp.load_state_dict(target, str(out), safetensors=True, aoa_config={"aoa_statements": STATEMENTS})
    for k, v in sd.items():
        back = target[k].view(paddle.uint16).numpy() if k == "llama.norm.weight" else target[k]
        assert back.dtype == v.dtype and back.tobytes() == v.tobytes(), k


def test_keys_select_hugging_face_names_and_bf16_widens(exported, tmp_path):
    sd, ck, cfg = exported
    out = tmp_path / "hf"
    argv = ["convert", str(ck), str(out), "--to", "hf", "--aoa-config", str(cfg), "--keys", r"layers\.1\.self_attn"]
    assert cli.main(argv) == 0
    got = read_directory(out)
    want = {k: v for k, v in hf_oracle(sd).items() if "layers.1.self_attn" in k}
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    # a bfloat16 output (no cast in the config) written as float32 with --bf16-as-float32
    cfg2 = tmp_path / "cfg2.json"
    cfg2.write_text(json.dumps({"aoa_statements": ["model.norm.weight -> llama.norm.weight"]}))
    out2 = tmp_path / "hf2"
    argv = ["convert", str(ck), str(out2), "--to", "hf", "--aoa-config", str(cfg2), "--keys", "norm", "--bf16-as-float32"]
    assert cli.main(argv) == 0
    got = read_directory(out2)
    assert list(got) == ["model.norm.weight"] and got["model.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(got["model.norm.weight"], bf16_values(sd["llama.norm.weight"]))


def test_optimizer_states_are_left_out_with_a_note(tmp_path, capsys):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    paddle_dcp.save_state_dict({"w": w, "w.moment1_0": w * 2}, str(tmp_path / "ck"))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"aoa_statements": ["hf.w^T -> w"]}))
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--aoa-config", str(cfg)]) == 0
    assert "1 optimizer states are not exported" in capsys.readouterr().err
    got = read_directory(tmp_path / "hf")
    assert list(got) == ["hf.w"] and np.array_equal(got["hf.w"], w.T)


BAD_CONFIGS = {
    "not json": "{nope",
    "not an object": "[1]",
    "no statements": '{"statements": []}',
    "statements not strings": '{"aoa_statements": [1]}',
    "not a statement": '{"aoa_statements": ["hf.w ->"]}',
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, capsys, name):
    paddle_dcp.save_state_dict({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "ck"))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(BAD_CONFIGS[name])
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--aoa-config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--aoa-config" in err[0] and "cfg.json" in err[0], err
    assert not (tmp_path / "hf").exists() or not list((tmp_path / "hf").iterdir())


def test_missing_file_and_other_formats_are_usage_errors(tmp_path, capsys):
    paddle_dcp.save_state_dict({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "ck"))
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--aoa-config", str(tmp_path / "no.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"aoa_statements": []}')
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "x.npz"), "--aoa-config", str(cfg)]) == 2
    assert "--aoa-config applies to --to hf only" in capsys.readouterr().err


def test_a_statement_the_engine_cannot_reverse_is_named(tmp_path, capsys):
    paddle_dcp.save_state_dict({"w": np.ones((2, 3), np.float32), "v": np.ones(3, np.float32)}, str(tmp_path / "ck"))
    cfg = tmp_path / "cfg.json"
    bad = "hf.v -> v, dtype='float32'"  # a one-way cast: paddle reverses only src_dtype=..., dst_dtype=...
    cfg.write_text(json.dumps({"aoa_statements": ["hf.w^T -> w", bad]}))
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--aoa-config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and repr(bad) in err[0] and "backwards" in err[0], err


# statement kinds: model-side shapes saved, the HF tensors expected (numpy), then the round trip
KINDS = {
    "permute": ({"x3p": (4, 2, 3)}, ["x3 -> x3p, permute='[2, 0, 1]'"], lambda sd: {"x3": sd["x3p"].transpose(1, 2, 0)}),
    "fused_ffn": (
        {"ug": (4, 12)}, ["mlp.gate, mlp.up -> ug, fused_ffn"],
        lambda sd: {"mlp.gate": sd["ug"][:, :6], "mlp.up": sd["ug"][:, 6:]},
    ),
    "fused_qkv split": (
        {"q": (D, HEADS * HD), "k": (D, KV * HD), "v": (D, KV * HD)},
        [f"fused.qkv -> q, k, v, fused_qkv, num_heads={HEADS}, num_key_value_groups={KV}"],
        lambda sd: {"fused.qkv": np.concatenate(
            [part for g in range(KV) for part in (sd["q"][:, g * 4:(g + 1) * 4], sd["k"][:, g * 2:(g + 1) * 2], sd["v"][:, g * 2:(g + 1) * 2])],
            axis=1)},
    ),
    "unfilled and expert": (
        {"experts.0.w": (2, 3), "experts.1.w": (2, 3)},
        ["mlp.experts.$EXPERT_ID.w^T -> experts.$EXPERT_ID.w", "_ -> extra"],
        lambda sd: {f"mlp.experts.{e}.w": sd[f"experts.{e}.w"].T for e in range(2)},
    ),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_statement_kinds_export_and_load_back(tmp_path, kind):
    shapes, statements, oracle = KINDS[kind]
    rng = np.random.default_rng(3)
    sd = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    paddle_dcp.save_state_dict({k: v.copy() for k, v in sd.items()}, str(tmp_path / "ck"))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"aoa_statements": statements}))
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--aoa-config", str(cfg)]) == 0
    got, want = read_directory(tmp_path / "hf"), oracle(sd)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want), (sorted(got), sorted(want))
    back = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    paddle_dcp.load_state_dict(back, str(tmp_path / "hf"), safetensors=True, aoa_config={"aoa_statements": statements})
    assert all(back[k].tobytes() == sd[k].tobytes() for k in sd)


def test_a_glob_over_hugging_face_names_cannot_run_backwards(tmp_path, capsys):
    paddle_dcp.save_state_dict({"all_b": np.ones(12, np.float32)}, str(tmp_path / "ck"))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"aoa_statements": ["layers.*.b -> all_b, axis=0"]}))
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--aoa-config", str(cfg)]) == 2
    assert "'layers.*.b -> all_b, axis=0' backwards" in capsys.readouterr().err
