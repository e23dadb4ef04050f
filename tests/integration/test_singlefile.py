"""The safetensors reader behind load_state_dict(state_dict, file): the header's rules, bounded
reads of any box, in-place loading of numpy state dicts, and no paddle needed for them."""
from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import paddle_dcp
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.io import reads
from paddle_dcp import singlefile
from paddle_dcp.core import load_plan
from paddle_dcp.core.keys import MissingKeys
from paddle_dcp.format import hf_dir, safetensors
from paddle_dcp.io import open_storage
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError, MismatchError

from unit.helpers import fast

REPO = Path(__file__).resolve().parents[2]


def write(path, tensors: dict, metadata: dict | None = None, pad: int = 0, header_override=None, tail=b""):
    """A safetensors file written from the specification (no library): tensors key -> (code, array)."""
    doc, data = {}, b""
    if metadata is not None:
        doc["__metadata__"] = metadata
    for key, (code, array) in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        doc[key] = {"dtype": code, "shape": list(array.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = header_override if header_override is not None else json.dumps(doc).encode() + b" " * pad
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + data + tail)
    return path


def test_reads_a_file_of_another_writer_by_flat_keys(tmp_path):
    import safetensors.numpy

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([True, False, True])
    path = tmp_path / "x.safetensors"
    safetensors.numpy.save_file({"model.a": a, "model.b": b, "c": np.full((), -3, np.int8)}, str(path))
    sd = {"model": {"a": np.zeros((3, 4), np.float32), "b": np.zeros(3, bool)}, "c": np.zeros((), np.int8)}
    singlefile.load_file(sd, str(path))
    assert np.array_equal(sd["model"]["a"], a) and np.array_equal(sd["model"]["b"], b) and sd["c"] == -3


def test_a_file_is_loaded_by_the_load_protocol_on_one_rank_each_batch_in_its_steps(tmp_path, monkeypatch):
    """Each batch is a one-rank load of the protocol a directory's load runs: its steps agreed in
    the protocol's order (the file opened in the verify step, after the plan), the plain values
    with the last batch only."""
    from paddle_dcp.parallel.comm import SoloComm
    from paddle_dcp.parallel.requests import Agree

    path = write(tmp_path / "x.safetensors", {"a": ("F32", np.arange(4, dtype=np.float32)),
                                               "b": ("I64", np.arange(3, dtype=np.int64))})
    steps: list[str] = []
    real = SoloComm.execute

    def execute(self, request):
        if isinstance(request, Agree):
            steps.append(request.step)
        return real(self, request)

    monkeypatch.setattr(SoloComm, "execute", execute)
    sd = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.int64)}
    singlefile.load_file(sd, str(path))
    assert steps == ["inspect", "read metadata", "plan", "verify", "read"]
    assert np.array_equal(sd["a"], np.arange(4)) and np.array_equal(sd["b"], np.arange(3))


@pytest.mark.parametrize("name", ["my model+v1\u00e9.safetensors", "weights (1).safetensors"])
def test_a_file_the_caller_names_may_have_any_name_its_file_system_allows(tmp_path, name):
    import safetensors.numpy

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / name
    safetensors.numpy.save_file({"a": a}, str(path))
    sd = {"a": np.zeros((2, 3), np.float32)}
    singlefile.load_file(sd, str(path))
    assert np.array_equal(sd["a"], a)


def test_a_storage_opens_no_name_that_leaves_its_directory(tmp_path):
    store = open_storage(str(tmp_path))
    for bad in ("..", ".", "a/b", "x\0y", "", "n" * 256):
        with pytest.raises(FormatError, match="plain file name"):
            store.resolve(bad)


def test_mismatches_are_refused_before_any_tensor_changes(tmp_path):
    path = write(tmp_path / "f", {"a": ("F32", np.ones((2, 3), np.float32)), "b": ("I64", np.ones(4, np.int64))})
    for sd, text in [
        ({"a": np.zeros((2, 3), np.float64), "b": np.zeros(4, np.int64)}, "float32"),
        ({"a": np.zeros((3, 2), np.float32), "b": np.zeros(4, np.int64)}, "(2, 3)"),
    ]:
        before = {k: v.copy() for k, v in sd.items()}
        with pytest.raises(MismatchError, match=text):
            singlefile.load_file(sd, str(path))
        assert all(np.array_equal(sd[k], before[k]) and sd[k].dtype == before[k].dtype for k in sd)
    other = write(tmp_path / "u", {"u": ("U16", np.ones(2, np.uint16))})
    with pytest.raises(MismatchError, match="U16"):
        singlefile.load_file({"u": np.zeros(2, np.int16)}, str(other))


