"""What a benchmark prints: its progress on stderr as it runs, then its report and the same
figures as JSON."""
from __future__ import annotations

import json
import sys


def log(msg: str) -> None:
    """One line of progress on stderr."""
    print(msg, file=sys.stderr, flush=True)


def emit(result: dict, text: str, json_out: str | None) -> None:
    """Print a benchmark's report ``text``, then its ``result`` as one JSON line on stdout;
    also write the result to ``json_out`` (indented) when given."""
    print(text)
    print(json.dumps(result, default=str), flush=True)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1, default=str)
            f.write("\n")
        log(f"wrote {json_out}")
