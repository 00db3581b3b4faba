"""The vendored scripts are the files their checksums in ``static/VENDORED.md`` name, with
their licences next to them, and the pages load those files and nothing else."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "static"


def test_vendored_files_match_their_recorded_checksums() -> None:
    table = (STATIC / "VENDORED.md").read_text()
    rows = re.findall(r"^\| `(vendor/[^`]+\.js)` \|.*\| `([0-9a-f]{64})` \|$", table, re.M)
    assert len(rows) == 2, rows
    for name, digest in rows:
        assert hashlib.sha256((STATIC / name).read_bytes()).hexdigest() == digest, name
    on_disk = {f"vendor/{p.name}" for p in (STATIC / "vendor").glob("*.js")}
    assert on_disk == {name for name, _ in rows}
    for licence in ("LICENSE.htmx", "LICENSE.htmx-ext-sse"):
        assert "Zero" in (STATIC / "vendor" / licence).read_text()


def test_the_base_template_loads_the_vendored_versions() -> None:
    base = (ROOT / "admin_templates" / "base.html").read_text()
    scripts = re.findall(r"static\('([^']+\.js)'\)", base)
    assert scripts == ["vendor/htmx-2.0.11.min.js", "vendor/htmx-ext-sse-2.2.4.js", "admin.js"]
    assert "htmx.org" not in base and "unpkg" not in base and "cdn" not in base.lower()
    assert '"allowScriptTags": false' in base and '"allowEval": false' in base
