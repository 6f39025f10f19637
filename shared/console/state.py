"""What every command shares without connecting anywhere: the one-line errors, the run's state file, and the
settings a command finds the mesh with."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.plumbing.settings import (
    Parse,
    Settings,
    any_path,
    any_text,
    documented,
    load_settings,
    setting,
    settings_from_env,
)

DEFAULT_HOME = ".gpuwarden"


@dataclass(frozen=True)
class ConsoleSettings:
    """What the commands read from the environment besides the mesh's own settings (``command_settings``)."""

    home: Path = setting(
        "GPUWARDEN_HOME",
        Path(DEFAULT_HOME),
        "gpuwarden up/down and the other commands: the run's folder: run.json (URLs, health URLs, pids), "
        "logs/, checkpoints/, redis/",
        parse=any_path(),
        shown=".gpuwarden in the working directory",
    )
    pod: str = setting(
        "GPUWARDEN_POD_NAME",
        "",
        "inference pods: the pod name `gpuwarden agent final-save` addresses",
        parse=any_text(),
    )
    debug: bool = setting(
        "GPUWARDEN_DEBUG",
        False,
        "gpuwarden: set to show the traceback of an unexpected error instead of its one line",
        parse=Parse(lambda _, raw: True, lambda _: ""),
    )
    """Any value but a blank one turns it on."""


DOCUMENTED = documented(ConsoleSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def console_settings(env: Mapping[str, str] | None = None) -> ConsoleSettings:
    """The commands' own settings from ``env`` (the process's by default); none of them can be wrong."""
    return settings_from_env(ConsoleSettings, env)


class CommandError(Exception):
    """Something the user can fix or should know, said in one line; the command exits 1."""


class UsageError(Exception):
    """Bad input on the command line: printed as one clear line, exit status 2."""


def home(env: Mapping[str, str] | None = None) -> Path:
    """The folder of the run's state, logs, checkpoints and Redis data: ``GPUWARDEN_HOME``."""
    return console_settings(env).home.expanduser().resolve()


def state_file(env: Mapping[str, str]) -> Path:
    return home(env) / "run.json"


def read_state(state_file: Path) -> dict[str, Any]:
    """The run's state file (``$GPUWARDEN_HOME/run.json``), or an empty dict when there is none."""
    try:
        found = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def command_env() -> dict[str, str]:
    """The process's environment, completed by the run's state file: a command finds the mesh through
    ``GPUWARDEN_NATS_URL``/``GPUWARDEN_REDIS_URL``, or else the mesh ``gpuwarden run`` started, or else the
    defaults."""
    env = dict(os.environ)
    state = read_state(state_file(env))
    if state.get("nats_url") and not (env.get("GPUWARDEN_NATS_URL") and env.get("GPUWARDEN_REDIS_URL")):
        env.setdefault("GPUWARDEN_NATS_URL", state["nats_url"])
        env.setdefault("GPUWARDEN_REDIS_URL", state["redis_url"])
        env.setdefault("GPUWARDEN_ROOT", state.get("root", "gw"))
        if state.get("secure") and not env.get("GPUWARDEN_NATS_USER"):  # `up --secure`: the CLI is the admin
            for name, value in state["secure"].items():
                env.setdefault(name, value)
    return env


def command_settings() -> Settings:
    """gpuwarden's settings for a command, from ``command_env``."""
    return load_settings(command_env())


def read_json_arg(raw: str) -> bytes:
    """A JSON argument as given: inline, ``@file`` or ``-`` for stdin."""
    if raw == "-":
        return sys.stdin.buffer.read()
    if raw.startswith("@"):
        try:
            return Path(raw[1:]).read_bytes()
        except OSError as exc:
            raise UsageError(f"{raw[1:]}: {exc.strerror}") from None
    return raw.encode()
