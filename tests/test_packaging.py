"""What the package says about itself is true: the sdist carries everything the README links
to or tells you to run, a LICENSE, and metadata whose driver floor matches what the code calls
(the LISTEN path's ``notifies(timeout=)`` needs psycopg 3.2)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

#: Files of the repository the README names in running text (commands, examples).
_MENTIONED = re.compile(
    r"(?<![\w./-])((?:scripts|bench|tests|example_app|example_socketio|docs|static)/[\w./-]*\w)"
)


def relative_links(markdown: str) -> set[str]:
    """Relative link targets (``[x](path)``, ``![x](path)``), relative to the file."""
    return {
        target.split("#", 1)[0]
        for target in re.findall(r"\]\(([^)\s]+)\)", markdown)
        if not re.match(r"[a-z]+:|#", target)
    }


def mentioned_paths(markdown: str) -> set[str]:
    """Repository paths named in the text (``scripts/run-example.sh``), from the root."""
    return set(_MENTIONED.findall(markdown))


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> tarfile.TarFile:
    out = tmp_path_factory.mktemp("sdist")
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "-o", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (archive,) = out.glob("flask_firm_channel-*.tar.gz")
    return tarfile.open(archive)


def _names(sdist: tarfile.TarFile) -> set[str]:
    names = set()
    for member in sdist.getnames():
        _, _, rest = member.partition("/")
        names.add(rest)
    return names


def test_sdist_carries_what_the_readme_links_to(sdist: tarfile.TarFile) -> None:
    names = _names(sdist)
    readme = (ROOT / "README.md").read_text()
    refs = relative_links(readme) | mentioned_paths(readme)
    assert "docs/benchmarks.md" in refs and "scripts/run-example.sh" in refs
    # Markdown files linked from the README link on in turn (docs/benchmarks.md's plot).
    for ref in sorted(refs):
        if ref.endswith(".md") and (ROOT / ref).is_file():
            text = (ROOT / ref).read_text()
            base = Path(ref).parent
            refs |= {str(base / r) for r in relative_links(text) if not r.startswith(".")}
            refs |= mentioned_paths(text)
    for ref in sorted(refs):
        if _ignored(ref):
            continue  # an output a command writes (bench/results/...), not a shipped file
        assert (ROOT / ref).exists(), f"the README names {ref}, which the repository lacks"
        assert ref in names or any(n.startswith(ref.rstrip("/") + "/") for n in names), (
            f"the README names {ref}, which the sdist lacks"
        )


def _ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def test_sdist_has_the_license_and_true_metadata(sdist: tarfile.TarFile) -> None:
    names = _names(sdist)
    assert "LICENSE" in names
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License")
    member = next(m for m in sdist.getmembers() if m.name.endswith("/PKG-INFO"))
    pkg_info = sdist.extractfile(member)
    assert pkg_info is not None
    meta = Parser().parsestr(pkg_info.read().decode())
    assert meta["License-Expression"] == "MIT"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    requires = meta.get_all("Requires-Dist") or []
    assert any(re.match(r"psycopg\[binary\]>=3\.2\b.*extra == .postgres.", r) for r in requires), (
        requires
    )
    classifiers = set(meta.get_all("Classifier") or [])
    for expected in (
        "Framework :: Flask",
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.13",
        "Topic :: Database",
    ):
        assert expected in classifiers


def test_the_listen_path_uses_what_the_floor_guarantees() -> None:
    """The PostgreSQL listener talks to libpq through psycopg's ``pgconn`` and loads rows
    with its ``Transformer`` (``backends/postgresql/``: ``runner.py``, ``wake.py``); the
    declared floor is 3.2."""
    import psycopg
    from psycopg.adapt import Transformer

    for name in ("consume_input", "notifies", "send_query", "prepare", "exec_prepared"):
        assert hasattr(psycopg.pq.PGconn, name), name
    assert hasattr(Transformer, "load_rows") and hasattr(Transformer, "dump_sequence")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"psycopg\[binary\]>=3\.2"', pyproject)
