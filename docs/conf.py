"""Sphinx configuration: ``bash scripts/docs.sh`` builds the site into ``docs/_build/html``."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

import flask_firm_channel  # noqa: E402

project = "flask-firm-channel"
copyright = "flask-firm-channel contributors"
release = flask_firm_channel.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "myst_parser",
    "sphinx_click",
    "pallets_sphinx_themes",
    "firm_config",
    "public_names",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Quotes and ellipses, but no dashes: "--app" in a command's help stays two hyphens.
smartquotes_action = "qe"

# The API reference: signatures with their type hints, hints shown in the description.
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_preserve_defaults = True
toc_object_entries_show_parents = "hide"

# Nitpicky (-n): every cross-reference must resolve, except to the libraries we build on,
# whose inventories are not fetched (the build works offline).
nitpick_ignore_regex = [
    (
        "py:class",
        r"(flask|flask_sqlalchemy|sqlalchemy|werkzeug|socketio|click|datetime|prometheus_client)\..*",
    ),
    ("py:class", r"(Flask|SQLAlchemy|Engine|Table|MetaData|Session|Response|timedelta|datetime)"),
    ("py:class", r"(collections\.abc|typing|_io|types|logging)\..*"),
    # Internal types that show in public signatures; their use is described where they appear.
    (
        "py:class",
        r"flask_firm_channel\.(extension\.FirmChannelState|engine\.(subscriptions\.SubscriptionRegistry"
        r"|create\.Created|trim\.Trimmer|heartbeat\.ProcessStatus))",
    ),
    ("py:class", r"Fanout"),
    ("py:data", r"MAX_GAPS"),
]

html_theme = "flask"
html_theme_options = {
    "index_sidebar_logo": False,
    # Every page in the sidebar of every page, the current one's sections open beneath it.
    "globaltoc_maxdepth": 2,
    "globaltoc_collapse": True,
}
html_sidebars = {"**": ["globaltoc.html", "relations.html", "searchbox.html"]}
html_title = f"flask-firm-channel {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
html_context = {"project_links": []}

# The code samples run as tests (``sphinx-build -b doctest``, tests/test_docs.py), each page
# in a temporary directory of its own, on SQLite.
doctest_global_setup = """
import os
import tempfile

_doctest_home = os.getcwd()
_doctest_dir = tempfile.mkdtemp(prefix="firm-channel-doctest-")
os.chdir(_doctest_dir)
__name__ = "docs_example"  # what Flask(__name__) is given in the samples
"""
doctest_global_cleanup = """
import shutil

os.chdir(_doctest_home)
shutil.rmtree(_doctest_dir, ignore_errors=True)
"""
# Exception messages are part of what the samples show, so they are compared too.
doctest_default_flags = doctest.ELLIPSIS | doctest.DONT_ACCEPT_TRUE_FOR_1
