"""``firm-config-keys``: the table of every ``FIRM_CHANNEL_*`` key, generated from
``flask_firm_channel.config.KEYS`` so the docs cannot drift from the code.

.. code-block:: rst

    .. firm-config-keys::

Each key also becomes a ``confval``-like target, ``:ref:`FIRM_CHANNEL_COMMIT_GRACE``` links to
its row.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from flask_firm_channel.config import KEYS


def _default(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"``{value!r}``"


class ConfigKeys(SphinxDirective):
    """A list-table with one row per key: name, type, default, description."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        lines = [
            ".. list-table::",
            "   :header-rows: 1",
            "   :widths: 28 16 12 44",
            "",
            "   * - key",
            "     - type",
            "     - default",
            "     - what it does",
        ]
        for key in KEYS:
            lines += [
                f"   * - .. _{key.name}:",
                "",
                f"       ``{key.name}``",
                f"     - {key.type}",
                f"     - {_default(key.default)}",
                f"     - {key.doc}",
            ]
        container = nodes.container(classes=["firm-config-keys"])
        self.state.nested_parse(StringList(lines, source=__file__), self.content_offset, container)
        return [container]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("firm-config-keys", ConfigKeys)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
