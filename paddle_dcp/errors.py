"""The one exception hierarchy of paddle_dcp.

::

    DcpError(Exception)
      FormatError        unreadable, corrupt, or unsupported checkpoint (metadata or data)
        IntegrityError   bytes whose checksum or size disagrees with the metadata
      MismatchError      key missing or unexpected; shape or dtype differs (names key + both)
        StateDictError   a state dict the library cannot take (also a FormatError)
      StorageError       I/O failure on a named path
      CollectiveError    a step failed on some ranks; .failures maps rank -> message
        CollectiveMismatchError  ... each of them with a MismatchError (also a MismatchError)
      PlanError          boxes that overlap, leave gaps, or fall out of bounds
      ArgumentError      a bad argument of a call (also a ValueError)
      UnsupportedError   a layout or value this version refuses (also a ValueError)

Every message says what went wrong, where (key, file, rank) and, where it helps, what to do.
A rank's failure crosses to other ranks as a :class:`Failure` (its class and message, as
data), never as text to parse.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping


class DcpError(Exception):
    """Base class of every error paddle_dcp raises on purpose."""


class FormatError(DcpError):
    """A checkpoint that cannot be read: malformed, corrupt, or of an unsupported version."""


class IntegrityError(FormatError):
    """Bytes on disk that disagree with the metadata (checksum, size, missing file)."""


class MismatchError(DcpError):
    """The state dict and the checkpoint disagree: a key, a shape, a dtype or a structure."""


class StateDictError(MismatchError, FormatError):
    """A state dict the library cannot take: an object leaf, a non-str key, two paths to one key.

    It is a FormatError only for compatibility with earlier releases, which raised that.
    """


class StorageError(DcpError):
    """An operating-system error while reading or writing a named path."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class PlanError(DcpError):
    """Pieces that do not tile their tensor: overlap, gap, or out of bounds."""


class ArgumentError(DcpError, ValueError):
    """An argument of a call that is wrong in itself (a negative id, an unknown name)."""


class UnsupportedError(DcpError, ValueError):
    """An argument, layout or value paddle_dcp refuses (rather than ignoring it silently)."""


@dataclass(frozen=True)
class Failure:
    """One rank's failure as it crosses to other ranks: structured, never text to parse.

    Attributes:
        kind: the exception's class name (``"IntegrityError"``); empty for what a rank saw of
            another (``"closed the connection"``), which is no exception of its own.
        message: the exception's message.
        mismatch: the exception is a :class:`MismatchError` (when every failure of a step is
            one, every rank raises :class:`CollectiveMismatchError`).
        also: the paddle_dcp class a reader may look for besides ``kind`` (a StateDictError
            is also the FormatError earlier releases raised).
    """

    kind: str
    message: str
    mismatch: bool = False
    also: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        also = FormatError.__name__ if isinstance(exc, StateDictError) else ""
        return cls(type(exc).__name__, str(exc), isinstance(exc, MismatchError), also)

    def line(self) -> str:
        """"Type: message", the form of ``CollectiveError.failures``."""
        if not self.kind:
            return self.message
        name = f"{self.kind} ({self.also})" if self.also else self.kind
        return f"{name}: {self.message}"

    def as_dict(self, limit: int = 4000) -> dict:
        """The failure as a JSON-ready dict, its message cut to ``limit`` characters."""
        return {"kind": self.kind, "message": self.message[:limit], "mismatch": self.mismatch, "also": self.also}

    @classmethod
    def from_dict(cls, doc: object) -> "Failure":
        """The failure :meth:`as_dict` gave; what is not one is reported as it came."""
        if isinstance(doc, dict) and {"kind", "message", "mismatch"} <= doc.keys():
            return cls(str(doc["kind"]), str(doc["message"]), doc["mismatch"] is True, str(doc.get("also", "")))
        return cls("", f"a malformed failure report: {str(doc)[:200]}")

    def encode(self, limit: int = 4000) -> bytes:
        """The failure as JSON bytes, its message cut to ``limit`` characters."""
        return json.dumps(self.as_dict(limit)).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Failure":
        """The failure :meth:`encode` gave; what does not decode is reported as it came."""
        try:
            return cls.from_dict(json.loads(data))
        except (ValueError, RecursionError):  # not JSON, or nested past the parser
            return cls("", f"a malformed failure report: {bytes(data[:200])!r}")


class CollectiveError(DcpError):
    """A step of a collective save or load failed on one or more ranks.

    Every rank of the group raises it, with the same ``step`` and ``failures``.

    Attributes:
        step: name of the step that failed (e.g. ``"write"``).
        failures: rank -> "ErrorType: message" for every rank that failed.
        errors: rank -> :class:`Failure`, the same as data.
    """

    def __init__(self, step: str, failures: Mapping[int, "Failure | str"]):
        self.step = step
        self.errors = {r: f if isinstance(f, Failure) else Failure("", str(f)) for r, f in sorted(failures.items())}
        self.failures = {r: f.line() for r, f in self.errors.items()}
        shown = list(self.failures.items())[:8]
        lines = [f"rank {r}: {msg}" for r, msg in shown]
        if len(self.failures) > len(shown):
            lines.append(f"... and {len(self.failures) - len(shown)} more ranks")
        super().__init__(
            f"step '{step}' failed on {len(self.failures)} rank(s):\n  " + "\n  ".join(lines)
        )

    def __reduce__(self):  # keep the exception picklable for multiprocessing users
        return (type(self), (self.step, self.errors))


class CollectiveMismatchError(CollectiveError, MismatchError):
    """A step failed with a MismatchError on every rank that failed (e.g. keys of some rank's
    state dict that the checkpoint lacks): every rank raises it, and ``except MismatchError``
    catches it on every rank."""


def collective_error(step: str, failures: Mapping[int, Failure]) -> CollectiveError:
    """The CollectiveError every rank raises for ``failures``: a CollectiveMismatchError when
    every one of them is a MismatchError."""
    if failures and all(f.mismatch for f in failures.values()):
        return CollectiveMismatchError(step, failures)
    return CollectiveError(step, failures)
