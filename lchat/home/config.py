"""The home service's settings (docs/home.md): an env file, then the environment, then flags —
the router's order and file syntax (:func:`lchat.config.read_env_file`).

Misconfiguration fails at boot with one :class:`lchat.config.ConfigError` naming the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Literal
from urllib.parse import urlsplit

from attrs import field, frozen

from lchat.config import ConfigError, read_env_file
from lchat.home.limits import DEFAULT_MAX_KEYS, NAMES, IPNetwork, Rate, parse_trusted
from lchat.objstore.where import Where

DEFAULT_ENV_FILE = "/data/home.env"

DEFAULTS: dict[str, str] = {
    "LCHAT_DATA_DIR": "/data",
    "LCHAT_RUN_DIR": "/run/lchat",
    "LCHAT_HOME_SOCKET": "",  # <run>/home.sock: the router proxies home.<domain> here
    "LCHAT_HOME_ADMIN_SOCKET": "",  # <run>/home-admin.sock: /status and /metrics
    "LCHAT_HOME_TCP": "",  # HOST:PORT: also listen on TCP (a stand-alone replica)
    "LCHAT_HOME_STORE": "",  # "" or sqlite (the default, forever), or s3
    "LCHAT_HOME_DB": "",  # <data>/home.db
    "LCHAT_HOME_S3_BUCKET": "",
    "LCHAT_HOME_S3_REGION": "",
    "LCHAT_HOME_S3_PREFIX": "",
    "LCHAT_HOME_S3_ENDPOINT": "",  # path-style, for S3-compatible stores
    "LCHAT_HOME_SESSION_KEY": "",  # base64 of >= 32 bytes; unset: ephemeral, with a warning
    "LCHAT_HOME_SESSION_KEY_ACCEPT": "",  # during a rotation: opens proofs/sessions, never makes
    "LCHAT_HOME_ORIGINS": "https://home.localhost",  # the WebAuthn origins the browser reports
    "LCHAT_HOME_RP_ID": "",  # the WebAuthn relying party id (default: the first origin's host)
    "LCHAT_HOME_RP_NAME": "lchat",  # shown by the browser's passkey dialogs
    # Seconds between two reads of the revocation feed: the revocation window across replicas.
    "LCHAT_HOME_REVOCATION_POLL": "5",
    # Rate limits (lchat.home.limits, docs/home.md "Limits"): COUNT/SECONDS, a bucket of COUNT
    # refilled over SECONDS; 0 turns one off.
    "LCHAT_HOME_LIMIT_IP": "300/60",  # every request, per client address
    "LCHAT_HOME_LIMIT_FAILURES_IP": "30/600",  # 401s per client address, then 429
    "LCHAT_HOME_LIMIT_REGISTER_IP": "10/3600",  # registrations per client address
    "LCHAT_HOME_LIMIT_REGISTER": "1000/3600",  # registrations, all addresses together
    "LCHAT_HOME_LIMIT_ACCOUNT": "600/60",  # authenticated requests per account
    "LCHAT_HOME_LIMIT_VAULT_WRITES": "120/3600",  # vault writes per account
    "LCHAT_HOME_LIMIT_MINTS": "10/3600",  # link tokens minted per account
    "LCHAT_HOME_LIMIT_REVOCATIONS": "20/86400",  # devices revoked per account
    "LCHAT_HOME_LIMIT_KEYS": "100000",  # keys (addresses, accounts) each limit tracks at most
    "LCHAT_HOME_TRUSTED_PROXIES": "",  # TCP peers whose last X-Forwarded-For entry is believed
    # Quotas.
    "LCHAT_HOME_MAX_DEVICES": "20",  # linked devices per account
    "LCHAT_HOME_VAULT_MAX": "18432",  # bytes of one vault (stored padded to this size)
    # Seconds a step-up (a fresh passkey assertion for one destructive change) stays good.
    "LCHAT_HOME_STEP_UP_WINDOW": "300",
}
REVOCATION_POLL_MAX = 300.0
MAX_DEVICES_CEILING = 200  # a user document stays small (lchat.home.store.MAX_USER_DOC)
VAULT_MAX_CEILING = 60 * 1024  # the vault and its request must fit the 64 KiB body cap

_ADDR = re.compile(r"(?:(\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:.]+\]|localhost)?:)?(\d{1,5})")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@frozen
class HomeConfig:
    env_file: str
    data_dir: str
    run_dir: str
    socket: str
    admin_socket: str
    tcp: tuple[str, int] | None
    store: Literal["sqlite", "s3"]
    db: str
    s3: Where | None  # LCHAT_HOME_S3_*: an S3 bucket, never file:
    session_key: str = field(repr=False)
    origins: tuple[str, ...]
    rp_id: str
    rp_name: str
    revocation_poll: float = 5.0
    rates: Mapping[str, Rate] = field(factory=dict)  # lchat.home.limits.NAMES -> rate; absent: off
    limit_keys: int = DEFAULT_MAX_KEYS
    trusted_proxies: tuple[IPNetwork, ...] = ()
    max_devices: int = 20
    vault_max: int = 18 * 1024
    step_up_window: float = 300.0
    # LCHAT_HOME_SESSION_KEY_ACCEPT (lchat.home.stateless.load_session_keys checks it): "" = none.
    session_key_accept: str = field(default="", repr=False)
    file_env: Mapping[str, str] = field(factory=dict, repr=False)

    @property
    def aws_env(self) -> dict[str, str]:
        """The env file's ``AWS_*`` values (the process environment wins over them)."""
        return {k: v for k, v in self.file_env.items() if k.startswith("AWS_")}


