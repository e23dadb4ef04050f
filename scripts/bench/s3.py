"""Object storage for the benchmarks (the suite s3, and compress and tiers): a local S3 server,
where the checkpoints go on it, and the server's own speed as the limit a library could reach.

The server is SeaweedFS's ``weed mini`` on 127.0.0.1 (tests/s3server.py, the one the tests
use), with its data directory in the bench's working directory; every launch gets the standard
AWS variables that point at it. The limit: one object of the checkpoint's logical size written
with s3fs as a multipart upload (parts of PART_BYTES, paddle_dcp's default part size) and read
back, from one stream (one part or one GET in flight) and from STREAMS in parallel (parts in
flight; GETs of contiguous ranges from as many threads), read two ways: s3fs's ``cat_file``
and a lean reader (botocore's plain client, each body read with ``readinto`` into its place);
the faster is the limit. GB/s = bytes / seconds, 1 GB = 1e9 bytes, best of the repeats; every
read is compared with what was written.
"""
from __future__ import annotations

import os
import sys
import time

from bench import REPO
from bench.report import log
from bench.threads import in_threads
from bench.units import GB, MiB

PART_BYTES = 32 * MiB  # paddle_dcp's default part size (issue 17, point 3)
STREAMS = 4
BUCKET = "ckpt"
# what runs on object storage: paddle's built-in takes local paths only; the ours-only phases
# (async, durable, no-verify) are local-disk questions
LIBS = ("ours", "torch")
LIB_NAMES = {"ours": "paddle_dcp", "torch": "torch DCP"}
PHASES = ("save", "load", "reshard")
# issue 17, point 6: ours / torch DCP at least this, per phase; and ours at least this fraction
# of the server's own speed (PUT for a save, GET for a load), from the same run
TARGETS = {"save": {"torch": 2.0}, "load": {"torch": 2.0}}
SERVER_FRACTION = 0.6
# issue 17, point 3: a rank's memory within the disk bound (10% of its share + 64 MiB) plus the
# parts in flight: paddle_dcp's defaults (io/objects.py ObjectOptions: 4 parts of 32 MiB)
PARTS_IN_FLIGHT = 4
# a load's reads in flight (ObjectOptions: read_ahead_bytes 64 MiB + read_cache_bytes 32 MiB)
READS_IN_FLIGHT = 96 * MiB


class S3Store:
    """A ``weed mini`` server for one bench run and the checkpoints on it."""

    def __init__(self, server, fs):
        self.server, self.fs = server, fs

    @classmethod
    def start(cls, workdir: str) -> "S3Store":
        import s3fs

        t0 = time.perf_counter()
        server = _s3server().S3Server.start(os.path.join(workdir, "weed"), bucket=BUCKET)
        os.environ.update(server.env)  # every launch inherits them: the way users configure it
        os.environ[SERVER_PID_ENV] = str(server.process.pid)  # a worker measures the server's CPU
        store = cls(server, s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False))
        # the first writes to a fresh server allocate its volumes (seconds): not in any timed call
        store.fs.pipe_file(f"{BUCKET}/warm-up/object", bytes(2 * PART_BYTES), chunksize=PART_BYTES)
        store.remove(store.path("warm-up"))
        log(f"S3 server (weed mini) at {server.endpoint}, bucket {BUCKET}, up in {time.perf_counter() - t0:.1f} s")
        return store

    def path(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}"

    def remove(self, url: str) -> None:
        """Every object under ``url`` (a checkpoint), if any."""
        key = url.split("://", 1)[1]
        try:
            if self.fs.find(key):
                self.fs.rm(key, recursive=True)
        except FileNotFoundError:
            pass

    def holds(self, url: str) -> bool:
        """Whether any object is under ``url`` (a save that took the URL for a local path
        writes none). weed lists a prefix whose objects were all deleted as an entry of its
        own, so only keys below it count."""
        key = url.split("://", 1)[1].rstrip("/")
        return any(p.startswith(key + "/") for p in self.fs.find(key))

    def info(self) -> dict:
        return {"server": "SeaweedFS weed mini (tests/s3server.py)", "version": _weed_version(),
                "endpoint": self.server.endpoint}

    def close(self) -> None:
        log("stopping the S3 server (it can take 20 s)")
        self.server.stop()


