"""The CheckpointManager's retention policy and manifest (pure, milliseconds)."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from paddle_dcp.core.job_layout import JobLayout, Mesh
from paddle_dcp.core.retention import Manifest, StepEntry, check_metrics, score, to_delete
from paddle_dcp.errors import ArgumentError, FormatError


def manifest(complete=(), writing=(), deleting=(), metrics=None):
    entries = [StepEntry(s, "complete", (metrics or {}).get(s)) for s in complete]
    entries += [StepEntry(s, "writing") for s in writing] + [StepEntry(s, "deleting") for s in deleting]
    return Manifest({e.step: e for e in entries})


def test_max_to_keep_keeps_the_newest():
    assert to_delete(manifest([10, 20, 30, 40]), 2) == [10, 20]
    assert to_delete(manifest([10, 20, 30, 40]), 1) == [10, 20, 30]
    assert to_delete(manifest([10, 20]), 5) == []


def test_none_keeps_every_complete_step_but_cleans_unfinished():
    assert to_delete(manifest([1, 2, 3], writing=[0], deleting=[5]), None) == [0, 5]


def test_the_step_being_written_is_never_deleted():
    assert to_delete(manifest([1, 2], writing=[3]), 1, protected=[3]) == [1]


def test_keep_every_n_steps_keeps_multiples_besides_max_to_keep():
    m = manifest([100, 200, 300, 400, 500, 600])
    assert to_delete(m, 2, keep_every_n_steps=300) == [100, 200, 400]
    assert to_delete(m, None, keep_every_n_steps=300) == []


def test_best_keeps_the_best_and_always_the_newest():
    m = manifest([1, 2, 3, 4])
    loss = {1: 0.5, 2: 0.1, 3: 0.3, 4: 0.9}
    assert to_delete(m, 2, scores={s: score(v, "min") for s, v in loss.items()}) == [1]  # keep 2, 3 (best) and 4 (newest)
    assert to_delete(m, 2, scores={s: score(v, "max") for s, v in loss.items()}) == [2, 3]  # keep 4, 1


def test_best_ranks_steps_without_a_value_last_and_ties_by_newer():
    m = manifest([1, 2, 3, 4, 5])
    scores = {1: None, 2: 1.0, 3: 1.0, 4: None, 5: 0.0}
    assert to_delete(m, 2, scores=scores) == [1, 4]  # keep 3, 2 (the best) and 5 (the newest)
    assert to_delete(m, 1, scores=scores) == [1, 2, 4]  # the tie is won by the newer


def test_score_takes_numbers_only():
    assert score(2, "max") == 2.0 and score(2.5, "min") == -2.5
    assert score(float("nan"), "max") is None and score("x", "max") is None and score(True, "max") is None


@settings(max_examples=200, deadline=None)
@given(
    st.sets(st.integers(0, 60), max_size=12),
    st.sets(st.integers(61, 70), max_size=3),
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.integers(1, 20)),
    st.booleans(),
)
def test_invariants(complete, unfinished, max_to_keep, every, best):
    m = manifest(sorted(complete), writing=sorted(unfinished))
    scores = {s: float((s * 7) % 11) for s in complete} if best else None
    protected = set(list(unfinished)[:1])
    doomed = set(to_delete(m, max_to_keep, every, scores, protected))
    kept = complete - doomed
    assert doomed <= complete | unfinished and not doomed & protected
    assert unfinished - protected <= doomed  # leftovers of crashes go
    if complete:
        assert max(complete) in kept  # the newest complete step is never deleted
    if every:
        assert {s for s in complete if s % every == 0} <= kept
    if max_to_keep is None:
        assert kept == complete
    else:
        assert len(kept - {s for s in complete if every and s % every == 0} - {max(complete, default=-1)}) <= max_to_keep
        if not best:  # the newest ones
            assert sorted(complete)[-max_to_keep:] == sorted(kept)[-max_to_keep:] or len(complete) <= max_to_keep


def test_manifest_round_trips_through_json_without_pickle():
    m = manifest([3], writing=[4], deleting=[1], metrics={3: {"loss": 0.25, "tag": "a", "nan": float("nan")}})
    back = Manifest.from_json(m.to_json())
    assert back.steps.keys() == m.steps.keys() and back.complete() == [3]
    assert back.steps[3].metrics["loss"] == 0.25 and back.steps[4].state == "writing"
    assert json.loads(m.to_json())["format"] == "paddle_dcp.manager"


def test_a_step_s_layout_round_trips_and_a_manifest_without_one_reads_as_before():
    layout = JobLayout(4, (Mesh((2, 2), (0, 1, 2, 3), ("dp", "mp")),), ((0, 1), (2, 3)))
    m = Manifest().with_entry(StepEntry(2, "complete", None, layout)).with_entry(StepEntry(3, "complete"))
    doc = json.loads(m.to_json())
    assert doc["steps"][0]["layout"] == {"world_size": 4, "nodes": [[0, 1], [2, 3]],
                                         "meshes": [{"shape": [2, 2], "process_ids": [0, 1, 2, 3], "dim_names": ["dp", "mp"]}]}
    assert "layout" not in doc["steps"][1]  # an entry without one is written as before it existed
    back = Manifest.from_json(m.to_json())
    assert back.steps[2].layout == layout and back.steps[3].layout is None
    doc["steps"][0]["layout"] = {"world_size": 0}
    with pytest.raises(FormatError, match="world_size"):
        Manifest.from_json(json.dumps(doc).encode())


@pytest.mark.parametrize("data", [b"{", b'{"format": "x"}', b'{"format": "paddle_dcp.manager", "version": 9, "steps": []}',
                                  b'{"format": "paddle_dcp.manager", "version": 1, "steps": [{"step": -1, "state": "complete", "metrics": null}]}',
                                  b'{"format": "paddle_dcp.manager", "version": 1, "steps": [{"step": 1, "state": "odd", "metrics": null}]}'])
def test_bad_manifests_are_format_errors(data):
    with pytest.raises(FormatError):
        Manifest.from_json(data)


def test_metrics_must_be_json():
    assert check_metrics(None) is None
    assert check_metrics({"loss": 1, "acc": [0.5]}) == {"loss": 1, "acc": [0.5]}
    with pytest.raises(ArgumentError):
        check_metrics({"x": object()})
    with pytest.raises(ArgumentError):
        check_metrics({1: 2})
    with pytest.raises(ArgumentError):
        check_metrics([1])