def test_a_key_the_file_lacks_is_refused_before_any_tensor_changes(tmp_path):
    path = write(tmp_path / "f", {"a": ("F32", np.ones(2, np.float32))})
    sd = {"a": np.zeros(2, np.float32), "missing": np.zeros(1, np.float32)}
    with pytest.raises(MismatchError, match=r"1 key\(s\) of the state_dict are not in .*f: missing\. .*strict=False"):
        singlefile.load_file(sd, str(path))
    assert not sd["a"].any()


def test_keys_on_one_side_only_are_warned_about(tmp_path, caplog):
    path = write(tmp_path / "f", {"a": ("F32", np.ones(2, np.float32)), "extra": ("F32", np.ones(1, np.float32))})
    sd = {"a": np.zeros(2, np.float32), "missing": np.zeros(1, np.float32)}
    with caplog.at_level(logging.WARNING, logger="paddle_dcp.singlefile"):
        singlefile.load_file(sd, str(path), missing=MissingKeys(strict=False))
    assert np.array_equal(sd["a"], np.ones(2)) and not sd["missing"].any()
    text = caplog.text
    assert "missing" in text and "extra" in text


def test_master_weight_spellings(tmp_path):
    path = write(tmp_path / "f", {"opt.master_weights.w": ("F32", np.full(2, 5, np.float32))})
    sd = {"opt": {"w_fp32_master_0": np.zeros(2, np.float32)}}
    singlefile.load_file(sd, str(path))
    assert (sd["opt"]["w_fp32_master_0"] == 5).all()
    sd = {"opt": {"w_fp32_master_0": np.zeros(2, np.float32)}}
    with pytest.raises(MismatchError, match="opt.w_fp32_master_0"):
        singlefile.load_file(sd, str(path), mw_name_compatibility=False)
    singlefile.load_file(sd, str(path), mw_name_compatibility=False, missing=MissingKeys(strict=False))
    assert not sd["opt"]["w_fp32_master_0"].any()


def bad_files():
    ok = {"a": ("F32", np.ones((2, 2), np.float32)), "b": ("U8", np.ones(3, np.uint8))}
    a = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    b = {"dtype": "U8", "shape": [3], "data_offsets": [16, 19]}

    def h(doc):
        return json.dumps(doc).encode()

    return {
        "truncated data": dict(tensors=ok, tail=b"", cut=1),
        "trailing bytes": dict(tensors=ok, tail=b"x"),
        "not json": dict(header_override=b"{nope"),
        "not an object": dict(header_override=b"[1, 2]"),
        "duplicate key": dict(header_override=b'{"a": %s, "a": %s}' % (h(a), h(a))),
        "unknown dtype": dict(header_override=h({"a": {**a, "dtype": "F31"}, "b": b})),
        "extra field": dict(header_override=h({"a": {**a, "x": 1}, "b": b})),
        "negative shape": dict(header_override=h({"a": {**a, "shape": [-2, -2]}, "b": b})),
        "bool shape": dict(header_override=h({"a": {**a, "shape": [True, 4]}, "b": b})),
        "wrong length": dict(header_override=h({"a": {**a, "data_offsets": [0, 15]}, "b": {**b, "data_offsets": [15, 18]}})),
        "overlap": dict(header_override=h({"a": a, "b": {**b, "data_offsets": [14, 17]}})),
        "hole": dict(header_override=h({"a": {**a, "shape": [2, 1], "data_offsets": [0, 8]}, "b": b})),
        "past the end": dict(header_override=h({"a": a, "b": {**b, "data_offsets": [16, 23], "shape": [7]}})),
        "metadata not str": dict(header_override=h({"__metadata__": {"k": 1}, "a": a, "b": b})),
        "bad structure": dict(header_override=h({"__metadata__": {"structure": "{"}, "a": a, "b": b})),
        "structure lists other tensors": dict(header_override=h(
            {"__metadata__": {"structure": json.dumps({"d": [["a", {"t": 0}]]})}, "a": a, "b": b})),
        "bad empty_tensors": dict(header_override=h(
            {"__metadata__": {"empty_tensors": json.dumps({"e": {"dtype": "F32", "shape": [2]}})}, "a": a, "b": b})),
    }


