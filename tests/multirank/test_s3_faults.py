"""Saves and loads on s3:// through a fault-injecting proxy (tests/faultproxy.py) in front of the
session's SeaweedFS server, 2 ranks: throttling, server errors, resets, cut bodies and slow
answers on the first requests are retried past (the values equal the numpy oracle); past the
limits of storage_options "retries" / "retry_deadline" every rank raises a StorageError naming
the object and the HTTP status, in bounded time, with nothing committed.

The proxy runs in this process; the ranks reach it through AWS_ENDPOINT_URL and set its plan
over its control path (tests/multirank/scripts/s3faults.py says what each case checks).
"""
import uuid

import pytest

from faultproxy import FaultProxy
from launcher import assert_passed, run_launch, script


@pytest.fixture
def through_proxy(s3_env, monkeypatch):
    """The AWS_* variables of the session's server, with the endpoint replaced by a proxy in
    front of it; S3FAULTS_BASE: a prefix of the bucket for this test alone."""
    with FaultProxy(s3_env.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("S3FAULTS_BASE", s3_env.url(f"s3faults-{uuid.uuid4().hex[:12]}"))
        monkeypatch.setenv("S3FAULTS_UPSTREAM", s3_env.endpoint)
        yield proxy


def test_retries_get_past_throttling_errors_resets_and_slow_answers(tmp_path, through_proxy):
    logs = run_launch(script("s3faults.py"), 2, tmp_path, args=[tmp_path / "work", "retries_succeed"], timeout=240)
    assert_passed(logs, ["retries_succeed"], 2)


def test_past_the_limit_every_rank_raises_storage_error_and_nothing_is_committed(tmp_path, through_proxy):
    cases = ["save_past_the_limit", "deadline_bounds_the_retries", "load_past_the_limit", "a_trickle_is_cut_at_the_deadline"]
    logs = run_launch(script("s3faults.py"), 2, tmp_path, args=[tmp_path / "work", *cases], timeout=240)
    assert_passed(logs, cases, 2)
