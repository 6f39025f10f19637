"""``gpuwarden nats-auth``: a nats-server authorization block, static (one least-privilege user per service) or the
auth callout's."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shared.console.state import UsageError, command_settings
from shared.contract.subjects import Subjects


def cmd_nats_auth(args: argparse.Namespace) -> int:
    """Print a nats-server authorization block. With ``--issuer-seed-file``: the auth callout's (its own user, from
    DIR's ``auth`` password file, and the issuer's public key; every other user is the callout's to authenticate,
    ``services.auth``). Without: a static block of one least-privilege user per service, the KV agents, an admin,
    and a gateway (a KV-aware router) when DIR has a ``gateway`` password file."""
    from shared.contract.permissions import AUTH, OPTIONAL_USERS, USERS, nats_auth_config, nats_callout_config

    settings = command_settings(needs=())  # the root alone: no server is asked
    directory = Path(args.password_dir)
    if args.issuer_seed_file:
        path = directory / AUTH
        try:
            password = path.read_text().strip()
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror} (the auth callout's own password)") from None
        issuer = _issuer_public_key(Path(args.issuer_seed_file))
        try:
            print(nats_callout_config(Subjects(settings.root), password, issuer, timeout_s=args.timeout))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return 0
    passwords: dict[str, str] = {}
    for user in USERS:
        path = directory / user
        try:
            passwords[user] = path.read_text().strip()
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror} (one file per user holding its password)") from None
    for user in OPTIONAL_USERS:  # a user of its own only when its password file is there
        path = directory / user
        if path.exists():
            try:
                passwords[user] = path.read_text().strip()
            except OSError as exc:
                raise UsageError(f"{path}: {exc.strerror}") from None
    try:
        print(
            nats_auth_config(
                Subjects(settings.root),
                passwords,
                node=args.node or None,
                pod=args.pod or None,
                bucket=args.bucket or None,
            )
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return 0


def _issuer_public_key(path: Path) -> str:
    """The public key of the account seed in ``path``, written afresh (mode 0600) when there is none yet. The
    seed itself is never printed: it goes to the auth service alone (``GPUWARDEN_AUTH_ISSUER_SEED_FILE``)."""
    import nkeys

    if not path.exists():
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise UsageError(f"{path}: {exc.strerror}") from None
        with os.fdopen(fd, "wb") as out:
            out.write(bytes(seed) + b"\n")
        print(
            f"gpuwarden nats-auth: wrote a new issuer seed to {path} (give it to the auth service only)",
            file=sys.stderr,
        )
    try:
        public = nkeys.from_seed(bytearray(path.read_bytes().strip())).public_key.decode()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    except Exception:
        raise UsageError(f"{path}: not an nkey seed") from None
    if not public.startswith("A"):
        raise UsageError(f"{path}: not an account seed (its public key must start with A)")
    return str(public)