@pytest.mark.parametrize("label", list(bad_files()))
def test_the_header_rules(tmp_path, label):
    spec = dict(bad_files()[label])
    cut = spec.pop("cut", 0)
    tensors = spec.pop("tensors", {"a": ("F32", np.ones((2, 2), np.float32)), "b": ("U8", np.ones(3, np.uint8))})
    path = write(tmp_path / "bad", tensors, **spec)
    if cut:
        path.write_bytes(path.read_bytes()[:-cut])
    sd = {"a": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.uint8)}
    with pytest.raises(FormatError) as info:
        singlefile.load_file(sd, str(path))
    assert str(path) in str(info.value)
    assert not sd["a"].any() and not sd["b"].any()


def test_header_size_is_capped(tmp_path):
    path = tmp_path / "huge"
    path.write_bytes(struct.pack("<Q", safetensors.MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(FormatError, match="header of"):
        safetensors.read_header(str(path))
    path.write_bytes(b"\x01\x02")
    with pytest.raises(FormatError, match="too short"):
        safetensors.read_header(str(path))


@given(
    shape=st.lists(st.integers(1, 7), min_size=0, max_size=4),
    data=st.data(),
    band=st.sampled_from([1, 8, 40, 1 << 20]),
)
@fast(80)
def test_read_box_reads_exactly_the_box(tmp_path_factory, shape, data, band):
    shape = tuple(shape)
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets))
    box = Box(offsets, sizes)
    array = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    path = write(tmp_path_factory.mktemp("rb") / "t", {"t": ("I32", array)}, pad=3)
    header = safetensors.read_header(str(path))
    out = np.full(sizes, -1, np.int32)
    # the single-file load's machinery: the file as a checkpoint's metadata, planned reads of
    # at most ``band`` bytes (small ones force the cut paths), executed on the storage's files
    meta = hf_dir.files_metadata([(path.name, header.file_bytes)], {"t": hf_dir.tensor_entry(header.entries["t"], 0)})
    ops = load_plan.plan_reads(meta, [load_plan.TargetPiece("t", "int32", shape, box)], max_read_bytes=band)
    files = open_storage(str(path.parent)).open_files(meta.files)
    try:
        reads.execute_reads(ops, meta, files, [out], verify=False)
    finally:
        files.close()
    assert np.array_equal(out, array[box.slices() + (Ellipsis,)])


def test_numpy_state_dicts_load_with_paddle_blocked(tmp_path):
    """Reading a file into numpy arrays and plain values needs no paddle."""
    path = write(tmp_path / "f", {"m.w": ("F64", np.arange(6.0).reshape(2, 3))},
                 metadata={"structure": json.dumps({"d": [["m", {"d": [["w", {"t": 0}]]}], ["step", {"v": 9}],
                                                          ["lr", {"f": "inf"}]]})})
    code = f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        sys.modules["paddle"] = None
        import numpy as np
        import paddle_dcp
        sd = {{"m": {{"w": np.zeros((2, 3))}}, "step": 0, "lr": 0.0}}
        paddle_dcp.load_state_dict(sd, {str(path)!r})
        assert sd["step"] == 9 and sd["lr"] == float("inf"), sd
        assert np.array_equal(sd["m"]["w"], np.arange(6.0).reshape(2, 3))
        print("ok")
        """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_flattened_sharded_weight_loads_from_one_file(tmp_path):
    """One file's load is a checkpoint directory's load (parallel.loadwork.plan_load): a
    flattened ShardedWeight (sharding stage 2) takes the boxes its range covers, which this
    path refused when it had a loop of its own."""
    paddle = pytest.importorskip("paddle")
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    whole = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) - 5
    path = write(tmp_path / "f.safetensors", {"w": ("F32", whole)})
    for start, stop in ((0, 24), (3, 17), (6, 12), (23, 24)):
        local = paddle.zeros([stop - start], dtype="float32")
        sd = {"w": ShardedWeight("w", local, (4, 6), (4, 6), (0, 0), True, slice(start, stop))}
        paddle_dcp.load_state_dict(sd, str(path))
        assert np.array_equal(local.numpy(), whole.reshape(-1)[start:stop]), (start, stop)
