"""JSON text from outside this process (a checkpoint's metadata, a safetensors header, a Hugging
Face index, a manager's manifest, a peer's message) parsed in one place, so that every way it
can be malformed is a :class:`~paddle_dcp.errors.FormatError` naming where it came from: not
UTF-8, not JSON, nested deeper than the parser goes (RecursionError), or a number too long to
read (ValueError past Python's digit limit)."""
from __future__ import annotations

import json
from typing import Any, Callable

from ..errors import FormatError


def parse_json(data: bytes | bytearray | memoryview | str, source: str, what: str = "JSON", hook: Callable | None = None) -> Any:
    """The value of JSON text ``data`` (bytes are UTF-8). ``hook``: ``object_pairs_hook``
    (one that raises FormatError has its message prefixed with ``source``).

    Raises:
        FormatError: ``"{source}: {what} is not valid JSON (...)"``, or the hook's error.
    """
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        return json.loads(text, object_pairs_hook=hook)
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}") from None
    except (ValueError, RecursionError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
        raise FormatError(f"{source}: {what} is not valid JSON ({type(exc).__name__}: {_short(exc)})") from None


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."
