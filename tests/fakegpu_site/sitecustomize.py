"""Started by every Python process that has this directory on PYTHONPATH (the fake-GPU runs
of the multi-process tests): measures coverage where asked (COVERAGE_PROCESS_START) and, with
PADDLE_DCP_FAKE_GPU=1, makes paddle report a GPU (tests/fakegpu.py) in every process but
paddle's launcher itself."""
import os
import sys

if os.environ.get("COVERAGE_PROCESS_START"):
    try:
        import coverage

        coverage.process_startup()
    except ImportError:
        pass

if os.environ.get("PADDLE_DCP_FAKE_GPU") == "1" and "paddle.distributed.launch" not in " ".join(sys.orig_argv):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fakegpu

    fakegpu.install()
