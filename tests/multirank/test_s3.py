"""Checkpoints on a real S3 server (SeaweedFS on 127.0.0.1, one per session: tests/s3server.py):
round trip and reshard on 2 and 4 ranks, numbering and generations, ranged GETs counted on the
wire, and a rank killed mid-save. The launched ranks inherit the AWS_* variables of ``s3_env``."""
import uuid


from launcher import assert_passed, launch, run_launch, run_single, script

CASES_2 = ["save_s0", "s0_into_s1", "s0_into_replicate", "s0_into_numpy", "numbering", "ranged_gets", "listings", "missing_id", "hf_directory"]
CASES_4 = ["save_2d", "2d_into_1d_s1", "2d_into_replicate"]


def test_s3_round_trip_and_reshard_2ranks(tmp_path, s3_env):
    logs = run_launch(script("s3.py"), 2, tmp_path, args=[s3_env.url(uuid.uuid4().hex), "2"], timeout=300)
    assert_passed(logs, CASES_2, 2)


def test_s3_reshard_4ranks(tmp_path, s3_env):
    logs = run_launch(script("s3.py"), 4, tmp_path, args=[s3_env.url(uuid.uuid4().hex), "4"], timeout=300)
    assert_passed(logs, CASES_4, 4)


def test_s3_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, s3_env):
    url = s3_env.url(uuid.uuid4().hex)
    result = launch(script("s3.py"), 2, tmp_path, args=[url, "crash"], timeout=300)
    assert result.returncode != 0, result.report
    assert "PASS save_first rank=0" in result.logs and "PASS save_first rank=1" in result.logs, result.report
    assert "DIED after part " in result.logs, result.report  # a part of rank 1's file was uploaded
    assert "CollectiveError" in result.logs, result.report  # rank 0 raised instead of waiting
    assert "PASS crash" not in result.logs, result.report
    out = run_single(script("s3.py"), tmp_path, args=[url, "check"], timeout=180)
    assert "PASS check rank=0" in out, out


# ---------------------------------------------------------------------- one process
def _state(variant: int = 0) -> dict:
    import numpy as np

    return {
        "model": {"w": (np.arange(300 * 257, dtype=np.float32).reshape(300, 257) + variant), "b": np.arange(1001) * 3},
        "step": variant,
    }