def load(
    env_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, str | None] | None = None,
) -> HomeConfig:
    environ = os.environ if environ is None else environ
    path = env_file if env_file is not None else DEFAULT_ENV_FILE
    file_env = read_env_file(path, must_exist=env_file is not None)
    merged: dict[str, str] = {}
    for source in (file_env, environ, {k: v for k, v in (flags or {}).items() if v is not None}):
        merged.update({k: v for k, v in source.items() if k.startswith("LCHAT_")})

    def get(name: str) -> str:
        return merged.get(name, DEFAULTS[name]).strip()

    data_dir, run_dir = get("LCHAT_DATA_DIR"), get("LCHAT_RUN_DIR")
    for name, value in (("LCHAT_DATA_DIR", data_dir), ("LCHAT_RUN_DIR", run_dir)):
        if not os.path.isabs(value):
            raise ConfigError(f"{name}={value!r} must be an absolute path")
    socket = get("LCHAT_HOME_SOCKET") or os.path.join(run_dir, "home.sock")
    admin_socket = get("LCHAT_HOME_ADMIN_SOCKET") or os.path.join(run_dir, "home-admin.sock")
    for name, value in (("LCHAT_HOME_SOCKET", socket), ("LCHAT_HOME_ADMIN_SOCKET", admin_socket)):
        if not os.path.isabs(value) or len(value.encode()) > 107:
            raise ConfigError(f"{name}={value!r} must be an absolute path of at most 107 bytes")
    if socket == admin_socket:
        raise ConfigError("LCHAT_HOME_SOCKET and LCHAT_HOME_ADMIN_SOCKET must differ")
    tcp = _tcp(get("LCHAT_HOME_TCP"))
    store = get("LCHAT_HOME_STORE").lower() or "sqlite"
    if store not in ("sqlite", "s3"):
        raise ConfigError(f"LCHAT_HOME_STORE={store!r}: sqlite (the default) or s3")
    db = get("LCHAT_HOME_DB") or os.path.join(data_dir, "home.db")
    if not os.path.isabs(db):
        raise ConfigError(f"LCHAT_HOME_DB={db!r} must be an absolute path")
    s3 = _s3(get) if store == "s3" else None
    origins = _origins(get("LCHAT_HOME_ORIGINS"))
    rp_id = (get("LCHAT_HOME_RP_ID") or (urlsplit(origins[0]).hostname or "")).lower()
    for origin in origins:
        host = (urlsplit(origin).hostname or "").lower()
        if host != rp_id and not host.endswith("." + rp_id):
            raise ConfigError(
                f"LCHAT_HOME_RP_ID={rp_id!r} is not {host!r} or a parent domain of it (origin "
                f"{origin}): browsers refuse passkeys for such a pair"
            )
    return HomeConfig(
        env_file=path,
        data_dir=data_dir,
        run_dir=run_dir,
        socket=socket,
        admin_socket=admin_socket,
        tcp=tcp,
        store="s3" if store == "s3" else "sqlite",
        db=db,
        s3=s3,
        session_key=get("LCHAT_HOME_SESSION_KEY"),
        session_key_accept=get("LCHAT_HOME_SESSION_KEY_ACCEPT"),
        origins=origins,
        rp_id=rp_id,
        rp_name=get("LCHAT_HOME_RP_NAME") or "lchat",
        revocation_poll=_poll(get("LCHAT_HOME_REVOCATION_POLL")),
        rates={name: _rate(f"LCHAT_HOME_LIMIT_{name.upper()}", get) for name in NAMES},
        limit_keys=_int(get, "LCHAT_HOME_LIMIT_KEYS", 100, 10_000_000),
        trusted_proxies=_trusted(get("LCHAT_HOME_TRUSTED_PROXIES")),
        max_devices=_int(get, "LCHAT_HOME_MAX_DEVICES", 1, MAX_DEVICES_CEILING),
        vault_max=_int(get, "LCHAT_HOME_VAULT_MAX", 1024, VAULT_MAX_CEILING),
        step_up_window=float(_int(get, "LCHAT_HOME_STEP_UP_WINDOW", 30, 900)),
        file_env=file_env,
    )


