"""Model rollouts, coordinated by the checkpoint service (it already owns where every session is).

Level-triggered: a loop reads the ``models`` document and runs every rollout it finds ``preparing`` (one replica
per rollout, by a lease). A run asks every Running pod of the deployment, through its KV agent, to prepare the new
version, within what is left of ``prepare_timeout_s`` since the rollout began; then settles it with one
compare-and-set of the document: ``switched`` (the serving version is the new one from that write on) when at
least ``min_ready`` of the pods are ready (with ``min_ready`` 1.0: all of them, none failed), else ``aborted``
with the reason, everything left on the old version. Either way ``kv.rollout.state`` is published: agents
switch on hearing it, and those that did not hear it switch on their next announcement, when they ask again.

A replica that dies mid-run loses the lease; the next one finds the rollout still preparing and runs it again
(prepare is idempotent), or aborts it when its time is up. Pods that were not running when the rollout ran
switch when they start (they ask for the serving version first).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from typing import Any

from shared.clients.rollouts import current_state, deployment_key, read_models, rollout_state, settle_rollout
from shared.contract.configdocs import DeploymentModel, ModelRollout
from shared.contract.models import ModelPrepared, PrepareModel, RolloutState, ServingQuery
from shared.host.runner import ServiceContext
from shared.plumbing.configsync import ConfigStore, redis_unreachable
from shared.ports.cluster import ClusterPort

from .ports import Leases

log = logging.getLogger(__name__)

TICK_S = 1.0
LEASE_EXTRA_S = 30.0


class RolloutCoordinator:
    def __init__(
        self, ctx: ServiceContext, store: ConfigStore, leases: Leases, cluster: ClusterPort, owner: str
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.leases = leases
        self.cluster = cluster
        self.owner = owner
        self.running: dict[str, str] = {}
        """deployment key -> the rollout this replica is running for it."""
        self._wake = asyncio.Event()

    def wake(self, *_: Any) -> None:
        self._wake.set()

    async def on_serving_query(self, query: ServingQuery) -> RolloutState:
        """Idempotent (a read). From Redis, so a pod never hears an older answer than the switch it may have
        heard already; from the last good configuration while Redis is away."""
        try:
            return await current_state(self.store, query.namespace, query.deployment)
        except Exception as exc:
            if not redis_unreachable(exc):
                raise
        held = self.ctx.config.current("models")
        doc = getattr(held.doc, "deployments", {}) if held else {}
        entry = doc.get(deployment_key(query.namespace, query.deployment))
        return rollout_state(query.namespace, query.deployment, entry, held.version if held else 0)

    async def loop(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("rollout reconcile failed", extra={"error": str(exc)})
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=TICK_S)
            except TimeoutError:
                pass
            self._wake.clear()

    async def reconcile(self) -> None:
        """Run each preparing rollout that no replica runs yet."""
        _, doc = await read_models(self.store)
        for key, entry in doc.deployments.items():
            rollout = entry.rollout
            if rollout is None or rollout.phase != "preparing" or self.running.get(key) == rollout.rollout_id:
                continue
            lease = rollout.prepare_timeout_s + LEASE_EXTRA_S
            if not await self.leases.take_turn("rollout", rollout.rollout_id, self.owner, lease):
                continue
            self.running[key] = rollout.rollout_id
            self.ctx.spawn(functools.partial(self._run, key, rollout), f"rollout-{rollout.rollout_id}")

    async def _run(self, key: str, rollout: ModelRollout) -> None:
        try:
            await self.run(key, rollout)
        except Exception:
            log.exception("rollout run failed; it is tried again", extra={"rollout": rollout.rollout_id})
            await asyncio.sleep(1.0)
        finally:
            if self.running.get(key) == rollout.rollout_id:
                del self.running[key]

    async def run(self, key: str, rollout: ModelRollout) -> RolloutState | None:
        """Prepare every pod, then switch or abort. Returns the state published, or None when the rollout was
        settled by someone else meanwhile."""
        namespace, deployment = key.split("/", 1)
        await self.ctx.publish(rollout_state(namespace, deployment, _entry(rollout)))
        pods = sorted(
            p.name
            for p in await self.cluster.pods()
            if p.namespace == namespace and p.deployment == deployment and p.phase == "Running"
        )
        remaining = rollout.started_at + rollout.prepare_timeout_s - time.time()
        log.info(
            "rollout preparing",
            extra={"rollout": rollout.rollout_id, "deployment": key, "pods": len(pods), "to": rollout.to_version},
        )

        async def prepare(pod: str) -> tuple[str, str]:
            if remaining <= 0:
                return pod, "the prepare timeout passed"
            command = PrepareModel(
                pod=pod,
                namespace=namespace,
                deployment=deployment,
                rollout_id=rollout.rollout_id,
                version=rollout.to_version,
                deadline_s=remaining,
            )
            try:
                answer = await self.ctx.bus.request(self.ctx.subjects.for_event(command), command, remaining + 1.0)
            except TimeoutError:
                return pod, f"no answer within {remaining:.0f}s"
            except Exception as exc:
                return pod, f"{type(exc).__name__}: {exc}"
            if isinstance(answer, ModelPrepared):
                return pod, "" if answer.ready else (answer.reason or "not ready")
            return pod, getattr(answer, "reason", "") or f"answered {answer.kind}"

        results = await asyncio.gather(*(prepare(p) for p in pods))
        ready = [pod for pod, why in results if not why]
        failed = [f"{pod}: {why}" for pod, why in results if why]
        needed = math.ceil(rollout.min_ready * len(pods))
        switch = len(ready) >= needed and (rollout.min_ready < 1.0 or not failed)
        if switch:
            reason = f"{len(ready)} of {len(pods)} pods ready"
        else:
            reason = f"{len(ready)} of {len(pods)} pods ready, {needed} needed: " + "; ".join(failed)[:1000]
        settled = await settle_rollout(
            self.store,
            namespace,
            deployment,
            rollout.rollout_id,
            "switched" if switch else "aborted",
            reason=reason,
            ready=ready,
            failed=failed,
            by=f"checkpoint/{self.owner}",
        )
        if settled is None:
            return None
        config_version, entry = settled
        state = rollout_state(namespace, deployment, entry, config_version)
        await self.ctx.publish(state)
        log.log(
            logging.INFO if switch else logging.WARNING,
            "rollout switched" if switch else "rollout aborted",
            extra={"rollout": rollout.rollout_id, "deployment": key, "reason": reason},
        )
        return state


def _entry(rollout: ModelRollout) -> DeploymentModel:
    return DeploymentModel(serving_version=rollout.from_version, rollout=rollout)
