"""What every command shares without connecting anywhere: the one-line errors, the run's state file, and the
settings a command finds the mesh with."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


def named(names: Iterable[str], most: int = 10) -> str:
    """Names for a line that says what exists: sorted, at most ``most`` of them and how many more; 'none'."""
    found = sorted(names)
    shown = ", ".join(found[:most])
    return (shown + (f" and {len(found) - most} more" if len(found) > most else "")) or "none"


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


Server = Literal["nats", "redis"]
"""A server a command needs: NATS (the bus), Redis (documents, the registry, the simulated cluster)."""
URL_VARIABLES: dict[Server, str] = {"nats": "GPUWARDEN_NATS_URL", "redis": "GPUWARDEN_REDIS_URL"}
NATS_ONLY: tuple[Server, ...] = ("nats",)
"""What a command of the bus alone needs (``publish``, ``where``, ``deadletters``, ``agent final-save``)."""
REDIS_ONLY: tuple[Server, ...] = ("redis",)
"""What a command of Redis alone needs (``config``, ``rollout``, ``sim label``)."""


class NoMesh(CommandError):
    """No mesh to act on: no run lives under ``GPUWARDEN_HOME`` and the user named no server's URL. Said at once, in
    one line: a command never tries the default ports of a server nobody named."""


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie (exited, not yet reaped by its parent) is gone for our purposes
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _run_pid(state: Mapping[str, Any]) -> int:
    try:
        return int(state.get("pid", 0) or 0)
    except (TypeError, ValueError):
        return 0


def command_env(needs: Iterable[Server] = ("nats", "redis")) -> dict[str, str]:
    """The process's environment, completed by the run's state file: a command finds each server it ``needs``
    through its URL variable (``GPUWARDEN_NATS_URL``, ``GPUWARDEN_REDIS_URL``), or else the run that ``gpuwarden
    up`` started under ``GPUWARDEN_HOME`` while that run lives; with neither it raises ``NoMesh`` (no default port
    is ever tried)."""
    env = dict(os.environ)
    state = read_state(state_file(env))
    live = bool(state.get("nats_url")) and alive(_run_pid(state))
    if live and not (env.get("GPUWARDEN_NATS_URL") and env.get("GPUWARDEN_REDIS_URL")):
        env.setdefault("GPUWARDEN_NATS_URL", state["nats_url"])
        env.setdefault("GPUWARDEN_REDIS_URL", state["redis_url"])
        env.setdefault("GPUWARDEN_ROOT", state.get("root", "gw"))
        if state.get("secure") and not env.get("GPUWARDEN_NATS_USER"):  # `up --secure`: the CLI is the admin
            for name, value in state["secure"].items():
                env.setdefault(name, value)
    unnamed = [URL_VARIABLES[server] for server in needs if not env.get(URL_VARIABLES[server])]
    if unnamed:
        raise NoMesh(no_mesh(env, state, unnamed))
    return env


def no_mesh(env: Mapping[str, str], state: Mapping[str, Any], unnamed: list[str]) -> str:
    """The one line that says no mesh is there, and how to start or reach one."""
    where = f"GPUWARDEN_HOME={home(env)}"
    pid = _run_pid(state)
    ended = ""
    if state:
        ended = (
            f" (its run, pid {pid}, is still starting)"
            if alive(pid)
            else f" (its run.json names pid {pid}, which has ended)"
        )
    given = [name for name in URL_VARIABLES.values() if env.get(name)]
    also = f"; {' and '.join(given)} alone is not enough: set {' and '.join(unnamed)} too" if given else ""
    return (
        f"no mesh is running under {where}{ended}{also}; `gpuwarden up --detach` starts one there, or set "
        "GPUWARDEN_NATS_URL and GPUWARDEN_REDIS_URL to reach one elsewhere"
    )


def command_settings(needs: Iterable[Server] = ("nats", "redis")) -> Settings:
    """gpuwarden's settings for a command, from ``command_env``: every server in ``needs`` named, or ``NoMesh``."""
    return load_settings(command_env(needs))


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
