#!/usr/bin/env bash
# Run every test: the pure unit tests and the multi-process tests under paddle's launcher,
# then list the 15 slowest. `scripts/test.sh --fast` runs the unit tests only (tests/unit).
# Other arguments go to pytest.
source "$(dirname "$0")/_env.sh"
if [ "${1:-}" = "--fast" ]; then
    shift
    exec python -m pytest -q -p no:cacheprovider "$@" tests/unit
fi
exec python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
