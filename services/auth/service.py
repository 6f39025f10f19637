"""The auth callout: nats-server hands it every connecting client's credentials (an authorization request on
``$SYS.REQ.USER.AUTH``); it answers with a user, signed with the issuer account's key, that carries exactly the
permissions of the identity the credentials prove (``shared.contract.permissions``), or with a refusal.

It connects as the one user the server itself knows (``<root>-auth``, in the configuration's ``auth_users``),
which may do nothing but hear the requests and answer each. Several replicas share the requests (a queue group);
while none runs, nobody else can connect: run two. It needs NATS alone and, for tokens, the cluster's
TokenReview: no streams, no Redis. Neither a password, a token nor the signing seed is ever logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.auth import config
from services.auth.authority import PASSWORD_ROLES, Authority, Verdict
from services.auth.natsjwt import (
    AuthorizationRequest,
    JwtError,
    account_key,
    encode,
    read_request,
    response_claims,
    user_claims,
)
from services.auth.ports import TokenReviewer
from shared.contract.permissions import AUTH_CALLOUT_SUBJECT, identity_name, permissions
from shared.host.runner import ServiceContext
from shared.plumbing.errors import SettingsError

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0


@dataclass
class Tally:
    authorized: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    unreadable: int = 0

    def describe(self) -> dict[str, Any]:
        return {"authorized": dict(self.authorized), "refused": self.refused, "unreadable": self.unreadable}


def read_passwords(folder: Path | None) -> dict[str, str]:
    """``role -> password`` from one file per role in ``folder`` (those there; a role without a file has no
    password user). A file that cannot be read is an error naming it, never its content."""
    if folder is None:
        return {}
    found: dict[str, str] = {}
    for role in PASSWORD_ROLES:
        path = folder / role
        if not path.exists():
            continue
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise SettingsError(f"{path}: {exc.strerror}") from None
        if value:
            found[role] = value
    return found


class AuthService:
    name = "auth"
    config_names: tuple[str, ...] = ()
    bus_only = True  # NATS alone: no streams to ensure, no configuration to watch

    def __init__(
        self,
        settings: config.AuthSettings | None = None,
        reviewer: TokenReviewer | None = None,
        passwords: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or config.load()
        self.reviewer = reviewer
        self.passwords = passwords
        self.clock = clock
        self.tally = Tally()

    async def start(self, ctx: ServiceContext) -> None:
        seed_file = self.settings.issuer_seed_file
        if seed_file is None:
            raise SettingsError("the auth callout needs its issuer seed (GPUWARDEN_AUTH_ISSUER_SEED_FILE)")
        try:
            self._signer = account_key(seed_file.read_bytes())
        except OSError as exc:
            raise SettingsError(f"{seed_file}: {exc.strerror}") from None
        except JwtError as exc:
            raise SettingsError(f"{seed_file}: {exc}") from None
        self.issuer = self._signer.public_key.decode()
        passwords = self.passwords if self.passwords is not None else read_passwords(self.settings.password_dir)
        reviewer = self.reviewer
        if reviewer is None:
            cluster = await ctx.backends.cluster(watch_kinds=())
            ctx.on_stop(cluster.close)
            reviewer = cluster
        self.subjects = ctx.subjects
        self.authority = Authority(self.settings, ctx.subjects, passwords, reviewer, self.clock)
        await ctx.bus.answer(AUTH_CALLOUT_SUBJECT, self.on_request, queue="auth", name="auth-callout")
        ctx.status["issuer"] = self.issuer
        ctx.status["password_users"] = sorted(passwords)
        ctx.status["token_audience"] = self.settings.audience
        ctx.status["callouts"] = self.tally.describe
        log.info("auth callout answering", extra={"issuer": self.issuer, "password_users": len(passwords)})

    async def on_request(self, data: bytes) -> bytes:
        """One authorization request, answered with a signed response: the user, or the refusal's reason. A
        request that is not a server's, or not for this issuer, gets an empty answer (the server refuses the
        client then)."""
        now = self.clock()
        try:
            request = read_request(data.decode(errors="replace"), self.issuer, now)
        except JwtError as exc:
            self.tally.unreadable += 1
            log.warning("authorization request unreadable; not answered", extra={"error": str(exc)})
            return b""
        verdict = await self.authority.decide(request)
        if verdict.identity is None:
            self.tally.refused += 1
            log.warning("refused", extra=_described(request, verdict))
            answer = response_claims(request.user_nkey, request.server_id, error=verdict.reason)
            return encode(answer, self._signer, int(now)).encode()
        name = identity_name(self.subjects, verdict.identity)
        perms = permissions(self.subjects, verdict.identity, self.settings.bucket or None)
        expires = verdict.expires_at or None
        user = encode(user_claims(request.user_nkey, name, perms, expires), self._signer, int(now))
        self.tally.authorized[verdict.identity.role] = self.tally.authorized.get(verdict.identity.role, 0) + 1
        log.info("authorized", extra={**_described(request, verdict), "as": name, "until": verdict.expires_at})
        return encode(
            response_claims(request.user_nkey, request.server_id, user_jwt=user), self._signer, int(now)
        ).encode()


def _described(request: AuthorizationRequest, verdict: Verdict) -> dict[str, str]:
    """What a log line may say of a request: who it claimed to be and from where, never a credential."""
    return {
        "user": request.user or ("(token)" if request.token else "(none)"),
        "client": request.client_name,
        "host": request.client_host,
        "via": verdict.via,
        "reason": verdict.reason,
    }
