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
"""
from __future__ import annotations

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


class CollectiveError(DcpError):
    """A step of a collective save or load failed on one or more ranks.

    Every rank of the group raises it, with the same ``step`` and ``failures``.

    Attributes:
        step: name of the step that failed (e.g. ``"write"``).
        failures: rank -> "ErrorType: message" for every rank that failed.
    """

    def __init__(self, step: str, failures: Mapping[int, str]):
        self.step = step
        self.failures = dict(sorted(failures.items()))
        shown = list(self.failures.items())[:8]
        lines = [f"rank {r}: {msg}" for r, msg in shown]
        if len(self.failures) > len(shown):
            lines.append(f"... and {len(self.failures) - len(shown)} more ranks")
        super().__init__(
            f"step '{step}' failed on {len(self.failures)} rank(s):\n  " + "\n  ".join(lines)
        )

    def __reduce__(self):  # keep the exception picklable for multiprocessing users
        return (type(self), (self.step, self.failures))


class CollectiveMismatchError(CollectiveError, MismatchError):
    """A step failed with a MismatchError on every rank that failed (e.g. keys of some rank's
    state dict that the checkpoint lacks): every rank raises it, and ``except MismatchError``
    catches it on every rank."""


def failure_line(exc: BaseException) -> str:
    """One rank's failure as "Type: message", the form of ``CollectiveError.failures``.

    A StateDictError is written "StateDictError (FormatError): ...": it is also a FormatError,
    the class earlier releases raised for it, and readers of the line may look for that name.
    """
    name = type(exc).__name__
    if isinstance(exc, StateDictError):
        name = f"{name} ({FormatError.__name__})"
    return f"{name}: {exc}"


_MISMATCH_NAMES = (MismatchError.__name__, StateDictError.__name__)


def collective_error(step: str, failures: Mapping[int, str]) -> CollectiveError:
    """The CollectiveError every rank raises for ``failures`` (rank -> "Type: message")."""
    names = [m.split(":", 1)[0].split(" ", 1)[0] for m in failures.values()]
    if names and all(name in _MISMATCH_NAMES for name in names):
        return CollectiveMismatchError(step, failures)
    return CollectiveError(step, failures)
