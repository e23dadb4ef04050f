"""The coordinator's account of the node-local tier's check (core.tier_check): what it tells
each rank after the survey and after each pass, against the sets worked out by hand."""
from __future__ import annotations

from paddle_dcp.core.tier_check import Survey, TierCheck

NODES = ((0, 1), (2, 3), (4, 5))  # writers 0..5; node 1 is new and empty
RANKS = (0, 1, 2, 3, 4, 5)
NEED = frozenset(range(6))


def survey(rank: int, good=(), bad=(), recorded=None, meta=True) -> Survey:
    return Survey(meta, NEED if meta else frozenset(), frozenset(good), tuple(bad), 77 if meta else 0,
                  None if recorded is None else frozenset(recorded))


def test_without_any_intact_metadata_each_node_is_told_the_names_its_ranks_found_bad():
    book = TierCheck(NODES)
    found = [survey(0, meta=False, bad=("7.metadata",)), survey(1, meta=False, bad=("0_0.distcp",)),
             survey(2, meta=False), survey(3, meta=False), survey(4, meta=False, bad=("x",)), survey(5, meta=False)]
    common, per_node = book.survey(RANKS, found)
    assert common == {"known": False}
    assert per_node == [{"bad": ["0_0.distcp", "7.metadata"]}, {"bad": []}, {"bad": ["x"]}]


def test_the_survey_names_the_writers_no_original_is_left_of_and_those_no_record_places():
    book = TierCheck(NODES)
    found = [survey(0, good=(0, 1), recorded=(0, 1)), survey(1, good=(0, 1)),
             survey(2, meta=False), survey(3, meta=False),
             survey(4, good=(4,), recorded=(4, 5)), survey(5, good=(4,))]  # 5's original is short
    common, per_node = book.survey(RANKS, found)
    assert common == {"known": True, "digest": 77, "absent": {2, 3, 5}, "holder": 0, "gone": {2, 3}}
    assert per_node == [{"bad": []}] * 3


def test_without_records_there_is_no_holder_and_nothing_is_gone():
    common, _ = TierCheck(NODES).survey(RANKS, [survey(r, good=(r,)) for r in RANKS])
    assert common["holder"] is None and common["gone"] == set() and common["absent"] == set()


def test_an_original_that_fails_its_check_sends_a_second_pass_to_its_copies():
    book = TierCheck(NODES)
    book.survey(RANKS, [survey(r, good=(r,)) for r in RANKS])
    # pass 1: every original checked; rank 3's is damaged (node 1 says so)
    good = [frozenset({r}) for r in RANKS]
    good[3] = frozenset()
    common, per_node = book.checked(RANKS, good, [(), (), (), ("3_0.distcp",), (), ()], originals=True)
    assert common == {"next": {3}}
    assert per_node == [{"bad": []}, {"bad": ["3_0.distcp"]}, {"bad": []}]
    # pass 2: node 2 holds the copy of 3 and finds it intact; node 1 is told nothing again
    common, per_node = book.checked(RANKS, [frozenset(), frozenset(), frozenset(), frozenset(), frozenset({3}), frozenset()],
                                    [()] * 6, originals=False)
    assert common == {"next": None, "lost": set()}
    assert per_node == [{"bad": []}] * 3


def test_a_writer_no_pass_finds_intact_is_lost():
    book = TierCheck(NODES)
    book.survey(RANKS, [survey(r, good=(r,) if r != 5 else ()) for r in RANKS])  # 5: absent
    common, _ = book.checked(RANKS, [frozenset({r}) for r in RANKS if r != 5] + [frozenset()], [()] * 6, originals=True)
    assert common == {"next": None, "lost": {5}}  # absent writers' copies were in this pass: no second one
