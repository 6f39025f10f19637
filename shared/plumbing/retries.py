"""The project's retry policies, on one library (stamina): which failures are worth another try, how long to wait
between tries, and when to give up. Every place that tries an operation again names its policy here; none counts
attempts or doubles a delay by hand.

A policy's waits start at ``first_s`` and double with each failure in a row up to ``max_s`` (plus up to
``jitter_s`` at random, where many processes might otherwise try again together); it gives up after ``attempts``
tries (None: never) or, with a deadline, rather than wait past it. ``async for attempt in POLICY.tries(): with
attempt: ...`` tries a block; ``POLICY.call(operation)`` an awaitable's factory. A try that succeeds ends them, so
the next ``tries()`` starts the waits over.

What is not a plain retry of an operation stays hand-written, where it lives and saying why:

- ``PdbBackoff`` (``shared.clients.evictions``): the delay after a round of evictions a PodDisruptionBudget refused,
  which the driver's coordinator keeps per node across its reconcile passes (state, not a loop) and the CLI's
  ``drain`` mixes with its poll of the node until the node is empty (a refusal is no failure);
- the durable consumer's nak delays (``shared.plumbing.consumer``): the server redelivers, nothing here waits;
  its pull, lost with a connection, is asked again on the pull loop's next tick;
- a periodic save that did not happen (``services.checkpoint.periodic``, ``_retry_soon``): a due time brought
  forward in the replica's schedule of saves, which its ticks pick up;
- the cadences of level-triggered loops, whose waits a wake cuts short and whose passes decide afresh rather than
  repeat an operation (the MIG controller's reconcile, ``services.device.mig``), and steady polls and checks (the
  simulation's re-seeding of an emptied Redis, a hung simulated GPU's fault);
- the reconnects of nats-py (``max_reconnect_attempts=-1``), the connection retries of redis-py
  (``shared.plumbing.configsync``) and urllib3 (``shared.adapters.metrics``): the client libraries' own.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.errors
import stamina

from shared.plumbing.errors import TemporaryError

_T = TypeVar("_T")

Failures = tuple[type[Exception], ...]
Note = Callable[[Exception, float], None]
"""Told of each failure about to be tried again, and of the wait before the next try (without its jitter)."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Which failures are tried again (``on``), the waits between tries and when to give up."""

    on: Failures
    first_s: float
    max_s: float
    attempts: int | None = None
    jitter_s: float = 0.0
    only: Callable[[Exception], bool] | None = None
    """Which failures of ``on`` the policy itself tries again (all by default); a site's ``when`` narrows it."""

    def tries(
        self,
        *,
        deadline: float | None = None,
        when: Callable[[Exception], bool] | None = None,
        note: Note | None = None,
    ) -> Tries:
        """The tries of one operation, for ``async for attempt in ...: with attempt: ...``. ``deadline`` (on
        ``time.monotonic()``): give up rather than wait past it; ``when``: which failures of ``on`` are tried
        again (all by default); ``note``: told of each failure tried again."""
        return Tries(self, deadline, when, note)

    async def call(
        self,
        operation: Callable[[], Awaitable[_T]],
        *,
        deadline: float | None = None,
        when: Callable[[Exception], bool] | None = None,
        note: Note | None = None,
    ) -> _T:
        """``await operation()``, tried again as the policy says; raises the last failure when it gives up.

        The first try runs before stamina's bookkeeping, which costs some tens of microseconds (a tenth of a
        JetStream publish's round trip): its failure is handed to stamina as the first attempt's, so the waits and
        the give-up points are stamina's all the same."""
        try:
            return await operation()
        except Exception as exc:
            first: list[Exception] = [exc]

        async def again() -> _T:
            if first:
                raise first.pop()
            return await operation()

        async for attempt in self.tries(deadline=deadline, when=when, note=note):
            with attempt:
                return await again()
        raise AssertionError("unreachable: the tries end with a result or the last failure")


class Tries:
    """stamina's tries under a policy. The decision to try again is taken here, in full (which failure, how many
    tries, the deadline), so that ``note`` hears exactly the failures that are tried again, with the wait."""

    def __init__(
        self,
        policy: RetryPolicy,
        deadline: float | None,
        when: Callable[[Exception], bool] | None,
        note: Note | None,
    ) -> None:
        self.policy = policy
        self._deadline = deadline
        self._when = when
        self._note = note
        self._current: stamina.Attempt | None = None
        self._inner = stamina.retry_context(
            on=self._again,
            attempts=None,
            timeout=None,
            wait_initial=policy.first_s,
            wait_max=policy.max_s,
            wait_jitter=policy.jitter_s,
        ).__aiter__()

    def __aiter__(self) -> Tries:
        return self

    async def __anext__(self) -> stamina.Attempt:
        self._current = await self._inner.__anext__()
        return self._current

    def _again(self, exc: BaseException) -> bool:
        policy, attempt = self.policy, self._current
        if not isinstance(exc, Exception) or not isinstance(exc, policy.on) or attempt is None:
            return False
        if (policy.only is not None and not policy.only(exc)) or (self._when is not None and not self._when(exc)):
            return False
        if policy.attempts is not None and attempt.num >= policy.attempts:
            return False
        wait = attempt.next_wait
        if self._deadline is not None and time.monotonic() + wait + policy.jitter_s > self._deadline:
            return False
        if self._note is not None:
            self._note(exc, wait)
        return True


