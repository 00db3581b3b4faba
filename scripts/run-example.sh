#!/usr/bin/env bash
# Start the example chat rooms under gunicorn (3 gthread workers) at http://127.0.0.1:8000 on a
# SQLite file. EXAMPLE_DATABASE_URL=postgresql+psycopg://... (or mysql+pymysql://...) uses a
# database server instead; PORT changes the port.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
PORT="${PORT:-8000}"
echo "Example app: http://127.0.0.1:${PORT}  (Ctrl-C to stop)" >&2
exec .venv/bin/gunicorn -c example_app/gunicorn.conf.py --bind "127.0.0.1:${PORT}"
