"""Statements compiled once by SQLAlchemy and run on a driver cursor.

The publish path and the listener run the same few statements thousands of times a second.
Compiling them once and binding values with the column types' own processors skips
SQLAlchemy's per-call compilation, ORM and result machinery while keeping its SQL and type
handling exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.types import TypeEngine


class Compiled:
    """``stmt`` compiled for ``engine``'s dialect; :meth:`params` turns a dict of values into
    what the driver expects (a dict or a tuple, in the compiled order)."""

    def __init__(self, stmt: ClauseElement, engine: Engine) -> None:
        dialect = engine.dialect
        compiled: Any = stmt.compile(dialect=dialect)
        self.sql = str(compiled)
        self._order: list[str] | None = (
            list(compiled.positiontup or []) if compiled.positional else None
        )
        #: Values SQLAlchemy bound itself (a LIMIT, say).
        self._defaults = {
            name: bind.effective_value
            for name, bind in compiled.binds.items()
            if not bind.required and bind.effective_value is not None
        }
        self._processors: dict[str, Callable[[Any], Any]] = {}
        for name, bind in compiled.binds.items():
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None:
                self._processors[name] = processor

    def params(self, values: dict[str, Any]) -> Any:
        if self._defaults:
            values = {**self._defaults, **values}
        for name, processor in self._processors.items():
            if name in values:
                values[name] = processor(values[name])
        if self._order is None:
            return values
        return tuple(values[name] for name in self._order)


def result_processors(
    engine: Engine, types: Sequence[TypeEngine[Any]]
) -> list[Callable[[Any], Any] | None]:
    """The driver-value-to-Python converters of ``types`` (``None`` where none is needed)."""
    dialect = engine.dialect
    return [t.dialect_impl(dialect).result_processor(dialect, None) for t in types]
