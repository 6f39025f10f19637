"""The KV agent and its checkpoint stores: a library imported by the inference server.

The server registers its sessions' KV blocks (numpy arrays, torch CPU/CUDA tensors, CuPy arrays, anything with
the buffer protocol or DLPack); the agent saves them to a store when the checkpoint service asks, when the pod's
preStop hook runs, and periodically; a new pod restores them byte for byte. See ``shared.kv.agent``.

``__all__`` is the public surface, what an inference server imports (``from shared.kv import KvAgent``); the
modules behind it may move. It installs without the services, the simulation and the CLI: the
``gpuwarden-kv-agent`` distribution (``agent/pyproject.toml``) holds this package, ``shared.contract`` and the
four ``shared.plumbing`` modules the endpoint's bus needs (docs/agent.md). ``TransformersEngine`` and
``NatsObjectStore`` are imported when first asked for: the first needs torch and transformers, the second is
needed only for a ``nats://`` store.
"""

from __future__ import annotations

import importlib
from typing import Any

from shared.kv.agent import DeadlineExceeded, KvAgent, RestoredSession, SaveFailure, SaveReport, SessionUnknown
from shared.kv.crypto import ChunkCipher, cipher_from_env
from shared.kv.endpoint import AgentEndpoint, LocateRefused, ModelHost, SessionHeld, connect_bus
from shared.kv.engines import EngineCache, SessionCheck, restore_cache
from shared.kv.filestore import FileStore
from shared.kv.load import LoadReporter
from shared.kv.manifest import (
    CheckpointManifest,
    IncompatibleCheckpoint,
    KvLayout,
    check_compatible,
    tokens_digest_of,
)
from shared.kv.presets import LLAMA_3_8B
from shared.kv.store import CheckpointNotFound, CheckpointStore, ChunkCorrupt, StoreError
from shared.kv.stores import open_store, parse_store_url

_LAZY = {
    "TransformersEngine": "shared.kv.engines.huggingface",
    "NatsObjectStore": "shared.kv.objstore",
}
"""Public names whose module is imported on first use, by the module that defines them."""

__all__ = [
    "LLAMA_3_8B",
    "AgentEndpoint",
    "CheckpointManifest",
    "CheckpointNotFound",
    "CheckpointStore",
    "ChunkCipher",
    "ChunkCorrupt",
    "DeadlineExceeded",
    "EngineCache",
    "FileStore",
    "IncompatibleCheckpoint",
    "KvAgent",
    "KvLayout",
    "LoadReporter",
    "LocateRefused",
    "ModelHost",
    "NatsObjectStore",
    "RestoredSession",
    "SaveFailure",
    "SaveReport",
    "SessionCheck",
    "SessionHeld",
    "SessionUnknown",
    "StoreError",
    "TransformersEngine",
    "check_compatible",
    "cipher_from_env",
    "connect_bus",
    "open_store",
    "parse_store_url",
    "restore_cache",
    "tokens_digest_of",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
