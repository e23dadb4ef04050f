"""paddle_dcp.core.naming: which names in a checkpoint directory are metadata, data files (of a
rank, an id and a generation) or a save's temporary files. Oracles: names written out here."""
import pytest

from paddle_dcp.core import naming


@pytest.mark.parametrize("name, parsed", [
    ("0_3.distcp", (0, 3, 0)),
    ("12_7.distcp", (12, 7, 0)),
    ("1_3.2.distcp", (1, 3, 2)),
    ("4_0.safetensors", (4, 0, 0)),
    ("4_0.9.safetensors", (4, 0, 9)),
    ("3.metadata", None), ("0_3.distcp.tmp.ab12", None), ("x_3.distcp", None), ("0_3.bin", None),
    ("0_3", None), ("_3.distcp", None), ("model.safetensors", None), ("0_3.2.1.distcp", None),
])  # fmt: skip
def test_a_data_file_name_gives_its_rank_id_and_generation(name, parsed):
    assert naming.parse_data_name(name) == parsed


@pytest.mark.parametrize("args, name", [
    ((0, 3), "0_3.distcp"), ((5, 3, 0), "5_3.distcp"), ((5, 3, 2), "5_3.2.distcp"),
    ((1, 0, 0, "safetensors"), "1_0.safetensors"), ((1, 0, 4, "safetensors"), "1_0.4.safetensors"),
])  # fmt: skip
def test_data_file_names_round_trip(args, name):
    assert naming.data_file_name(*args) == name
    assert naming.parse_data_name(name) == tuple(args[:3]) + (0,) * (3 - len(args[:3]))


def test_an_unknown_suffix_is_refused():
    with pytest.raises(ValueError, match="'npz'"):
        naming.data_file_name(0, 1, suffix="npz")


def test_metadata_names():
    assert naming.metadata_name(12) == "12.metadata"
    assert naming.METADATA_RE.match("12.metadata").group(1) == "12"
    for other in ("12.metadata.tmp.ab", "a.metadata", "12.meta", ".metadata"):
        assert naming.METADATA_RE.match(other) is None


@pytest.mark.parametrize("name, temporary", [
    ("0_3.distcp.tmp.0badf00d", True), ("1_3.2.distcp.tmp.0a1b", True), ("9.metadata.tmp.ab12", True),
    ("2_9.safetensors.tmp.cd34", True),
    ("0_3.distcp", False), ("out.npz.tmp.ab12", False), ("0_3.distcp.tmp.XYZ", False), ("0_3.distcp.tmp.", False),
])  # fmt: skip
def test_temporary_files_of_a_save_are_told_from_other_files(name, temporary):
    assert (naming.TMP_RE.match(name) is not None) == temporary
    assert naming.TMP_MARK in name or not temporary


@pytest.mark.parametrize("name", [
    "12.metadata\n", "0_3.distcp\n", "0_3.2.safetensors\n", "0_3.distcp.tmp.ab12\n",
    "\u0661\u0662.metadata", "0_\u0663.distcp", "\uff11_3.distcp",  # Arabic-Indic and full-width digits
])
def test_a_name_is_matched_whole_and_in_ascii_digits(name):
    """A final newline or another script's digits (which int() reads as the same number) make
    no checkpoint's name: a crafted directory cannot pass one off as checkpoint 12's."""
    assert naming.METADATA_RE.match(name) is None and naming.parse_data_name(name) is None
    assert naming.TMP_RE.match(name) is None
