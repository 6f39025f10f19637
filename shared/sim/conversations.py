"""The traffic the simulation sends: conversations of several turns per deployment, each closed at its end
(``Conversations``), published at a steady rate (``publish_requests``)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass

from shared.contract.requests import InferenceRequest
from shared.plumbing.bus import Bus
from shared.sim.spec import DeploymentSpec, SimSpec


@dataclass
class Conversation:
    session_id: str
    turns_left: int
    tokens: int = 0


class Conversations:
    """The traffic ``publish_requests`` sends: per deployment, ``sessions`` conversations at a time, each of a
    random number of turns (1 to ``max_turns``) and then a close; a new conversation, under a new id, takes the
    place of each one that closes. A conversation whose next turn would pass the model's ``max_model_len`` sends
    that turn (the pod refuses it and ends the session, as a client meets a context-length error) and stops
    there. Only the open conversations are remembered.

    Session ids carry a tag of their own per instance, so a restarted generator never continues the sessions
    (and checkpoints) of an earlier one by accident."""

    def __init__(
        self,
        spec: SimSpec,
        sessions: int,
        prompt_tokens: int,
        new_tokens: int,
        max_turns: int,
        *,
        seed: int | None = None,
        tag: str = "",
    ) -> None:
        if sessions < 1 or max_turns < 1:
            raise ValueError(f"sessions ({sessions}) and max_turns ({max_turns}) must be at least 1")
        if prompt_tokens + new_tokens <= 0:
            raise ValueError("a turn needs prompt or new tokens (a request with neither closes its session)")
        self.spec = spec
        self.turn_tokens = prompt_tokens + new_tokens
        self.prompt_tokens = prompt_tokens
        self.new_tokens = new_tokens
        self.max_turns = max_turns
        self.tag = tag or uuid.uuid4().hex[:6]
        self._random = random.Random(seed)
        self._started = 0
        self._open: dict[tuple[str, str], list[Conversation]] = {
            (d.namespace, d.name): [self._new(d) for _ in range(sessions)] for d in spec.deployments
        }
        self._next = 0

    def _new(self, deployment: DeploymentSpec) -> Conversation:
        self._started += 1
        return Conversation(f"{deployment.name}-{self.tag}-{self._started}", self._random.randint(1, self.max_turns))

    @property
    def started(self) -> int:
        """Conversations begun so far, over all deployments."""
        return self._started

    def next_requests(self) -> list[InferenceRequest]:
        """One request per deployment: the next turn of the next open conversation, or its close."""
        out: list[InferenceRequest] = []
        for deployment in self.spec.deployments:
            slots = self._open[(deployment.namespace, deployment.name)]
            slot = self._next % len(slots)
            talk = slots[slot]
            if talk.turns_left == 0:
                out.append(self._request(deployment, talk.session_id, 0, 0))
                slots[slot] = self._new(deployment)
                continue
            out.append(self._request(deployment, talk.session_id, self.prompt_tokens, self.new_tokens))
            talk.tokens += self.turn_tokens
            talk.turns_left -= 1
            if talk.tokens > deployment.model.max_model_len:
                talk.turns_left = 0
        self._next += 1
        return out

    def closing(self) -> list[InferenceRequest]:
        """The close of every open conversation; none is open afterwards (the next request starts new ones)."""
        out = [
            self._request(d, talk.session_id, 0, 0)
            for d in self.spec.deployments
            for talk in self._open[(d.namespace, d.name)]
        ]
        for d in self.spec.deployments:
            slots = self._open[(d.namespace, d.name)]
            slots[:] = [self._new(d) for _ in slots]
        return out

    @staticmethod
    def _request(deployment: DeploymentSpec, session_id: str, prompt: int, new: int) -> InferenceRequest:
        return InferenceRequest(
            namespace=deployment.namespace,
            deployment=deployment.name,
            session_id=session_id,
            prompt_tokens=prompt,
            max_new_tokens=new,
        )


async def publish_requests(
    bus: Bus,
    spec: SimSpec,
    sessions: int,
    rate_per_s: float,
    prompt_tokens: int,
    new_tokens: int,
    seconds: float,
    max_turns: int = 12,
) -> int:
    """A steady load: ``rate_per_s`` requests per second per deployment over ``sessions`` open conversations
    per deployment, each of at most ``max_turns`` turns and then closed (``Conversations``)."""
    conversations = Conversations(spec, sessions, prompt_tokens, new_tokens, max_turns)
    sent = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        for request in conversations.next_requests():
            await bus.publish(request)
            sent += 1
        await asyncio.sleep(1.0 / rate_per_s)
    return sent
