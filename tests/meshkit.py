"""The ``gpuwarden`` command run as a user runs it, in a subprocess, for the tests that start a mesh of their own."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

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


def status(env: dict[str, str], sample: float = 3.0) -> dict[str, Any]:
    """``gpuwarden status --json`` in ``env``, listening ``sample`` seconds for the GPUs' utilisation."""
    done = gpuwarden(env, "status", "--json", "--sample", f"{sample:g}")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """``check()`` again every ``every`` seconds until it is truthy (its value), at most ``timeout`` seconds: a poll
    with a deadline, for checks that run a command or read a process from outside."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")
