"""proto/externalscaler.proto matches KEDA's wire contract (../shared/facts/keda-external-scaler.md), and the
committed stubs in services/scaler/gen/ are what protoc makes of it today."""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor

from services.scaler.gen import externalscaler_pb2 as pb
from tools import protogen

F = FieldDescriptor
MESSAGES = {
    "ScaledObjectRef": {
        "name": (1, F.TYPE_STRING),
        "namespace": (2, F.TYPE_STRING),
        "scalerMetadata": (3, F.TYPE_MESSAGE),
    },
    "IsActiveResponse": {"result": (1, F.TYPE_BOOL)},
    "GetMetricSpecResponse": {"metricSpecs": (1, F.TYPE_MESSAGE)},
    "MetricSpec": {
        "metricName": (1, F.TYPE_STRING),
        "targetSize": (2, F.TYPE_INT64),
        "targetSizeFloat": (3, F.TYPE_DOUBLE),
    },
    "GetMetricsRequest": {"scaledObjectRef": (1, F.TYPE_MESSAGE), "metricName": (2, F.TYPE_STRING)},
    "GetMetricsResponse": {"metricValues": (1, F.TYPE_MESSAGE)},
    "MetricValue": {
        "metricName": (1, F.TYPE_STRING),
        "metricValue": (2, F.TYPE_INT64),
        "metricValueFloat": (3, F.TYPE_DOUBLE),
    },
}
RPCS = {
    "IsActive": ("ScaledObjectRef", "IsActiveResponse", False),
    "StreamIsActive": ("ScaledObjectRef", "IsActiveResponse", True),
    "GetMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", False),
    "GetMetrics": ("GetMetricsRequest", "GetMetricsResponse", False),
    "StreamMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", True),
}


def test_messages_and_field_numbers_are_exactly_kedas() -> None:
    assert pb.DESCRIPTOR.package == "externalscaler"
    assert set(pb.DESCRIPTOR.message_types_by_name) == set(MESSAGES)
    for name, fields in MESSAGES.items():
        descriptor = pb.DESCRIPTOR.message_types_by_name[name]
        assert {f.name: (f.number, f.type) for f in descriptor.fields} == fields, name
    metadata = pb.DESCRIPTOR.message_types_by_name["ScaledObjectRef"].fields_by_name["scalerMetadata"]
    assert metadata.message_type.GetOptions().map_entry
    repeated = [("GetMetricSpecResponse", "metricSpecs"), ("GetMetricsResponse", "metricValues")]
    for message, field in repeated:
        assert pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].is_repeated


def test_service_and_rpcs_are_exactly_kedas() -> None:
    service = pb.DESCRIPTOR.services_by_name["ExternalScaler"]
    assert service.full_name == "externalscaler.ExternalScaler"
    found = {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods}
    assert found == RPCS
    assert not any(m.client_streaming for m in service.methods)


def test_committed_stubs_do_not_drift_from_the_proto() -> None:
    assert protogen.EXTERNAL_SCALER.drift() == [], "run: python -m tools.protogen"


def test_a_stub_from_another_grpcio_tools_release_is_no_drift_but_a_changed_contract_is(tmp_path: Path) -> None:
    """The package index's patch releases of grpcio-tools change only the line naming themselves; the check of
    committed stubs must pass on a fresh install as on the machine that generated them, and still catch a change."""
    committed = protogen.EXTERNAL_SCALER.gen_dir / "externalscaler_pb2_grpc.py"
    text = committed.read_text()
    other = tmp_path / "other.py"
    other.write_text(re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.99.9'", text))
    assert other.read_text() != text and protogen._contract(other) == protogen._contract(committed)
    other.write_text(text.replace("GetMetrics", "GetMetric"))
    assert protogen._contract(other) != protogen._contract(committed)
