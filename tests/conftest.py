"""Fixtures shared by the unit and the multi-process tests."""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `import s3server` whatever pytest's import mode
    sys.path.insert(0, str(HERE))


# the longest multi-process tests, started first: the suite runs two tests at a time, and the
# many short ones then fill the end instead of one long test running alone (its order: the
# durations CI lists)
LONGEST_FIRST = ("test_guide.py", "test_layout_pairs.py", "test_paddle_flows.py", "test_paddleformers.py",
                 "test_reliability.py", "test_tiers.py", "test_resume.py", "test_training.py")


def pytest_collection_modifyitems(config, items):
    def weight(item):
        name = Path(str(item.fspath)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=weight)  # stable: the others keep their order


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server on 127.0.0.1 for the whole session (tests/s3server.py); each
    test takes its own prefix of the bucket (``s3_server.url("name")``)."""
    from s3server import S3Server

    server = S3Server.start(str(tmp_path_factory.mktemp("weed")))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The standard AWS variables pointing at the session's server, set for this test."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
