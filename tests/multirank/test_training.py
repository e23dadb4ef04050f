"""get_state_dict / set_state_dict: train on 2 ranks, save, resume on 2 ranks with renamed
parameters (bit for bit), on 4 ranks with a [2, 2] mesh and in one process (to float32
rounding), each compared with the uninterrupted run; the gathered file of the trained state in
one process; master weights; and the examples of docs/training.md, run as they are."""
import re
import pytest

from launcher import assert_passed, run_launch, run_single, script

TRAIN2 = ["train_save_reference", "resume_same_split_exact", "set_from_other_placements"]
RESUME4 = ["resume_grid_4"]
RESUME1 = ["resume_single", "gathered_into_single", "master_weights_round_trip"]


def test_resume_on_other_layouts_and_rank_counts(tmp_path):
    work = tmp_path / "work"
    resume = script("train_resume.py")
    logs = run_launch(resume, 2, tmp_path, args=[work, "train2"], timeout=150)
    assert_passed(logs, TRAIN2, 2)
    logs4 = run_launch(resume, 4, tmp_path, args=[work, "resume4"], timeout=150)
    assert_passed(logs4, RESUME4, 4)
    logs1 = run_single(resume, tmp_path, args=[work, "resume1"], timeout=120)
    assert_passed(logs1, RESUME1, 1)
    lines = re.findall(r"^RESUME .*$", logs + logs4 + logs1, re.M)
    assert len(lines) == 3, lines
    print("\n".join(lines))


@pytest.mark.device
def test_docs_training_examples(tmp_path):
    docs = script("docs_training.py")
    assert_passed(run_launch(docs, 2, tmp_path, args=[tmp_path / "launch"], timeout=150), ["docs_training"], 2)
    assert_passed(run_single(docs, tmp_path, args=[tmp_path / "single"], timeout=120), ["docs_training"], 1)
