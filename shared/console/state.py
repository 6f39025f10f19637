"""What every command shares without connecting anywhere: the one-line error and the run's state file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_HOME": (
        "gpuwarden up/down and the other commands: the run's folder: run.json (URLs, health URLs, pids), "
        "logs/, checkpoints/, redis/ (default .gpuwarden in the working directory)"
    ),
    "GPUWARDEN_POD_NAME": "inference pods: the pod name `gpuwarden agent final-save` addresses",
    "GPUWARDEN_DEBUG": "gpuwarden: set to show the traceback of an unexpected error instead of its one line",
}
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


class CommandError(Exception):
    """Something the user can fix or should know, said in one line; the command exits 1."""


def read_state(state_file: Path) -> dict[str, Any]:
    """The run's state file (``$GPUWARDEN_HOME/run.json``), or an empty dict when there is none."""
    try:
        found = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
