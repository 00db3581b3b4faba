"""The documentation is true and whole: the Sphinx site builds with warnings as errors and
every reference resolved, its code samples run, every ``FIRM_CHANNEL_*`` key of the code is in
it (and nothing else), every ``flask firm-channel`` command is in it, and the README's links
lead to files that exist."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from flask_firm_channel.cli import firm_channel_cli
from flask_firm_channel.config import KEYS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
pytestmark = pytest.mark.slow

#: ``FIRM_CHANNEL_*`` names the docs may use that are not config keys: the test suite's
#: environment variables (the fault schedule's seed among them).
_NOT_KEYS = re.compile(r"FIRM_CHANNEL_(?:TEST_\w+|FAULT_SEED)")
#: A key's name (not a prefix such as ``FIRM_CHANNEL_SSE_*``).
_KEY = re.compile(r"(?<![A-Za-z0-9_])FIRM_CHANNEL_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_*])")

#: Python samples in the docs that are shown but not run, and why. Every other python block
#: of a page is a ``testcode``/``doctest`` block, run by ``sphinx-build -b doctest``.
NOT_RUN = {
    ("sse.md", "for message in firm_channel.listen("): "the signature with every argument at"
    " its default (timeout=None blocks); a runnable listen() follows it",
    ("socketio.md", "from flask_socketio import SocketIO"): "an app factory elided with ...",
    ("scaling.md", 'app.config["SQLALCHEMY_DATABASE_URI"] = "postgresql+psycopg://'): "needs"
    " a PostgreSQL server behind PgBouncer (tests/test_pooler.py covers it)",
    ("table.md", "def upgrade():"): "an Alembic migration; runs under `flask db upgrade`",
}


def _sphinx(builder: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-n", "-q", "-b", builder, str(DOCS), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HTML site, built from the repository into a fresh directory."""
    out = tmp_path_factory.mktemp("html")
    built = _sphinx("html", out)
    assert built.returncode == 0, f"sphinx-build -W -n failed:\n{built.stdout}\n{built.stderr}"
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    for page in ("index", "quickstart", "tutorial", "configuration", "cli", "api", "changelog"):
        assert (site / f"{page}.html").is_file(), page
    # The bench writes these pages; they stay pages of the site under their own names.
    for page in (
        "benchmarks",
        "benchmarks-fleet",
        "benchmarks-burst",
        "benchmarks-sse",
        "benchmarks-socketio",
    ):
        assert (site / f"{page}.html").is_file(), page
    assert (site / "reliability.html").is_file()
    # Nothing is loaded from elsewhere: the pages work offline.
    for page in site.rglob("*.html"):
        for url in re.findall(r'(?:src|href)="(https?://[^"]+)"', page.read_text()):
            assert "sphinx-doc.org" in url, f"{page.name} loads {url}"


def test_the_api_reference_covers_the_public_names(site: Path) -> None:
    import flask_firm_channel

    api = (site / "api.html").read_text()
    for name in flask_firm_channel.__all__:
        if name.startswith("__"):
            continue
        assert f'id="flask_firm_channel.{name}"' in api, f"{name} is not in the API reference"
    for target in (
        "flask_firm_channel.FirmChannel.stream",
        "flask_firm_channel.FirmChannel.listen",
    ):
        assert f'id="{target}"' in api, target


def test_the_code_samples_run(tmp_path: Path) -> None:
    ran = _sphinx("doctest", tmp_path)
    report = (tmp_path / "output.txt").read_text() if (tmp_path / "output.txt").exists() else ""
    assert ran.returncode == 0, f"{report}\n{ran.stdout}\n{ran.stderr}"
    tests = sum(int(n) for n in re.findall(r"^\s*(\d+) tests?$", report, re.M))
    failures = sum(int(n) for n in re.findall(r"^\s*(\d+) failures? in", report, re.M))
    assert tests >= 16 and failures == 0, report


