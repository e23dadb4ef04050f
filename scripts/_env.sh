# Sourced by scripts/*.sh: create or reuse the repo's virtualenv and install what it needs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtualenv $VENV" >&2
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.paddle_dcp-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.py" -nt "$STAMP" ]; then
    echo "installing paddle_dcp with its cpu and test extras into $VENV" >&2
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e "$ROOT[cpu,test]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
