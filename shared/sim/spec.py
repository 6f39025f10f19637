"""The node spec file that drives the simulation (YAML or JSON).

```yaml
driver_version: "550.54.15"        # installed on every node unless a node says otherwise
cuda_version: "12.4"
nodes:
  - name: node-1
    labels: {pool: a100}
    gpus:
      - {model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 2, mig_profiles: ["1g.10gb", "3g.40gb"]}
fleets:                            # many nodes alike: node-4, node-5, ... node-1003 (no entry each)
  - {count: 1000, name_prefix: node-, first: 4, gpus: [{count: 8}]}
hollow: false                      # true: `gpuwarden up` runs all nodes' agents in one process per service kind
deployments:
  - {name: llama, namespace: llm, replicas: 3, gpus_per_pod: 1, max_unavailable: 1,
     gpu_memory_utilization: 0.9,   # or kv_blocks: 128 (the pool's size in blocks, set outright)
     model: {layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens: 16,
             weights_mib: 15316, max_model_len: 8192}}
```

Unknown keys are refused, and every error names the field (``$.nodes[0].gpus[0].memory_mib``).

Each pod of a deployment runs an engine with a KV block pool sized as vLLM sizes its own: blocks =
(GPUs per pod x GPU memory x ``gpu_memory_utilization`` - model weights) / block bytes, on the smallest GPU of
the spec, unless ``kv_blocks`` sets it outright. Either way the pool must hold one ``max_model_len`` sequence
(vLLM refuses to start otherwise), and an explicit pool must fit in the GPU memory the weights leave.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from shared.contract.base import TOKEN_PATTERN
from shared.kv.presets import LLAMA_3_8B, LLAMA_3_8B_MAX_MODEL_LEN, LLAMA_3_8B_WEIGHTS_MIB
from shared.plumbing.settings import any_path, documented, setting, settings_from_env
from shared.sim.drasched import DEVICE_CLASSES, DeviceRequest, Selector, SelectorError

Name = Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
MIB = 2**20
VLLM_CPU_BLOCK = 32
"""vLLM's CPU attention backend accepts only block sizes that are multiples of this."""
_NAME_RE = re.compile(TOKEN_PATTERN)


@dataclass(frozen=True)
class SpecSettings:
    """Where the simulation's node spec is read from."""

    path: Path | None = setting(
        "GPUWARDEN_SIM_SPEC",
        None,
        "sim: the node spec file, YAML or JSON",
        parse=any_path(),
        shown="nodes node-1..3 with 2 GPUs each; see `shared/sim/spec.py`",
    )
    """None: the default spec (``default_spec``)."""


