"""Saves finishing in the background: the AsyncSave handle, the one writer thread that runs
them in order, the host memory they stage into, and waiting for them (at exit too).

``save_state_dict(..., async_save=True)`` plans and copies this rank's pieces into the
process's :class:`~paddle_dcp.parallel.device.StagingArena` in the caller's thread, then hands
the rest of the save (writing, the commit, and whatever the caller chains after it, e.g. a
CheckpointManager's retention) to the writer thread. The thread and the arena live as long
as the process, so later saves pay neither a thread start nor fresh memory; the process
group the background collectives use is made once, by the writer thread. The first async save
of a process, which has no staging memory yet, writes its data file in the caller's thread
instead (as fast as copying into fresh memory would be), and the writer thread then makes
the memory for the next one.
"""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import queue
import sys
import threading
from typing import Callable


logger = logging.getLogger(__name__)


class AsyncSave:
    """A save finishing in the background (``save_state_dict(..., async_save=True)``).

    The call that made it returned once this rank's pieces were copied to host memory (or,
    for the first async save of a process, written to its data file); the tensors may change
    from then on. Its data files and metadata are written by the
    process's writer thread, over a process group of its own. :meth:`wait` (or the next
    save, or :func:`wait_async_save`) waits for it and raises its error, if it failed.
    """

    def __init__(self):
        self._done = threading.Event()
        self._result: int | None = None
        self._error: BaseException | None = None

    def _run(self, fn: Callable[[], int]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        """True once the save finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the save; returns its unique id.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            DcpError: the background save's own error.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the async save did not finish within {timeout} s")
        if self in _PENDING:
            _PENDING.remove(self)
        if self._error is not None:
            raise self._error
        return self._result


class _Writer:
    """One daemon thread running background saves in the order they were submitted."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], int]) -> AsyncSave:
        handle = AsyncSave()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="paddle_dcp-async-save", daemon=True)
                self._thread.start()
        _PENDING.append(handle)
        self._jobs.put((handle, fn))
        return handle

    def _loop(self) -> None:
        while True:
            handle, fn = self._jobs.get()
            handle._run(fn)
            del handle, fn  # the staged state of a finished save is not kept alive by the thread


_WRITER = _Writer()
_PENDING: list[AsyncSave] = []


def submit(fn: Callable[[], int]) -> AsyncSave:
    """Run ``fn`` (the rest of a save; returns its id) on the writer thread."""
    return _WRITER.submit(fn)


def wait_async_save(timeout: float | None = None) -> None:
    """Wait for every async save of this process to finish; raise the first error."""
    errors = []
    for handle in list(_PENDING):
        try:
            handle.wait(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)
    if errors:
        raise errors[0]


_FAILED_AT_EXIT: list[BaseException] = []


def _finish_pending_saves() -> None:  # an interpreter exiting must not abandon a save
    for handle in list(_PENDING):
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - nobody is left to raise it to
            logger.error("an async save failed: %s", exc)
            _FAILED_AT_EXIT.append(exc)


def _fail_the_exit() -> None:
    """The last exit hook: when a save the exit waited for failed, the process ends with status
    1 (nobody was left to raise it to, and a scheduler must not take the run for a success):
    the standard streams and logging are flushed first, the hooks after this one skipped."""
    if not _FAILED_AT_EXIT:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: nothing to flush
            pass
    os._exit(1)


# An exiting interpreter first runs threading's exit hooks, newest first: concurrent.futures'
# stops every thread pool from taking work (a data file's writer uses one), so the pending
# saves must be finished by a hook registered after it, not by atexit, which runs later.
# atexit runs its hooks newest first: _fail_the_exit, registered first, runs last.
atexit.register(_fail_the_exit)
atexit.register(_finish_pending_saves)
try:
    threading._register_atexit(_finish_pending_saves)
except (AttributeError, RuntimeError):  # another Python, or already exiting: atexit only
    pass