def test_s3_objects_equal_the_local_files_and_no_local_directory_appears(tmp_path, s3_env, monkeypatch):
    import paddle_dcp
    from paddle_dcp.io import open_storage

    monkeypatch.chdir(tmp_path)
    url = s3_env.url(uuid.uuid4().hex)
    paddle_dcp.save_state_dict(_state(), url)
    paddle_dcp.save_state_dict(_state(), str(tmp_path / "disk"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]  # no "s3:" directory
    store = open_storage(url)
    assert sorted(store.sizes()) == ["0.0.claim", "0.metadata", "0_0.distcp"]
    data = store.fs.cat_file(store.full("0_0.distcp"))
    assert data == (tmp_path / "disk" / "0_0.distcp").read_bytes()
    assert paddle_dcp.read_metadata(url).files == paddle_dcp.read_metadata(str(tmp_path / "disk")).files


def test_s3_cli_inspect_convert_clean_and_save_gathered(tmp_path, s3_env, capsys):
    import numpy as np
    from safetensors.numpy import load, load_file

    import paddle_dcp
    from paddle_dcp.io import open_storage
    from paddle_dcp.tools import cli

    url = s3_env.url(uuid.uuid4().hex)
    paddle_dcp.save_state_dict(_state(0), url)
    paddle_dcp.save_state_dict(_state(1), url)
    expected = _state(1)["model"]
    capsys.readouterr()
    assert cli.main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "complete ids: 0, 1" in out and "model.w" in out and "(300, 257)" in out, out
    assert cli.main(["convert", url, str(tmp_path / "c.safetensors")]) == 0
    got = load_file(str(tmp_path / "c.safetensors"))
    assert np.array_equal(got["model.w"], expected["w"]) and np.array_equal(got["model.b"], expected["b"])
    assert cli.main(["clean", "--incomplete", url]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    gathered = f"{url}/gathered/model.safetensors"
    paddle_dcp.save_gathered(_state(1), gathered, storage_options={"part_size": 5 << 20})
    store = open_storage(f"{url}/gathered")
    got = load(store.fs.cat_file(store.full("model.safetensors")))
    assert np.array_equal(got["model.w"], expected["w"]) and np.array_equal(got["model.b"], expected["b"])


def test_s3_cli_verify(s3_env, capsys):
    import paddle_dcp
    from paddle_dcp.io import open_storage
    from paddle_dcp.tools import cli

    url = s3_env.url(uuid.uuid4().hex)
    paddle_dcp.save_state_dict(_state(0), url)
    assert cli.main(["verify", url]) == 0, capsys.readouterr()
    store = open_storage(url)
    data = bytearray(store.fs.cat_file(store.full("0_0.distcp")))
    data[1000] ^= 1  # a flipped bit in the object: verify names the object and the key
    store.fs.pipe_file(store.full("0_0.distcp"), bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", url]) == 1
    out = capsys.readouterr()
    assert "0_0.distcp" in out.out + out.err and "model.w" in out.out + out.err, out


def test_s3_single_file_load(s3_env):
    """A gathered file on S3 loads in place, read through the object storage (ranged GETs)."""
    import numpy as np

    import paddle_dcp

    url = s3_env.url(uuid.uuid4().hex) + "/model.safetensors"
    paddle_dcp.save_gathered(_state(2), url)
    target = {"model": {"w": np.zeros((300, 257), np.float32), "b": np.zeros(1001, np.int64)}, "step": 0}
    paddle_dcp.load_state_dict(target, url)
    want = _state(2)
    assert np.array_equal(target["model"]["w"], want["model"]["w"])
    assert np.array_equal(target["model"]["b"], want["model"]["b"]) and target["step"] == 2


def test_s3_save_streams_parts_without_building_the_file_and_async_save_works(s3_env):
    """A 60 MiB tensor saved with 5 MiB parts, 2 in flight: the Python heap's peak (tracemalloc:
    the part buffers and botocore's copies) stays far below the file's size."""
    import tracemalloc

    import numpy as np

    import paddle_dcp

    url = s3_env.url(uuid.uuid4().hex)
    options = {"part_size": 5 << 20, "parts_in_flight": 2}
    a = (np.arange(60 << 20, dtype=np.int64) % 251).astype(np.uint8).reshape(-1, 1024)
    assert paddle_dcp.save_state_dict({"a": a}, url, async_save=True, storage_options=options).wait() == 0
    tracemalloc.start()
    try:
        paddle_dcp.save_state_dict({"a": a}, url, storage_options=options)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, peak
    for uid in (0, 1):
        sd = {"a": np.zeros_like(a)}
        paddle_dcp.load_state_dict(sd, url, unique_id=uid, storage_options=options)
        assert np.array_equal(sd["a"], a)


def test_s3_cli_storage_options_instead_of_the_environment(s3_env, monkeypatch, capsys):
    import paddle_dcp
    from paddle_dcp.tools import cli

    url = s3_env.url(uuid.uuid4().hex)
    paddle_dcp.save_state_dict(_state(0), url)
    endpoint, key, secret = (s3_env.env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    # the environment now points nowhere (a closed port of 127.0.0.1): only the options reach the server
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    capsys.readouterr()
    opts = [f"--storage-option=endpoint_url={endpoint}", f"--storage-option=key={key}",
            f"--storage-option=secret={secret}", "--storage-option=retries=2"]
    assert cli.main(["inspect", url, *opts]) == 0
    assert "complete ids: 0" in capsys.readouterr().out
    assert cli.main(["inspect", url, "--storage-option", "nonsense"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert cli.main(["inspect", url, "--storage-option=retries=1"]) == 1  # the environment's endpoint: refused
    assert "127.0.0.1:9" in capsys.readouterr().err


def test_s3_cli_convert_writes_to_urls_and_never_a_local_directory(tmp_path, s3_env, monkeypatch, capsys):
    """convert's OUT may be a URL too: a safetensors file, an npz (zip streamed without seeks),
    a Hugging Face directory and a pdparams file land as objects, read back equal; nothing
    local appears."""
    import io

    import numpy as np
    from safetensors.numpy import load

    import paddle_dcp
    from paddle_dcp.io import open_storage
    from paddle_dcp.tools import cli

    monkeypatch.chdir(tmp_path)
    url = s3_env.url(uuid.uuid4().hex)
    paddle_dcp.save_state_dict(_state(2), url)
    expected = _state(2)["model"]
    out = f"{url}-out"
    for args in (["convert", url, f"{out}/c.safetensors"], ["convert", url, f"{out}/c.npz"],
                 ["convert", url, f"{out}/hf", "--to", "hf"]):
        assert cli.main(args) == 0, capsys.readouterr()
    store = open_storage(out)
    got = load(store.fs.cat_file(store.full("c.safetensors")))
    assert np.array_equal(got["model.w"], expected["w"]) and np.array_equal(got["model.b"], expected["b"])
    with np.load(io.BytesIO(store.fs.cat_file(store.full("c.npz"))), allow_pickle=False) as npz:
        assert np.array_equal(npz["model.w"], expected["w"]) and np.array_equal(npz["model.b"], expected["b"])
    hf = open_storage(f"{out}/hf")
    got = load(hf.fs.cat_file(hf.full("model.safetensors")))
    assert np.array_equal(got["model.w"], expected["w"])
    assert cli.main(["convert", url, f"{out}/c.pdparams"]) == 0
    import paddle

    state = paddle.load(io.BytesIO(store.fs.cat_file(store.full("c.pdparams"))))  # our own file: pickle is fine here
    assert np.array_equal(state["model.w"].numpy(), expected["w"])
    assert cli.main(["convert", url, f"{out}/hf", "--to", "hf"]) != 0  # not empty: refused
    assert "not empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no "s3:" directory


def test_s3_import_paddle_into_a_url(tmp_path, s3_env, monkeypatch, capsys):
    """import-paddle's OUT may be a URL: the data objects, then the metadata; loads back equal;
    a second import of the id is refused; nothing local appears in the working directory."""
    import numpy as np
    import paddle

    import paddle_dcp
    from paddle_dcp.tools import cli

    from unit.helpers import paddle_builtin_save

    src = tmp_path / "paddle"
    oracle = paddle_builtin_save(paddle, src)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    url = s3_env.url(uuid.uuid4().hex)
    assert cli.main(["import-paddle", str(src), url, "--trust"]) == 0, capsys.readouterr()
    assert cli.main(["verify", url]) == 0
    state = {"model": {"w": np.zeros((4, 6), np.float32), "e": paddle.zeros([3, 5], dtype="bfloat16")},
             "opt": {"n": np.zeros(5, np.int64)}}
    paddle_dcp.load_state_dict(state, url)
    assert np.array_equal(state["model"]["w"], oracle["model.w"]) and np.array_equal(state["opt"]["n"], oracle["opt.n"])
    assert np.array_equal(state["model"]["e"].numpy(), oracle["model.e"])
    capsys.readouterr()
    assert cli.main(["import-paddle", str(src), url, "--trust"]) == 2
    assert "already holds" in capsys.readouterr().err
    assert list(work.iterdir()) == []
