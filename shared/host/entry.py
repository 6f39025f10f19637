"""A service's ``__main__``: one node's service, or with ``GPUWARDEN_HOLLOW_NODES`` one instance per simulated
node in this process. The choice is made here, above both ``runner`` (one service) and ``hollow`` (many), so
neither imports the other."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from shared.host.hollow import HollowPlan, HollowSettings, run_hollow
from shared.host.runner import BackendsFactory, Service, run
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import settings_from_env


def main(
    name: str, make: Callable[[], Service], backends: BackendsFactory | None = None, hollow: HollowPlan | None = None
) -> int:
    """A service's ``__main__``: build the service (its own settings are read there) and ``run`` it. Bad settings,
    shared or the service's own, are one line on stderr and exit status 2, never a traceback.

    A node-scoped service hands ``hollow`` too: with ``GPUWARDEN_HOLLOW_NODES`` set, it runs once per node named
    there, every instance in this process (``shared.host.hollow``)."""
    try:
        hollow_settings = settings_from_env(HollowSettings)
        nodes = hollow_settings.nodes
        if nodes and hollow is None:
            raise SettingsError("GPUWARDEN_HOLLOW_NODES: this service runs once per cluster, not once per node")
        service = hollow.instance(True) if nodes and hollow is not None else make()
    except SettingsError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    if nodes and hollow is not None:
        return run_hollow(name, hollow_settings, hollow, os.environ)
    return run(service, backends)


def exit_now(code: int) -> NoReturn:
    """End a service's process once ``main`` returned, without the interpreter's teardown. By then the runner has
    stopped the service in order (consumers, loops, stop hooks, connections: ``shared.host.runner``); what is left
    is freeing every object of the interpreter, which takes a CPU-bound second or more per process when a dozen
    stop at once on a busy 2-core machine (and seconds with torch and transformers loaded), all of which
    ``gpuwarden down`` would wait for. Only the logs and stdio are left to flush, and they are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
