"""Reading one request for the pick: the session it names and the endpoints the gateway allows.

The session comes from the session header when there is one, else from the OpenAI request body's ``user`` field.
Either must pass the contract's id rule (``shared.contract.base.id_problem``); one that does not is refused with
the rule (``RequestFacts.session_problem``) and the request is routed as if it named none. A body that is not JSON,
is too large or has no string ``user`` names no session: that is no error.

The gateway's candidates (Gateway API Inference Extension): the header ``x-gateway-destination-endpoint-subset``
(``ip:port`` separated by commas) or the same list under the dynamic metadata ``envoy.lb.subset_hint``. Entries that
are no ``ip:port`` are dropped; a subset given with no valid entry allows nothing (503), never everything.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping

from shared.contract.base import id_problem

from .picker import RequestFacts

SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
MAX_SUBSET = 4096
"""Candidate endpoints read at most (a gateway's pool is far smaller)."""


def endpoint_or_none(text: str) -> str | None:
    """``text`` as an ``ip:port`` endpoint (``[v6]:port`` for IPv6), or None when it is none."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        return None
    if address.version == 6 and not bracketed:
        return None
    return f"[{address}]:{int(port)}" if address.version == 6 else f"{address}:{int(port)}"


def subset_of(header: str | None, hint: Iterable[str] | None) -> frozenset[str] | None:
    """The candidates the gateway named (the header, else the metadata hint); None when it named none."""
    if header is not None:
        entries: list[str] = header.split(",")
    elif hint is not None:
        entries = list(hint)
    else:
        return None
    found = (endpoint_or_none(e) for e in entries[:MAX_SUBSET] if isinstance(e, str))
    return frozenset(e for e in found if e is not None)


def session_from_body(body: bytes) -> str | None:
    """The OpenAI body's ``user`` field when the body is a JSON object with a string there; else None."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    user = parsed.get("user")
    return user if isinstance(user, str) else None


def read_request(
    headers: Mapping[str, str],
    session_header: str,
    body: bytes | None = None,
    hint: Iterable[str] | None = None,
) -> RequestFacts:
    """The facts of one request. ``headers``: lower-case names; ``body``: None when it was not read."""
    subset = subset_of(headers.get(SUBSET_HEADER), hint)
    named = headers.get(session_header)
    if named is None and body:
        named = session_from_body(body)
    if named is None or named == "":
        return RequestFacts(subset=subset)
    problem = id_problem("session", named)
    if problem:
        return RequestFacts(session_problem=problem, subset=subset)
    return RequestFacts(session=named, subset=subset)
