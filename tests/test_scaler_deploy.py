"""deploy/keda validates offline against a subset of KEDA's CRD schema (keda.sh/v1alpha1), written from
../shared/facts/keda-external-scaler.md, and its trigger metadata is what the scaler accepts."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.scaler.trigger import parse_trigger

KEDA_DIR = Path(__file__).resolve().parents[1] / "deploy" / "keda"

_INT = {"type": "integer", "minimum": 0}
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
_OBJECT_META = {"type": "object", "required": ["name", "namespace"], "properties": {"name": _NAME, "namespace": _NAME}}

SCALED_OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"enum": ["keda.sh/v1alpha1"]},
        "kind": {"enum": ["ScaledObject"]},
        "metadata": _OBJECT_META,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": _NAME,
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": _INT,
                "initialCooldownPeriod": _INT,
                "idleReplicaCount": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {"failureThreshold": _INT, "replicas": _INT},
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"enum": ["external", "external-push"]},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "additionalProperties": False,
                                "properties": {
                                    "name": _NAME,
                                    "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

TRIGGER_AUTHENTICATION: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"enum": ["keda.sh/v1alpha1"]},
        "kind": {"enum": ["TriggerAuthentication"]},
        "metadata": _OBJECT_META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {
                            # The PEM contents KEDA's external scaler takes (facts: TLS).
                            "parameter": {"enum": ["caCert", "tlsClientCert", "tlsClientKey"]},
                            "name": _NAME,
                            "key": {"type": "string"},
                        },
                    },
                }
            },
        },
    },
}

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "boolean": bool,
}


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """The subset of JSON Schema used above: type, enum, required, properties, additionalProperties, items,
    minItems, minimum, pattern. Returns every error with its path."""
    errors: list[str] = []
    expected = schema.get("type")
    if expected:
        python_type = _TYPES[expected]
        if not isinstance(value, python_type) or (expected == "integer" and isinstance(value, bool)):
            return [f"{path}: expected {expected}, got {type(value).__name__} {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} is below {schema['minimum']}")
    if "pattern" in schema and not re.match(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: {key} is required")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                errors += validate(item, properties[key], f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unknown field {key}")
            elif isinstance(extra, dict):
                errors += validate(item, extra, f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: needs at least {schema['minItems']} items")
        for i, item in enumerate(value):
            errors += validate(item, schema.get("items", {}), f"{path}[{i}]")
    return errors


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((KEDA_DIR / name).read_text()) if d]


def scaled_objects() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(KEDA_DIR.glob("*.yaml")):
        found += [(path.name, d) for d in documents(path.name) if d.get("kind") == "ScaledObject"]
    return found


def test_there_is_an_example_for_each_trigger_type() -> None:
    types = {t["type"] for _, so in scaled_objects() for t in so["spec"]["triggers"]}
    assert types == {"external", "external-push"}


@pytest.mark.parametrize(("name", "so"), scaled_objects(), ids=[n for n, _ in scaled_objects()])
def test_scaled_objects_validate_and_their_metadata_is_accepted(name: str, so: dict[str, Any]) -> None:
    assert validate(so, SCALED_OBJECT) == []
    spec = so["spec"]
    auth_names = {d["metadata"]["name"] for d in documents("triggerauthentication-tls.yaml") if d["kind"] != "Secret"}
    for trigger in spec["triggers"]:
        parsed = parse_trigger(trigger["metadata"], so["metadata"]["namespace"])  # raises on a key we refuse
        assert parsed.deployment == spec["scaleTargetRef"]["name"]
        assert parsed.min_replicas == spec.get("minReplicaCount", 0)
        assert parsed.max_replicas == spec.get("maxReplicaCount", 100)
        assert trigger.get("metricType", "AverageValue") == "AverageValue"  # the value/target pair assumes it
        assert trigger["metadata"]["scalerAddress"].endswith(":9090")
        if "authenticationRef" in trigger:
            assert trigger["authenticationRef"]["name"] in auth_names


def test_trigger_authentication_validates_and_its_secret_has_every_key() -> None:
    docs = documents("triggerauthentication-tls.yaml")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for auth in (d for d in docs if d["kind"] == "TriggerAuthentication"):
        assert validate(auth, TRIGGER_AUTHENTICATION) == []
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in secrets[ref["name"]]["stringData"]
            assert secrets[ref["name"]]["metadata"]["namespace"] == auth["metadata"]["namespace"]


def test_kustomization_lists_files_that_exist() -> None:
    (kustomization,) = documents("kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (KEDA_DIR / resource).is_file()


def test_the_schema_subset_refuses_what_keda_would() -> None:
    _, so = scaled_objects()[0]
    for mutate, words in [
        (lambda s: s.update(apiVersion="keda.sh/v1beta1"), "is not one of"),
        (lambda s: s["spec"]["triggers"][0].update(type="nats-jetstream"), "is not one of"),
        (lambda s: s["spec"].pop("scaleTargetRef"), "scaleTargetRef is required"),
        (lambda s: s["spec"].update(pollingIntervall=5), "unknown field pollingIntervall"),
        (lambda s: s["spec"]["triggers"][0]["metadata"].update(queueDepthPerReplica=8), "expected string"),
    ]:
        broken = copy.deepcopy(so)
        mutate(broken)
        errors = validate(broken, SCALED_OBJECT)
        assert any(words in e for e in errors), (words, errors)
