"""Saves and loads on s3:// through the fault-injecting proxy (tests/faultproxy.py), 2 ranks.

Usage (under paddle.distributed.launch): s3faults.py DIR [case ...], with
  AWS_ENDPOINT_URL (and the other AWS_* variables): the proxy, which forwards to the server;
  S3FAULTS_BASE: the s3://bucket/prefix this run owns;
  S3FAULTS_UPSTREAM: the server itself, for checks that must not go through the proxy.

Rank 0 sets the proxy's plan over its control path before each step, between barriers.
Cases:
- retries_succeed: 503 SlowDown, 500, resets and a cut upload on the first PUTs of a save,
  then 503s, a cut download, a slow answer and a reset on the first GETs of its load: both
  succeed, every value equals the numpy oracle, the proxy injected every planned fault, and
  no object was tried more than "retries" times.
- save_past_the_limit: every PUT answers 503: the save raises on every rank a StorageError
  naming an s3:// object of the checkpoint and the status 503, within a bounded time, having
  tried no object more than "retries" times; the checkpoint id has no metadata object and no
  multipart upload is left open.
- deadline_bounds_the_retries: every PUT answers 503, "retries" is 1000 and "retry_deadline"
  2 s: the save raises the same way within seconds, having retried, far fewer than 1000 times.
- load_past_the_limit: every GET of a data object answers 500: the load raises on every rank
  a StorageError naming a data object and the status 500, within a bounded time.
- a_trickle_is_cut_at_the_deadline: every GET of a data object answers at once and then sends
  its body 1 KiB every 50 ms (a read timeout never fires; a whole range would take minutes);
  with "retry_deadline" 2 s each attempt is cut after 2 s: the load raises on every rank a
  StorageError naming a data object and the timeout, within seconds.
"""
import os
import sys
import time
import urllib.parse

import common as c
import paddle_dcp
from paddle_dcp import CollectiveError, StorageError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/
from faultproxy import remote_counts, remote_plan  # noqa: E402

ROOT = c.init()
R = c.rank()
PROXY = os.environ["AWS_ENDPOINT_URL"]
BASE = os.environ["S3FAULTS_BASE"].rstrip("/")
UPSTREAM = os.environ["S3FAULTS_UPSTREAM"]
MESH = c.Mesh([0, 1])
MiB = 1 << 20
# 16 MiB, 8 MiB per rank in 5 MiB parts (S3's smallest): every rank's data object is a multipart upload
# of two parts
LEAVES = [
    c.Leaf(("w",), (4096, 1024), "float32", MESH, (("S", 0),), index=0),
    c.Leaf(("b",), (8, 24), "bfloat16", MESH, (("S", 1),), index=1),
    c.Leaf(("n",), (5,), "int64", index=2),
]
PART = 5 * MiB
RETRIES = 6  # attempts per request when faults are expected to be overcome
LIMIT = {"retries": 3, "retry_deadline": 5.0, "part_size": PART}  # past these: StorageError
BOUND = 60.0  # seconds a failing call may take: the retry deadline plus a generous margin


def plan(rules) -> None:
    """Every rank waits until rank 0 has given the proxy ``rules`` (its counts zeroed)."""
    c.dist.barrier()
    if R == 0:
        remote_plan(PROXY, rules)
    c.dist.barrier()


def counts() -> dict:
    """The proxy's counts once every rank is done with the step before (printed by rank 0: the
    requests a save or load made, by S3 operation)."""
    c.dist.barrier()
    cnt = remote_counts(PROXY)
    if R == 0:
        print(f"proxy: requests {cnt['requests']}, faults {cnt['faults']}", flush=True)
    return cnt


def upstream():
    """A botocore client of the server itself (no proxy, no faults)."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=UPSTREAM, region_name=os.environ.get("AWS_REGION", "us-east-1"),
        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"], aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
    )


def bucket_prefix(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.netloc, parts.path.strip("/") + "/"


def keys_under(url: str) -> list[str]:
    bucket, prefix = bucket_prefix(url)
    found = upstream().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix):] for o in found)


def open_uploads(url: str) -> list[str]:
    bucket, prefix = bucket_prefix(url)
    return [u["Key"] for u in upstream().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])]


def max_attempts(cnt: dict, method: str) -> int:
    """The most requests the proxy saw for one data object's part or byte range with ``method``."""
    return max((n for obj, n in cnt["objects"].items() if obj.startswith(method + " ") and ".distcp" in obj),
               default=0)


def storage_failure(fn, *needles) -> float:
    """``fn()`` raises here a StorageError, or a CollectiveError for a StorageError, whose text
    holds every needle; returns the seconds it took."""
    t0 = time.monotonic()
    try:
        fn()
    except (StorageError, CollectiveError) as exc:
        seconds = time.monotonic() - t0
        if isinstance(exc, CollectiveError):
            texts = [m for m in exc.failures.values() if m.startswith("StorageError")]
            assert texts, f"a CollectiveError without a StorageError: {exc}"
        else:
            texts = [str(exc)]
        assert any(all(n in t for n in needles) for t in texts), (needles, texts)
        print(f"rank {R}: {type(exc).__name__} after {seconds:.1f} s: {str(exc)[:400]}", flush=True)
        return seconds
    raise AssertionError(f"expected a StorageError naming {needles}, nothing was raised")


