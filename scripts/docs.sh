#!/usr/bin/env bash
# Build the documentation into docs/_build/html (a warning or a broken reference is an error)
# and print the page to open. Extra arguments go to sphinx-build.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
.venv/bin/python -m sphinx -W -n -q -b html "$@" docs docs/_build/html
echo "Docs built: file://$ROOT/docs/_build/html/index.html" >&2
