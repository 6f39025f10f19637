"""The generated JSON Schema and AsyncAPI files: the committed copies match the Structs and describe the wire.

Other systems build against ``proto/events/``; a Struct changed without regenerating would break them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shared.contract.node import DrainRequested
from shared.contract.registry import BY_KIND, FAMILIES, codec
from shared.contract.subjects import ROUTES, Subjects
from tools import schemas

REGENERATE = "run `make schemas` (python -m tools.schemas) and commit proto/events/"

try:
    import jsonschema
except ImportError:  # pragma: no cover - depends on the environment
    jsonschema = None


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/"), f"only local refs are generated, got {ref}"
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    assert isinstance(node, dict)
    return node


def _type_matches(name: str, value: Any) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}[name]
    return isinstance(value, expected)


def _structural_errors(schema: dict[str, Any], value: Any, root: dict[str, Any], at: str = "$") -> list[str]:
    """The subset of JSON Schema msgspec emits for these Structs, used when jsonschema is not installed."""
    errors: list[str] = []
    if "$ref" in schema:
        errors += _structural_errors(_resolve(root, schema["$ref"]), value, root, at)
    if "anyOf" in schema and all(_structural_errors(s, value, root, at) for s in schema["anyOf"]):
        errors.append(f"{at}: matches none of anyOf")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{at}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} is not one of {schema['enum']!r}")
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_matches(n, value) for n in names):
            errors.append(f"{at}: {value!r} is not of type {schema['type']!r}")
    if isinstance(value, dict):
        errors += [f"{at}: {name!r} is required" for name in schema.get("required", ()) if name not in value]
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += _structural_errors(sub, value[name], root, f"{at}.{name}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _structural_errors(schema["items"], item, root, f"{at}[{i}]")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{at}: {value!r} does not match {schema['pattern']!r}")
    return errors


def validation_errors(schema: dict[str, Any], value: Any) -> list[str]:
    """Real JSON Schema validation when jsonschema is installed, the structural subset otherwise."""
    if jsonschema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        return [error.message for error in validator.iter_errors(value)]
    return _structural_errors(schema, value, schema)


def _committed(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((schemas.DEFAULT_DIR / name).read_bytes())
    return document


@pytest.fixture(scope="module")
def asyncapi() -> dict[str, Any]:
    return _committed(schemas.ASYNCAPI_FILE)


def test_committed_files_match_the_structs() -> None:
    rendered = schemas.render()
    committed = {p.name: p.read_bytes() for p in sorted(schemas.DEFAULT_DIR.glob("*.json"))}
    differing = sorted(name for name in rendered if committed.get(name) != rendered[name])
    extra = sorted(set(committed) - set(rendered))
    assert not differing, f"out of date in {schemas.DEFAULT_DIR}: {differing}; {REGENERATE}"
    assert not extra, f"no longer generated, in {schemas.DEFAULT_DIR}: {extra}; {REGENERATE}"


def test_render_is_deterministic_and_covers_every_family() -> None:
    first = schemas.render()
    assert first == schemas.render()
    assert set(first) == {f"{family}.schema.json" for family in FAMILIES} | {schemas.ASYNCAPI_FILE}
    for data in first.values():
        assert data.endswith(b"}\n")


def test_write_removes_stale_files_and_check_reports_drift(tmp_path: Path) -> None:
    (tmp_path / "gone.schema.json").write_text("{}\n")
    (tmp_path / "README.md").write_text("kept\n")
    written = schemas.write(tmp_path)

    assert sorted(p.name for p in written) == sorted(schemas.render())
    assert not (tmp_path / "gone.schema.json").exists()
    assert (tmp_path / "README.md").exists()
    assert schemas.check(tmp_path) == []
    assert schemas.main(["--check", str(tmp_path)]) == 0

    (tmp_path / "node.schema.json").write_text("{}\n")
    (tmp_path / "extra.json").write_text("{}\n")
    problems = schemas.check(tmp_path)
    assert any("node.schema.json" in p for p in problems)
    assert any("extra.json" in p for p in problems)
    assert schemas.main(["--check", str(tmp_path)]) == 1
    assert (tmp_path / "node.schema.json").read_text() == "{}\n"


def test_every_kind_is_a_channel_an_operation_and_a_message(asyncapi: dict[str, Any]) -> None:
    channels = asyncapi["channels"]
    by_address = {channel["address"]: channel for channel in channels.values()}
    message_names = {m["name"]: m for m in asyncapi["components"]["messages"].values()}
    operations_by_channel = {op["channel"]["$ref"]: op for op in asyncapi["operations"].values()}
    subjects = Subjects("gw")

    assert set(message_names) == set(BY_KIND)
    assert len(channels) == len(BY_KIND) == len(asyncapi["operations"])
    for kind in BY_KIND:
        address = "{root}." + ROUTES[kind].template
        assert address in by_address, f"{kind} has no channel"
        channel = by_address[address]
        fields = re.findall(r"\{(\w+)\}", address)
        assert set(channel["parameters"]) == set(fields)
        assert re.sub(r"\{\w+\}", "*", address.replace("{root}", "gw")) == subjects.pattern(kind)

        (message_ref,) = channel["messages"].values()
        assert _resolve(asyncapi, message_ref["$ref"])["name"] == kind

        channel_id = next(cid for cid, c in channels.items() if c is channel)
        operation = operations_by_channel[f"#/channels/{channel_id}"]
        assert operation["action"] == ("send" if kind in schemas.EXTERNALLY_PUBLISHED else "receive")


def test_asyncapi_header(asyncapi: dict[str, Any]) -> None:
    assert asyncapi["asyncapi"] == "3.0.0"
    assert asyncapi["info"]["title"] == "gpuwarden"
    assert re.fullmatch(r"\d+\.0\.0", asyncapi["info"]["version"])
    assert asyncapi["defaultContentType"] == "application/json"
    assert {"host": "127.0.0.1:4222", "protocol": "nats"}.items() <= asyncapi["servers"]["nats"].items()


@pytest.mark.parametrize("name", sorted(schemas.render()))
def test_every_ref_resolves(name: str) -> None:
    document = _committed(name)
    text = json.dumps(document)
    refs = re.findall(r'"\$ref": "([^"]+)"', text)
    assert refs
    for ref in refs:
        _resolve(document, ref)
    if name == schemas.ASYNCAPI_FILE:
        assert "#/$defs/" not in text


def test_family_schemas_are_2020_12_and_discriminate_on_kind() -> None:
    for family, types in FAMILIES.items():
        document = _committed(f"{family}.schema.json")
        assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert document["$id"] == f"https://gpuwarden.dev/schemas/events/{family}.json"
        for event_type in types:
            definition = document["$defs"][event_type.__name__]
            kind = event_type.__struct_config__.tag
            assert definition["properties"]["kind"] == {"enum": [kind]}
            assert "kind" in definition["required"]


def _drain_requested() -> dict[str, Any]:
    event = DrainRequested(node="gpu-node-1", drain_id="d-42", reason="driver upgrade", deadline_s=20.0)
    payload: dict[str, Any] = msgspec.json.decode(codec.encode(event))
    return payload


def test_an_encoded_drain_request_validates_against_the_node_schema() -> None:
    payload = _drain_requested()
    assert payload["kind"] == "node.drain.requested"
    assert validation_errors(_committed("node.schema.json"), payload) == []


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"deadline_s": "soon"}, "wrong type"),
        ({"node": "has spaces*"}, "not a subject token"),
        ({"kind": "node.drain.bogus"}, "unknown kind"),
        ({"node": None}, "null where a string is required"),
    ],
)
def test_a_malformed_drain_request_is_rejected(change: dict[str, Any], why: str) -> None:
    payload = {**_drain_requested(), **change}
    assert validation_errors(_committed("node.schema.json"), payload), why


def test_a_drain_request_without_its_node_is_rejected() -> None:
    payload = _drain_requested()
    del payload["node"]
    assert validation_errors(_committed("node.schema.json"), payload)
