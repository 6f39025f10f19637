"""The KV agent and its checkpoint stores: a library imported by the inference server.

The server registers its sessions' KV blocks (numpy arrays, torch CPU/CUDA tensors, CuPy arrays, anything with
the buffer protocol or DLPack); the agent saves them to a store when the checkpoint service asks, when the pod's
preStop hook runs, and periodically; a new pod restores them byte for byte. See ``shared.kv.agent``.

``__all__`` is the public surface, what an inference server imports (``from shared.kv import KvAgent``); the
modules behind it may move. It installs without the services, the simulation and the CLI: the
``gpuwarden-kv-agent`` distribution (``agent/pyproject.toml``) holds this package, ``shared.contract`` and the
four ``shared.plumbing`` modules the endpoint's bus needs (docs/agent.md). Every name is imported when first asked for
(``TransformersEngine`` needs torch and transformers, ``NatsObjectStore`` only a ``nats://`` store).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees; at run time each name is imported on first use (below)
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
    "AgentEndpoint": "shared.kv.endpoint",
    "CheckpointManifest": "shared.kv.manifest",
    "CheckpointNotFound": "shared.kv.store",
    "CheckpointStore": "shared.kv.store",
    "ChunkCipher": "shared.kv.crypto",
    "ChunkCorrupt": "shared.kv.store",
    "DeadlineExceeded": "shared.kv.agent",
    "EngineCache": "shared.kv.engines",
    "FileStore": "shared.kv.filestore",
    "IncompatibleCheckpoint": "shared.kv.manifest",
    "KvAgent": "shared.kv.agent",
    "KvLayout": "shared.kv.manifest",
    "LLAMA_3_8B": "shared.kv.presets",
    "LoadReporter": "shared.kv.load",
    "LocateRefused": "shared.kv.endpoint",
    "ModelHost": "shared.kv.endpoint",
    "RestoredSession": "shared.kv.agent",
    "SaveFailure": "shared.kv.agent",
    "SaveReport": "shared.kv.agent",
    "SessionCheck": "shared.kv.engines",
    "SessionHeld": "shared.kv.endpoint",
    "SessionUnknown": "shared.kv.agent",
    "StoreError": "shared.kv.store",
    "check_compatible": "shared.kv.manifest",
    "cipher_from_env": "shared.kv.crypto",
    "connect_bus": "shared.kv.endpoint",
    "open_store": "shared.kv.stores",
    "parse_store_url": "shared.kv.stores",
    "restore_cache": "shared.kv.engines",
    "tokens_digest_of": "shared.kv.manifest",
    "TransformersEngine": "shared.kv.engines.huggingface",
    "NatsObjectStore": "shared.kv.objstore",
}
"""Every public name and the module that defines it, imported on first use: importing one module of the package
(``shared.kv.store`` for a store URL, ``shared.kv.manifest`` for a layout) costs that module, not the agent and
numpy behind it (what a one-shot CLI command pays on every start)."""

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
