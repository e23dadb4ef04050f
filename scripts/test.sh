#!/usr/bin/env bash
# Run every test: the pure unit tests and the multi-process tests under paddle's launcher,
# then list the 15 slowest. `scripts/test.sh --fast` runs the unit tests only (tests/unit).
# `scripts/test.sh --fake-gpu` runs the device module's tests and the multi-process tests marked
# `device` with every worker on the fake GPU (tests/fakegpu.py: tensors on Place(gpu), paddle's
# GPU rules enforced) and prints the line coverage of the device module under them. Other arguments go to pytest.
source "$(dirname "$0")/_env.sh"
if [ "${1:-}" = "--fast" ]; then
    shift
    exec python -m pytest -q -p no:cacheprovider "$@" tests/unit
fi
if [ "${1:-}" = "--fake-gpu" ]; then
    shift
    exec bash "$ROOT/scripts/fake_gpu_tests.sh" "$@"
fi
exec python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
