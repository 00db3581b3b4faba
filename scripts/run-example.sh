#!/usr/bin/env bash
# Start the example app on a SQLite file under gunicorn (two workers) at http://127.0.0.1:8000
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
PORT="${PORT:-8000}"
echo "Example app: http://127.0.0.1:${PORT}  (Ctrl-C to stop)" >&2
exec .venv/bin/gunicorn --workers 2 --threads 4 --bind "127.0.0.1:${PORT}" \
    --access-logfile - "example_app:create_app()"
