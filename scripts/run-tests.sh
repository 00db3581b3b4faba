#!/usr/bin/env bash
# Run the test suite on SQLite, PostgreSQL and MariaDB/MySQL. A server that is not running is
# skipped with a loud warning (under CI=true it fails instead). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/python -m pytest "$@"
