"""The layout a CheckpointManager records with a step and reports with a restore
(core/job_layout.py): its JSON, and what a reader refuses."""
import json

import pytest

from paddle_dcp.core.job_layout import JobLayout, Mesh
from paddle_dcp.errors import FormatError


@pytest.mark.parametrize("layout", [
    JobLayout(1),
    JobLayout(2, (), ((0, 1),)),
    JobLayout(8, (Mesh((2, 4), tuple(range(8)), ("dp", "mp")), Mesh((4,), (4, 5, 6, 7), ("pp",))), ((0, 1, 2, 3), (4, 5, 6, 7))),
])
def test_a_layout_round_trips_through_json(layout):
    doc = json.loads(json.dumps(layout.to_json()))
    assert JobLayout.from_json(doc, "here") == layout


def test_unknown_parts_stay_unknown():
    """None (not recorded) is told from () (recorded: no dist tensor)."""
    assert JobLayout.from_json({"world_size": 3}, "here") == JobLayout(3, None, None)
    assert JobLayout(3, (), None).to_json() == {"world_size": 3, "meshes": [], "nodes": None}


@pytest.mark.parametrize("doc", [
    None, [], {}, {"world_size": 0}, {"world_size": "2"}, {"world_size": True},
    {"world_size": 2, "meshes": [{"shape": [2]}]},
    {"world_size": 2, "meshes": [{"shape": [2.0], "process_ids": [0, 1]}]},
    {"world_size": 2, "nodes": [[0, "1"]]}, {"world_size": 2, "nodes": 3},
])
def test_what_is_not_a_layout_is_a_format_error_naming_its_source(doc):
    with pytest.raises(FormatError, match="^record.json: "):
        JobLayout.from_json(doc, "record.json")
