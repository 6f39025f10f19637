"""``resource.k8s.io/v1`` objects for the cluster port's DRA calls: a ``ResourceSlice`` as the ``kubernetes`` client's
generated ``V1ResourceSlice`` model (which refuses an object the schema would: a required field missing, a value of
the wrong type), the slice read back for comparison, and a ``ResourceClaim``'s
allocation as the port says it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.aio.client import V1ResourceSlice

from shared.ports.cluster import (
    AllocatedDevice,
    ClusterError,
    DeviceAttribute,
    DeviceTaint,
    ResourceClaimInfo,
    ResourceSlice,
    Semver,
    SliceDevice,
)

Obj = dict[str, Any]
API_VERSION = "resource.k8s.io/v1"
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")


def _attribute(value: DeviceAttribute) -> Obj:
    if isinstance(value, Semver):
        return {"version": value.value}
    if isinstance(value, bool):  # before int: a bool is an int in Python
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def _attribute_value(obj: Mapping[str, Any]) -> DeviceAttribute:
    if "version" in obj:
        return Semver(str(obj["version"]))
    if "bool" in obj:
        return bool(obj["bool"])
    if "int" in obj:
        return int(obj["int"])
    return str(obj.get("string", ""))


def slice_object(resource_slice: ResourceSlice, generation: int, resource_version: str = "") -> V1ResourceSlice:
    """The object to create (or, with the ``resource_version`` read, to replace) for the slice, as the client's
    model; ``ClusterError`` when the model refuses it."""
    devices: list[Obj] = []
    for device in resource_slice.devices:
        entry: Obj = {"name": device.name}
        if device.attributes:
            entry["attributes"] = {k: _attribute(v) for k, v in device.attributes.items()}
        if device.capacity:
            entry["capacity"] = {k: {"value": v} for k, v in device.capacity.items()}
        if device.taints:
            entry["taints"] = [
                {"key": t.key, "effect": t.effect, **({"value": t.value} if t.value else {})} for t in device.taints
            ]
        devices.append(entry)
    metadata: Obj = {"name": resource_slice.name}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    body: Obj = {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": resource_slice.driver,
            "nodeName": resource_slice.node,
            "pool": {"name": resource_slice.pool, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }
    try:
        model = V1ResourceSlice.from_dict(body)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ClusterError(
            f"ResourceSlice {resource_slice.name}: refused by the resource.k8s.io/v1 schema: {exc}"
        ) from None
    assert model is not None
    return model


def slice_from_object(obj: Mapping[str, Any]) -> ResourceSlice:
    """The slice as the port says it, from the object read (fields the API server adds are left out)."""
    spec = obj.get("spec") or {}
    devices = []
    for device in spec.get("devices") or []:
        taints = tuple(
            DeviceTaint(key=t.get("key", ""), value=t.get("value", ""), effect=t.get("effect", "NoSchedule"))
            for t in device.get("taints") or []
            if t.get("effect", "NoSchedule") in TAINT_EFFECTS
        )
        devices.append(
            SliceDevice(
                name=device.get("name", ""),
                attributes={k: _attribute_value(v) for k, v in (device.get("attributes") or {}).items()},
                capacity={k: str(v.get("value", "")) for k, v in (device.get("capacity") or {}).items()},
                taints=taints,
            )
        )
    return ResourceSlice(
        driver=spec.get("driver", ""),
        node=spec.get("nodeName", ""),
        pool=(spec.get("pool") or {}).get("name", ""),
        devices=tuple(devices),
    )


def generation_of(obj: Mapping[str, Any]) -> int:
    generation = ((obj.get("spec") or {}).get("pool") or {}).get("generation", 0)
    return generation if isinstance(generation, int) else 0


def claim_info(obj: Mapping[str, Any]) -> ResourceClaimInfo:
    meta = obj.get("metadata") or {}
    allocation = (obj.get("status") or {}).get("allocation")
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    return ResourceClaimInfo(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        allocated=allocation is not None,
        devices=tuple(
            AllocatedDevice(
                request=r.get("request", ""),
                driver=r.get("driver", ""),
                pool=r.get("pool", ""),
                device=r.get("device", ""),
            )
            for r in results
        ),
    )
