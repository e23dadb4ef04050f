"""A save's claim of its id and generation (io/claims.py): exclusive, the next free id or
generation when taken, and a commit refused once a newer generation is claimed."""
import os
import threading

import pytest

from paddle_dcp.errors import StorageError
from paddle_dcp.io import claims, local
from paddle_dcp.io.storage import list_checkpoints, listing_of

from .memory_storage import MemoryStorage


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):
    return MemoryStorage("mem://ck", {}) if request.param == "memory" else local.LocalStorage(str(tmp_path))


def test_a_save_without_an_id_takes_the_next_id_when_its_id_is_claimed(store):
    listing = list_checkpoints(store)
    assert claims.claim(store, 5, 0, listing, fresh=True) == (5, 0)
    assert claims.claim(store, 5, 0, listing, fresh=True) == (6, 0)  # the same stale listing: the next id
    assert claims.claim(store, 5, 0, listing, fresh=True) == (7, 0)
    assert sorted(list_checkpoints(store).claims) == [(5, 0), (6, 0), (7, 0)]


def test_a_save_of_a_given_id_takes_the_next_generation_when_its_generation_is_claimed(store):
    assert claims.claim(store, 3, 0, None, fresh=False) == (3, 0)
    assert claims.claim(store, 3, 0, None, fresh=False) == (3, 1)
    assert list_checkpoints(store).claimed(3) == [0, 1]


def test_a_save_without_an_id_takes_an_id_the_directory_shows_nothing_of(store):
    """A crashed save's data file (or any claim, or a metadata file) makes an id taken: two
    saves whose listings differ never claim two generations of one id."""
    store.write_atomic("0_4.distcp", b"")
    store.write_atomic("5.metadata", b"{}")
    store.create_exclusive("6.3.claim", b"")
    assert claims.claim(store, 4, 1, list_checkpoints(store), fresh=True) == (7, 0)
    assert claims.claim(store, 4, 1, listing_of([]), fresh=True) == (4, 0)  # a listing that saw nothing of 4


def test_the_first_free_generation_is_past_every_file_and_claim():
    listing = listing_of(["0_2.distcp", "1_2.1.distcp", "2.3.claim", "0_5.distcp"])
    assert claims.first_free(listing, 2) == 4
    assert claims.first_free(listing, 5) == 1
    assert claims.first_free(listing, 9) == 0
    assert claims.first_free(listing, 9, seen=2) == 3


def test_no_free_id_after_the_attempts_is_a_storage_error_naming_the_directory(store, monkeypatch):
    monkeypatch.setattr(claims, "ATTEMPTS", 3)
    monkeypatch.setattr(store, "create_exclusive", lambda name, data: False)  # another save is always first
    for fresh in (False, True):
        with pytest.raises(StorageError, match="no free id"):
            claims.claim(store, 1, 0, None, fresh=fresh)


def test_a_claim_seen_after_a_gap_is_passed_in_one_step(store):
    for g in range(3):
        store.create_exclusive(f"1.{g}.claim", b"")
    assert claims.claim(store, 1, 0, None, fresh=False) == (1, 3)
    assert claims.claim(store, 1, 0, None, fresh=True) == (2, 0)
    assert claims.claim(store, 1, 0, listing_of([]), fresh=True) == (3, 0)  # 1 and 2 found claimed, then listed


def test_a_commit_is_refused_once_a_newer_generation_is_claimed(store):
    claims.check_latest(store, 3, 0)  # nothing newer
    assert claims.claim(store, 3, 0, None, fresh=False) == (3, 0)
    claims.check_latest(store, 3, 0)
    assert claims.claim(store, 3, 0, None, fresh=False) == (3, 1)  # another save of checkpoint 3
    with pytest.raises(StorageError, match=r"3\.1\.claim"):
        claims.check_latest(store, 3, 0)
    claims.check_latest(store, 3, 1)


def test_one_of_many_racing_creators_wins_on_a_local_disk(tmp_path):
    store = local.LocalStorage(str(tmp_path))
    won, start = [], threading.Barrier(8)

    def race(i):
        start.wait()
        if store.create_exclusive("9.0.claim", b"%d" % i):
            won.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and (tmp_path / "9.0.claim").read_bytes() == b"%d" % won[0]


def test_a_link_planted_under_a_claims_name_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(target, ck / "1.0.claim")
    assert not local.LocalStorage(str(ck)).create_exclusive("1.0.claim", b"mine")
    assert target.read_bytes() == b"keep"
