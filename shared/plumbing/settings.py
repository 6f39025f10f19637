"""Settings from environment variables (and mounted files for secrets), with documented defaults.

Secrets are wrapped in ``Secret`` so that no repr, log line or event ever shows them. Every variable a service
reads is listed in ``DOCUMENTED`` and, from there, in the README.
"""

from __future__ import annotations

import math
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from shared.contract.permissions import AGENT, Identity, identity_name, inbox_prefix
from shared.contract.subjects import Subjects
from shared.plumbing.errors import SettingsError

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_NATS_URL": "NATS server URL(s), comma separated (default nats://127.0.0.1:4222)",
    "GPUWARDEN_REDIS_URL": (
        "Redis URL (default redis://127.0.0.1:6379/0; rediss:// for TLS); behind Sentinel: "
        "redis+sentinel://host:port,host:port/<master name>/<db> (rediss+sentinel:// for TLS)"
    ),
    "GPUWARDEN_ROOT": "subject root, stream prefix and Redis key prefix (default gw)",
    "GPUWARDEN_NODE": "the node a node-scoped service runs on (default: the host name)",
    "GPUWARDEN_BACKEND": "sim (simulated GPUs and cluster) or real (NVML and the Kubernetes API); default sim",
    "GPUWARDEN_HTTP_ADDR": "host:port of /healthz, /readyz and /metrics (default 127.0.0.1:0, a free port)",
    "GPUWARDEN_HTTP_FD": "a listening socket the process inherits (from `gpuwarden up`, which holds the port "
    "for every restart) to serve HTTP on instead of binding GPUWARDEN_HTTP_ADDR (default: none)",
    "GPUWARDEN_LOG_LEVEL": "DEBUG, INFO, WARNING or ERROR (default INFO)",
    "GPUWARDEN_NATS_REPLICAS": "replicas of the JetStream streams the services create (default 1; 3 in production)",
    "GPUWARDEN_NATS_USER": "NATS user name (with GPUWARDEN_NATS_PASSWORD or _PASSWORD_FILE)",
    "GPUWARDEN_NATS_PASSWORD": "NATS password (prefer GPUWARDEN_NATS_PASSWORD_FILE)",
    "GPUWARDEN_NATS_TOKEN": "NATS token (or GPUWARDEN_NATS_TOKEN_FILE)",
    "GPUWARDEN_NATS_TOKEN_FILE": (
        "file holding the NATS token, read again at every (re)connect: a pod's projected service-account token, "
        "which the kubelet refreshes"
    ),
    "GPUWARDEN_NATS_INBOX_PREFIX": (
        "the inbox prefix of this connection's replies, _INBOX.<user> (default: from GPUWARDEN_NATS_USER; for a KV "
        "agent authenticating with its pod's token, from GPUWARDEN_POD_NAME; else _INBOX)"
    ),
    "GPUWARDEN_NATS_NKEY_SEED_FILE": "file holding an NKey seed",
    "GPUWARDEN_NATS_CREDS_FILE": "NATS .creds file (JWT + seed)",
    "GPUWARDEN_NATS_TLS_CA": "CA bundle to verify the NATS server",
    "GPUWARDEN_NATS_TLS_CERT": "client certificate for NATS mTLS (with GPUWARDEN_NATS_TLS_KEY)",
    "GPUWARDEN_NATS_TLS_KEY": "client key for NATS mTLS",
    "GPUWARDEN_REDIS_USERNAME": "Redis ACL user",
    "GPUWARDEN_REDIS_PASSWORD": "Redis password (prefer GPUWARDEN_REDIS_PASSWORD_FILE)",
    "GPUWARDEN_REDIS_SENTINEL_PASSWORD": "password of the Sentinels themselves, when they require one (or _FILE)",
    "GPUWARDEN_REDIS_TLS_CA": "CA bundle to verify the Redis server",
    "GPUWARDEN_REDIS_TLS_CERT": "client certificate for Redis mTLS (with GPUWARDEN_REDIS_TLS_KEY)",
    "GPUWARDEN_REDIS_TLS_KEY": "client key for Redis mTLS",
    "GPUWARDEN_CONFIG_REREAD_S": "seconds between full re-reads of the configuration from Redis (default 15)",
}


