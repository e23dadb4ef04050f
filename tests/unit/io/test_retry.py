"""paddle_dcp.io.retry: transient failures retried with a capped, doubling backoff on a fake
clock, bounded by attempts and a deadline; what counts as transient; the error that names the
object and the status."""
from __future__ import annotations

import pytest

from paddle_dcp.errors import ArgumentError, StorageError
from paddle_dcp.io.retry import RetryPolicy, describe_failure, retrying


class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ClientError(Exception):
    """Shaped as botocore's: a ``response`` dict."""

    def __init__(self, status: int, code: str):
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def failing(errors, value="ok"):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return value

    return fn, calls


def run(fn, policy, clock):
    return retrying(fn, "GET s3://b/k", policy, clock=clock, sleep=clock.sleep, rand=lambda: 1.0)


def test_transient_failures_are_retried_with_doubling_backoff_until_one_succeeds():
    clock = FakeClock()
    # s3fs raises an OSError caused by botocore's ClientError: the status is found through the cause
    wrapped = OSError("slow down")
    wrapped.__cause__ = ClientError(503, "SlowDown")
    fn, calls = failing([wrapped, ClientError(500, "InternalError"), ConnectionResetError("reset")])
    assert run(fn, RetryPolicy(attempts=6, deadline=60, base=0.5, cap=1.5), clock) == "ok"
    assert len(calls) == 4
    assert clock.sleeps == [0.5, 1.0, 1.5]  # doubling, capped (rand() = 1: the jitter's upper bound)


def test_after_the_last_attempt_the_error_names_the_object_and_the_status():
    clock = FakeClock()
    fn, calls = failing([ClientError(503, "SlowDown")] * 10)
    with pytest.raises(StorageError, match=r"GET s3://b/k failed after 3 attempt\(s\): HTTP 503 SlowDown") as info:
        run(fn, RetryPolicy(attempts=3, deadline=60, base=0.1), clock)
    assert len(calls) == 3 and info.value.path == "GET s3://b/k"


def test_the_deadline_bounds_the_total_time():
    clock = FakeClock()
    fn, calls = failing([TimeoutError("read timed out")] * 100)
    with pytest.raises(StorageError, match="within the 5 s retry deadline: TimeoutError"):
        run(fn, RetryPolicy(attempts=100, deadline=5, base=1, cap=2), clock)
    assert clock.now - 100.0 < 5 and len(calls) < 10


@pytest.mark.parametrize("exc", [ClientError(403, "AccessDenied"), ClientError(400, "InvalidPart"), ValueError("bug")])
def test_a_failure_that_is_not_transient_is_not_retried(exc):
    clock = FakeClock()
    fn, calls = failing([exc])
    with pytest.raises(StorageError):
        run(fn, RetryPolicy(), clock)
    assert len(calls) == 1 and clock.sleeps == []


def test_fatal_errors_pass_through_unchanged():
    fn, calls = failing([FileNotFoundError("b/k")])
    with pytest.raises(FileNotFoundError):
        retrying(fn, "GET", RetryPolicy(), fatal=(FileNotFoundError,), sleep=lambda s: None)
    assert len(calls) == 1


def test_classification():
    assert describe_failure(ClientError(429, "TooManyRequests")) == (True, "HTTP 429 TooManyRequests")
    assert describe_failure(ClientError(404, "NoSuchKey"))[0] is False
    assert describe_failure(ClientError(501, "NotImplemented"))[0] is False
    assert describe_failure(type("EndpointConnectionError", (Exception,), {})("refused"))[0] is True
    from fsspec.exceptions import FSTimeoutError  # an attempt cut at its time limit

    assert describe_failure(FSTimeoutError()) == (True, "FSTimeoutError: no answer within the attempt's time limit")


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"deadline": 0}])
def test_bad_retry_bounds_are_argument_errors(kwargs):
    with pytest.raises(ArgumentError):
        RetryPolicy(**kwargs)
