"""Resolve the docstrings' references to where the API reference documents them.

The code refers to its objects by the name it imports them under (``Message``,
``flask_firm_channel.engine.PubSub``, ``Listening.close``); the reference documents them
under the public name (``flask_firm_channel.Message``). A reference that finds no target
is retried with its module path dropped, under each documented module in turn.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

#: The modules the API reference documents objects under, most public first.
DOCUMENTED = (
    "flask_firm_channel",
    "flask_firm_channel.extension",
    "flask_firm_channel.engine",
    "flask_firm_channel.socketio",
    "flask_firm_channel.config",
)


def _resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    if node.get("refdomain") != "py":
        return None
    domain: Any = env.get_domain("py")
    parts = node["reftarget"].lstrip("~.").split(".")
    for start in range(len(parts)):
        name = ".".join(parts[start:])
        for module in DOCUMENTED:
            full = f"{module}.{name}"
            if full in domain.objects:
                return domain.resolve_xref(
                    env, node["refdoc"], app.builder, node["reftype"], full, node, contnode
                )
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", _resolve)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
