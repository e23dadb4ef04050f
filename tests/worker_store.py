"""A launched rank other than 0 waits for rank 0's store before it connects (tests only).

paddle's ``init_parallel_env`` has rank 0 listen on ``PADDLE_MASTER``'s port (the global TCP
store) and every other rank connect to it; a rank that tries before rank 0 listens tries again
about 3 s later (measured here: the call took 3.2-3.4 s instead of 0.3-0.6 s, on every rank, in
about half of the 2-rank launches). A rank that waits until the port listens, polling every 20
ms, connects at its first try. Installed by tests/worker_site/sitecustomize.py in launched ranks
other than 0: ``paddle.distributed.parallel.init_parallel_env`` is wrapped as its module is
imported; nothing else changes."""
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

MODULE = "paddle.distributed.parallel"
POLL_S = 0.02
WAIT_S = 60.0  # then paddle's own connect and its errors take over


def listening(port: int) -> bool:
    """Whether a socket of this machine listens on TCP ``port`` (read from /proc/net, not by
    connecting: paddle's store server aborts now and then on a client that connects and closes
    at once, an assertion in its libuv loop)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def wait_for_master() -> None:
    """Until rank 0's store listens (at most WAIT_S); only for a master on this machine."""
    host, port = os.environ["PADDLE_MASTER"].rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost"):
        return
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not listening(int(port)):
        time.sleep(POLL_S)


def _wrapped(module) -> None:
    original = module.init_parallel_env

    @functools.wraps(original)
    def init_parallel_env(*args, **kwargs):
        wait_for_master()
        return original(*args, **kwargs)

    module.init_parallel_env = init_parallel_env


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _wrapped(module)

            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if MODULE in sys.modules:
        _wrapped(sys.modules[MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
