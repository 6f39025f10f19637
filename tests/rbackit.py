"""The RBAC rules deploy/rbac/ ships, read as a set of accesses, and whether one access is allowed by them."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.fake_kube_api import Access

RBAC = Path(__file__).resolve().parent.parent / "deploy" / "rbac"


def shipped_rules(role: str, path: Path | None = None) -> set[Access]:
    """What the (Cluster)Roles bound to ``gpuwarden-<role>`` allow, as (verb, group, resource, namespace) with
    namespace "" for a ClusterRole and the Role's namespace otherwise. ``path``: the file, where it is not
    deploy/rbac/<role>.yaml (the router's lies beside its pool, in deploy/router/)."""
    allowed: set[Access] = set()
    for doc in yaml.safe_load_all((path or RBAC / f"{role}.yaml").read_text()):
        if not doc or doc.get("kind") not in ("ClusterRole", "Role"):
            continue
        namespace = doc["metadata"].get("namespace", "") if doc["kind"] == "Role" else "*"
        for rule in doc.get("rules") or []:
            for group in rule.get("apiGroups", [""]):
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        allowed.add(Access(verb, group, resource, namespace))
    return allowed


def allowed(access: Access, rules: set[Access]) -> bool:
    return Access(access.verb, access.group, access.resource, "*") in rules or access in rules
