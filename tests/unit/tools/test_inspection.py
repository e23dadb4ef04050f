"""paddle_dcp.tools.inspection (the inspect command): every key, file and value of a checkpoint
as text, the exact JSON, incomplete ids and temporary files shown, an empty directory a
problem. Oracle: the tensors, mesh and values the checkpoint was saved from."""
import json
import os


from .commands import TENSORS, expected_pieces, run


def test_inspect_text_lists_every_key_file_and_value(saved, capsys):
    path, oracle = saved
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"checkpoint directory {path}"
    assert "  complete ids: 0" in lines
    for name, (dtype, shape, placements) in TENSORS.items():
        nbytes = oracle[f"model.{name}"].nbytes
        row = f"model.{name} {tuple(shape)} {dtype} {expected_pieces(shape, placements)} {nbytes}"
        assert row in [" ".join(line.split()) for line in lines], row
    meta = json.loads(open(os.path.join(path, "0.metadata")).read())
    for f in meta["files"]:
        assert f"{f['name']} {os.path.getsize(os.path.join(path, f['name']))}" in [" ".join(x.split()) for x in lines]
    assert "  step = 5" in lines and '  name = "run-1"' in lines and "  done = null" in lines
    assert "  lr = NaN" in lines
    total = sum(a.nbytes for a in oracle.values())
    assert any(line.startswith(f"total: {total} bytes") for line in lines)


def test_inspect_json_is_exact(saved, capsys):
    path, oracle = saved
    code, out, _ = run(capsys, "inspect", path, "--json")
    assert code == 0
    doc = json.loads(out)
    files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert doc == {
        "path": path,
        "complete": [0],
        "incomplete": [],
        "temporary": [],
        "problems": [],
        "checkpoint": {
            "unique_id": 0,
            "format_version": 1,
            "world_size": 4,
            "created_by": "",
            "checksum": "xxh3_64",
            "block_bytes": 64,
            "tensors": {
                f"model.{n}": {
                    "shape": list(s),
                    "dtype": d,
                    "pieces": expected_pieces(s, p),
                    "bytes": oracle[f"model.{n}"].nbytes,
                }
                for n, (d, s, p) in sorted(TENSORS.items())
            },
            "files": [{"name": n, "bytes": os.path.getsize(os.path.join(path, n))} for n in files],
            "values": {"step": 5, "lr": "nan", "name": "run-1", "done": None},
            "tensor_bytes": sum(a.nbytes for a in oracle.values()),
            "file_bytes": sum(os.path.getsize(os.path.join(path, n)) for n in files),
        },
    }


def test_inspect_shows_incomplete_ids_and_temporary_files(ck, capsys):
    for name in ("0_9.distcp", "1_9.distcp", "0_9.distcp.tmp.0badf00d"):
        open(os.path.join(ck, name), "wb").close()
    code, out, _ = run(capsys, "inspect", ck, "--json")
    doc = json.loads(out)
    assert code == 0
    assert (doc["complete"], doc["incomplete"], doc["temporary"]) == ([0], [9], ["0_9.distcp.tmp.0badf00d"])
    code, out, err = run(capsys, "inspect", ck)
    assert "incomplete ids: 9" in out and "0_9.distcp.tmp.0badf00d" in out
    code, out, err = run(capsys, "inspect", ck, "--unique-id", 9)
    assert code == 1 and "checkpoint 9" in err and "incomplete" in err
    code, out, err = run(capsys, "inspect", ck, "--unique-id", 42)
    assert code == 2 and "no checkpoint 42" in err and len(err.strip().splitlines()) == 1


def test_inspect_empty_directory_is_a_problem(tmp_path, capsys):
    code, out, err = run(capsys, "inspect", tmp_path)
    assert code == 1 and "no complete checkpoint" in err
    code, out, _ = run(capsys, "inspect", tmp_path, "--json")
    assert code == 1 and json.loads(out)["checkpoint"] is None


def test_inspect_shows_each_tensor_s_encoding_and_stored_bytes(compressed, capsys):
    path, _ = compressed
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "checkpoint 0: format_version 2" in lines[2]
    assert "key shape dtype pieces bytes encoding stored" in lines
    # stored: whole blocks per piece, by the format's definition (264 bytes for int8, 136 for int4)
    assert "model.m1 (9, 70) float32 2 2520 int8 1056" in lines  # rows 5 | 4: 350 and 280 elements, 2 blocks each
    assert "model.m2 (5, 300) bfloat16 2 3000 int4 816" in lines  # columns 150 | 150: 750 elements, 3 blocks each
    assert "model.n (12,) int64 1 96 - 96" in lines  # matched, but integers stay plain
    code, out, _ = run(capsys, "inspect", path, "--json")
    tensors = json.loads(out)["checkpoint"]["tensors"]
    assert tensors["model.m1"]["encoding"] == "int8" and tensors["model.m1"]["stored_bytes"] == 1056
    assert "encoding" not in tensors["model.n"] and "stored_bytes" not in tensors["model.n"]


def test_inspect_shows_a_derived_tensor_s_source_and_no_stored_bytes(derived, capsys):
    path, _ = derived
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "model.p.w_0 (9, 70) float32 0 2520 derived from model.p 0" in lines
    assert "model.p (9, 70) bfloat16 2 1260 - 1260" in lines
    code, out, _ = run(capsys, "inspect", path, "--json")
    tensors = json.loads(out)["checkpoint"]["tensors"]
    assert tensors["model.p.w_0"] == {
        "shape": [9, 70], "dtype": "float32", "pieces": 0, "bytes": 2520, "encoding": "derived", "stored_bytes": 0,
        "source": "model.p",
    }
    assert "source" not in tensors["model.p"]


HOSTILE = "\x1b]0;owned\x07\x1b[2J\u202e\n\x9b31m"  # a title, a clear screen, a bidi override, a forged line, a C1 CSI


def test_no_command_prints_a_control_character_a_checkpoint_holds(tmp_path, capsys):
    """A stranger's checkpoint names a tensor and a value with terminal escapes, a bidi
    override and a newline: inspect (text and JSON), verify and convert print them escaped,
    on stdout and stderr."""
    import re

    import numpy as np

    from ..helpers import save_checkpoint

    path = str(tmp_path / "ck")
    os.makedirs(path)
    save_checkpoint(path, {"w" + HOSTILE: np.arange(6, dtype=np.float32)}, {"w" + HOSTILE: "float32"}, (2,),
                    {"w" + HOSTILE: (0,)}, values={"note": HOSTILE})
    printed = []
    for argv in (["inspect", path], ["inspect", path, "--json"], ["verify", path],
                 ["convert", path, str(tmp_path / "out.safetensors"), "--to", "safetensors"],
                 ["inspect", path, "--unique-id", "7"]):
        code, out, err = run(capsys, *argv)
        printed.append((argv[0], code, out, err))
    for name, code, out, err in printed:
        for text in (out, err):
            assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", text), (name, text)
    text = printed[0][2]
    assert "w\\x1b]0;owned\\x07\\x1b[2J\\u202e\\n\\x9b31m" in text, text  # still readable, as escapes
    assert printed[1][1] == 0 and json.loads(printed[1][2])["checkpoint"]["values"]["note"] == HOSTILE