class Secret:
    """A value that never shows itself in a repr or a log line."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


@dataclass(frozen=True)
class TlsFiles:
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.ca is not None or self.cert is not None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if self.cert:
            ctx.load_cert_chain(str(self.cert), str(self.key) if self.key else None)
        return ctx


@dataclass(frozen=True)
class NatsSettings:
    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    user: str | None = None
    password: Secret | None = None
    token: Secret | None = None
    nkey_seed_file: Path | None = None
    creds_file: Path | None = None
    tls: TlsFiles = field(default_factory=TlsFiles)
    replicas: int = 1
    token_file: Path | None = None
    """Read again at every (re)connect (a projected service-account token rotates); ``token`` is its first read."""
    inbox_prefix: str = ""
    """Where replies to this connection go (``_INBOX.<user>``, ``shared.contract.permissions.inbox_prefix``);
    empty: derived from ``user`` when there is one, else nats-py's ``_INBOX``."""


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: Secret | None = None
    tls: TlsFiles = field(default_factory=TlsFiles)
    sentinel_password: Secret | None = None


@dataclass(frozen=True)
class SentinelUrl:
    """A Redis reached through its Sentinels: ``redis+sentinel://[user[:password]@]host:port[,host:port...]
    /<master name>[/<db>]`` (``rediss+sentinel://``: TLS to the Sentinels and to Redis). Clients ask the
    Sentinels which server is the primary now, and ask again when it fails over."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: Secret | None = None
    tls: bool = False


_SENTINEL_URL = re.compile(
    r"^(?P<scheme>rediss?)\+sentinel://(?:(?P<user>[^:@/]*)(?::(?P<password>[^@/]*))?@)?(?P<hosts>[^/@]+)"
    r"/(?P<service>[^/]+)(?:/(?P<db>[^/]*))?/?$"
)


def sentinel_url(url: str) -> SentinelUrl | None:
    """The Sentinel address in ``url``; None for a plain ``redis://``, ``rediss://`` or ``unix://`` URL. Raises
    ``SettingsError`` saying what is wrong with a malformed ``redis+sentinel://`` one."""
    if not re.match(r"^rediss?\+sentinel://", url):
        return None
    name = "GPUWARDEN_REDIS_URL"
    shown = public_url(url)
    match = _SENTINEL_URL.match(url)
    if match is None:
        raise SettingsError(
            f"{name}={shown!r}: expected redis+sentinel://host:port[,host:port...]/<master name>[/<db>]"
        )
    sentinels = tuple(
        parse_host_port(name, hostport.strip(), "127.0.0.1:26379") for hostport in match["hosts"].split(",")
    )
    db = match["db"] or "0"
    if not db.isdigit():
        raise SettingsError(f"{name}={shown!r}: the database after the master name must be a number, not {db!r}")
    user, password = match["user"], match["password"]
    return SentinelUrl(
        sentinels=sentinels,
        service=unquote(match["service"]),
        db=int(db),
        username=unquote(user) if user else None,
        password=Secret(unquote(password)) if password else None,
        tls=match["scheme"] == "rediss",
    )


