"""Retrying a request to an object store: which failures are worth another attempt, and the
one loop that retries them with exponential backoff and full jitter, bounded in attempts and
in total time. Pure: the clock, the sleep and the random source are parameters, so the unit
tests run it on a fake clock.

A failure is retried when it is transient: an HTTP 5xx (500, 502, 503 SlowDown, 504), a 429
or a throttling code (``SlowDown``, ``Throttling``, ``RequestLimitExceeded``...), a reset or
refused connection, a timeout, or a response cut short. Anything else (403, 404, a bad
request) fails at once. After the last attempt the failure becomes a StorageError naming the
object and the HTTP status (or the connection error).
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from ..errors import ArgumentError, StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestLimitExceeded", "TooManyRequestsException", "RequestTimeout",
    "InternalError", "ServiceUnavailable", "BandwidthLimitExceeded", "EC2ThrottledException",
})
# exception class names (of the stdlib, urllib3, botocore, aiohttp) that mean the connection
# failed or the response was cut short; matched by name so this module imports none of them
TRANSIENT_NAMES = frozenset({
    "ConnectionError", "ConnectionResetError", "ConnectionRefusedError", "ConnectionAbortedError",
    "BrokenPipeError", "TimeoutError", "timeout", "IncompleteRead", "ProtocolError",
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "HTTPClientError", "ResponseParserError", "ResponseStreamingError", "IncompleteReadError",
    "ClientPayloadError", "ServerDisconnectedError", "ClientOSError", "ClientConnectionError",
    "ClientConnectorError", "ServerTimeoutError", "FSTimeoutError", "RemoteDisconnected",
})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one request.

    Attributes:
        attempts: attempts in all, the first included (1: no retry).
        deadline: seconds from the first attempt after which no new attempt starts.
        base: the first backoff's upper bound, in seconds; doubled at each retry.
        cap: the largest backoff, in seconds.
    """

    attempts: int = 6
    deadline: float = 60.0
    base: float = 0.2
    cap: float = 10.0

    def __post_init__(self):
        if type(self.attempts) is not int or self.attempts < 1:
            raise ArgumentError(f"retries must be an int >= 1 (attempts in all), got {self.attempts!r}")
        if not self.deadline > 0:
            raise ArgumentError(f"retry_deadline must be a positive number of seconds, got {self.deadline!r}")

    def backoff(self, retry: int, rand: Callable[[], float]) -> float:
        """The wait before retry number ``retry`` (1 for the first): full jitter, uniform in
        [0, min(cap, base * 2 ** (retry - 1)))."""
        return rand() * min(self.cap, self.base * (2 ** (retry - 1)))


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a failed request behind ``exc`` (through its causes), or None."""
    for e in _causes(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def describe_failure(exc: BaseException) -> tuple[bool, str]:
    """(whether ``exc`` is transient, what it was: "HTTP 503 SlowDown" or the connection
    error), looking through the exception's causes (s3fs raises an OSError caused by
    botocore's ClientError)."""
    for e in _causes(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code", "")
            text = f"HTTP {status} {code}".strip() if status else f"error {code}"
            # 501 Not Implemented: a call the store lacks, never fixed by asking again
            transient = (isinstance(status, int) and (status >= 500 and status != 501 or status == 429)) or code in THROTTLE_CODES
            return transient, text
    for e in _causes(exc):
        if type(e).__name__ in TRANSIENT_NAMES or isinstance(e, (ConnectionError, TimeoutError)):
            said = str(e) or ("no answer within the attempt's time limit" if "Timeout" in type(e).__name__ else "")
            return True, f"{type(e).__name__}: {said}" if said else type(e).__name__
    return False, f"{type(exc).__name__}: {exc}"


def retrying(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
    fatal: tuple[type[BaseException], ...] = (),
) -> T:
    """``fn()``, retried on transient failures within ``policy``.

    Args:
        what: the request and its object, for messages ("GET s3://bucket/key bytes 0-99").
        fatal: exception types passed through unchanged, never retried (a missing object, an
            error of our own).

    Raises:
        StorageError: naming ``what``, the attempts made and the last failure's HTTP status
            or connection error, once the attempts or the deadline are used up, or at once for
            a failure that is not transient.
    """
    started = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except fatal:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            transient, text = describe_failure(exc)
            if not transient:
                raise StorageError(f"{what} failed: {text}", what) from exc
            wait = policy.backoff(attempt, rand)
            late = clock() + wait - started >= policy.deadline
            if attempt >= policy.attempts or late:
                limit = f"{attempt} attempt(s)" + (f" within the {policy.deadline:g} s retry deadline" if late else "")
                raise StorageError(f"{what} failed after {limit}: {text}", what) from exc
            logger.warning("%s failed (%s), attempt %d of %d; retrying in %.2f s", what, text, attempt, policy.attempts, wait)
            sleep(wait)
