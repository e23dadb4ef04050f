"""The command-line tests' fixtures (tests/unit/tools/conftest.py), for the ones here."""
from unit.tools.conftest import ck, compressed, derived, saved  # noqa: F401 - fixtures, found by pytest by name