@dataclass(frozen=True)
class Settings:
    nats: NatsSettings = field(default_factory=NatsSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    root: str = "gw"
    node: str = ""
    backend: str = "sim"
    http_host: str = "127.0.0.1"
    http_port: int = 0
    http_fd: int = -1
    log_level: str = "INFO"
    config_reread_s: float = 15.0

    @property
    def simulated(self) -> bool:
        return self.backend == "sim"


def public_url(url: str) -> str:
    """``url`` as it may be shown: a password in it (``redis://user:secret@host``) becomes ``***``."""
    return re.sub(r"^([a-z+]+://[^/@:]*:)[^/@]*@", r"\1***@", url)


_HOSTPORT = re.compile(r"^(?P<host>[^:]*|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


def _secret(env: Mapping[str, str], name: str) -> Secret | None:
    if env.get(name):
        return Secret(env[name])
    path = env.get(f"{name}_FILE")
    if path:
        try:
            return Secret(Path(path).read_text().strip())
        except OSError as exc:
            raise SettingsError(f"{name}_FILE={path}: cannot read: {exc.strerror}") from None
    return None


def _file(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise SettingsError(f"{name}={value}: no such file")
    return path


def _tls(env: Mapping[str, str], prefix: str) -> TlsFiles:
    tls = TlsFiles(_file(env, f"{prefix}_CA"), _file(env, f"{prefix}_CERT"), _file(env, f"{prefix}_KEY"))
    if tls.cert and not tls.key:
        raise SettingsError(f"{prefix}_CERT is set but {prefix}_KEY is not: mTLS needs both")
    return tls


def _float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a number") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r}: must be at least {minimum}")
    return value


def env_seconds(
    env: Mapping[str, str],
    name: str,
    default: float,
    *,
    allow_zero: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """A duration setting: a number of seconds, positive (or zero, where zero means "off"), and within
    ``minimum``..``maximum`` where they are given. Every service's ``config.load`` reads its durations here."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a number of seconds") from None
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise SettingsError(f"{name}={raw!r}: expected seconds between {minimum:g} and {maximum:g}")
    if minimum is not None and not (math.isfinite(value) and value >= minimum):
        raise SettingsError(f"{name}={raw!r}: expected at least {minimum:g} seconds")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise SettingsError(f"{name}={raw!r}: must be {'zero or more' if allow_zero else 'positive'}")
    return value


def env_count(env: Mapping[str, str], name: str, default: int, *, minimum: int = 1, maximum: int = 100_000) -> int:
    """A whole number setting (how many at once, how many at most) within ``minimum``..``maximum``."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a whole number") from None
    if not minimum <= value <= maximum:
        raise SettingsError(f"{name}={raw!r}: expected a whole number from {minimum} to {maximum}")
    return value


def env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    """A setting that is one of ``choices`` (case and surrounding blanks ignored); empty or unset is ``default``."""
    value = env.get(name, "").strip().lower() or default
    if value not in choices:
        raise SettingsError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def env_on_off(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A switch: ``on`` or ``off``; empty or unset is ``default``."""
    return env_choice(env, name, ("on", "off"), "on" if default else "off") == "on"


def env_absolute_path(env: Mapping[str, str], name: str, default: str) -> Path:
    """A path that must be absolute; empty or unset is ``default``."""
    raw = env.get(name, "").strip() or default
    if not raw.startswith("/"):
        raise SettingsError(f"{name}={raw!r}: expected an absolute path (e.g. / or /run/nvidia/driver)")
    return Path(raw)


def parse_host_port(name: str, raw: str, example: str = "0.0.0.0:8080") -> tuple[str, int]:
    match = _HOSTPORT.match(raw)
    if not match or int(match["port"]) > 65535:
        raise SettingsError(f"{name}={raw!r}: expected host:port, e.g. {example}")
    return match["host"].strip("[]") or "0.0.0.0", int(match["port"])


def _inbox_prefix(env: Mapping[str, str], root: str, user: str | None, token: bool) -> str:
    """``GPUWARDEN_NATS_INBOX_PREFIX``, or the one the auth callout gives a KV agent proving its pod with a token
    (``_INBOX.<root>-agent-<pod>``, from ``GPUWARDEN_POD_NAME``); empty: ``Bus.connect`` derives it from the user."""
    raw = env.get("GPUWARDEN_NATS_INBOX_PREFIX", "").strip()
    if raw:
        if not re.fullmatch(r"_INBOX\.[A-Za-z0-9_\-]+", raw):
            raise SettingsError(f"GPUWARDEN_NATS_INBOX_PREFIX={raw!r}: expected _INBOX.<one token>")
        return raw
    pod = env.get("GPUWARDEN_POD_NAME", "").strip()
    if user or not token or not pod:
        return ""
    try:
        return inbox_prefix(identity_name(Subjects(root), Identity(AGENT, pod=pod)))
    except ValueError as exc:
        raise SettingsError(f"GPUWARDEN_POD_NAME={pod!r}: {exc}") from None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read every common setting, or raise ``SettingsError`` naming the variable that is wrong."""
    env = os.environ if env is None else env
    servers = tuple(s.strip() for s in env.get("GPUWARDEN_NATS_URL", "nats://127.0.0.1:4222").split(",") if s)
    for server in servers:
        if not re.match(r"^(nats|tls|ws|wss)://", server):
            raise SettingsError(f"GPUWARDEN_NATS_URL={server!r}: expected nats://host:port or tls://host:port")
    redis_url = env.get("GPUWARDEN_REDIS_URL", "redis://127.0.0.1:6379/0")
    if not re.match(r"^(redis|rediss|unix|redis\+sentinel|rediss\+sentinel)://", redis_url):
        raise SettingsError(
            f"GPUWARDEN_REDIS_URL={public_url(redis_url)!r}: expected redis://, rediss://, unix:// or redis+sentinel://"
        )
    sentinel_url(redis_url)  # a malformed Sentinel address is refused here, naming the variable
    backend = env.get("GPUWARDEN_BACKEND", "sim")
    if backend not in ("sim", "real"):
        raise SettingsError(f"GPUWARDEN_BACKEND={backend!r}: expected 'sim' or 'real'")
    level = env.get("GPUWARDEN_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise SettingsError(f"GPUWARDEN_LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING or ERROR")
    host, port = parse_host_port("GPUWARDEN_HTTP_ADDR", env.get("GPUWARDEN_HTTP_ADDR", "127.0.0.1:0"))
    raw_fd = env.get("GPUWARDEN_HTTP_FD", "").strip()
    if raw_fd and not raw_fd.isdigit():
        raise SettingsError(f"GPUWARDEN_HTTP_FD={raw_fd!r}: expected a file descriptor number")
    replicas = int(_float(env, "GPUWARDEN_NATS_REPLICAS", 1, minimum=1))
    root = env.get("GPUWARDEN_ROOT", "gw")
    if not re.match(r"^[A-Za-z][A-Za-z0-9_\-]{0,31}$", root):
        raise SettingsError(f"GPUWARDEN_ROOT={root!r}: a letter, then up to 31 letters, digits, '_' or '-'")
    node = env.get("GPUWARDEN_NODE") or os.uname().nodename.split(".")[0]
    user = env.get("GPUWARDEN_NATS_USER") or None
    token = _secret(env, "GPUWARDEN_NATS_TOKEN")
    return Settings(
        nats=NatsSettings(
            servers=servers,
            user=user,
            password=_secret(env, "GPUWARDEN_NATS_PASSWORD"),
            token=token,
            token_file=_file(env, "GPUWARDEN_NATS_TOKEN_FILE") if not env.get("GPUWARDEN_NATS_TOKEN") else None,
            nkey_seed_file=_file(env, "GPUWARDEN_NATS_NKEY_SEED_FILE"),
            creds_file=_file(env, "GPUWARDEN_NATS_CREDS_FILE"),
            tls=_tls(env, "GPUWARDEN_NATS_TLS"),
            replicas=replicas,
            inbox_prefix=_inbox_prefix(env, root, user, token is not None),
        ),
        redis=RedisSettings(
            url=redis_url,
            username=env.get("GPUWARDEN_REDIS_USERNAME") or None,
            password=_secret(env, "GPUWARDEN_REDIS_PASSWORD"),
            tls=_tls(env, "GPUWARDEN_REDIS_TLS"),
            sentinel_password=_secret(env, "GPUWARDEN_REDIS_SENTINEL_PASSWORD"),
        ),
        root=root,
        node=node,
        backend=backend,
        http_host=host,
        http_port=port,
        http_fd=int(raw_fd) if raw_fd else -1,
        log_level=level,
        config_reread_s=_float(env, "GPUWARDEN_CONFIG_REREAD_S", 15.0, minimum=0.1),
    )
