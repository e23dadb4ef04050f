"""A function run in several threads at once, timed: the one thread timer of the benchmarks."""
from __future__ import annotations

import threading
import time
from typing import Callable


def in_threads(fn: Callable, args_list: list) -> float:
    """Run fn(*args) for each args in a thread of its own (one: inline); wall seconds; the first
    error raised."""
    errors = []

    def body(args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller
            errors.append(exc)

    t0 = time.perf_counter()
    if len(args_list) == 1:
        body(args_list[0])
    else:
        threads = [threading.Thread(target=body, args=(a,)) for a in args_list]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds
