"""The ScaledObject trigger's ``metadata:`` as the scaler reads it: parsed and checked once per change.

KEDA passes the whole map on every call (``ScaledObjectRef.scalerMetadata``, all values strings). Every key is
checked: a missing, malformed or unknown key is refused with ``TriggerError``, which the gRPC layer answers as
``INVALID_ARGUMENT`` naming the key and what is allowed, so a typo shows in the ScaledObject's events instead of
silently running on a default.

| key | allowed | default |
|---|---|---|
| ``deployment`` | the Deployment whose request queue is ``<root>.requests.<namespace>.<deployment>`` | required |
| ``namespace`` | its namespace | the ScaledObject's namespace |
| ``queueDepthPerReplica`` | integer >= 1: queued plus in-progress requests one replica serves | 10 |
| ``gpuUtilTarget`` | percent, 1-100: mean GPU utilisation per replica to aim for | unset: GPU signal off |
| ``kvCacheUtilTarget`` | percent, 1-100: KV-cache blocks used per pool to aim for (``kv.pod.load``) | unset: off |
| ``ttftP90TargetMs`` | milliseconds, above 0 (at most 3600000): time to first token at p90 to aim for | unset: off |
| ``combine`` | ``max``: the most demanding signal wins; ``sum``: queue and GPU counts added first | max |
| ``activationQueueDepth`` | integer >= 0: active (0 -> 1) when the queue is deeper than this | 0 |
| ``activationGpuUtil`` | percent, 0-100: also active when utilisation is above this | unset: queue only |
| ``minReplicas`` / ``maxReplicas`` | integers, 0 <= min <= max, max >= 1 (match the ScaledObject's bounds) | 0 / 100 |
| ``stabilisationWindow`` | seconds (``300``, ``90s``, ``5m``): scale down only to the highest count seen in it | 60s |
| ``drainSurge`` | ``true`` or ``false``: add the pods of draining nodes | true |
| ``queueStaleAfter`` / ``utilStaleAfter`` | seconds: an input older than this is stale | 15s / 60s |
| ``loadStaleAfter`` | seconds: a pod's load report older than this is missing (none fresh: stale) | 15s |

KEDA's own keys (``scalerAddress``, ``enableTLS``, ``unsafeSsl``, ``tlsCertFile``, ``caCert``, ``tlsClientCert``,
``tlsClientKey``) are accepted and ignored.

Limits, checked before anything else reads the request (sizes in UTF-8 bytes, Kubernetes-sized); over one, the
answer is ``INVALID_ARGUMENT`` naming the key (its first ``SHOWN_CHARS`` characters when longer) and the limit:

| what | limit |
|---|---|
| keys in ``metadata`` | ``MAX_KEYS`` = 64 |
| a key | ``MAX_KEY_BYTES`` = 253 (a ConfigMap key's limit) |
| a value | ``MAX_VALUE_BYTES`` = 1024 (1 KiB) |
| a value of ``caCert``, ``tlsClientCert``, ``tlsClientKey`` | ``MAX_PEM_BYTES`` = 65536 (64 KiB: a certificate chain) |
| ``ScaledObjectRef`` ``name`` and ``namespace`` | ``MAX_NAME_BYTES`` = 253 (a Kubernetes object name) |
| ``GetMetricsRequest`` ``metricName`` | ``MAX_VALUE_BYTES`` = 1024 |

No error quotes more than ``SHOWN_CHARS`` (32) characters of what the caller sent (``shown``). A request over
gRPC's own 4 MiB message limit is refused by gRPC before it is read (``RESOURCE_EXHAUSTED``).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

KEDA_KEYS = frozenset(
    {"scalerAddress", "enableTLS", "unsafeSsl", "tlsCertFile", "caCert", "tlsClientCert", "tlsClientKey"}
)
PEM_KEYS = frozenset({"caCert", "tlsClientCert", "tlsClientKey"})
MAX_KEYS = 64
MAX_KEY_BYTES = 253
MAX_VALUE_BYTES = 1024
MAX_PEM_BYTES = 64 * 1024
MAX_NAME_BYTES = 253
SHOWN_CHARS = 32
MAX_TTFT_TARGET_MS = 3_600_000
KEYS = frozenset(
    {
        "deployment",
        "namespace",
        "queueDepthPerReplica",
        "gpuUtilTarget",
        "kvCacheUtilTarget",
        "ttftP90TargetMs",
        "combine",
        "activationQueueDepth",
        "activationGpuUtil",
        "minReplicas",
        "maxReplicas",
        "stabilisationWindow",
        "drainSurge",
        "queueStaleAfter",
        "utilStaleAfter",
        "loadStaleAfter",
    }
)
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DURATION = re.compile(r"^(?P<n>\d+(\.\d+)?)(?P<unit>ms|s|m|h)?$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def size(text: str) -> int:
    """``text``'s length in UTF-8 bytes (ASCII, the usual case, without encoding it)."""
    return len(text) if text.isascii() else len(text.encode())


