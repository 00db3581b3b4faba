"""What the backends share: the base dialect (also the generic, polling one), the base wake
hint (plain polling, also every hint's fallback) and the cursor runner. Imports no backend."""

from .dialect import INSERT_PARAMS, Dialect
from .runner import CursorRunner, Runner
from .wake import HintHealth, WakeHint

__all__ = ["INSERT_PARAMS", "CursorRunner", "Dialect", "HintHealth", "Runner", "WakeHint"]