def test_every_python_sample_runs_or_says_why() -> None:
    shown = set()
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S):
            first = block.lstrip().splitlines()[0]
            key = next((k for k in NOT_RUN if k[0] == page.name and first.startswith(k[1])), None)
            assert key, f"{page.name}: a python sample that does not run: {first!r}"
            shown.add(key)
    assert shown == set(NOT_RUN), f"no longer in the docs: {set(NOT_RUN) - shown}"


def _documented_keys(text: str) -> set[str]:
    return {k for k in _KEY.findall(text) if not _NOT_KEYS.fullmatch(k)}


def test_every_config_key_is_documented_and_every_documented_key_exists(site: Path) -> None:
    in_code = [key.name for key in KEYS]
    assert len(in_code) == len(set(in_code))
    page = (site / "configuration.html").read_text()
    table = page[page.index('class="firm-config-keys') :]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr[^>]*>\s*<td>(.*?)</td>", table, re.S)
    in_table = [name for row in rows for name in _KEY.findall(row)]
    assert in_table == in_code, "the generated table is not the code's list"
    for key in KEYS:
        assert key.doc and key.type, f"{key.name} has no description or type"
    # Every key named anywhere (pages, README, the built site) is one of the code's.
    named = _documented_keys(README.read_text())
    for source in [*DOCS.glob("*.md"), *DOCS.glob("*.rst"), *site.glob("*.html")]:
        named |= _documented_keys(source.read_text())
    assert named - set(in_code) == set(), f"documented but not in the code: {named - set(in_code)}"


def _commands(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    found = {}
    for name, command in group.commands.items():
        found[f"{prefix}{name}"] = command
        if isinstance(command, click.Group):
            found |= _commands(command, f"{prefix}{name} ")
    return found


def test_every_cli_command_is_documented(site: Path) -> None:
    page = _text(site / "cli.html")
    sources = (DOCS / "cli.md").read_text()
    commands = _commands(firm_channel_cli)
    assert {"create-table", "broadcast", "tail", "stats", "trim"} <= set(commands)
    for name, command in commands.items():
        assert f"flask firm-channel {name}" in page, f"`{name}` is not on the CLI page"
        assert f"flask firm-channel {name}" in sources, f"`{name}` is not in the CLI overview"
        for param in command.params:
            for opt in param.opts if isinstance(param, click.Option) else []:
                assert opt in page, f"`{name} {opt}` is not on the CLI page"


def _slug(heading: str) -> str:
    """GitHub's (and MyST's) anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_the_readme_links_resolve() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.is_file(), f"the README links to {link}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"no heading for {link}"
    # Every page the README links into is a page of the site.
    toctree = (DOCS / "index.md").read_text()
    for link in links:
        if link.startswith("docs/") and link.endswith((".md", ".rst")):
            page = Path(link.partition("#")[0]).stem
            assert re.search(rf"^{re.escape(page)}$", toctree, re.M), (
                f"{page} is not in the toctree"
            )


def test_the_readme_is_a_landing_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 200
    assert "bash scripts/docs.sh" in text
    assert "docs/latency.png" in text


def _toctree_pages() -> list[str]:
    index = (DOCS / "index.md").read_text()
    blocks = re.findall(r"```\{toctree\}\n(.*?)```", index, re.S)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.startswith(":")
    ]


def test_every_page_has_the_whole_site_in_its_sidebar(site: Path) -> None:
    pages = _toctree_pages()
    assert len(pages) > 20
    for name in [*pages, "index"]:
        html_text = (site / f"{name}.html").read_text()
        sidebar = html_text[html_text.index('class="sphinxsidebar"') :]
        linked = set(re.findall(r'href="([\w-]+)\.html(?:#[^"]*)?"', sidebar))
        # The page itself is in the list as the current entry.
        assert set(pages) - {name} <= linked, f"{name}: the sidebar lacks {set(pages) - linked}"


def test_the_installation_page_names_every_extra() -> None:
    from importlib.metadata import metadata

    extras = metadata("flask-firm-channel").get_all("Provides-Extra") or []
    assert {"postgres", "mysql", "metrics", "tracing", "socketio"} <= set(extras)
    page = (DOCS / "installation.md").read_text()
    for extra in extras:
        assert f'pip install "flask-firm-channel[{extra}]"' in page, extra