def shown(text: str) -> str:
    """``text`` as an error may quote it: quoted, and cut to ``SHOWN_CHARS`` characters plus its size when longer,
    so that an error never carries back what the caller sent."""
    quoted = repr(text[:SHOWN_CHARS])
    cut = len(text) > SHOWN_CHARS
    if len(quoted) > 2 * SHOWN_CHARS:  # unprintable characters escape to as many as 10 characters each
        quoted, cut = quoted[: 2 * SHOWN_CHARS], True
    return f"{quoted}... ({size(text)} bytes)" if cut else quoted


class TriggerError(ValueError):
    """A request the scaler cannot use; the message names the key (``where`` it is) and what is allowed, and quotes
    no more than ``shown`` does."""

    def __init__(self, key: str, message: str, where: str = "metadata") -> None:
        named = key if len(key) <= SHOWN_CHARS and key.isascii() and key.isprintable() else shown(key)
        super().__init__(f"{where} {named}: {message}" if key else f"{where}: {message}")
        self.key = key


def check_limits(meta: Mapping[str, str]) -> None:
    """Refuse metadata over the limits of the module's table (``TriggerError``) before anything else reads it."""
    if len(meta) > MAX_KEYS:
        raise TriggerError("", f"{len(meta)} keys, more than the {MAX_KEYS} allowed")
    for key in sorted(meta):
        if size(key) > MAX_KEY_BYTES:  # longer than SHOWN_CHARS too: the message gives its size
            raise TriggerError(key, f"a key longer than the {MAX_KEY_BYTES} bytes allowed")
        limit = MAX_PEM_BYTES if key in PEM_KEYS else MAX_VALUE_BYTES
        if (n := size(meta[key])) > limit:
            raise TriggerError(key, f"a value of {n} bytes, longer than the {limit} bytes allowed")


def check_ref(name: str, namespace: str) -> None:
    """Refuse a ``ScaledObjectRef`` name or namespace longer than a Kubernetes name may be."""
    for field, value in (("name", name), ("namespace", namespace)):
        if (n := size(value)) > MAX_NAME_BYTES:
            raise TriggerError(field, f"{n} bytes, longer than the {MAX_NAME_BYTES} allowed", where="scaledObjectRef")


def check_metric_name(name: str) -> None:
    if (n := size(name)) > MAX_VALUE_BYTES:
        raise TriggerError(
            "metricName", f"{n} bytes, longer than the {MAX_VALUE_BYTES} allowed", where="GetMetricsRequest"
        )


@dataclass(frozen=True, slots=True)
class Trigger:
    """One ScaledObject trigger, checked. Frozen and hashable: it keys the scaler's view of a ScaledObject."""

    namespace: str
    deployment: str
    queue_depth_per_replica: int = 10
    gpu_util_target: float | None = None
    combine: Literal["max", "sum"] = "max"
    activation_queue_depth: int = 0
    activation_gpu_util: float | None = None
    min_replicas: int = 0
    max_replicas: int = 100
    stabilisation_window_s: float = 60.0
    drain_surge: bool = True
    queue_stale_after_s: float = 15.0
    util_stale_after_s: float = 60.0
    kv_cache_util_target: float | None = None
    ttft_p90_target_ms: float | None = None
    load_stale_after_s: float = 15.0

    @property
    def metric_name(self) -> str:
        """The metric name KEDA registers (it prefixes ``s<index>-``): lower case, dots and slashes as dashes."""
        return f"gpuwarden-{self.namespace}-{self.deployment}".replace(".", "-")


def _int(meta: Mapping[str, str], key: str, default: int, low: int) -> int:
    raw = meta.get(key)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise TriggerError(key, f"{shown(raw)} is not an integer; expected an integer >= {low}") from None
    if value < low:
        raise TriggerError(key, f"{shown(raw)} is below {low}; expected an integer >= {low}")
    return value


