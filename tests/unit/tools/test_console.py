"""paddle_dcp.tools.console: byte counts for people, the progress line (without tqdm), usage
errors of a directory, and the checkpoint a command works on. Oracles: strings written out here
and listings built from file names."""
import sys
from types import SimpleNamespace

import pytest

from paddle_dcp.errors import FormatError
from paddle_dcp.io.storage import listing_of
from paddle_dcp.tools import console


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 << 20, "5.0 MiB"),
    (3 << 30, "3.0 GiB"), (2 << 40, "2.0 TiB"), (5000 << 40, "5000.0 TiB"),
])  # fmt: skip
def test_bytes_for_people(n, text):
    assert console.human(n) == text


def test_a_multi_line_message_is_one_line():
    assert console._one_line("  a\n   b\n\nc ") == "a; b; c"


def test_the_progress_line_without_tqdm_draws_done_total_and_percent(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed
    with console.ProgressBar(2048, "verify 0", enabled=True) as bar:
        bar.update(1024)
        bar.update(1024)
    err = capsys.readouterr().err
    assert "verify 0: 2.0 KiB / 2.0 KiB (100%)" in err and err.endswith("\n")
    with console.ProgressBar(2048, "x", enabled=False) as bar:
        bar.update(10)
    with console.ProgressBar(0, "x", enabled=True) as bar:  # nothing to count: nothing drawn
        bar.update(0)
    assert capsys.readouterr().err == "" and bar.done == 0


def test_progress_is_on_when_asked_or_when_stderr_is_a_terminal(monkeypatch):
    assert console._progress_enabled(SimpleNamespace(progress=True))
    assert not console._progress_enabled(SimpleNamespace(progress=False))
    monkeypatch.setattr(sys, "stderr", SimpleNamespace(isatty=lambda: True))
    assert console._progress_enabled(SimpleNamespace(progress=None))


def test_a_command_needs_an_existing_directory_or_a_url(tmp_path):
    assert console._directory(str(tmp_path)) == str(tmp_path)
    assert console._directory("s3://bucket/run/") == "s3://bucket/run"
    with pytest.raises(console.UsageError, match="does not exist"):
        console._directory(str(tmp_path / "nope"))
    (tmp_path / "f").write_text("")
    with pytest.raises(console.UsageError, match="is not a directory"):
        console._directory(str(tmp_path / "f"))


def test_the_checkpoint_chosen_is_the_one_asked_or_the_latest_complete():
    listing = listing_of(["3.metadata", "0_3.distcp", "5.metadata", "0_5.distcp", "0_7.distcp"])
    assert console.incomplete_ids(listing) == [7]
    assert console.choose_id("ck", listing, None) == 5
    assert console.choose_id("ck", listing, 3) == 3
    with pytest.raises(FormatError, match="checkpoint 7 in ck is incomplete: data files but no 7.metadata"):
        console.choose_id("ck", listing, 7)
    with pytest.raises(console.UsageError, match="no checkpoint 4 in ck; complete ids: 3, 5"):
        console.choose_id("ck", listing, 4)


def test_without_a_complete_checkpoint_the_error_names_the_incomplete_ids():
    with pytest.raises(FormatError, match=r"no complete checkpoint in ck: no \*.metadata file \(incomplete ids: 2\)"):
        console.choose_id("ck", listing_of(["0_2.distcp"]), None)
    with pytest.raises(FormatError, match=r"no \*.metadata file$"):
        console.choose_id("ck", listing_of([]), None)
