"""paddle_dcp.parallel.requests: the requests a protocol yields are plain frozen values that
compare by content, and ``Request`` names every one of them (a comm dispatches on it)."""
import dataclasses
import inspect
import typing

import pytest

from paddle_dcp.parallel import requests


def classes():
    """The requests (not Reduction: what a ReduceAmong carries)."""
    return [c for _, c in inspect.getmembers(requests, inspect.isclass)
            if c.__module__ == requests.__name__ and c is not requests.Reduction]


def test_request_is_the_union_of_every_request_class():
    assert set(typing.get_args(requests.Request)) == set(classes())
    assert {c.__name__ for c in classes()} == {
        "AllMax", "Gather", "Scatter", "Broadcast", "AllGather", "Agree", "Pairwise", "ReduceAmong", "Detach"
    }


@pytest.mark.parametrize("cls", classes(), ids=lambda c: c.__name__)
def test_no_request_changes_once_yielded(cls):
    names = [f.name for f in dataclasses.fields(cls)]
    request = cls(*[None] * len(names))
    for name in names:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(request, name, 1)


def test_requests_compare_by_content_and_cannot_change():
    assert requests.Gather(b"x", 0) == requests.Gather(b"x", 0) != requests.Gather(b"x", 1)
    assert requests.Agree("write", None).values == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        requests.Broadcast(b"x", 0).root = 1
