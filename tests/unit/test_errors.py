"""paddle_dcp.errors: the one exception tree, the collective error every rank raises (its
message, its pickling, a mismatch on every rank kept a MismatchError), and a rank's failure
crossing to other ranks as data (class and message as JSON fields, never text to parse)."""
import pickle

import pytest

from paddle_dcp import errors



def test_collective_error_names_ranks_and_survives_pickling():
    e = errors.CollectiveError("write", {3: "OSError: disk full", 1: "FormatError: bad"})
    assert list(e.failures) == [1, 3] and e.step == "write"
    assert "rank 1: FormatError: bad" in str(e) and "2 rank(s)" in str(e)
    back = pickle.loads(pickle.dumps(e))
    assert back.step == e.step and back.failures == e.failures and str(back) == str(e)
    one, two = errors.MismatchError("2 key(s) ..."), errors.MismatchError("1 key(s) ...")
    mismatch = errors.collective_error("plan", {0: errors.Failure.of(one), 1: errors.Failure.of(two)})
    assert isinstance(mismatch, errors.MismatchError) and isinstance(mismatch, errors.CollectiveError)
    assert mismatch.failures == {0: "MismatchError: 2 key(s) ...", 1: "MismatchError: 1 key(s) ..."}
    back = pickle.loads(pickle.dumps(mismatch))
    assert type(back) is errors.CollectiveMismatchError and back.errors == mismatch.errors
    other = errors.collective_error("plan", {0: errors.Failure.of(one), 1: errors.Failure.of(OSError("b"))})
    assert not isinstance(other, errors.MismatchError)
    many = errors.CollectiveError("plan", {r: "x" for r in range(20)})
    assert "and 12 more ranks" in str(many)


def test_storage_error_keeps_its_path():
    assert errors.StorageError("cannot read", "/ck/0.metadata").path == "/ck/0.metadata"


def test_a_bad_state_dict_is_a_mismatch_and_still_a_format_error():
    assert issubclass(errors.StateDictError, errors.MismatchError)
    assert issubclass(errors.StateDictError, errors.FormatError)
    bad = errors.Failure.of(errors.StateDictError("bad: cannot save a value of type object"))
    assert bad.line() == "StateDictError (FormatError): bad: cannot save a value of type object"
    assert errors.Failure.of(OSError("disk full")).line() == "OSError: disk full"
    both = errors.collective_error("flatten", {0: bad, 1: errors.Failure.of(errors.MismatchError("1 key(s) ..."))})
    assert isinstance(both, errors.CollectiveMismatchError) and "rank 0: StateDictError" in str(both)
    assert type(errors.collective_error("flatten", {0: bad, 1: errors.Failure.of(OSError("b"))})) is errors.CollectiveError


def test_a_failure_crosses_ranks_as_data_not_as_text_to_parse():
    """Its class and message travel as JSON fields: a message that reads like another class
    is not taken for one (text parsing did that), and what does not decode says so."""
    f = errors.Failure.of(errors.IntegrityError("0_0.distcp: bytes [0, 64) fail their checksum"))
    assert errors.Failure.decode(f.encode()) == f and f.kind == "IntegrityError" and not f.mismatch
    posing = errors.Failure.of(OSError("MismatchError: a key is missing"))
    assert not errors.Failure.decode(posing.encode()).mismatch
    assert type(errors.collective_error("load", {0: posing})) is errors.CollectiveError
    assert errors.Failure.decode(b"MismatchError: plain text").kind == ""
    assert "malformed failure report" in errors.Failure.decode(b"{not json").message
    assert len(errors.Failure.of(OSError("x" * 10000)).encode(limit=100)) < 300


@pytest.mark.parametrize("doc", [
    None, [], "MismatchError: x", {"kind": "X"}, {"message": "m", "mismatch": True},
    {"kind": "X", "mismatch": False},
])  # fmt: skip
def test_a_report_that_is_not_a_failure_is_reported_as_it_came(doc):
    f = errors.Failure.from_dict(doc)
    assert f.kind == "" and not f.mismatch and f.message.startswith("a malformed failure report: ")
    assert f.line() == f.message  # no class to name


def test_a_failure_report_takes_only_true_as_a_mismatch_and_keeps_its_other_class():
    doc = {"kind": "StateDictError", "message": "m", "mismatch": "yes", "also": "FormatError"}
    f = errors.Failure.from_dict(doc)
    assert (f.kind, f.message, f.mismatch, f.also) == ("StateDictError", "m", False, "FormatError")
    assert errors.Failure.from_dict({**doc, "mismatch": True}).mismatch
    assert errors.Failure.from_dict({"kind": "K", "message": "m", "mismatch": False}).also == ""


def test_a_collective_error_of_no_failures_is_no_mismatch():
    e = errors.collective_error("save", {})
    assert type(e) is errors.CollectiveError and "failed on 0 rank(s)" in str(e)


@pytest.mark.parametrize("cls, bases", [
    (errors.ArgumentError, (errors.DcpError, ValueError)),
    (errors.UnsupportedError, (errors.DcpError, ValueError)),
    (errors.IntegrityError, (errors.FormatError,)),
    (errors.CollectiveMismatchError, (errors.CollectiveError, errors.MismatchError)),
    (errors.DcpError, (Exception,)),
])  # fmt: skip
def test_the_tree_is_as_the_module_docstring_draws_it(cls, bases):
    assert all(issubclass(cls, b) for b in bases)
    assert cls.__name__ in errors.__doc__
