"""What every command shares without connecting anywhere: the one-line error and the run's state file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CommandError(Exception):
    """Something the user can fix or should know, said in one line; the command exits 1."""


def read_state(state_file: Path) -> dict[str, Any]:
    """The run's state file (``$GPUWARDEN_HOME/run.json``), or an empty dict when there is none."""
    try:
        found = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
