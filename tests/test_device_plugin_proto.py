"""proto/deviceplugin.proto matches the kubelet's device plugin API v1beta1 (../shared/facts/kubelet-device-plugin.md)
field for field, and the committed stubs in services/device/gen/ are what protoc makes of it today."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from services.device.gen import deviceplugin_pb2 as pb
from tools import protogen

F = FieldDescriptor
S, B, M = F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_MESSAGE
MESSAGES = {
    "DevicePluginOptions": {"pre_start_required": (1, B), "get_preferred_allocation_available": (2, B)},
    "RegisterRequest": {"version": (1, S), "endpoint": (2, S), "resource_name": (3, S), "options": (4, M)},
    "Empty": {},
    "ListAndWatchResponse": {"devices": (1, M)},
    "TopologyInfo": {"nodes": (1, M)},
    "NUMANode": {"ID": (1, F.TYPE_INT64)},
    "Device": {"ID": (1, S), "health": (2, S), "topology": (3, M)},
    "PreStartContainerRequest": {"devices_ids": (1, S)},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {"container_requests": (1, M)},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": (1, S),
        "must_include_deviceIDs": (2, S),
        "allocation_size": (3, F.TYPE_INT32),
    },
    "PreferredAllocationResponse": {"container_responses": (1, M)},
    "ContainerPreferredAllocationResponse": {"deviceIDs": (1, S)},
    "AllocateRequest": {"container_requests": (1, M)},
    "ContainerAllocateRequest": {"devices_ids": (1, S)},
    "CDIDevice": {"name": (1, S)},
    "AllocateResponse": {"container_responses": (1, M)},
    "ContainerAllocateResponse": {
        "envs": (1, M),
        "mounts": (2, M),
        "devices": (3, M),
        "annotations": (4, M),
        "cdi_devices": (5, M),
    },
    "Mount": {"container_path": (1, S), "host_path": (2, S), "read_only": (3, B)},
    "DeviceSpec": {"container_path": (1, S), "host_path": (2, S), "permissions": (3, S)},
}
REPEATED = {
    ("ListAndWatchResponse", "devices"),
    ("TopologyInfo", "nodes"),
    ("PreStartContainerRequest", "devices_ids"),
    ("PreferredAllocationRequest", "container_requests"),
    ("ContainerPreferredAllocationRequest", "available_deviceIDs"),
    ("ContainerPreferredAllocationRequest", "must_include_deviceIDs"),
    ("PreferredAllocationResponse", "container_responses"),
    ("ContainerPreferredAllocationResponse", "deviceIDs"),
    ("AllocateRequest", "container_requests"),
    ("ContainerAllocateRequest", "devices_ids"),
    ("AllocateResponse", "container_responses"),
    ("ContainerAllocateResponse", "envs"),
    ("ContainerAllocateResponse", "mounts"),
    ("ContainerAllocateResponse", "devices"),
    ("ContainerAllocateResponse", "annotations"),
    ("ContainerAllocateResponse", "cdi_devices"),
}
SERVICES = {
    "Registration": {"Register": ("RegisterRequest", "Empty", False)},
    "DevicePlugin": {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    },
}


def test_messages_and_field_numbers_are_exactly_the_kubelets() -> None:
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert set(pb.DESCRIPTOR.message_types_by_name) == set(MESSAGES)
    for name, fields in MESSAGES.items():
        descriptor = pb.DESCRIPTOR.message_types_by_name[name]
        assert {f.name: (f.number, f.type) for f in descriptor.fields} == fields, name
        for f in descriptor.fields:
            assert f.is_repeated == ((name, f.name) in REPEATED), f"{name}.{f.name}"
    response = pb.DESCRIPTOR.message_types_by_name["ContainerAllocateResponse"]
    for field in ("envs", "annotations"):
        entry = response.fields_by_name[field].message_type
        assert entry.GetOptions().map_entry
        assert [(f.name, f.type) for f in entry.fields] == [("key", S), ("value", S)]


def test_services_and_rpcs_are_exactly_the_kubelets() -> None:
    assert set(pb.DESCRIPTOR.services_by_name) == set(SERVICES)
    for name, rpcs in SERVICES.items():
        service = pb.DESCRIPTOR.services_by_name[name]
        assert service.full_name == f"v1beta1.{name}"
        found = {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods}
        assert found == rpcs
        assert not any(m.client_streaming for m in service.methods)


def test_committed_stubs_do_not_drift_from_the_proto() -> None:
    assert protogen.DEVICE_PLUGIN.drift() == [], "run: python -m tools.protogen"
