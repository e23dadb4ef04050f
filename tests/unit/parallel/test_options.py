"""The frozen options of a save and a load (parallel/options.py): what a rank is asked, by
value."""
from paddle_dcp.parallel.options import SaveOptions


def test_a_save_names_its_data_files_by_the_kind_its_options_ask_for():
    assert SaveOptions().file_kind == "distcp"
    assert SaveOptions(safetensors=True).file_kind == "safetensors"