def _percent(meta: Mapping[str, str], key: str, low: float, strictly_above_low: bool) -> float | None:
    raw = meta.get(key)
    if raw is None:
        return None
    allowed = f"a percentage {'above' if strictly_above_low else 'from'} {low:g} up to 100, like '70'"
    try:
        value = float(raw.strip().removesuffix("%"))
    except ValueError:
        raise TriggerError(key, f"{shown(raw)} is not a number; expected {allowed}") from None
    if not math.isfinite(value) or value > 100 or value < low or (strictly_above_low and value == low):
        raise TriggerError(key, f"{shown(raw)} is out of range; expected {allowed}")
    return value


def _milliseconds(meta: Mapping[str, str], key: str) -> float | None:
    raw = meta.get(key)
    if raw is None:
        return None
    allowed = f"milliseconds above 0 up to {MAX_TTFT_TARGET_MS}, like '500'"
    try:
        value = float(raw.strip().removesuffix("ms"))
    except ValueError:
        raise TriggerError(key, f"{shown(raw)} is not a number; expected {allowed}") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_TTFT_TARGET_MS:
        raise TriggerError(key, f"{shown(raw)} is out of range; expected {allowed}")
    return value


def _seconds(meta: Mapping[str, str], key: str, default: float, low: float) -> float:
    raw = meta.get(key)
    if raw is None:
        return default
    match = _DURATION.match(raw.strip())
    if not match:
        raise TriggerError(key, f"{shown(raw)} is not a duration; expected seconds like '300', '90s' or '5m'")
    value = float(match["n"]) * _UNIT[match["unit"] or "s"]
    if value < low:
        raise TriggerError(key, f"{shown(raw)} is too short; expected at least {low:g}s")
    return value


def _bool(meta: Mapping[str, str], key: str, default: bool) -> bool:
    raw = meta.get(key)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered not in ("true", "false"):
        raise TriggerError(key, f"{shown(raw)}: expected 'true' or 'false'")
    return lowered == "true"


def _name(meta: Mapping[str, str], key: str, default: str) -> str:
    raw = meta.get(key, default).strip()
    if not raw:
        raise TriggerError(key, "missing; expected the name of a Kubernetes object (lower case DNS name)")
    if not _NAME.match(raw):
        raise TriggerError(key, f"{shown(raw)} is not a Kubernetes name; expected lower case letters, digits, '-', '.'")
    return raw


def parse_trigger(meta: Mapping[str, str], default_namespace: str = "") -> Trigger:
    """The trigger described by ``meta``, or ``TriggerError`` for the first key that is wrong."""
    check_limits(meta)
    for key in sorted(meta):
        if key not in KEYS and key not in KEDA_KEYS:
            close = difflib.get_close_matches(key, sorted(KEYS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TriggerError(key, f"unknown key; {hint}the scaler reads: {', '.join(sorted(KEYS))}")
    deployment = _name(meta, "deployment", "")
    namespace = _name(meta, "namespace", default_namespace)
    combine = meta.get("combine", "max").strip().lower()
    if combine not in ("max", "sum"):
        raise TriggerError("combine", f"{shown(meta['combine'])}: expected 'max' or 'sum'")
    min_replicas = _int(meta, "minReplicas", 0, 0)
    max_replicas = _int(meta, "maxReplicas", 100, 1)
    if min_replicas > max_replicas:
        above = f"{shown(str(min_replicas))} is above maxReplicas {shown(str(max_replicas))}"
        raise TriggerError("minReplicas", above)
    return Trigger(
        namespace=namespace,
        deployment=deployment,
        queue_depth_per_replica=_int(meta, "queueDepthPerReplica", 10, 1),
        gpu_util_target=_percent(meta, "gpuUtilTarget", 0.0, strictly_above_low=True),
        combine="sum" if combine == "sum" else "max",
        activation_queue_depth=_int(meta, "activationQueueDepth", 0, 0),
        activation_gpu_util=_percent(meta, "activationGpuUtil", 0.0, strictly_above_low=False),
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        stabilisation_window_s=_seconds(meta, "stabilisationWindow", 60.0, 0.0),
        drain_surge=_bool(meta, "drainSurge", True),
        queue_stale_after_s=_seconds(meta, "queueStaleAfter", 15.0, 0.1),
        util_stale_after_s=_seconds(meta, "utilStaleAfter", 60.0, 0.1),
        kv_cache_util_target=_percent(meta, "kvCacheUtilTarget", 0.0, strictly_above_low=True),
        ttft_p90_target_ms=_milliseconds(meta, "ttftP90TargetMs"),
        load_stale_after_s=_seconds(meta, "loadStaleAfter", 15.0, 0.1),
    )
