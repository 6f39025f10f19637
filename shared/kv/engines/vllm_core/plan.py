"""What the scheduler tells the workers in one engine step (``StepPlan``): sessions to claim, truncate, load, copy
and finish; msgpack-encoded, as vLLM hands connector metadata to every worker."""

from __future__ import annotations

import msgspec


class ClaimSpec(msgspec.Struct, frozen=True, array_like=True):
    """A new session on this engine: take it (its next generation from the checkpoint service)."""

    session: str


class TruncateSpec(msgspec.Struct, frozen=True, array_like=True):
    """The conversation was rewritten: keep only the session's first ``blocks`` blocks."""

    session: str
    blocks: int


class LoadSpec(msgspec.Struct, frozen=True, array_like=True):
    """Load session blocks ``first .. first + len(block_ids)`` into vLLM blocks ``block_ids``; from the store
    (``from_store``: restore the session, verified) or from the agent's host copy."""

    req_id: str
    session: str
    first: int
    block_ids: list[int]
    from_store: bool


class CopySpec(msgspec.Struct, frozen=True, array_like=True):
    """vLLM blocks ``block_ids`` are the session's full blocks ``first ..``: copy each the agent lacks."""

    req_id: str
    session: str
    first: int
    block_ids: list[int]


class FinishSpec(msgspec.Struct, frozen=True, array_like=True):
    """The request finished with ``tokens`` positions computed in ``block_ids``: copy what the agent lacks (the
    partial tail too), then report the request so vLLM frees its blocks (``held``: only when the scheduler told
    vLLM to hold them; a request it freed at once, such as one failed at its load, is never reported).
    ``end``: the conversation is over."""

    req_id: str
    session: str
    tokens: int
    block_ids: list[int]
    end: bool = False
    held: bool = True


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker does in one engine step, in this order: claims, truncates, loads (before the forward),
    copies, finishes (after it)."""

    claims: list[ClaimSpec] = msgspec.field(default_factory=list)
    truncates: list[TruncateSpec] = msgspec.field(default_factory=list)
    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    copies: list[CopySpec] = msgspec.field(default_factory=list)
    finishes: list[FinishSpec] = msgspec.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.claims or self.truncates or self.loads or self.copies or self.finishes)


_plan_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)


def encode_plan(plan: StepPlan) -> bytes:
    return _plan_encoder.encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    """``ValueError`` (one line) for bytes that are not a plan."""
    try:
        return _plan_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"connector metadata is not a gpuwarden step plan: {exc}") from None
