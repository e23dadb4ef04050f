"""The library words its refusals without command-line names; the cli adds its options."""
import numpy as np
import pytest

from paddle_dcp.errors import ArgumentError, UnsupportedError
from paddle_dcp.tools import consolidate

from ..helpers import save_checkpoint
from .test_cli import run, saved  # noqa: F401 - the fixture


def test_a_bad_key_pattern_is_an_argument_error_the_cli_names_by_its_option(saved, tmp_path, capsys):  # noqa: F811
    with pytest.raises(ArgumentError) as info:
        consolidate.key_filter("(")
    assert "--keys" not in str(info.value) and "'(' is not a regular expression" in str(info.value)
    code, _, err = run(capsys, "convert", saved[0], tmp_path / "bad.npz", "--keys", "(")
    assert code == 1 and "error: --keys '(' is not a regular expression" in err


def test_a_dtype_safetensors_refuses_gets_the_cli_options_only_from_the_cli(tmp_path, capsys):
    path = str(tmp_path / "c128")
    (tmp_path / "c128").mkdir()
    save_checkpoint(path, {"z": np.ones(3, np.complex128)}, {"z": "complex128"}, (1,), {"z": (None,)})
    meta = consolidate.open_storage(path).read_metadata(0)
    with pytest.raises(UnsupportedError) as info:
        consolidate.convert(path, meta, str(tmp_path / "z.safetensors"), "safetensors", consolidate.select(meta))
    assert "--" not in str(info.value) and "complex128" in str(info.value)
    code, _, err = run(capsys, "convert", path, tmp_path / "z.safetensors")
    assert code == 1 and err.strip().endswith("; leave it out with --keys or convert --to npz"), err
    with pytest.raises(ArgumentError, match="unknown output format"):
        consolidate.convert(path, meta, str(tmp_path / "z.x"), "x", consolidate.select(meta))
