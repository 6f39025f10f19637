"""The CDI (Container Device Interface) spec of the node's GPUs: the container toolkit's role.

A runtime that reads CDI turns a device name such as ``nvidia.com/gpu=<uuid>`` (what Allocate answers under the
``cdi`` device-list strategy) into the edits listed here. Each GPU is named by UUID and by index, each MIG
instance by UUID and ``<gpu index>:<instance>``, and ``all`` names every GPU. The spec is written atomically (a
temporary file in the same folder, then a rename), so a runtime never reads half a file.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.contract.device import GpuDevice

from .resources import CDI_KIND

CDI_VERSION = "0.6.0"
SPEC_FILE = "gpuwarden-nvidia.com-gpu.json"
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_KIND_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")
_NAME_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.:-]*[a-zA-Z0-9])?$")
_VERSION_RE = re.compile(r"^0\.[3-8]\.[0-9]+$")
_EDIT_KEYS = ("env", "deviceNodes", "mounts", "hooks")


class CdiError(OSError):
    """The CDI spec could not be written; names the folder and why."""


def _gpu_node(gpu: GpuDevice) -> dict[str, Any]:
    return {"path": f"/dev/nvidia{gpu.index}"}


def cdi_spec(gpus: Sequence[GpuDevice]) -> dict[str, Any]:
    """The spec as a JSON-ready dict; the same GPUs give the same spec."""
    devices: list[dict[str, Any]] = []
    ordered = sorted(gpus, key=lambda g: g.index)
    for gpu in ordered:
        edits = {"deviceNodes": [_gpu_node(gpu)]}
        devices.append({"name": gpu.uuid, "containerEdits": edits})
        devices.append({"name": str(gpu.index), "containerEdits": edits})
        for k, mig in enumerate(gpu.mig_instances):
            devices.append({"name": mig.uuid, "containerEdits": edits})
            devices.append({"name": f"{gpu.index}:{k}", "containerEdits": edits})
    if ordered:
        devices.append({"name": "all", "containerEdits": {"deviceNodes": [_gpu_node(g) for g in ordered]}})
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": p} for p in CONTROL_DEVICE_NODES],
        },
    }


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
        if not isinstance(mount, dict) or not str(mount.get("containerPath", "")).startswith("/"):
            problems.append(f"{where}.mounts[{n}].containerPath: expected an absolute path")
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


def write_cdi_spec(directory: Path, gpus: Sequence[GpuDevice]) -> Path | None:
    """Write the spec of ``gpus`` into ``directory``; returns its path, or None when the node has no GPUs (any
    spec there is removed: CDI refuses a spec without devices). Rewrites only what changed."""
    path = directory / SPEC_FILE
    try:
        if not gpus:
            path.unlink(missing_ok=True)
            return None
        spec = cdi_spec(gpus)
        problems = spec_problems(spec)
        if problems:
            raise CdiError(f"{path}: the CDI spec would be invalid: {'; '.join(problems)}")
        body = json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n"
        directory.mkdir(parents=True, exist_ok=True)
        if path.is_file() and path.read_bytes() == body:
            return path
        fd, tmp = tempfile.mkstemp(prefix=f".{SPEC_FILE}.", dir=directory)
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
    except CdiError:
        raise
    except OSError as exc:
        raise CdiError(f"cannot write the CDI spec into {directory} (GPUWARDEN_CDI_DIR): {exc}") from None
    return path
