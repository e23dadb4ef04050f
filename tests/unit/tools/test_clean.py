"""paddle_dcp.tools.clean (the clean command): a dry run changes nothing and lists what would
go; temporary files go first, data files no metadata uses only with --incomplete; the
checkpoint still verifies after."""
import os


from .commands import run



LEFTOVERS = {
    "temporary": ["0_1.distcp.tmp.0badf00d", "1.metadata.tmp.deadbeef"],
    "incomplete": ["0_7.distcp", "1_7.distcp"],
    "superseded": ["2_0.1.distcp"],  # a generation the metadata of checkpoint 0 does not list
}


def add_leftovers(path):
    for names in LEFTOVERS.values():
        for name in names:
            with open(os.path.join(path, name), "wb") as f:
                f.write(b"x" * 10)


def test_clean_dry_run_changes_nothing(ck, capsys):
    add_leftovers(ck)
    before = sorted(os.listdir(ck))
    code, out, _ = run(capsys, "clean", ck, "--dry-run")
    assert code == 0 and sorted(os.listdir(ck)) == before
    assert {line.split("/")[-1] for line in out.splitlines() if line.startswith("would remove ")} == set(
        LEFTOVERS["temporary"]
    )
    code, out, _ = run(capsys, "clean", ck, "--incomplete", "--dry-run")
    assert code == 0 and sorted(os.listdir(ck)) == before
    listed = {line.split("/")[-1] for line in out.splitlines() if line.startswith("would remove ")}
    assert listed == {n for names in LEFTOVERS.values() for n in names}
    assert "total: 5 files (50 bytes) would be removed" in out


def test_clean_removes_temporary_files_then_incomplete_ones(ck, capsys):
    complete = sorted(os.listdir(ck))
    add_leftovers(ck)
    code, out, _ = run(capsys, "clean", ck)
    assert code == 0
    assert sorted(os.listdir(ck)) == sorted(complete + LEFTOVERS["incomplete"] + LEFTOVERS["superseded"])
    assert f"removed {os.path.join(ck, LEFTOVERS['temporary'][0])}" in out
    code, out, _ = run(capsys, "clean", ck, "--incomplete")
    assert code == 0 and sorted(os.listdir(ck)) == complete
    assert "total: 3 files (30 bytes) removed" in out
    code, out, _ = run(capsys, "clean", ck, "--incomplete")
    assert code == 0 and "nothing to remove" in out
    assert run(capsys, "verify", ck)[0] == 0
