"""What the run ran on: CPU, kernel, package and server versions, the commit."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from typing import Any

from .contenders import MARIADB_URL, PG_URL, REDIS_HOST, REDIS_PORT


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "cpu": "unknown",
    }
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    pkgs = {}
    for name in ("flask-firm-channel", "firm-channel", "SQLAlchemy", "psycopg", "PyMySQL", "redis"):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = "-"
    info["packages"] = pkgs
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        info["commit"] = rev.stdout.strip() or "-"
    except (OSError, subprocess.SubprocessError):
        info["commit"] = "-"
    servers = {}
    try:
        import sqlite3

        servers["SQLite"] = sqlite3.sqlite_version
        import sqlalchemy as sa

        for label, url in (("PostgreSQL", PG_URL), ("MariaDB", MARIADB_URL)):
            try:
                e = sa.create_engine(url)
                with e.connect() as c:
                    v = c.exec_driver_sql("SELECT version()").scalar()
                servers[label] = str(v).split(" on ")[0].split(",")[0]
                e.dispose()
            except Exception:  # noqa: BLE001
                servers[label] = "unreachable"
        import redis

        r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
        servers["Redis"] = r.info("server").get("redis_version", "?")
        r.close()
    except Exception:  # noqa: BLE001
        pass
    info["servers"] = servers
    return info
