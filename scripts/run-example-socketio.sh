#!/usr/bin/env bash
# Start the Socket.IO example under gunicorn (3 gthread workers, each a Socket.IO server, the
# database their message queue) at http://127.0.0.1:8001 on a SQLite file.
# EXAMPLE_DATABASE_URL=postgresql+psycopg://... (or mysql+pymysql://...) uses a database server
# instead; PORT changes the port.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
PORT="${PORT:-8001}"
echo "Socket.IO example: http://127.0.0.1:${PORT}  (Ctrl-C to stop)" >&2
exec .venv/bin/gunicorn -c example_socketio/gunicorn.conf.py --bind "127.0.0.1:${PORT}"