NO_PEERS_FOR_PLACEMENT = 10005
"""JetStream's ``err_code`` for a stream or consumer it cannot place (``no suitable peers for placement``): what a
cluster answers a create while a server is offline or not yet current, as after a start or a server's loss."""


def _jetstream_unavailable(exc: Exception) -> bool:
    if isinstance(exc, nats.js.errors.APIError) and not isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return exc.err_code == NO_PEERS_FOR_PLACEMENT
    return True


JETSTREAM_API = RetryPolicy(
    on=(
        nats.errors.TimeoutError,
        nats.errors.NoRespondersError,
        nats.js.errors.ServiceUnavailableError,
        nats.js.errors.BadRequestError,
    ),
    first_s=0.1,
    max_s=1.0,
    only=_jetstream_unavailable,
)
"""A JetStream API call (a lookup or an idempotent create) while the cluster cannot answer it, until the bus's
``API_DEADLINE``: a timeout, no responders, a 503, or a create the cluster cannot place yet (a 400 with
``NO_PEERS_FOR_PLACEMENT``; any other refusal is not tried again)."""

JETSTREAM_PUBLISH = RetryPolicy(
    on=(nats.errors.Error, nats.js.errors.Error, TimeoutError),
    first_s=0.05,
    max_s=1.0,
)
"""A JetStream publish, sent again with the same ``Nats-Msg-Id`` (stored once) until acknowledged or the bus's
``publish_deadline``; the bus tries no refusal again (``Bus._publish_js``)."""

LOOP_RESTART = RetryPolicy(on=(Exception,), first_s=0.5, max_s=30.0)
"""A service's background loop that crashed, started again for the service's lifetime (``ServiceContext.spawn``)."""

DRAIN_RECORD = RetryPolicy(on=(TemporaryError,), first_s=0.5, max_s=5.0)
"""A question to a drain's record that the checkpoint service did not answer (not running, its Redis away), asked
again while a command waits for the verdict (``shared.clients.drains``, ``VerdictWatch``)."""

NODE_LABELS = RetryPolicy(on=(Exception,), first_s=1.0, max_s=60.0)
"""The device service's write of its node's labels, while the cluster cannot be reached or refuses."""

KUBE_WATCH = RetryPolicy(on=(Exception,), first_s=0.025, max_s=10.0, jitter_s=0.025)
"""A Kubernetes watch resumed after a dropped connection, a 5xx or 429, or a request that ended with no event;
jittered, since every process watching resumes when an API server comes back. Which failures, the adapter says
(``shared.adapters.kubeapi``, ``_curable``: a ``ClusterError``, but no refusal retrying cannot cure, a 403); this
module, shipped with the KV agent, imports no port."""


CLUSTER_REWATCH = RetryPolicy(on=(Exception,), first_s=0.5, max_s=30.0)
"""A watch of the cluster port watched again after it ended before any change came: the adapter beneath has
already resumed what it could (``KUBE_WATCH``), so what ends here is a refusal, or the simulation's changes trimmed
past the watch (list and watch anew). The MIG controller's node watch and the simulated workload's; a watch that
brought changes and then ended is watched again at once, with the waits started over. Which failures, each site
says (the controller a ``ClusterError``, the simulation any)."""

SIM_REDIS = RetryPolicy(on=(Exception,), first_s=0.1, max_s=2.0)
"""A read of the simulation's Redis streams (the cluster's changes, the GPUs' health) while Redis is away: the
simulated world waits for it as long as it takes. Which failures, the simulation says (Redis's and the socket's:
this module, shipped with the KV agent, imports no Redis)."""

BENCH_READ = RetryPolicy(on=(Exception,), first_s=0.2, max_s=5.0, attempts=8)
"""A benchmark's own read of the mesh it measures (``bench.scale_upgrade``'s watch of the upgrade labels) while
that mesh's Redis times out under the load being measured: tried again, never the end of the run. Which failures,
the benchmark says (the cluster port's and Redis's)."""


def quiet_library_hooks() -> None:
    """For a process of this project's own (``shared.plumbing.logs.configure``): the sites log their retries in
    their own words (the bus's not at all), so stamina's default hooks would only add a line for each, and a
    Prometheus counter labelled by retry number (unbounded under a policy that never gives up) in a registry no
    endpoint serves. Not done on import: the KV agent runs inside an inference server, whose stamina settings are
    its own."""
    stamina.instrumentation.set_on_retry_hooks(())
