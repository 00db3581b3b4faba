#!/usr/bin/env bash
# Start the example chat rooms under gunicorn (3 gthread workers) at http://127.0.0.1:8000 on a
# SQLite file. EXAMPLE_DATABASE_URL=postgresql+psycopg://... (or mysql+pymysql://...) uses a
# database server instead; PORT changes the port.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
PORT="${PORT:-8000}"
cat >&2 <<INFO
Example app:   http://127.0.0.1:${PORT}  (Ctrl-C to stop)
Admin console: http://127.0.0.1:${PORT}/_channels/   metrics: http://127.0.0.1:${PORT}/_channels/metrics
               (both for requests from this machine only)
From a shell:  .venv/bin/flask --app example_app firm-channel tail -v room:lobby
INFO
exec .venv/bin/gunicorn -c example_app/gunicorn.conf.py --bind "127.0.0.1:${PORT}"
