"""Cleaning a checkpoint directory up (io/cleanup.py): temporary files of crashed saves by id
and rank, data files of older generations and of ids without metadata; nothing else."""
import os

from paddle_dcp.io import cleanup, local
from paddle_dcp.io.storage import listing_of


def test_removing_temporary_and_stale_files_touches_only_what_it_names(tmp_path):
    names = ["3.metadata", "0_3.distcp", "1_3.distcp", "0_3.1.distcp", "0_3.distcp.tmp.ab", "1_3.1.distcp.tmp.cd",
             "3.metadata.tmp.ef", "0_4.distcp", "0_4.distcp.tmp.aa", "notes.txt", "3.0.claim", "3.1.claim", "3.2.claim",
             "0_3.2.distcp", "0_3.2.distcp.tmp.01", "4.0.claim"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(b"")
    path = str(tmp_path)
    store = local.LocalStorage(path)
    # older generations go with their claims; generation 2 and every temporary file may be a
    # save still running: they stay
    assert sorted(cleanup.remove_older(store, 3, 0, 1, claims=True)) == ["0_3.distcp", "3.0.claim"]
    assert sorted(cleanup.remove_temporary(store, 3, 0)) == ["0_3.2.distcp.tmp.01", "0_3.distcp.tmp.ab"]
    assert cleanup.remove_temporary(store, 3, -1) == ["3.metadata.tmp.ef"]
    assert cleanup.remove_incomplete(store) == ["0_4.distcp", "4.0.claim"]
    assert sorted(cleanup.remove_temporary(store)) == ["0_4.distcp.tmp.aa", "1_3.1.distcp.tmp.cd"]
    assert sorted(os.listdir(path)) == ["0_3.1.distcp", "0_3.2.distcp", "1_3.distcp", "3.1.claim", "3.2.claim",
                                        "3.metadata", "notes.txt"]


def test_temporary_names_by_id_and_rank():
    listing = listing_of(["0_3.distcp.tmp.a", "1_3.2.distcp.tmp.b", "3.metadata.tmp.c", "0_4.distcp.tmp.d", "3.metadata"])
    assert sorted(cleanup.temporary_names(listing)) == ["0_3.distcp.tmp.a", "0_4.distcp.tmp.d", "1_3.2.distcp.tmp.b",
                                                        "3.metadata.tmp.c"]
    assert sorted(cleanup.temporary_names(listing, 3)) == ["0_3.distcp.tmp.a", "1_3.2.distcp.tmp.b", "3.metadata.tmp.c"]
    assert cleanup.temporary_names(listing, 3, 1) == ["1_3.2.distcp.tmp.b"]
    assert cleanup.temporary_names(listing, 3, -1) == ["3.metadata.tmp.c"]  # the coordinator's metadata
    assert cleanup.temporary_names(listing, 5) == []


def test_removing_steps_takes_their_data_and_temporary_files_of_one_rank_or_all_and_nothing_else(tmp_path):
    names = ["3.metadata", "0_3.distcp", "1_3.distcp", "1_3.1.distcp", "1_3.distcp.tmp.ab", "3.metadata.tmp.ef",
             "0_4.distcp", "1_4.distcp", "4.metadata", "0_5.distcp", "1_5.distcp.tmp.cd", "notes.txt"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(b"")
    store = local.LocalStorage(str(tmp_path))
    assert sorted(cleanup.remove_steps(store, [3, 4], rank=1)) == ["1_3.1.distcp", "1_3.distcp", "1_3.distcp.tmp.ab",
                                                                   "1_4.distcp"]
    assert sorted(cleanup.remove_steps(store, [3])) == ["0_3.distcp", "3.metadata.tmp.ef"]
    assert cleanup.remove_steps(store, []) == []
    # the metadata is the caller's to remove first; other steps and other files stay
    assert sorted(os.listdir(tmp_path)) == ["0_4.distcp", "0_5.distcp", "1_5.distcp.tmp.cd", "3.metadata", "4.metadata",
                                            "notes.txt"]
