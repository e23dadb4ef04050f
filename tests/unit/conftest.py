"""tests/unit holds only tests that need no paddle and no other process: a run of these alone
(``scripts/test.sh --fast``) fails when one of them imported paddle (those belong in
tests/integration)."""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session", autouse=True)
def no_paddle(request):
    """After the last test of a run of tests/unit alone: an error if paddle was imported."""
    yield
    items = request.session.items
    alone = all(HERE in Path(str(item.fspath)).resolve().parents for item in items)
    if alone and sys.modules.get("paddle") is not None:
        pytest.fail("a test of tests/unit imported paddle: it belongs in tests/integration", pytrace=False)
