#!/usr/bin/env bash
# The device paths on the fake GPU (called by `scripts/test.sh --fake-gpu`, inside its
# virtualenv): the device module's unit tests on the fake in a process of their own
# (tests/fakegpu_unit), then the multi-process tests marked `device` (tests/multirank/conftest.py:
# those that take user tensors through the device paths; the launcher, S3, guide and crash tests
# reach none) with every launched worker installing tests/fakegpu.py at start-up; the coverage of
# paddle_dcp/parallel/device.py over both is reported at the end. Fails when a test fails, none
# ran, or a line of the device module did not run (except lines marked `# pragma: real GPU`).
set -uo pipefail
cd "$(dirname "$0")/.."
cov="$(mktemp -d)"
trap 'rm -rf "$cov"' EXIT
cat > "$cov/rc" <<RC
[run]
parallel = True
data_file = $cov/data
include = */paddle_dcp/parallel/device.py
[report]
exclude_lines =
    pragma: real GPU
show_missing = True
RC
export PADDLE_DCP_FAKE_GPU=1 COVERAGE_PROCESS_START="$cov/rc"
# the device module's own paths, in a process of their own (the fake patches paddle in-process)
PADDLE_DCP_FAKE_GPU_INPROCESS=1 python -m coverage run --rcfile="$cov/rc" -m pytest -q -p no:cacheprovider tests/fakegpu_unit
unit=$?
python -m pytest -q -p no:cacheprovider --durations=10 -m device "$@" tests/multirank  # "$@": two at a time, from test.sh
status=$?
[ "$unit" -ne 0 ] && status=$unit
python -m coverage combine --rcfile="$cov/rc" -q "$cov" >/dev/null 2>&1
echo "line coverage of the device module under the fake GPU:"
python -m coverage report --rcfile="$cov/rc" --fail-under=100
covered=$?
[ "$status" -ne 0 ] && exit "$status"
exit "$covered"
