"""What every fuzz example of the integration suites runs under (issue 38, point 7): a load that
either raises one of our errors or returns, under a watchdog (SIGALRM: an example that runs for
more than ``LIMIT_S`` seconds is a hang) and ``tracemalloc`` (a load of these tiny files that
allocates more than ``PEAK_BYTES`` at once is a bug too), and a tally of the outcomes so that
a fuzz that only ever errors out (or only ever loads) fails."""
from __future__ import annotations

import os
import signal
import tracemalloc
from typing import Callable

from paddle_dcp.errors import DcpError

LIMIT_S = 20
PEAK_BYTES = 64 << 20


def examples(default: int) -> int:
    """The examples a fuzz test runs: ``FUZZ_EXAMPLES`` when set, else ``default``."""
    return int(os.environ.get("FUZZ_EXAMPLES", default))


class Hang(Exception):
    """A load ran past the watchdog (not a DcpError: the fuzz reports it)."""


class TooMuchMemory(Exception):
    """A load allocated more than the bound at its peak."""


def _alarm(signum, frame):
    raise Hang(f"a load ran for more than {LIMIT_S} s")


def guarded(load: Callable[[], object]) -> DcpError | None:
    """Run ``load``: None when it returns, the DcpError it raised; any other exception
    propagates (the fuzz's failure), as do a hang and a peak allocation over the bound."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    tracemalloc.start()
    tracemalloc.reset_peak()
    error = None
    try:
        load()
    except DcpError as exc:
        error = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if peak > PEAK_BYTES:
        raise TooMuchMemory(f"the load allocated {peak} bytes at its peak (bound {PEAK_BYTES}); error: {error!r}")
    return error


class Outcomes:
    """How the examples of one fuzz ended: "loaded", or the class name of the error."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.messages: dict[str, int] = {}

    def add(self, error: DcpError | None) -> None:
        name = "loaded" if error is None else type(error).__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        if error is not None:  # what the errors say, their paths and numbers left out (FUZZ_REPORT=1 prints them)
            text = " ".join(w for w in str(error).split() if "/" not in w and not any(ch.isdigit() for ch in w))[:70]
            self.messages[text] = self.messages.get(text, 0) + 1

    def report(self) -> str:
        lines = [f"{n:5d}  {m}" for m, n in sorted(self.messages.items(), key=lambda kv: -kv[1])]
        return f"outcomes {self.counts}\n" + "\n".join(lines)

    def check_both(self, kinds: int = 2) -> None:
        """Some examples loaded, some raised, and at least ``kinds`` outcomes in all."""
        if os.environ.get("FUZZ_REPORT"):
            print(self.report())
        loaded = self.counts.get("loaded", 0)
        assert loaded > 0 and sum(self.counts.values()) > loaded, self.counts
        assert len(self.counts) >= kinds, self.counts
