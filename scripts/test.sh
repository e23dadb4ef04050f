#!/usr/bin/env bash
# Run every test: the pure unit tests and the multi-process tests under paddle's launcher.
source "$(dirname "$0")/_env.sh"
python -m pytest -q -p no:cacheprovider "$@" tests
