"""The CDI spec of one prepared claim: the edits of exactly the devices allocated to it, in a file of its own.

As NVIDIA's DRA driver does, each prepared claim gets ``<kind vendor>-claim_<claim uid>.json`` in the CDI folder,
of kind ``k8s.gpu.gpuwarden.io/claim``, naming each device ``<claim uid>-<device>``; the kubelet hands the runtime
the ids ``k8s.gpu.gpuwarden.io/claim=<claim uid>-<device>``. A device's edits are the node spec's for its GPU or
MIG UUID (``cdi.cdi_spec``: device node, MIG capability nodes), with the node spec's common edits (control nodes,
the driver's libraries, firmware, tools and hooks). The file is written only when its content changes and removed
when the claim is unprepared, so preparing or unpreparing twice changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.contract.device import GpuDevice, MigInstance

from ..cdi import CDI_VERSION, CdiError, DriverRoot, cdi_spec, find_driver_files, write_spec_file
from .slices import gpu_device_name, mig_device_name

CLAIM_KIND = "k8s.gpu.gpuwarden.io/claim"
_UID = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9-]{0,62}[a-zA-Z0-9])?$")


class ClaimSpecError(ValueError):
    """The claim cannot be given a CDI spec (a malformed UID); says why."""


def spec_path(directory: Path, claim_uid: str) -> Path:
    if not _UID.match(claim_uid):
        raise ClaimSpecError(f"claim uid {claim_uid!r} is not a Kubernetes UID")
    vendor = CLAIM_KIND.split("/", 1)[0]
    return directory / f"{vendor}-claim_{claim_uid}.json"


def cdi_device_id(claim_uid: str, device: str) -> str:
    return f"{CLAIM_KIND}={claim_uid}-{device}"


def names_gpu(cdi_id: str, gpu: GpuDevice) -> bool:
    """Whether a CDI id this driver answered for a claim (``<kind>=<claim uid>-<device>``) is ``gpu`` or one of its
    MIG devices: what the kubelet's PodResources API reports of a pod's claims."""
    kind, _, name = cdi_id.partition("=")
    if kind != CLAIM_KIND:
        return False
    devices = [gpu_device_name(gpu), *(mig_device_name(gpu, k, m) for k, m in enumerate(gpu.mig_instances))]
    return any(name.endswith(f"-{device}") for device in devices)


def claim_spec(
    claim_uid: str,
    devices: Sequence[tuple[str, GpuDevice, MigInstance | None]],
    root: DriverRoot | None,
    driver_version: str,
) -> dict[str, Any]:
    """The spec of ``devices`` (slice device name, its GPU, its MIG instance or None) for the claim."""
    gpus = {gpu.uuid: gpu for _, gpu, _ in devices}
    driver = find_driver_files(root, driver_version) if root is not None else None
    node = cdi_spec(list(gpus.values()), driver)
    edits = {d["name"]: d["containerEdits"] for d in node["devices"]}
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CLAIM_KIND,
        "devices": [
            {"name": f"{claim_uid}-{name}", "containerEdits": edits[(mig or gpu).uuid]} for name, gpu, mig in devices
        ],
        "containerEdits": node["containerEdits"],
    }


def write_claim_spec(
    directory: Path,
    claim_uid: str,
    devices: Sequence[tuple[str, GpuDevice, MigInstance | None]],
    root: DriverRoot | None = None,
    driver_version: str = "",
) -> bool:
    """Write the claim's spec (nothing for a claim without devices); True when the file changed. ``CdiError`` when
    it cannot be written, ``ClaimSpecError`` for a malformed UID."""
    path = spec_path(directory, claim_uid)
    if not devices:
        return remove_claim_spec(directory, claim_uid)
    try:
        return write_spec_file(path, claim_spec(claim_uid, devices, root, driver_version))
    except CdiError:
        raise
    except OSError as exc:
        raise CdiError(f"cannot write the claim's CDI spec into {directory} (GPUWARDEN_CDI_DIR): {exc}") from None


def remove_claim_spec(directory: Path, claim_uid: str) -> bool:
    """True when there was a spec to remove."""
    path = spec_path(directory, claim_uid)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CdiError(f"cannot remove {path}: {exc}") from None
    return True