def _s3server():
    """tests/s3server.py: the server the tests use."""
    tests = os.path.join(REPO, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import s3server

    return s3server


def _weed_version() -> str | None:
    import subprocess

    try:
        out = subprocess.run([_s3server().weed_binary(), "version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, TypeError):
        return None


SERVER_PID_ENV = "PADDLE_DCP_BENCH_SERVER_PID"


def server_cpu_seconds() -> float | None:
    """The bench's S3 server's CPU seconds so far (None without one: a local-disk bench)."""
    pid = os.environ.get(SERVER_PID_ENV)
    return _cpu_seconds(int(pid)) if pid else None


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def server_speed(store: S3Store, nbytes: int, streams=(1, STREAMS)) -> dict:
    """PUT and GET of one ``nbytes`` object, at each number of ``streams`` (see the module
    docstring); GB/s, and the CPU seconds the server spent per GB (its own cost, which on a
    machine of few cores bounds every client)."""
    import numpy as np

    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    key = f"{BUCKET}/server-limit/object"
    out = {"bytes": nbytes, "part_bytes": PART_BYTES, "put_gbps": {}, "get_gbps": {},
           "put_server_cpu_s_per_gb": {}, "get_server_cpu_s_per_gb": {}}
    fs = store.fs
    pid = store.server.process.pid

    def cpu_per_gb(before):
        after = _cpu_seconds(pid)
        return None if before is None or after is None else (after - before) / (nbytes / GB)

    for k in streams:
        store.remove(store.path("server-limit"))
        cpu, t0 = _cpu_seconds(pid), time.perf_counter()
        fs.pipe_file(key, data, chunksize=PART_BYTES, max_concurrency=k)
        out["put_gbps"][str(k)] = nbytes / (time.perf_counter() - t0) / GB
        out["put_server_cpu_s_per_gb"][str(k)] = cpu_per_gb(cpu)
        step = -(-nbytes // k)
        ranges = [(i * step, min((i + 1) * step, nbytes)) for i in range(k)]
        for how, get in (("s3fs", _s3fs_get(fs, key)), ("lean", _lean_get(key))):
            out.setdefault(f"get_gbps_{how}", {})
            buf = bytearray(nbytes)
            view = memoryview(buf)
            cpu, t0 = _cpu_seconds(pid), time.perf_counter()
            if k > 1:
                in_threads(lambda a, b: get(a, view[a:b]), ranges)
            else:
                get(0, view)
            seconds = time.perf_counter() - t0
            out[f"get_gbps_{how}"][str(k)] = nbytes / seconds / GB
            out["get_gbps"][str(k)] = max(out["get_gbps"].get(str(k), 0), nbytes / seconds / GB)
            if how == "lean":
                out["get_server_cpu_s_per_gb"][str(k)] = cpu_per_gb(cpu)
            if buf != data:
                raise RuntimeError(f"the server returned other bytes than were written ({k} streams, {how})")
            del view, buf
    store.remove(store.path("server-limit"))
    return out


def _s3fs_get(fs, key: str):
    """A ranged GET through s3fs (``cat_file``: the body joined into bytes, then copied)."""
    def get(start: int, out: memoryview) -> None:
        out[:] = fs.cat_file(key, start=start, end=start + len(out))
    return get


def _lean_get(key: str):
    """A ranged GET through botocore's plain client, the body read with ``readinto`` straight
    into the buffer (the least a client can do per byte: what the server alone allows)."""
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", config=Config(max_pool_connections=16, response_checksum_validation="when_required"))
    bucket, _, name = key.partition("/")

    def get(start: int, out: memoryview) -> None:
        resp = client.get_object(Bucket=bucket, Key=name, Range=f"bytes={start}-{start + len(out) - 1}")
        raw, got = resp["Body"]._raw_stream, 0
        while got < len(out):
            n = raw.readinto(out[got : got + MiB])
            if not n:
                raise RuntimeError(f"GET of {key} ended at {start + got}")
            got += n
    return get


def best_server_speed(samples: list) -> dict:
    """The best of the repeats, per direction and stream count."""
    if not samples:
        return {}
    out = {"bytes": samples[0]["bytes"], "part_bytes": samples[0]["part_bytes"], "samples": samples}
    for what in ("put_gbps", "get_gbps", "get_gbps_s3fs", "get_gbps_lean"):
        out[what] = {k: max(s[what][k] for s in samples) for k in samples[0].get(what, {})}
    for what in ("put_server_cpu_s_per_gb", "get_server_cpu_s_per_gb"):  # the least of the repeats
        out[what] = {k: min((s[what][k] for s in samples if s[what].get(k) is not None), default=None)
                     for k in samples[0][what]}
    return out


def speed_line(server: dict) -> str:
    """The server's own PUT and GET (:func:`server_speed` or :func:`best_server_speed`), one line."""
    return ("S3 server: PUT " + " / ".join(f"{v:.2f}" for v in server["put_gbps"].values()) + ", GET "
            + " / ".join(f"{v:.2f}" for v in server["get_gbps"].values())
            + f" GB/s from {' / '.join(server['put_gbps'])} stream(s)")


def limit_targets(entry: dict, server: dict) -> dict | None:
    """Ours' best GB/s as a fraction of the server's best (any stream count): PUT for a save,
    GET for a load or reshard; issue 17's 60% target for the save and the same-layout load."""
    ours = entry["libs"].get("ours", {}).get("best_gbps")
    what = "put_gbps" if entry["phase"] == "save" else "get_gbps"
    limit = max(server.get(what, {}).values(), default=None)
    if not ours or not limit:
        return None
    target = entry["phase"] in TARGETS
    return {"server_gbps": limit, "fraction": ours / limit, "at_least": SERVER_FRACTION if target else None,
            "met": ours / limit >= SERVER_FRACTION if target else None}


def in_flight(phase: str) -> tuple[int, str]:
    """(bytes, what) a rank may hold beyond the disk bound: a save's parts, a load's reads."""
    if phase == "save":
        return PARTS_IN_FLIGHT * PART_BYTES, f"{PARTS_IN_FLIGHT} parts of {PART_BYTES / MiB:.0f} MiB in flight"
    return READS_IN_FLIGHT, f"{READS_IN_FLIGHT / MiB:.0f} MiB of reads ahead and kept"


def memory_target(entry: dict) -> dict | None:
    """Ours' peak RSS growth per rank against the disk bound plus the parts or reads in flight."""
    ours = entry["libs"].get("ours", {})
    if "rss_growth_max_bytes" not in ours:
        return None
    limit = 0.1 * entry["share_bytes"] + 64 * MiB + in_flight(entry["phase"])[0]
    return {"limit_bytes": limit, "met": ours["rss_growth_max_bytes"] <= limit}


def report_lines(entry: dict, server: dict) -> list:
    """The lines under a phase's table: the server's own speed and ours as a fraction of it."""
    if not server:
        return []
    what, verb = ("put_gbps", "PUT") if entry["phase"] == "save" else ("get_gbps", "GET")
    counts = " / ".join(server[what])
    speeds = " / ".join(f"{v:.2f}" for v in server[what].values())
    cpu = server.get(what.replace("gbps", "server_cpu_s_per_gb"), {})
    cost = (f"; the server's CPU seconds per GB: {' / '.join(f'{v:.2f}' for v in cpu.values())}"
            if cpu and None not in cpu.values() else "")
    how = ("s3fs" if verb == "PUT" else "the faster of s3fs and a lean botocore reader: " + ", ".join(
        f"{k} {' / '.join(f'{v:.2f}' for v in server[f'get_gbps_{k}'].values())}" for k in ("s3fs", "lean")
        if server.get(f"get_gbps_{k}")))
    lines = [f"server's own {verb} GB/s of one {server['bytes'] / MiB:.0f} MiB object ({how}; "
             f"{server['part_bytes'] / MiB:.0f} MiB parts) from {counts} stream(s): {speeds}{cost}"]
    frac = entry["targets"].get("server")
    if frac:
        target = (f"; target >= {100 * frac['at_least']:.0f}%: {'met' if frac['met'] else 'not met'}"
                  if frac["at_least"] else "")
        lines.append(f"paddle_dcp at {100 * frac['fraction']:.0f}% of the server's best "
                     f"({frac['server_gbps']:.2f} GB/s){target}")
    for lib, stat in entry["libs"].items():
        cpu = stat.get("best_cpu")
        if cpu and cpu.get("server_seconds") is not None:
            lines.append(
                f"CPU seconds in {LIB_NAMES.get(lib, lib)}'s best run: ranks {cpu['ranks_seconds']:.2f} + server "
                f"{cpu['server_seconds']:.2f} of the {cpu['available_seconds']:.2f} the machine's cores offer "
                f"in that time ({100 * cpu['busy_fraction']:.0f}% busy)")
    mem = entry["targets"].get("memory")
    if mem:
        lines.append(f"ours' memory limit (10% of share + 64 MiB + {in_flight(entry['phase'])[1]}): "
                     f"{mem['limit_bytes'] / MiB:.0f} MiB/rank -> "
                     f"{'ok' if mem['met'] else 'over'}")
    return lines
