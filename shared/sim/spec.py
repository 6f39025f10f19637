"""The node spec file that drives the simulation (YAML or JSON).

```yaml
driver_version: "550.54.15"        # installed on every node unless a node says otherwise
cuda_version: "12.4"
nodes:
  - name: node-1
    labels: {pool: a100}
    gpus:
      - {model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 2, mig_profiles: ["1g.10gb", "3g.40gb"]}
deployments:
  - {name: llama, namespace: llm, replicas: 3, gpus_per_pod: 1, max_unavailable: 1,
     model: {layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens: 16}}
```

Unknown keys are refused, and every error names the field (``$.nodes[0].gpus[0].memory_mib``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import msgspec
import yaml

from shared.contract.base import TOKEN_PATTERN

Name = Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)]
Positive = Annotated[int, msgspec.Meta(gt=0)]


class SpecError(ValueError):
    """The spec file is unusable; the message names the file and the field."""


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str = "NVIDIA H100 80GB HBM3"
    memory_mib: Positive = 81559
    count: Positive = 1
    mig_profiles: list[str] = msgspec.field(default_factory=list)
    nvlink: bool = True


class NodeSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Name
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    gpus: list[GpuSpec] = msgspec.field(default_factory=lambda: [GpuSpec(count=2)])
    driver_version: str = ""
    numa_nodes: Positive = 1

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)


class ModelShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model's KV geometry: bytes per token = layers x kv_heads x head_dim x 2 (K and V) x dtype_bytes."""

    model_id: str = "meta-llama/Meta-Llama-3-8B"
    model_version: str = "1"
    tokenizer_id: str = "llama3"
    dtype: str = "float16"
    layers: Positive = 32
    kv_heads: Positive = 8
    head_dim: Positive = 128
    dtype_bytes: Positive = 2
    block_tokens: Positive = 16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


class DeploymentSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Name
    namespace: Name = "default"
    replicas: Annotated[int, msgspec.Meta(ge=0)] = 2
    gpus_per_pod: Positive = 1
    max_unavailable: Annotated[int, msgspec.Meta(ge=0)] = 1
    grace_period_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    model: ModelShape = msgspec.field(default_factory=ModelShape)


class SimSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    driver_version: str = "550.54.15"
    cuda_version: str = "12.4"
    nodes: list[NodeSpec]
    deployments: list[DeploymentSpec] = msgspec.field(default_factory=list)

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise SpecError(f"node {name!r} is not in the spec (nodes: {', '.join(n.name for n in self.nodes)})")

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SpecError("$.nodes: at least one node is needed")
        seen: set[str] = set()
        for i, n in enumerate(self.nodes):
            if n.name in seen:
                raise SpecError(f"$.nodes[{i}].name: duplicate node name {n.name!r}")
            seen.add(n.name)
        names: set[tuple[str, str]] = set()
        for i, d in enumerate(self.deployments):
            if (d.namespace, d.name) in names:
                raise SpecError(f"$.deployments[{i}].name: duplicate deployment {d.namespace}/{d.name}")
            names.add((d.namespace, d.name))


H100_MIG_PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def default_spec() -> SimSpec:
    """3 nodes named node-1..node-3 with 2 H100 GPUs each (node-3's MIG-capable, as the H100's profiles), and one
    small Llama-3-8B deployment."""
    return SimSpec(
        nodes=[
            NodeSpec(name="node-1"),
            NodeSpec(name="node-2"),
            NodeSpec(name="node-3", gpus=[GpuSpec(count=2, mig_profiles=list(H100_MIG_PROFILES))]),
        ],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2)],
    )


def parse_spec(raw: bytes | str, origin: str = "<spec>") -> SimSpec:
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise SpecError(f"{origin}: not valid YAML or JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: the top level must be a mapping with a 'nodes' list")
    try:
        return msgspec.convert(data, SimSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(f"{origin}: {exc}") from None
    except SpecError as exc:
        raise SpecError(f"{origin}: {exc}") from None


def load_spec(path: str | None = None) -> SimSpec:
    """The spec at ``path`` (or ``GPUWARDEN_SIM_SPEC``), or the default spec when neither is set."""
    path = path or os.environ.get("GPUWARDEN_SIM_SPEC") or None
    if not path:
        return default_spec()
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(f"GPUWARDEN_SIM_SPEC={path}: {exc.strerror}") from None
    return parse_spec(raw, path)
