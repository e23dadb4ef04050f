"""Multi-process tests: every test here starts ranks under paddle.distributed.launch."""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `import launcher` whatever pytest's import mode
    sys.path.insert(0, str(HERE))


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: starts several ranks under paddle.distributed.launch")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.dist)
