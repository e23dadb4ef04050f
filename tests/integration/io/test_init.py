"""paddle_dcp.io (the package's own functions): a path dispatched to its storage (a URL to the
objects, else the local disk, which never imports fsspec), a single file's directory and name,
the default storage options of a block, and a single output file written whole."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp import io as io_package
from paddle_dcp.errors import ArgumentError, UnsupportedError
from paddle_dcp.io import is_url, local, open_storage

from unit.helpers import listdir


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_open_storage_of_a_local_path_is_the_local_disk(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), local.LocalStorage)


def test_a_url_is_never_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_url("s3://bucket/run1") and is_url("memory://x") and not is_url("run1") and not is_url("/a/s3:/b")
    with pytest.raises(UnsupportedError, match="nosuchproto"):
        paddle_dcp.save_state_dict({"w": np.zeros(3, np.float32)}, "nosuchproto://bucket/run1")
    assert os.listdir(tmp_path) == []  # no "nosuchproto:" directory


def test_storage_options_on_a_local_path_are_refused(tmp_path):
    with pytest.raises(UnsupportedError, match="storage_options"):
        open_storage(str(tmp_path), {"part_size": 1 << 20})


def test_a_local_path_never_imports_fsspec_or_s3fs(tmp_path):
    code = (
        "import sys, numpy as np, paddle_dcp\n"
        f"paddle_dcp.save_state_dict({{'w': np.arange(4.0)}}, {str(tmp_path / 'c')!r})\n"
        "sd = {'w': np.zeros(4)}\n"
        f"paddle_dcp.load_state_dict(sd, {str(tmp_path / 'c')!r})\n"
        "from paddle_dcp.tools import cli\n"
        f"assert cli.main(['inspect', {str(tmp_path / 'c')!r}]) == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 's3fs', 'botocore', 'aiobotocore'))\n"
        "assert not bad, bad\n"
        "assert (sd['w'] == np.arange(4.0)).all()\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_open_file_names_the_directory_and_the_file_following_a_symlink_only_when_asked(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "m.safetensors").write_bytes(b"x")
    os.symlink(tmp_path / "real" / "m.safetensors", tmp_path / "link.safetensors")
    store, name = io_package.open_file(str(tmp_path / "link.safetensors"))
    assert (store.path, name) == (str(tmp_path / "real"), "m.safetensors")
    store, name = io_package.open_file(str(tmp_path / "link.safetensors"), follow=False)
    assert (store.path, name) == (str(tmp_path), "link.safetensors")
    store, name = io_package.open_file("m.safetensors", follow=False)
    assert (store.path, name) == (".", "m.safetensors")


def test_open_file_of_a_url_is_the_prefix_above_the_object():
    store, name = io_package.open_file("memory://bucket/run/m.safetensors")
    assert (store.resolve(name), name) == ("memory://bucket/run/m.safetensors", "m.safetensors")
    with pytest.raises(ArgumentError, match="names no object under a bucket"):
        io_package.open_file("memory://bucket")


def test_is_file_is_true_of_a_file_alone(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    assert io_package.is_file(str(tmp_path / "f"))
    assert not io_package.is_file(str(tmp_path)) and not io_package.is_file(str(tmp_path / "nope"))
    assert not io_package.is_file("memory://bucket") and not io_package.is_file("memory://bucket/")


def test_default_storage_options_apply_inside_the_block_alone(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("paddle_dcp.io.objects.open_url", lambda url, options: seen.append((url, options)))
    with io_package.default_storage_options({"retries": 2}):
        open_storage("memory://b/x")
        open_storage("memory://b/y", {"retries": 5})  # the caller's options win
        with pytest.raises(UnsupportedError):  # a local path takes none, even here
            open_storage(str(tmp_path), {"retries": 5})
        open_storage(str(tmp_path))  # the defaults are for URLs: a local path ignores them
    open_storage("memory://b/z")
    assert seen == [("memory://b/x", {"retries": 2}), ("memory://b/y", {"retries": 5}), ("memory://b/z", None)]


def test_open_output_writes_the_header_and_the_bytes_and_the_file_appears_at_commit(tmp_path):
    out = tmp_path / "new" / "model.bin"
    writer = io_package.open_output(str(out), header=b"HEAD")
    writer.write(memoryview(b"abc"))
    writer.write(memoryview(b"de"))
    assert listdir(str(tmp_path / "new")) != ["model.bin"]  # not there before its commit
    writer.commit()
    assert out.read_bytes() == b"HEADabcde" and listdir(str(tmp_path / "new")) == ["model.bin"]
