"""Started by every Python process the multi-process tests start (tests/multirank/launcher.py
puts this directory on PYTHONPATH): measures coverage where asked (COVERAGE_PROCESS_START);
with PADDLE_DCP_FAKE_GPU=1, makes paddle report a GPU (tests/fakegpu.py) in every process but
paddle's launcher itself; and in a launched rank other than 0, waits for rank 0's store before
paddle's init_parallel_env connects to it (tests/worker_store.py: it saves about 3 s in half
of the launches here)."""
import os
import sys

if os.environ.get("COVERAGE_PROCESS_START"):
    try:
        import coverage

        coverage.process_startup()
    except ImportError:
        pass

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if os.environ.get("PADDLE_DCP_FAKE_GPU") == "1" and "paddle.distributed.launch" not in " ".join(sys.orig_argv):
    sys.path.insert(0, _TESTS)
    import fakegpu

    fakegpu.install()

if os.environ.get("PADDLE_MASTER") and os.environ.get("PADDLE_TRAINER_ID", "0") != "0":
    sys.path.insert(0, _TESTS)
    import worker_store

    worker_store.install()