# ------------------------------------------------------------------------------ cases
def retries_succeed():
    url = f"{BASE}/retries"
    options = {"retries": RETRIES, "retry_deadline": 120.0, "part_size": PART}
    save_rules = [
        {"fault": "slowdown", "count": 2, "method": "PUT"},
        {"fault": "internal", "count": 1, "method": "PUT"},
        {"fault": "reset", "count": 1, "method": "PUT"},
        {"fault": "cut", "count": 1, "op": "put_part"},  # the connection drops in the middle of a part
        {"fault": "slowdown", "count": 1, "op": "list"},  # numbering the save (unique_id=None) lists
    ]
    plan(save_rules)
    paddle_dcp.save_state_dict(c.build(LEAVES, 0), url, storage_options=options)
    cnt = counts()
    assert cnt["rules"] == [2, 1, 1, 1, 1], cnt  # every planned fault happened: the save retried past them
    assert cnt["requests"].get("put_part", 0) >= 2 + 2, cnt  # two parts per rank at least
    assert max_attempts(cnt, "PUT") <= RETRIES, cnt
    assert [k for k in keys_under(url) if k.endswith(".metadata")], keys_under(url)
    load_rules = [
        {"fault": "slowdown", "count": 2, "method": "GET", "path": r"\.distcp"},
        {"fault": "cut", "count": 1, "method": "GET", "path": r"\.distcp"},  # half a body, then closed
        {"fault": "slow", "count": 1, "method": "GET", "path": r"\.distcp", "delay": 1.5},
        {"fault": "reset", "count": 1, "method": "GET", "path": r"\.metadata"},
        {"fault": "slow", "count": 1, "op": "list", "delay": 1.0},  # finding the latest id lists
    ]
    plan(load_rules)
    sd = c.build(LEAVES, 0, target=True)
    paddle_dcp.load_state_dict(sd, url, storage_options=options)
    c.check_state(sd, LEAVES, 0, R)
    cnt = counts()
    assert cnt["rules"] == [2, 1, 1, 1, 1], cnt
    assert max_attempts(cnt, "GET") <= RETRIES, cnt


def save_past_the_limit():
    url = f"{BASE}/save_limit"
    plan([{"fault": "slowdown", "count": -1, "method": "PUT", "path": r"\.distcp"}])  # the data objects' uploads
    bucket, prefix = bucket_prefix(url)
    seconds = storage_failure(lambda: paddle_dcp.save_state_dict(c.build(LEAVES, 0), url, storage_options=LIMIT),
                              f"s3://{bucket}/{prefix}", "503")
    assert seconds < BOUND, seconds
    cnt = counts()
    assert cnt["faults"].get("slowdown", 0) >= LIMIT["retries"], cnt  # it did retry
    assert max_attempts(cnt, "PUT") <= LIMIT["retries"], cnt  # and no more than it was told
    plan([])
    names = keys_under(url)
    assert not [k for k in names if k.endswith(".metadata")], names  # nothing committed
    assert open_uploads(url) == [], open_uploads(url)  # the failed save aborted its uploads


def deadline_bounds_the_retries():
    url = f"{BASE}/deadline"
    plan([{"fault": "slowdown", "count": -1, "method": "PUT", "path": r"\.distcp"}])  # the data objects' uploads
    options = {"retries": 1000, "retry_deadline": 2.0, "part_size": PART}
    seconds = storage_failure(lambda: paddle_dcp.save_state_dict(c.build(LEAVES, 0), url, storage_options=options),
                              f"s3://{bucket_prefix(url)[0]}/{bucket_prefix(url)[1]}", "503")
    assert seconds < 30.0, seconds  # the deadline, one capped backoff, and the ranks agreeing
    cnt = counts()
    assert 3 <= max_attempts(cnt, "PUT") < 1000, cnt  # it retried, and the deadline, not the count, stopped it
    plan([])
    assert not [k for k in keys_under(url) if k.endswith(".metadata")], keys_under(url)


def load_past_the_limit():
    url = f"{BASE}/load_limit"
    plan([])
    paddle_dcp.save_state_dict(c.build(LEAVES, 0), url)
    plan([{"fault": "internal", "count": -1, "method": "GET", "path": r"\.distcp"}])
    bucket, prefix = bucket_prefix(url)
    sd = c.build(LEAVES, 0, target=True)
    seconds = storage_failure(lambda: paddle_dcp.load_state_dict(sd, url, storage_options=LIMIT),
                              f"s3://{bucket}/{prefix}", ".distcp", "500")
    assert seconds < BOUND, seconds
    cnt = counts()
    assert cnt["faults"].get("internal", 0) >= LIMIT["retries"], cnt
    assert max_attempts(cnt, "GET") <= LIMIT["retries"], cnt
    plan([])


def a_trickle_is_cut_at_the_deadline():
    url = f"{BASE}/trickle"
    plan([])
    paddle_dcp.save_state_dict(c.build(LEAVES, 0), url)
    plan([{"fault": "trickle", "count": -1, "method": "GET", "path": r"\.distcp", "delay": 0.05}])
    bucket, prefix = bucket_prefix(url)
    sd = c.build(LEAVES, 0, target=True)
    options = {"retries": 2, "retry_deadline": 2.0}
    seconds = storage_failure(lambda: paddle_dcp.load_state_dict(sd, url, storage_options=options),
                              f"s3://{bucket}/{prefix}", ".distcp", "Timeout")
    assert seconds < 30.0, seconds  # two cut attempts and the ranks agreeing, not minutes of trickle
    assert counts()["faults"].get("trickle", 0) >= 2
    plan([])


c.run_cases({
    "retries_succeed": retries_succeed,
    "save_past_the_limit": save_past_the_limit,
    "deadline_bounds_the_retries": deadline_bounds_the_retries,
    "load_past_the_limit": load_past_the_limit,
    "a_trickle_is_cut_at_the_deadline": a_trickle_is_cut_at_the_deadline,
})
