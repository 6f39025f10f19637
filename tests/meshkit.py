"""The ``gpuwarden`` command run as a user runs it, in a subprocess, for the tests that start a mesh of their own."""

from __future__ import annotations

import subprocess
import sys

UP_READY_S = 240
"""How long a test's ``up --detach`` waits for every process to answer ``/readyz``. A quiet machine needs 15-20 s;
``make test`` runs three workers on 2 cores beside the vLLM engines' tests, where the default 90 s was seen to run
out. A mesh that never gets ready still fails, naming what it waited for."""


def gpuwarden(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """One ``gpuwarden`` command in ``env``: its exit status, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def up_detached(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``gpuwarden up --detach ARGS`` with the ready window of a loaded test machine (``UP_READY_S``)."""
    return gpuwarden(env, "up", "--detach", *args, "--ready-timeout", str(UP_READY_S), timeout=UP_READY_S + 60)
