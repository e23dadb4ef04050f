"""Multi-process tests: every test here starts ranks under paddle.distributed.launch."""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `import launcher` whatever pytest's import mode
    sys.path.insert(0, str(HERE))


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: starts several ranks under paddle.distributed.launch")
    config.addinivalue_line(
        "markers",
        "device: takes user tensors through paddle_dcp's device paths (run again on the fake GPU by "
        "scripts/fake_gpu_tests.sh, which checks that together they run every line of parallel/device.py)",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.dist)
