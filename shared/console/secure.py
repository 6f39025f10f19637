"""A NATS server behind the auth callout, and the credentials of everyone who connects to it: what ``gpuwarden up
--secure`` runs (and the tests' secured fixtures), as a real cluster runs gpuwarden.

``callout_secrets(folder)`` makes (or keeps) one password file per password user (the callout's own, each
service's, the admin's, the gateway's) and the issuer's account seed, all mode 0600 in a folder of mode 0700;
``write_server_config`` writes the server's configuration (JetStream, and ``nats_callout_config``: the callout's
user and the issuer); ``auth_env``, ``user_env`` say how the auth service and a password user find theirs. A KV agent
never has a password: it proves its pod with a service-account token (the SIMULATED cluster's, written where
``GPUWARDEN_SIM_TOKEN_DIR`` says, read again at every reconnect: ``GPUWARDEN_NATS_TOKEN_FILE``). Nothing here
prints or logs a password or the seed.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from shared.contract.permissions import ADMIN, AUTH, GATEWAY, SERVICES, nats_callout_config, user_name
from shared.contract.subjects import Subjects

PASSWORD_USERS: tuple[str, ...] = (AUTH, *SERVICES, ADMIN, GATEWAY)
SEED_FILE = "issuer.nk"
PASSWORDS = "passwords"


@dataclass(frozen=True)
class CalloutSecrets:
    """Where the secrets of one secured server are: ``folder/<user>`` each password, ``seed`` the issuer's account
    seed (the auth service's alone), ``issuer`` its public key (the server configuration's)."""

    folder: Path
    seed: Path
    issuer: str

    def password_file(self, name: str) -> Path:
        return self.folder / name

    @property
    def passwords(self) -> dict[str, str]:
        return {name: self.password_file(name).read_text().strip() for name in PASSWORD_USERS}


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def callout_secrets(where: Path) -> CalloutSecrets:
    """The secrets under ``where``, made where missing (kept where present: a restarted mesh keeps its users)."""
    import nkeys

    where.mkdir(parents=True, exist_ok=True)
    where.chmod(0o700)
    folder = where / PASSWORDS
    folder.mkdir(exist_ok=True)
    folder.chmod(0o700)
    for name in PASSWORD_USERS:
        path = folder / name
        if not path.exists():
            _write_private(path, (secrets.token_urlsafe(18) + "\n").encode())
    seed = where / SEED_FILE
    if not seed.exists():
        _write_private(seed, bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)) + b"\n")
    issuer = nkeys.from_seed(bytearray(seed.read_bytes().strip())).public_key.decode()
    return CalloutSecrets(folder, seed, str(issuer))


def write_server_config(path: Path, subjects: Subjects, found: CalloutSecrets, timeout_s: float = 5.0) -> Path:
    """The server's configuration at ``path`` (mode 0600): JetStream, and the callout's ``authorization`` block.
    The store directory is not in it: ``NatsServer`` passes ``-sd``, and nats-server refuses a second one."""
    text = "jetstream {}\n" + nats_callout_config(
        subjects, found.password_file(AUTH).read_text().strip(), found.issuer, timeout_s
    )
    path.unlink(missing_ok=True)
    _write_private(path, text.encode())
    return path


def user_env(subjects: Subjects, found: CalloutSecrets, name: str) -> dict[str, str]:
    """How the password user ``name`` (a service, ``admin``, ``gateway``, ``auth``) connects: its user and password
    file."""
    return {
        "GPUWARDEN_NATS_USER": user_name(subjects, name),
        "GPUWARDEN_NATS_PASSWORD_FILE": str(found.password_file(name)),
    }


def auth_env(subjects: Subjects, found: CalloutSecrets, bucket: str = "") -> dict[str, str]:
    """The auth service's environment: its own user, the seed it signs with, the passwords it compares, and the
    checkpoint bucket family whose rights it grants (``GPUWARDEN_AUTH_BUCKET``, when the store is NATS)."""
    env = user_env(subjects, found, AUTH)
    env["GPUWARDEN_AUTH_ISSUER_SEED_FILE"] = str(found.seed)
    env["GPUWARDEN_AUTH_PASSWORD_DIR"] = str(found.folder)
    if bucket:
        env["GPUWARDEN_AUTH_BUCKET"] = bucket
    return env
