"""paddle_dcp.parallel.aoa_paddle, through load_state_dict(aoa_config=...) in one process: paddle's engine interprets the statements,
every result is compared with a numpy oracle built here from the statement's meaning."""
import logging

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_dcp  # noqa: E402
from paddle_dcp.errors import MismatchError, UnsupportedError  # noqa: E402

D, HEADS, KV, HD = 4, 4, 2, 2  # hidden, attention heads, key/value heads, head dim


def values(shape, seed):
    """Exact in float16 and bfloat16 too (multiples of 1/8 below 256)."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + seed * 13) % 200 / 8 - 11).astype(np.float32).reshape(shape)


SAVED = {
    "layers.0.w": values((4, 6), 1), "layers.1.w": values((4, 6), 2),
    "layers.0.b": values((6,), 3), "layers.1.b": values((6,), 4),
    "attn.q": values((D, HEADS * HD), 5), "attn.k": values((D, KV * HD), 6), "attn.v": values((D, KV * HD), 7),
    "mlp.gate": values((D, 6), 8), "mlp.up": values((D, 6), 9),
    "fused.qkv": values((D, (HEADS + 2 * KV) * HD), 10), "fused.ug": values((D, 12), 11),
    "emb": values((5, 3), 12) + np.float32(1 / 3), "x3": values((2, 3, 4), 13),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("aoa"))
    paddle_dcp.save_state_dict({k: v.copy() for k, v in SAVED.items()}, path)
    return path


def load(path, targets, statements, **kw):
    sd = {k: (np.full(shape, -99, np.float32) if isinstance(shape, tuple) else shape) for k, shape in targets.items()}
    paddle_dcp.load_state_dict(sd, path, aoa_config={"aoa_statements": statements}, **kw)
    return sd


def heads(a, n):
    return np.split(a, n, axis=1)


def fused_qkv_oracle(q, k, v):
    """Per key/value group: its query heads, then its key head, then its value head (axis 1)."""
    qs, ks, vs = heads(q, HEADS), heads(k, KV), heads(v, KV)
    per = HEADS // KV
    parts = []
    for g in range(KV):
        parts += qs[g * per:(g + 1) * per] + [ks[g], vs[g]]
    return np.concatenate(parts, axis=1)


def test_rename_with_layer_id_and_transpose(ckpt):
    sd = load(ckpt, {"blocks.0.w": (6, 4), "blocks.1.w": (6, 4)}, ["layers.$LAYER_ID.w^T -> blocks.$LAYER_ID.w"])
    np.testing.assert_array_equal(sd["blocks.0.w"], SAVED["layers.0.w"].T)
    np.testing.assert_array_equal(sd["blocks.1.w"], SAVED["layers.1.w"].T)


def test_glob_merges_layers(ckpt):
    sd = load(ckpt, {"all_b": (12,)}, ["layers.*.b -> all_b, axis=0"])
    np.testing.assert_array_equal(sd["all_b"], np.concatenate([SAVED["layers.0.b"], SAVED["layers.1.b"]]))


def test_fused_qkv_merge_and_split(ckpt):
    stmt = f"fused_qkv, num_heads={HEADS}, num_key_value_groups={KV}"
    sd = load(ckpt, {"qkv": (D, (HEADS + 2 * KV) * HD)}, [f"attn.q, attn.k, attn.v -> qkv, {stmt}"])
    np.testing.assert_array_equal(sd["qkv"], fused_qkv_oracle(SAVED["attn.q"], SAVED["attn.k"], SAVED["attn.v"]))
    sd = load(ckpt, {"q": (D, HEADS * HD), "k": (D, KV * HD), "v": (D, KV * HD)}, [f"fused.qkv -> q, k, v, {stmt}"])
    np.testing.assert_array_equal(fused_qkv_oracle(sd["q"], sd["k"], sd["v"]), SAVED["fused.qkv"])


def test_fused_ffn_merge_and_split(ckpt):
    sd = load(ckpt, {"ug": (D, 12)}, ["mlp.gate, mlp.up -> ug, fused_ffn"])
    np.testing.assert_array_equal(sd["ug"], np.concatenate([SAVED["mlp.gate"], SAVED["mlp.up"]], axis=1))
    sd = load(ckpt, {"g": (D, 6), "u": (D, 6)}, ["fused.ug -> g, u, fused_ffn"])
    np.testing.assert_array_equal(sd["g"], SAVED["fused.ug"][:, :6])
    np.testing.assert_array_equal(sd["u"], SAVED["fused.ug"][:, 6:])


def test_permute(ckpt):
    sd = load(ckpt, {"x3p": (4, 2, 3)}, ["x3 -> x3p, permute='[2,0,1]'"])
    np.testing.assert_array_equal(sd["x3p"], SAVED["x3"].transpose(2, 0, 1))


def test_dtype_casts_as_paddle_does(ckpt):
    half = paddle.zeros([5, 3], dtype="float16")
    bf = paddle.zeros([3, 5], dtype="bfloat16")
    sd = {"emb_h": half, "emb_b": bf}
    paddle_dcp.load_state_dict(sd, ckpt, aoa_config={"aoa_statements": [
        "emb -> emb_h, dtype='float16'", "emb^T -> emb_t", "emb_t -> emb_b, dtype='bfloat16'"]})
    emb = paddle.to_tensor(SAVED["emb"])
    np.testing.assert_array_equal(sd["emb_h"].numpy().view(np.uint16), paddle.cast(emb, "float16").numpy().view(np.uint16))
    want = paddle.cast(emb.T, "bfloat16").view(paddle.uint16).numpy()
    np.testing.assert_array_equal(sd["emb_b"].view(paddle.uint16).numpy(), want)
    assert not (want == (SAVED["emb"].T.copy().view(np.uint32) >> 16)).all()  # rounding, not truncation, matters here


def test_keys_filled_by_the_config_are_not_missing(ckpt, caplog):
    stmt = ["layers.$LAYER_ID.w^T -> blocks.$LAYER_ID.w"]
    targets = {"blocks.0.w": (6, 4), "blocks.1.w": (6, 4), "emb": (5, 3)}
    sd = load(ckpt, targets, stmt)  # strict: keys are checked after the config's mapping
    np.testing.assert_array_equal(sd["blocks.1.w"], SAVED["layers.1.w"].T)
    with pytest.raises(MismatchError, match=r"1 key\(s\) of the state_dict are not in .*: absent\. "):
        load(ckpt, dict(targets, absent=(2,)), stmt)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="paddle_dcp.api"):
        sd = load(ckpt, dict(targets, absent=(2,)), stmt, strict=False)
    np.testing.assert_array_equal(sd["emb"], SAVED["emb"])  # no statement: the same name
    assert (sd["absent"] == -99).all()
    missing = [r.getMessage() for r in caplog.records if "not found" in r.getMessage()]
    assert len(missing) == 1 and "'absent'" in missing[0] and "blocks" not in missing[0]
    unexpected = [r.getMessage() for r in caplog.records if "not in the state_dict" in r.getMessage()]
    assert len(unexpected) == 1 and "layers.0.w" not in unexpected[0] and "'x3'" in unexpected[0]


def test_master_weight_names_still_match_with_a_config(tmp_path):
    paddle_dcp.save_state_dict({"opt": {"w_fp32_master_0": values((3,), 1)}, "a": values((2, 2), 2)}, str(tmp_path))
    sd = {"opt": {"master_weights": {"w": np.zeros(3, np.float32)}}, "b": np.zeros((2, 2), np.float32)}
    paddle_dcp.load_state_dict(sd, str(tmp_path), aoa_config={"aoa_statements": ["a^T -> b"]})
    np.testing.assert_array_equal(sd["opt"]["master_weights"]["w"], values((3,), 1))
    np.testing.assert_array_equal(sd["b"], values((2, 2), 2).T)


def test_config_errors(ckpt):
    with pytest.raises(MismatchError, match=r"blocks.0.w: aoa_config gives shape \(6, 4\), state_dict has \(4, 6\)"):
        load(ckpt, {"blocks.0.w": (4, 6)}, ["layers.$LAYER_ID.w^T -> blocks.$LAYER_ID.w"])
    with pytest.raises(UnsupportedError, match="AOA engine"):
        load(ckpt, {"q": (D, 4)}, ["fused.qkv -> q, k, v, axis=1"])  # 16 columns in 3 parts
    with pytest.raises(UnsupportedError, match="aoa_statements"):
        load(ckpt, {"q": (D, 4)}, "fused.qkv -> q")
