"""The CDI (Container Device Interface) spec of the node's GPUs: the container toolkit's role.

A runtime that reads CDI turns a device name such as ``nvidia.com/gpu=<uuid>`` (what Allocate answers under the
``cdi`` device-list strategy) into the edits listed here. Each GPU is named by UUID and by index, each MIG
instance by UUID and ``<gpu index>:<instance>``, and ``all`` names every GPU. The spec is written atomically (a
temporary file in the same folder, then a rename), so a runtime never reads half a file.

A device node alone does not make a GPU usable: the container also needs the user-space half of the driver, of
exactly the kernel module's version. As ``nvidia-ctk cdi generate`` does, the common edits bind-mount the driver's
libraries, firmware and tools from the node read-only, and (when the node has NVIDIA's CDI hook binary) add hooks
that make the libraries' ``.so.1``/``.so`` links and the container's ldcache, so programs find them by name. What
is mounted is what is really there, looked up under the driver root each time the GPUs change.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from shared.contract.device import GpuDevice, MigInstance

from .resources import CDI_KIND

log = logging.getLogger(__name__)

CDI_VERSION = "0.6.0"
SPEC_FILE = "gpuwarden-nvidia.com-gpu.json"
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
LIBRARY_FOLDERS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib")
DRIVER_LIBRARIES: tuple[tuple[str, str | None], ...] = (
    ("libcuda.so", "libcuda.so.1"),
    ("libnvidia-ml.so", "libnvidia-ml.so.1"),
    ("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
    ("libnvidia-nvvm.so", "libnvidia-nvvm.so.4"),
    ("libcudadebugger.so", "libcudadebugger.so.1"),
    ("libnvidia-opencl.so", "libnvidia-opencl.so.1"),
    ("libnvidia-allocator.so", "libnvidia-allocator.so.1"),
    ("libnvidia-cfg.so", "libnvidia-cfg.so.1"),
    ("libnvidia-gpucomp.so", None),
)
"""Each library the spec mounts as ``<name>.<driver version>``, with the SONAME programs load it by (None: the
versioned file is its own SONAME, so there is no link to make)."""
DRIVER_BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
HOOK_BINARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook",)),
    ("usr/bin/nvidia-ctk", ("nvidia-ctk", "hook")),
)
"""Where NVIDIA's hook binary may be, preferred first, with the arguments that come before a hook's name (the
legacy ``nvidia-ctk`` takes hooks as ``nvidia-ctk hook <name>``)."""
FIRMWARE_FOLDER = "lib/firmware/nvidia"
MIG_MINORS = "proc/driver/nvidia-caps/mig-minors"
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
HOOK_NAMES = frozenset({"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"})
_KIND_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")
_NAME_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.:-]*[a-zA-Z0-9])?$")
_VERSION_RE = re.compile(r"^0\.[3-8]\.[0-9]+$")
_EDIT_KEYS = ("env", "deviceNodes", "mounts", "hooks")


class CdiError(OSError):
    """The CDI spec could not be written; names the folder and why."""


@dataclass(frozen=True)
class DriverRoot:
    """``host``: the folder the driver is installed under, as the host and so the container runtime sees it (the
    spec's paths are host paths); ``here``: where this process can look into it (the service's mount of it)."""

    host: Path = Path("/")
    here: Path = Path("/")


class DriverLibrary(NamedTuple):
    name: str  # libcuda.so
    path: str  # inside the container: the host path without the driver root
    soname: str | None


@dataclass(frozen=True)
class DriverFiles:
    """The driver's files on the node, as container paths (the host path without the driver root). ``hook`` is
    the hook binary's host path and the arguments before a hook's name, None when the node has none;
    ``mig_minors`` maps ``gpu0/gi1/access`` to its capability minor, None when the driver does not list them."""

    host_root: str = "/"
    version: str = ""
    libraries: tuple[DriverLibrary, ...] = ()
    missing_libraries: tuple[str, ...] = ()
    firmware: str | None = None
    binaries: tuple[str, ...] = ()
    hook: tuple[str, tuple[str, ...]] | None = None
    mig_minors: Mapping[str, int] | None = None

    def on_host(self, path: str) -> str:
        return str(PurePosixPath(self.host_root) / path.lstrip("/"))


def parse_mig_minors(text: str) -> dict[str, int]:
    """``gpu0/gi1/access 12`` lines (and ``config 1``, ``monitor 2``) as name -> minor; lines of another shape are
    skipped, as the driver may add kinds."""
    minors: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isascii() and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    return minors


def find_driver_files(root: DriverRoot, version: str) -> DriverFiles:
    """What of driver ``version`` is under ``root``: each library's first match in ``LIBRARY_FOLDERS``, the
    firmware folder, the tools, the hook binary and the MIG capability minors. An unknown version (``""``) finds no
    libraries or firmware, never another version's. Only what is there as a file (or a link to one that resolves
    here) is listed: a mount or hook naming a missing path would stop every container that asks for a GPU."""
    here = root.here
    libraries: list[DriverLibrary] = []
    missing: list[str] = []
    for name, soname in DRIVER_LIBRARIES:
        found = None
        if version:
            found = next((f for f in LIBRARY_FOLDERS if (here / f / f"{name}.{version}").is_file()), None)
        if found is None:
            missing.append(name)
        else:
            libraries.append(DriverLibrary(name, f"/{found}/{name}.{version}", soname))
    firmware = f"{FIRMWARE_FOLDER}/{version}"
    hook = next(((path, prefix) for path, prefix in HOOK_BINARIES if (here / path).is_file()), None)
    try:
        minors: dict[str, int] | None = parse_mig_minors((here / MIG_MINORS).read_text())
    except OSError:
        minors = None
    return DriverFiles(
        host_root=str(root.host),
        version=version,
        libraries=tuple(libraries),
        missing_libraries=tuple(missing),
        firmware=f"/{firmware}" if version and (here / firmware).is_dir() else None,
        binaries=tuple(f"/usr/bin/{b}" for b in DRIVER_BINARIES if (here / "usr/bin" / b).is_file()),
        hook=(str(root.host / hook[0]), hook[1]) if hook else None,
        mig_minors=minors,
    )


def _gpu_node(gpu: GpuDevice) -> dict[str, Any]:
    return {"path": f"/dev/nvidia{gpu.index}"}


def mig_cap_nodes(gpu: GpuDevice, mig: MigInstance, minors: Mapping[str, int] | None) -> list[str]:
    """The capability device nodes that open ``mig`` (its GPU instance's and its compute instance's access);
    empty when its ids or their minors are unknown."""
    gi, ci = mig.gpu_instance_id, mig.compute_instance_id
    if minors is None or gi is None or ci is None:
        return []
    keys = (f"gpu{gpu.index}/gi{gi}/access", f"gpu{gpu.index}/gi{gi}/ci{ci}/access")
    if not all(k in minors for k in keys):
        return []
    return [f"/dev/nvidia-caps/nvidia-cap{minors[k]}" for k in keys]


def _mount(driver: DriverFiles, path: str) -> dict[str, Any]:
    return {"hostPath": driver.on_host(path), "containerPath": path, "options": list(MOUNT_OPTIONS)}


def _hook(driver: DriverFiles, *args: str) -> dict[str, Any]:
    assert driver.hook is not None
    path, prefix = driver.hook
    return {"hookName": "createContainer", "path": path, "args": [*prefix, *args]}


def _driver_edits(driver: DriverFiles) -> dict[str, Any]:
    paths = [lib.path for lib in driver.libraries]
    paths += [driver.firmware] if driver.firmware else []
    edits: dict[str, Any] = {"mounts": [_mount(driver, p) for p in [*paths, *driver.binaries]]}
    if driver.hook is None or not driver.libraries:
        return edits
    links: list[str] = []
    for lib in driver.libraries:
        if lib.soname is None:
            continue
        folder, file = lib.path.rsplit("/", 1)
        links += ["--link", f"{file}::{folder}/{lib.soname}", "--link", f"{lib.soname}::{folder}/{lib.name}"]
    folders = sorted({lib.path.rsplit("/", 1)[0] for lib in driver.libraries})
    hooks = [_hook(driver, "create-symlinks", *links)] if links else []
    hooks.append(_hook(driver, "update-ldcache", *(a for f in folders for a in ("--folder", f))))
    edits["hooks"] = hooks
    return edits


def cdi_spec(gpus: Sequence[GpuDevice], driver: DriverFiles | None = None) -> dict[str, Any]:
    """The spec as a JSON-ready dict; the same GPUs and driver files give the same spec. Without ``driver`` (or
    with nothing found) it has the device nodes only."""
    minors = driver.mig_minors if driver else None
    devices: list[dict[str, Any]] = []
    every_node: list[dict[str, Any]] = []
    ordered = sorted(gpus, key=lambda g: g.index)
    for gpu in ordered:
        edits = {"deviceNodes": [_gpu_node(gpu)]}
        every_node.append(_gpu_node(gpu))
        devices.append({"name": gpu.uuid, "containerEdits": edits})
        devices.append({"name": str(gpu.index), "containerEdits": edits})
        for k, mig in enumerate(gpu.mig_instances):
            caps = [{"path": p} for p in mig_cap_nodes(gpu, mig, minors)]
            every_node.extend(c for c in caps if c not in every_node)  # compute instances share their GI's cap
            mig_edits = {"deviceNodes": [_gpu_node(gpu), *caps]}
            devices.append({"name": mig.uuid, "containerEdits": mig_edits})
            devices.append({"name": f"{gpu.index}:{k}", "containerEdits": mig_edits})
    if ordered:
        devices.append({"name": "all", "containerEdits": {"deviceNodes": every_node}})
    common: dict[str, Any] = {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": p} for p in CONTROL_DEVICE_NODES],
    }
    if driver is not None:
        common |= {k: v for k, v in _driver_edits(driver).items() if v}
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices, "containerEdits": common}


def _edit_problems(edits: Any, where: str) -> list[str]:
    if not isinstance(edits, dict):
        return [f"{where}: must be an object"]
    problems = [f"{where}.{key}: unknown edit" for key in edits if key not in _EDIT_KEYS]
    if not any(edits.get(k) for k in _EDIT_KEYS):
        problems.append(f"{where}: has no edits")
    for n, env in enumerate(edits.get("env", [])):
        if not isinstance(env, str) or "=" not in env:
            problems.append(f"{where}.env[{n}]: expected 'NAME=value'")
    for n, node in enumerate(edits.get("deviceNodes", [])):
        if not isinstance(node, dict) or not str(node.get("path", "")).startswith("/"):
            problems.append(f"{where}.deviceNodes[{n}].path: expected an absolute path")
    for n, mount in enumerate(edits.get("mounts", [])):
        for key in ("hostPath", "containerPath"):
            if not isinstance(mount, dict) or not str(mount.get(key, "")).startswith("/"):
                problems.append(f"{where}.mounts[{n}].{key}: expected an absolute path")
        if isinstance(mount, dict) and not _strings(mount.get("options", [])):
            problems.append(f"{where}.mounts[{n}].options: expected a list of strings")
    for n, hook in enumerate(edits.get("hooks", [])):
        problems.extend(_hook_problems(hook, f"{where}.hooks[{n}]"))
    return problems


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _hook_problems(hook: Any, where: str) -> list[str]:
    if not isinstance(hook, dict):
        return [f"{where}: must be an object"]
    problems: list[str] = []
    if hook.get("hookName") not in HOOK_NAMES:
        problems.append(f"{where}.hookName: {hook.get('hookName')!r} is not one of {', '.join(sorted(HOOK_NAMES))}")
    if not str(hook.get("path", "")).startswith("/"):
        problems.append(f"{where}.path: expected an absolute path")
    if not _strings(hook.get("args", [])):
        problems.append(f"{where}.args: expected a list of strings")
    env = hook.get("env", [])
    if not _strings(env) or not all("=" in e for e in env):
        problems.append(f"{where}.env: expected a list of 'NAME=value'")
    timeout = hook.get("timeout")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0):
        problems.append(f"{where}.timeout: expected a positive number of seconds")
    return problems


def spec_problems(spec: Any) -> list[str]:
    """What makes ``spec`` invalid by the CDI format (empty when valid): version, ``vendor/class`` kind, unique
    device names of the allowed characters, and container edits of the known kinds."""
    if not isinstance(spec, dict):
        return ["$: must be an object"]
    problems: list[str] = []
    if not _VERSION_RE.match(str(spec.get("cdiVersion", ""))):
        problems.append(f"$.cdiVersion: {spec.get('cdiVersion')!r} is not a CDI version such as {CDI_VERSION!r}")
    if not _KIND_RE.match(str(spec.get("kind", ""))):
        problems.append(f"$.kind: {spec.get('kind')!r} is not 'vendor/class'")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("$.devices: must be a non-empty list")
        devices = []
    seen: set[str] = set()
    for n, device in enumerate(devices):
        where = f"$.devices[{n}]"
        name = device.get("name") if isinstance(device, dict) else None
        if not isinstance(name, str) or not _NAME_RE.match(name):
            problems.append(f"{where}.name: {name!r} is not a CDI device name")
        elif name in seen:
            problems.append(f"{where}.name: {name!r} is used twice")
        else:
            seen.add(name)
        problems.extend(_edit_problems(device.get("containerEdits") if isinstance(device, dict) else None, where))
    if "containerEdits" in spec:
        problems.extend(_edit_problems(spec["containerEdits"], "$.containerEdits"))
    return problems


_last_report: dict[Path, tuple[DriverFiles, list[str]]] = {}


def _report(directory: Path, driver: DriverFiles, gpus: Sequence[GpuDevice]) -> None:
    """Said when what is found differs from what this process last said for ``directory`` (so at start, and then
    once per change on the node), not at every inventory read."""
    migs = [(g, m) for g in gpus for m in g.mig_instances]
    unknown = [m.uuid for g, m in migs if not mig_cap_nodes(g, m, driver.mig_minors)]
    if _last_report.get(directory) == (driver, unknown):
        return
    _last_report[directory] = (driver, unknown)
    root = driver.host_root
    log.info(
        "CDI spec: driver files found",
        extra={
            "driver_root": root,
            "driver_version": driver.version or None,
            "libraries": [lib.path for lib in driver.libraries],
            "missing_libraries": list(driver.missing_libraries),
            "firmware": driver.firmware,
            "binaries": list(driver.binaries),
            "hook": driver.hook[0] if driver.hook else None,
        },
    )
    if driver.hook is None:
        log.warning(
            "CDI spec has no hooks: no nvidia-cdi-hook or nvidia-ctk in usr/bin under the driver root; containers "
            "get the libraries without their .so.1/.so links or an ldcache entry",
            extra={"driver_root": root},
        )
    if migs and driver.mig_minors is None:
        log.warning(
            f"CDI spec: no {MIG_MINORS} under the driver root; MIG devices get only their GPU's device node",
            extra={"driver_root": root},
        )
    elif unknown:
        log.warning(
            "CDI spec: MIG devices whose capability minors are unknown get only their GPU's device node",
            extra={"mig_devices": unknown},
        )


def _replace(path: Path, body: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_spec_file(path: Path, spec: dict[str, Any]) -> bool:
    """Check ``spec`` against the CDI format and write it to ``path`` atomically unless the file already holds it;
    True when it wrote. ``CdiError`` (nothing written) for an invalid spec; ``OSError`` when it cannot write."""
    problems = spec_problems(spec)
    if problems:
        raise CdiError(f"{path}: the CDI spec would be invalid: {'; '.join(problems)}")
    body = json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_bytes() == body:
        return False
    _replace(path, body)
    return True


def write_cdi_spec(
    directory: Path, gpus: Sequence[GpuDevice], root: DriverRoot | None = None, driver_version: str = ""
) -> Path | None:
    """Write the spec of ``gpus`` into ``directory``, with the files of ``driver_version`` found under ``root``
    (none without a root); returns its path, or None when the node has no GPUs (any spec there is removed: CDI
    refuses a spec without devices). Rewrites only what changed."""
    path = directory / SPEC_FILE
    try:
        if not gpus:
            path.unlink(missing_ok=True)
            return None
        driver = None
        if root is not None:
            try:
                driver = find_driver_files(root, driver_version)
            except OSError as exc:
                raise CdiError(
                    f"cannot look for the driver's files under {root.here} (GPUWARDEN_DRIVER_ROOT): {exc}"
                ) from None
        write_spec_file(path, cdi_spec(gpus, driver))
    except CdiError:
        raise
    except OSError as exc:
        raise CdiError(f"cannot write the CDI spec into {directory} (GPUWARDEN_CDI_DIR): {exc}") from None
    if driver is not None:
        _report(directory, driver, gpus)
    return path