def _poll(text: str) -> float:
    try:
        seconds = float(text or DEFAULTS["LCHAT_HOME_REVOCATION_POLL"])
    except ValueError:
        seconds = -1.0
    if not 0.1 <= seconds <= REVOCATION_POLL_MAX:
        raise ConfigError(
            f"LCHAT_HOME_REVOCATION_POLL={text!r}: seconds between reads of the revocation feed, "
            f"0.1 to {REVOCATION_POLL_MAX:g} (the revocation window across replicas; default 5)"
        )
    return seconds


def _rate(name: str, get: Callable[[str], str]) -> Rate:
    text = get(name) or DEFAULTS[name]
    count, _, seconds = text.partition("/")
    try:
        rate = Rate(int(count), float(seconds or 1))
    except ValueError:
        rate = Rate(-1, 0)
    if text.strip() == "0":
        return Rate(0, 1)
    if not (0 < rate.count <= 1_000_000 and 0 < rate.seconds <= 7 * 86400):
        raise ConfigError(
            f"{name}={text!r}: COUNT/SECONDS (a bucket of COUNT requests refilled over SECONDS, "
            f"e.g. {DEFAULTS[name]}), or 0 to turn the limit off"
        )
    return rate


def _int(get: Callable[[str], str], name: str, low: int, high: int) -> int:
    text = get(name) or DEFAULTS[name]
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ConfigError(f"{name}={text!r}: a whole number from {low} to {high}")
    return value


def _trusted(text: str) -> tuple[IPNetwork, ...]:
    try:
        return parse_trusted(text)
    except ValueError as e:
        raise ConfigError(
            f"LCHAT_HOME_TRUSTED_PROXIES={text!r}: comma-separated addresses or networks ({e})"
        ) from e


def _tcp(text: str) -> tuple[str, int] | None:
    if not text or text.lower() == "off":
        return None
    match = _ADDR.fullmatch(text)
    port = int(match.group(2)) if match else 0
    if match is None or not 0 < port < 65536:
        raise ConfigError(f"LCHAT_HOME_TCP={text!r} is not HOST:PORT or :PORT")
    return ((match.group(1) or "127.0.0.1").strip("[]"), port)


def _s3(get: Callable[[str], str]) -> Where:
    bucket, region = get("LCHAT_HOME_S3_BUCKET"), get("LCHAT_HOME_S3_REGION")
    if not bucket or not region:
        raise ConfigError(
            "LCHAT_HOME_STORE=s3 needs LCHAT_HOME_S3_BUCKET and LCHAT_HOME_S3_REGION (and AWS "
            "credentials by the standard chain)"
        )
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(f"LCHAT_HOME_S3_BUCKET={bucket!r} is not an S3 bucket name")
    endpoint = get("LCHAT_HOME_S3_ENDPOINT").rstrip("/")
    if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
        raise ConfigError(f"LCHAT_HOME_S3_ENDPOINT={endpoint!r} must be an http(s) URL")
    prefix = get("LCHAT_HOME_S3_PREFIX").strip("/")
    return Where(bucket, prefix, s3_region=region, endpoint=endpoint)


def _origins(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if not origins:
        raise ConfigError("LCHAT_HOME_ORIGINS is empty: name the origin(s) of the home pages")
    for origin in origins:
        parts = urlsplit(origin)
        if parts.scheme not in ("https", "http") or not parts.hostname or parts.path:
            raise ConfigError(
                f"LCHAT_HOME_ORIGINS: {origin!r} is not an origin (https://host[:port])"
            )
        if parts.scheme == "http" and parts.hostname not in ("localhost", "127.0.0.1"):
            raise ConfigError(
                f"LCHAT_HOME_ORIGINS: {origin!r}: browsers allow passkeys over http only on "
                f"localhost"
            )
    return origins
