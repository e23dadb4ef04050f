"""The one agreement on failures: after a step, every rank learns whether the step failed on
any rank, and if so every rank raises the same CollectiveError, built from each failing rank's
:class:`~paddle_dcp.errors.Failure` (its class and message, as data).

Two routes carry the same reports and the same verdict:

* ``collective``: one all-reduce (a failure flag and the step's values to maximize), then, only
  when some rank failed, an all-gather of the reports. What the save and load protocols use
  after each local step.
* ``star``: point to point through the coordinator (each rank sends its report, the
  coordinator sends every rank the verdict), over the connections of
  :mod:`paddle_dcp.parallel.p2p`. For steps whose ranks may finish far apart: paddle's gloo
  collectives give up after 30 s, a connection waits as long as its own timeout (a gathered
  save, where the gathering rank writes while the others have long sent their pieces).

Between two ranks inside a pairwise step, a rank that cannot answer sends only the FAILED
status (:func:`paddle_dcp.parallel.wire.send_failed`): the pair stays in step, and its error
reaches every rank here, never through that message.
"""
from __future__ import annotations

from typing import Sequence

from . import wire
from ..errors import CollectiveError, DcpError, Failure, collective_error


def agree(comm, step: str, error: BaseException | None, values: Sequence[int] = (), star: bool = False) -> list[int]:
    """Return the maximum over the ranks of ``values`` when no rank failed; else raise
    CollectiveError(step, failures) on every rank (the failing rank chains its own error). In
    a world of one, re-raise the error.

    Args:
        comm: the ranks' :class:`~paddle_dcp.parallel.comm.Comm`.
        step: the step's name, in the error.
        error: this rank's failure in the step, or None.
        values: integers to maximize over the ranks (every rank gives as many).
        star: through the coordinator, point to point (see the module docstring).
    """
    if comm.size == 1:
        if error is not None:
            raise error
        return list(values)
    route = _star if star else _collective
    maxima, failures = route(comm, step, error, [int(v) for v in values])
    if failures:
        raise collective_error(step, failures) from error
    return maxima


def _collective(comm, step: str, error: BaseException | None, values: list[int]) -> tuple[list[int], dict]:
    maxima = comm.call(step, lambda: comm.all_max([1 if error is not None else 0, *values]))
    if not maxima[0]:
        return list(maxima[1:]), {}
    report = Failure.of(error).encode() if error is not None else b""
    reports = comm.call(step, lambda: comm.all_gather(report))
    return [], {comm.ranks[i]: Failure.decode(m) for i, m in enumerate(reports) if m}


def _star(comm, step: str, error: BaseException | None, values: list[int]) -> tuple[list[int], dict]:
    mine = _report(error, values)
    try:
        if comm.rank != comm.coordinator:
            wire.send_message(comm, comm.coordinator, mine)
            return _verdict(wire.recv_message(comm, comm.coordinator), comm.coordinator)
        reports = {comm.rank: wire.decode_json(mine)}
        for r in comm.ranks:
            if r != comm.rank:
                reports[r] = _checked(wire.recv_message(comm, r), r)
        sized = [rep["v"] for rep in reports.values() if len(rep["v"]) == len(values)]
        maxima = [max(v[i] for v in sized) for i in range(len(values))]
        failures = {r: Failure.from_dict(rep["f"]) for r, rep in reports.items() if rep["f"] is not None}
        verdict = wire.encode_json({"m": maxima, "f": {str(r): f.as_dict() for r, f in failures.items()}})
        for r in comm.ranks:
            if r != comm.rank:
                wire.send_message(comm, r, verdict)
        return maxima, failures
    except DcpError:
        raise
    except Exception as exc:  # a closed connection, a timeout: the peer may have died
        raise communication_failed(step, comm.rank, exc) from exc
    finally:
        comm.end_pairwise()


def communication_failed(step: str, rank: int, exc: BaseException) -> CollectiveError:
    """The error of a step whose messages could not cross (a dead peer, a backend's timeout),
    seen by ``rank``."""
    return CollectiveError(step, {rank: f"communication failed ({Failure.of(exc).line()}); another rank may have died"})


def _report(error: BaseException | None, values: list[int]) -> bytes:
    return wire.encode_json({"v": values, "f": Failure.of(error).as_dict() if error is not None else None})


def _checked(data: bytes | None, rank: int) -> dict:
    """A rank's report as the coordinator received it; one that is not a report (a peer of
    another version, a bug) is that rank's failure."""
    doc = _json(data)
    if isinstance(doc, dict) and isinstance(doc.get("v"), list) and all(type(v) is int for v in doc["v"]) and "f" in doc:
        return doc
    return {"v": [], "f": Failure("", f"sent a malformed agreement report: {bytes(data or b'')[:200]!r}").as_dict()}


def _verdict(data: bytes | None, coordinator: int) -> tuple[list[int], dict]:
    doc = _json(data)
    if not (isinstance(doc, dict) and isinstance(doc.get("m"), list) and isinstance(doc.get("f"), dict)):
        return [], {coordinator: Failure("", f"sent a malformed agreement verdict: {bytes(data or b'')[:200]!r}")}
    return [int(v) for v in doc["m"]], {int(r): Failure.from_dict(f) for r, f in doc["f"].items()}


def _json(data: bytes | None):
    try:
        return wire.decode_json(data) if data else None
    except ValueError:
        return None
