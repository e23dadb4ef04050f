#!/usr/bin/env bash
# Run every test: the pure unit tests and the multi-process tests under paddle's launcher,
# then list the 15 slowest; two tests at a time. `scripts/test.sh --fast` runs the unit tests only (tests/unit: no paddle,
# no processes); the rest are tests/integration (paddle in one process, or a server) and tests/multirank.
# `scripts/test.sh --fake-gpu` runs the device module's tests and the multi-process tests marked
# `device` with every worker on the fake GPU (tests/fakegpu.py: tensors on Place(gpu), paddle's
# GPU rules enforced) and prints the line coverage of the device module under them. Other arguments go to pytest.
source "$(dirname "$0")/_env.sh"
# two tests at a time (pytest-xdist; PADDLE_DCP_TEST_WORKERS=0 runs them one by one): a
# multi-process test waits on its ranks about half of its time
PARALLEL=(-n "${PADDLE_DCP_TEST_WORKERS:-2}" --dist worksteal)
if [ "${1:-}" = "--fast" ]; then
    shift
    exec python -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" "$@" tests/unit
fi
if [ "${1:-}" = "--fake-gpu" ]; then
    shift
    exec bash "$ROOT/scripts/fake_gpu_tests.sh" "${PARALLEL[@]}" "$@"
fi
exec python -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" --durations=15 "$@" tests