DOCUMENTED = documented(SpecSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


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


class FleetSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``count`` nodes alike, named ``<name_prefix><n>`` for ``n`` from ``first`` on: a simulated fleet of a
    thousand nodes without a thousand entries. Each becomes a ``NodeSpec`` of ``nodes`` (after the listed ones)."""

    count: Positive
    name_prefix: str = "node-"
    first: Annotated[int, msgspec.Meta(ge=0)] = 1
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    gpus: list[GpuSpec] = msgspec.field(default_factory=lambda: [GpuSpec(count=8)])
    driver_version: str = ""
    numa_nodes: Positive = 1

    def names(self) -> list[str]:
        return [f"{self.name_prefix}{n}" for n in range(self.first, self.first + self.count)]

    def expand(self) -> list[NodeSpec]:
        return [
            NodeSpec(
                name=name,
                labels=dict(self.labels),
                gpus=list(self.gpus),
                driver_version=self.driver_version,
                numa_nodes=self.numa_nodes,
            )
            for name in self.names()
        ]


class ModelShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model's KV geometry: bytes per token = layers x kv_heads x head_dim x 2 (K and V) x dtype_bytes.

    ``engine``: ``synthetic`` (blocks of this geometry filled from the session id: any model size, no compute) or
    ``transformers`` (a real Llama of this shape, ``attention_heads`` query heads (0: twice ``kv_heads``) and a
    ``vocab_size`` vocabulary, its weights drawn from ``seed``; it really prefills and decodes, so keep it tiny).
    A real model's layout (tokenizer, weights digest) is read from the model, not from ``tokenizer_id``.
    ``vllm``: the same tiny Llama served by vLLM's CPU build, one engine process per pod with gpuwarden's connector
    (``shared.sim.vllmpods``): float32 only, and ``block_tokens`` (vLLM's block size) a multiple of 32, as vLLM's CPU
    attention backend requires."""

    engine: Literal["synthetic", "transformers", "vllm"] = "synthetic"

    model_id: str = LLAMA_3_8B.model_id
    model_version: str = LLAMA_3_8B.model_version
    tokenizer_id: str = LLAMA_3_8B.tokenizer_id
    dtype: str = LLAMA_3_8B.dtype
    layers: Positive = LLAMA_3_8B.layers
    kv_heads: Positive = LLAMA_3_8B.kv_heads
    head_dim: Positive = LLAMA_3_8B.head_dim
    dtype_bytes: Positive = 2
    block_tokens: Positive = LLAMA_3_8B.block_tokens
    weights_mib: Annotated[int, msgspec.Meta(ge=0)] = LLAMA_3_8B_WEIGHTS_MIB
    max_model_len: Positive = LLAMA_3_8B_MAX_MODEL_LEN  # the longest session, prompt and output, in tokens
    attention_heads: Annotated[int, msgspec.Meta(ge=0)] = 0
    vocab_size: Annotated[int, msgspec.Meta(ge=3)] = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.engine == "synthetic":
            return
        if self.engine == "vllm":
            if self.dtype != "float32":
                raise SpecError(f"model.dtype: a vllm engine here runs float32 (vLLM's CPU build), not {self.dtype!r}")
            if self.block_tokens % VLLM_CPU_BLOCK:
                raise SpecError(
                    f"model.block_tokens: vLLM's CPU attention backend takes blocks of a multiple of "
                    f"{VLLM_CPU_BLOCK} tokens, not {self.block_tokens}"
                )
        sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
        if self.dtype not in sizes:
            raise SpecError(f"model.dtype: a transformers engine runs {', '.join(sizes)}, not {self.dtype!r}")
        if self.dtype_bytes != sizes[self.dtype]:
            raise SpecError(f"model.dtype_bytes: {self.dtype} takes {sizes[self.dtype]} bytes, not {self.dtype_bytes}")
        if self.attention_heads % self.kv_heads:
            raise SpecError(
                f"model.attention_heads: {self.attention_heads} is not a multiple of kv_heads ({self.kv_heads})"
            )

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    @property
    def max_len_blocks(self) -> int:
        """Blocks one ``max_model_len`` session holds: the least a pool must have."""
        return -(-self.max_model_len // self.block_tokens)


class ClaimSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A deployment's pods ask for their GPUs by DRA claim (``resource.k8s.io/v1``) instead of the device plugin's
    count: ``gpus_per_pod`` devices of ``device_class`` that every CEL selector in ``selectors`` selects (the forms
    ``shared.sim.drasched`` evaluates), tolerating the taints whose keys ``tolerates`` lists. The simulated
    scheduler allocates them from the ResourceSlices the nodes' device services publish
    (``GPUWARDEN_DEVICE_API=dra`` or ``both``); without a slice that offers them a pod stays Pending."""

    device_class: str = "gpu.gpuwarden.io"
    selectors: tuple[str, ...] = ()
    tolerates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.device_class not in DEVICE_CLASSES:
            raise SpecError(f"claim.device_class: {self.device_class!r} is none of {', '.join(DEVICE_CLASSES)}")
        for i, expression in enumerate(self.selectors):
            try:
                Selector.parse(expression)
            except SelectorError as exc:
                raise SpecError(f"claim.selectors[{i}]: {exc}") from None

    def request(self, count: int) -> DeviceRequest:
        """What a pod of the deployment asks the scheduler for."""
        return DeviceRequest("gpus", self.device_class, _parsed(self.selectors), count=count, tolerates=self.tolerates)


@functools.lru_cache(maxsize=256)
def _parsed(expressions: tuple[str, ...]) -> tuple[Selector, ...]:
    """Selectors parsed once (every reconcile of the simulated cluster asks again for a pod still Pending)."""
    return tuple(Selector.parse(e) for e in expressions)


class DeploymentSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Name
    namespace: Name = "default"
    replicas: Annotated[int, msgspec.Meta(ge=0)] = 2
    gpus_per_pod: Positive = 1
    max_unavailable: Annotated[int, msgspec.Meta(ge=0)] = 1
    grace_period_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    model: ModelShape = msgspec.field(default_factory=ModelShape)
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    kv_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: derived from the GPU memory, as vLLM does
    claim: ClaimSpec | None = None  # GPUs by DRA claim (the simulated scheduler's), not the device plugin's count

    def kv_capacity(self, gpu_memory_mib: float) -> int:
        """The KV pool of one pod on GPUs of ``gpu_memory_mib``, in blocks: ``kv_blocks`` when set, else what
        ``gpu_memory_utilization`` of the pod's GPUs holds once the weights are loaded (never below 0)."""
        if self.kv_blocks:
            return self.kv_blocks
        spare = self.gpus_per_pod * gpu_memory_mib * self.gpu_memory_utilization - self.model.weights_mib
        return max(0, int(spare * MIB) // self.model.block_bytes)

    def check_capacity(self, gpu_memory_mib: float) -> None:
        """``SpecError`` (without the field path) when a pod on such GPUs could not serve one longest session."""
        model = self.model
        blocks = self.kv_capacity(gpu_memory_mib)
        pod_mib = self.gpus_per_pod * gpu_memory_mib
        if self.kv_blocks:
            spare_mib = pod_mib - model.weights_mib
            if self.kv_blocks * model.block_bytes > spare_mib * MIB:
                raise SpecError(
                    f"kv_blocks: {self.kv_blocks} blocks of {model.block_bytes / MIB:g} MiB "
                    f"({self.kv_blocks * model.block_bytes / MIB:g} MiB) do not fit in the {spare_mib:g} MiB the "
                    f"weights ({model.weights_mib} MiB) leave of a pod's {pod_mib:g} MiB of GPU memory"
                )
            where = "kv_blocks"
        else:
            where = "gpu_memory_utilization"
            if blocks <= 0:
                raise SpecError(
                    f"gpu_memory_utilization: the model's weights ({model.weights_mib} MiB) leave no room for a KV "
                    f"cache in {self.gpu_memory_utilization:g} x {pod_mib:g} MiB of GPU memory"
                )
        if blocks < model.max_len_blocks:
            raise SpecError(
                f"{where}: a pod's KV pool holds {blocks} blocks ({blocks * model.block_tokens} tokens) on "
                f"{pod_mib:g} MiB of GPU memory, fewer than one model.max_model_len session ({model.max_model_len} "
                f"tokens, {model.max_len_blocks} blocks): raise {where} or lower model.max_model_len"
            )


class SimSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    driver_version: str = "550.54.15"
    cuda_version: str = "12.4"
    nodes: list[NodeSpec] = msgspec.field(default_factory=list)
    fleets: list[FleetSpec] = msgspec.field(default_factory=list)
    """Generated nodes; once the spec is read they are in ``nodes`` and this list is empty."""
    deployments: list[DeploymentSpec] = msgspec.field(default_factory=list)
    hollow: bool = False
    """``gpuwarden up`` runs every node's driver, device and metrics agents in one process per service kind
    (hollow nodes) instead of one process per service and node; ``up --hollow`` asks for it too."""

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        names = [n.name for n in self.nodes]
        shown = ", ".join(names[:10]) + (f", ... ({len(names)} nodes)" if len(names) > 10 else "")
        raise SpecError(f"node {name!r} is not in the spec (nodes: {shown})")

    def __post_init__(self) -> None:
        if self.fleets:
            generated: list[NodeSpec] = []
            for i, fleet in enumerate(self.fleets):
                for name in fleet.names():
                    if not _NAME_RE.match(name):
                        raise SpecError(f"$.fleets[{i}].name_prefix: {name!r} is not a valid node name")
                generated += fleet.expand()
            msgspec.structs.force_setattr(self, "nodes", [*self.nodes, *generated])
            msgspec.structs.force_setattr(self, "fleets", [])
        if not self.nodes:
            raise SpecError("$.nodes: at least one node is needed (or a fleet in $.fleets)")
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
        smallest = self.smallest_gpu_mib()
        if smallest:
            for i, d in enumerate(self.deployments):
                try:
                    d.check_capacity(smallest)
                except SpecError as exc:
                    raise SpecError(f"$.deployments[{i}].{exc}") from None

    def smallest_gpu_mib(self) -> int:
        """The memory of the spec's smallest GPU (0 when it has none): what a pod may land on."""
        return min((g.memory_mib for n in self.nodes for g in n.gpus), default=0)


H100_MIG_PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]

TINY_LLAMA = ModelShape(
    engine="transformers",
    model_id="gpuwarden/tiny-llama",
    model_version="1",
    dtype="float32",
    dtype_bytes=4,
    layers=2,
    kv_heads=2,
    attention_heads=4,
    head_dim=16,
    block_tokens=16,
    weights_mib=1,
    max_model_len=1024,
)
"""A real 2-layer Llama (about 70 K parameters, 8 KiB blocks): each request really prefills and decodes on the CPU."""


def default_spec() -> SimSpec:
    """3 nodes named node-1..node-3 with 2 H100 GPUs each (node-3's MIG-capable, as the H100's profiles), and one
    deployment of a real tiny Llama (``TINY_LLAMA``): its pods really prefill and decode, and every restored
    session is checked against a reference run.

    The pool is 128 blocks per pod and sessions end at 1024 tokens, not the 29,043 blocks and 8192 tokens of a
    Llama-3-8B on a real H100 pod: small enough for a laptop's CPU, small enough that the default traffic fills the
    pools (preemption and recompute happen). A Llama-3-8B's geometry runs with ``engine: synthetic``."""
    return SimSpec(
        nodes=[
            NodeSpec(name="node-1"),
            NodeSpec(name="node-2"),
            NodeSpec(name="node-3", gpus=[GpuSpec(count=2, mig_profiles=list(H100_MIG_PROFILES))]),
        ],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2, kv_blocks=128, model=TINY_LLAMA)],
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


def load_spec(path: str | None = None, env: Mapping[str, str] | None = None) -> SimSpec:
    """The spec at ``path`` (or ``GPUWARDEN_SIM_SPEC`` of ``env``, by default the process's), or the default spec
    when neither is set."""
    if not path:
        given = settings_from_env(SpecSettings, env).path
        if given is None:
            return default_spec()
        path = str(given)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(f"GPUWARDEN_SIM_SPEC={path}: {exc.strerror}") from None
    return parse_spec(raw, path)
