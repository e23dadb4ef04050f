"""A checkpoint whose pieces overlap or leave a gap is a bad checkpoint: every public entry
point (read_metadata, load_state_dict, the verify command) raises or reports a FormatError
naming the metadata file and the key, never a PlanError."""
import pytest

import paddle_dcp
from paddle_dcp.errors import FormatError, PlanError
from paddle_dcp.tools import cli

from unit.checkpoints import assert_untouched, read_doc, target, two_rank_checkpoint, write_doc

EDITS = {  # w: 8 x 5 float32 in two pieces of 4 rows at offsets [0, 0] and [4, 0]
    "overlap and gap": ("offsets", [0, 0, 3, 0]),
    "gap": ("offsets", [0, 0, 5, 0]),
    "overlap": ("offsets", [0, 0, 2, 0]),
}


@pytest.fixture(params=sorted(EDITS))
def bad(request, tmp_path):
    path = two_rank_checkpoint(str(tmp_path / "ck"))
    doc = read_doc(path)
    field, value = EDITS[request.param]
    doc["tensors"]["model.w"][field] = value
    if request.param == "overlap":  # the second piece 6 rows long, still inside the tensor
        doc["tensors"]["model.w"]["shapes"] = [4, 5, 6, 5]
    write_doc(path, doc)
    return path


def _is_format_error(exc: BaseException) -> None:
    assert isinstance(exc, FormatError) and not isinstance(exc, PlanError), type(exc)
    assert "0.metadata" in str(exc) and "model.w" in str(exc), exc


def test_read_metadata_raises_a_format_error(bad):
    with pytest.raises(paddle_dcp.DcpError) as info:
        paddle_dcp.read_metadata(bad)
    _is_format_error(info.value)


def test_load_raises_a_format_error_and_changes_nothing(bad):
    sd = target()
    with pytest.raises(paddle_dcp.DcpError) as info:
        paddle_dcp.load_state_dict(sd, bad)
    _is_format_error(info.value)
    assert_untouched(sd)


def test_verify_reports_the_metadata_file_and_the_key(bad, capsys):
    code = cli.main(["verify", bad])
    out = capsys.readouterr().out
    assert code == 1, out
    assert any("0.metadata" in line and "model.w" in line for line in out.splitlines()), out
