"""paddle_dcp.async_save: background saves run on one writer thread in the order submitted;
a handle gives the save's id or raises its error; waiting for every pending save raises the
first error after waiting for all. The saves here are plain functions (no files)."""
import threading

import pytest

from paddle_dcp import async_save
from paddle_dcp.errors import StorageError


def test_saves_run_on_one_thread_in_the_order_submitted_and_give_their_ids():
    order, threads = [], set()

    def save(uid):
        def run():
            order.append(uid)
            threads.add(threading.current_thread().name)
            return uid

        return run

    handles = [async_save.submit(save(uid)) for uid in range(5)]
    assert [h.wait(10) for h in handles] == list(range(5))
    assert order == list(range(5)) and threads == {"paddle_dcp-async-save"}
    assert all(h.done() for h in handles) and not any(h in async_save._PENDING for h in handles)


def test_a_failed_save_raises_its_own_error_to_whoever_waits():
    def fail():
        raise StorageError("disk full", "/ck/0_0.distcp")

    handle = async_save.submit(fail)
    with pytest.raises(StorageError, match="disk full"):
        handle.wait(10)
    assert handle.done()


def test_a_save_not_finished_in_time_is_a_timeout_and_stays_pending():
    gate = threading.Event()
    handle = async_save.submit(lambda: gate.wait(10) and 7)
    with pytest.raises(TimeoutError, match="did not finish within 0.01 s"):
        handle.wait(0.01)
    assert not handle.done() and handle in async_save._PENDING
    gate.set()
    assert handle.wait(10) == 7


def test_waiting_for_every_save_waits_for_all_then_raises_the_first_error():
    gate, finished = threading.Event(), []

    def fail(message):
        def run():
            gate.wait(10)
            raise StorageError(message)

        return run

    def ok():
        finished.append(True)
        return 3

    async_save.submit(fail("first"))
    async_save.submit(fail("second"))
    last = async_save.submit(ok)
    gate.set()
    with pytest.raises(StorageError, match="first"):
        async_save.wait_async_save(10)
    assert finished == [True] and last.done() and async_save._PENDING == []
    async_save.wait_async_save(10)  # nothing pending: returns
