"""A driver install on a real node: the node's own shell command (``GPUWARDEN_DRIVER_INSTALL_COMMAND``, ``{version}``
substituted; for example a restart of the node's driver container), run as a subprocess.

The NVML adapter of the GPU port (``shared.adapters.nvml``) installs through this; whoever asked validates
afterwards (``GpuPort.validate_driver``): a command that exits 0 has only said it is done, not that the driver works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
from dataclasses import dataclass

from shared.plumbing.settings import any_text, documented, setting, settings_from_env
from shared.ports.gpu import DriverInstallError

log = logging.getLogger(__name__)

INSTALL_COMMAND_ENV = "GPUWARDEN_DRIVER_INSTALL_COMMAND"
DRIVER_VERSION_RE = re.compile(r"^\d+(\.\d+){1,2}$")
STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class DriverInstallSettings:
    command: str = setting(
        INSTALL_COMMAND_ENV,
        "",
        "real backend: the shell command that installs a driver version on the node (`{version}` is "
        "substituted), e.g. restarting the node's driver container",
        parse=any_text(),
    )


DOCUMENTED = documented(DriverInstallSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


async def install_driver(version: str, command: str | None = None) -> None:
    """Run the install command for ``version`` (``command``, else ``GPUWARDEN_DRIVER_INSTALL_COMMAND`` as it is
    now) and wait for it; ``DriverInstallError`` when the version is no driver version (it goes into a shell
    command, quoted, and must look like ``550.54.15``), no command is set, or it cannot run or exits non-zero
    (with the tail of its stderr). Cancelled, the command is killed."""
    if not DRIVER_VERSION_RE.match(version):
        raise DriverInstallError(f"{version!r} is not a driver version such as '550.54.15'")
    template = command if command is not None else settings_from_env(DriverInstallSettings).command
    if not template or not template.strip():
        raise DriverInstallError(
            f"cannot install driver {version}: set {INSTALL_COMMAND_ENV} to the shell command that installs a "
            "driver on this node ({version} is substituted), e.g. one that restarts the node's driver container"
        )
    shell = template.replace("{version}", shlex.quote(version))
    log.info("installing driver", extra={"version": version, "command": shell})
    try:
        proc = await asyncio.create_subprocess_shell(
            shell, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        raise DriverInstallError(f"installing driver {version}: could not run {shell!r}: {exc}") from exc
    try:
        _stdout, stderr = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.shield(proc.wait())
        raise
    if proc.returncode != 0:
        tail = stderr.decode(errors="replace").strip()[-STDERR_TAIL_CHARS:]
        raise DriverInstallError(
            f"installing driver {version}: {shell!r} exited with {proc.returncode}: {tail or '(no stderr)'}"
        )
    log.info("driver install command finished", extra={"version": version})
