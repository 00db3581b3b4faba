# Sourced by the other scripts: make ./.venv with the package and its test/driver/docs extras.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "Creating .venv with $($PYTHON --version)" >&2
    "$PYTHON" -m venv .venv
fi
# Quiet and quick when everything is already installed.
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[dev,postgres,mysql,docs,metrics]"
