"""Unit tests of paddle_dcp's device module on the fake GPU, in one process of their own:
``install()`` patches paddle for the whole process, so these run only where
``PADDLE_DCP_FAKE_GPU_INPROCESS=1`` says this process is theirs (scripts/fake_gpu_tests.sh)."""
import os
import sys
from pathlib import Path

if os.environ.get("PADDLE_DCP_FAKE_GPU_INPROCESS") == "1":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: fakegpu
    import fakegpu

    fakegpu.install()
else:
    collect_ignore_glob = ["test_*.py"]
