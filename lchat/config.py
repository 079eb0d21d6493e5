"""BoxConfig: ``router.env`` + the process environment + twistd flags -> validated, typed settings.

Precedence, lowest first: the env file (``--env-file``, default ``/data/router.env``; absent is fine
unless named explicitly), the process environment, command-line flags. Anything wrong fails here, at
boot, with a message naming the variable (docs/design.md §10, invariant 7). Secrets never appear in a repr.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import re
import shlex
import shutil
import socket
from collections.abc import Callable, Mapping
from typing import Literal, cast
from urllib.parse import urlsplit

from attrs import field, frozen
from twisted.internet.endpoints import serverFromString

from lchat import builds, hosts
from lchat.objstore.where import Where, file_bucket, parse_where

DEFAULT_ENV_FILE = "/data/router.env"

Units = Literal["systemd", "builtin"]
Isolation = Literal["auto", "on", "off"]
Replication = Literal["stream", "batched", "daily"]
_Getter = Callable[[str], str]
_NO_REACTOR = object()  # what an endpoint string is parsed with, to check it (never used)


class ConfigError(ValueError):
    """A setting that cannot be used. The message names the variable."""


@frozen
class HibernateConfig:
    bucket: str
    region: str
    prefix: str
    endpoint: str
    idle: float  # seconds with nothing in flight before a space sleeps
    lease_ttl: float = 900.0  # a space's lease lives this long unless renewed (renewed at a third)
    sweep: float = 5.0  # the idle sweep's period
    due_sweep: float = 30.0  # the due-wake sweep's period (worst-case lateness of a due wake)

    @property
    def where(self) -> Where:
        """The bucket as one value (``region`` is its S3 signing region)."""
        return Where(self.bucket, self.prefix, self.region, self.endpoint)

    def key(self, *parts: str) -> str:
        """An object key under the configured prefix."""
        return self.where.key(*parts)


@frozen
class BackupConfig:
    """The router's own backup of every database it does not hibernate (docs/backup.md)."""

    bucket: str
    region: str
    prefix: str
    endpoint: str
    box: str  # this box's segment: <prefix>/<box>/<database name>/
    interval: float = 10.0  # the longest a commit waits before it is in the backup
    extra: tuple[str, ...] = ()  # globs under the data dir: more databases to back up
    # AES-256 key for the spaces' env files (their secrets) in the backup; b"": not backed up.
    env_key: bytes = field(default=b"", repr=False)

    @property
    def where(self) -> Where:
        """The bucket as one value (``region`` is its S3 signing region)."""
        return Where(self.bucket, self.prefix, self.region, self.endpoint)

    def key(self, *parts: str) -> str:
        """An object key under the configured prefix."""
        return self.where.key(*parts)


MIN_MESH_TOKEN = 32  # characters of LCHAT_MESH_TOKEN (and _ACCEPT): `openssl rand -hex 32` has 64


@frozen
class MeshConfig:
    self_url: str
    domains: tuple[str, ...]
    token: str = field(repr=False)
    region: str
    heartbeat: float = 15.0  # seconds between this box's heartbeat PUTs
    dead_after: float = 45.0  # a member whose heartbeat is older (bucket clock) is gone
    ca_file: str = ""  # extra CA bundle trusted for peers' certificates ("" = system trust)
    # LCHAT_MESH_BUCKET: where the heartbeats live when it is not the hibernation bucket (a fleet
    # whose regions keep their replicas in different buckets still needs one membership).
    bucket: Where | None = None
    # LCHAT_MESH_TOKEN_ACCEPT: one more token this box accepts (bearer and forwarded marker) but
    # never sends, for a rotation without refusals (lchat.mesh.tokens, docs/secrets.md); "": none.
    accept_token: str = field(default="", repr=False)
    # LCHAT_MESH_OUTAGE_TOLERANCE: the longest this box keeps its spaces on its peers' word alone,
    # no heartbeat of it landing in the bucket (a bucket outage: docs/lease.md, "Witnesses").
    outage_tolerance: float = 900.0

    @property
    def self_host(self) -> str:
        """The hostname of ``self_url``: requests addressed to it are for this box's mesh API."""
        return (urlsplit(self.self_url).hostname or "").lower()


LETS_ENCRYPT = "https://acme-v02.api.letsencrypt.org/directory"
LETS_ENCRYPT_STAGING = "https://acme-staging-v02.api.letsencrypt.org/directory"
DNSIMPLE_URL = "https://api.dnsimple.com"
DNSProvider = Literal["dnsimple", "route53"]
MAX_DNS_TIMEOUT = 300.0
CertCache = Literal["dir", "s3"]


@frozen
class AcmeConfig:
    """Certificate issuance (``LCHAT_ACME_DIRECTORY`` not ``off``)."""

    directory: str  # the ACME directory URL
    email: str = ""  # account contact (optional)
    ca_file: str = ""  # CA bundle for the directory's own TLS ("" = system trust)
    dns_provider: DNSProvider = "dnsimple"
    dnsimple_token: str = field(default="", repr=False)
    dnsimple_url: str = DNSIMPLE_URL
    dnsimple_account: str = ""  # needed only with a user token (an account token names its own)
    route53_zone_id: str = ""
    route53_endpoint: str = ""
    dns_resolvers: tuple[tuple[str, int], ...] = ()  # () = the system's resolver
    dns_timeout: float = 120.0  # how long to wait for a TXT record to be visible


@frozen
class ProxyConfig:
    """Limits and timeouts of the front door (seconds and bytes)."""

    dial_retry: float = 13.0  # keep retrying a refused/missing socket this long (space restarts)
    header_timeout: float = 10.0  # a request head must arrive within this (slowloris)
    keepalive_timeout: float = 60.0  # an idle client connection is closed after this
    upstream_timeout: float = 300.0  # the space must start answering within this (long polls)
    # A client's buffered output that has not moved for this long: the connection is aborted
    # (a client that stopped reading; also bounds a close waiting on a full buffer).
    send_timeout: float = 60.0
    # Pipelined requests queued behind the one being served; the last one allowed is answered
    # with "Connection: close" and nothing after it is read (with the output high-water mark,
    # this bounds what one connection can make the router hold).
    max_pipelined: int = 100
    # At shutdown, how long requests in flight may take before their connections are aborted
    # (longer than the activator's wait for a sleeping space's requests, Budgets.requests).
    drain_grace: float = 15.0
    # How long a TLS handshake for a host with no certificate yet waits while ACME issues one
    # (on-demand issuance on): its first visitor gets a valid certificate. 0: never wait.
    first_contact_wait: float = 10.0
    max_header_bytes: int = 65536  # request line + headers; over it -> 431
    max_headers: int = 100  # header count; over it -> 431
    # An upgraded (101) tunnel that carried no byte either way for this long is closed, both
    # sides (a WebSocket that pings every minute or so is never idle this long).
    tunnel_idle_timeout: float = 600.0
    # The most request body bytes one request may carry: a larger Content-Length is answered 413
    # before anything is sent upstream; a chunked body that grows past it is cut off (413 when its
    # response has not started, else the connection is aborted), and a space never receives more
    # than this. 0 = no limit (as nginx's client_max_body_size 0).
    max_body: int = 100 * 1024 * 1024
    access_log: bool = False  # one structured log line per request


@frozen
class BoxConfig:
    env_file: str
    data_dir: str
    run_dir: str
    registry: str
    acme_cache: str
    cert_cache: CertCache
    https_addr: str | None  # a Twisted server endpoint string; None = not listening
    http_addr: str | None
    fallback_url: str
    units: Units
    space_command: tuple[str, ...]
    sidecar_command: tuple[str, ...]
    hibernate: HibernateConfig | None
    mesh: MeshConfig | None
    wildcard_domains: tuple[str, ...]
    proxy: ProxyConfig = ProxyConfig()
    metrics_addr: str | None = None  # optional TCP endpoint serving /metrics
    http_redirect: bool = True  # with HTTPS on, plain HTTP answers 301 (else it proxies too)
    acme: AcmeConfig | None = None  # None: no issuance, the cache is served as it is
    backup: BackupConfig | None = None  # None: no fleet backup (LCHAT_BACKUP_BUCKET unset)
    cert_cache_key: bytes = field(default=b"", repr=False)  # AES-256 key for keys in the bucket
    # LCHAT_CERT_CACHE_KEY_PREVIOUS: the key being rotated away from: entries sealed with it are
    # still read, and re-sealed with cert_cache_key (lchat.acme.cache); b"": none.
    cert_cache_previous_key: bytes = field(default=b"", repr=False)
    cert_cache_sync: float = 60.0  # how often the shared cache is listed for new certificates
    # LCHAT_MAX_INSTANCES: resident space processes (always-on and awake hibernating together);
    # LCHAT_MAX_REGISTERED: instance rows add-instance accepts. 0 = no limit (docs/hibernation.md).
    max_instances: int = 40
    max_registered: int = 400
    # LCHAT_CLOUD_REGION: add-instance's default --home-region; LCHAT_CLOUD_ID_LEDGER: the shared
    # id counter add-instance --mint draws from (None: this box's own count). docs/mesh.md.
    cloud_region: str = ""
    id_ledger: Where | None = None
    # LCHAT_REGION_BUCKETS: each mesh region's hibernation bucket by its label, sorted (lchat
    # relocate); empty: one shared.
    region_buckets: Mapping[str, Where] = field(factory=dict)
    # LCHAT_ISOLATION: every space its own user (lchat/isolation.py, docs/secrets.md); auto: when
    # the router has the privilege for it. LCHAT_SPACE_UIDS: the uids spaces are given.
    isolation: Isolation = "auto"
    space_uids: tuple[int, int] = (40000, 59999)
    warnings: tuple[str, ...] = ()
    file_env: Mapping[str, str] = field(factory=dict, repr=False)
    # The environment the box's tools and bucket openers read: the env file's values, then the
    # process environment (load's ``environ``, as it was at load) winning. Merged once, here.
    env: Mapping[str, str] = field(factory=dict, repr=False)

    @property
    def aws_env(self) -> dict[str, str]:
        """``AWS_*`` from the env file: the seeds put the bucket's credentials there (the process
        environment, where the S3 client's credential chain looks, still wins)."""
        return {k: v for k, v in self.file_env.items() if k.startswith("AWS_")}

    @property
    def box_id(self) -> str:
        """Who this box is, in leases and probes: its mesh URL (normalised, so a respelling of
        LCHAT_MESH_SELF still recognises its own leases), else its hostname."""
        if self.mesh is not None:
            return hosts.normalise_member_url(self.mesh.self_url)
        return socket.gethostname()

    @property
    def admin_socket(self) -> str:
        """The admin API's unix socket (mode 0600): how the CLI reaches the running router."""
        return os.path.join(self.run_dir, "router.sock")

    # moved to lchat.builds.space_argv: importers outside configuration still use this (the
    # settings hold the command; which build runs it is the build tree's, read from the disk)
    def space_argv(self, host: str) -> list[str]:
        return builds.space_argv(self.space_command, host)

    def sidecar_argv(self, host: str) -> list[str]:
        return builds.space_argv(self.sidecar_command, host, sidecar=True)


# Every variable we read, with its default. Names not listed here but starting LCHAT_ get a warning.
DEFAULTS: dict[str, str] = {
    "LCHAT_DATA_DIR": "/data",
    "LCHAT_RUN_DIR": "/run/lchat",
    "LCHAT_REGISTRY": "",  # default: <data>/registry.db
    "LCHAT_ACME_CACHE": "",  # default: <data>/acme
    "LCHAT_CERT_CACHE": "dir",
    "LCHAT_CERT_CACHE_KEY": "",
    "LCHAT_CERT_CACHE_KEY_PREVIOUS": "",  # during a key rotation: read (and re-sealed), never written
    "LCHAT_CERT_CACHE_SYNC": "1m",
    "LCHAT_ACME_DIRECTORY": LETS_ENCRYPT,
    "LCHAT_ACME_EMAIL": "",
    "LCHAT_ACME_CA_FILE": "",
    "LCHAT_DNS_PROVIDER": "dnsimple",
    "LCHAT_DNSIMPLE_TOKEN": "",
    "LCHAT_DNSIMPLE_URL": DNSIMPLE_URL,
    "LCHAT_DNSIMPLE_ACCOUNT": "",
    "LCHAT_ROUTE53_ZONE_ID": "",
    "LCHAT_ROUTE53_ENDPOINT": "",
    "LCHAT_DNS_RESOLVERS": "",
    "LCHAT_DNS_PROPAGATION_TIMEOUT": "2m",
    "LCHAT_HTTPS_ADDR": ":443",
    "LCHAT_HTTP_ADDR": ":80",
    "LCHAT_FALLBACK_URL": "",
    "LCHAT_UNITS": "auto",
    "LCHAT_ISOLATION": "auto",
    "LCHAT_SPACE_UIDS": "40000-59999",
    "LCHAT_SPACE_COMMAND": "/opt/lchat/live/{host}",
    "LCHAT_HIBERNATE_BUCKET": "",
    "LCHAT_HIBERNATE_REGION": "",
    "LCHAT_HIBERNATE_PREFIX": "",
    "LCHAT_HIBERNATE_ENDPOINT": "",
    "LCHAT_HIBERNATE_IDLE": "15m",
    # "": 15m off a mesh; 2h on a mesh box, whose leases its heartbeat fences (docs/lease.md).
    "LCHAT_LEASE_TTL": "",
    "LCHAT_HIBERNATE_SWEEP": "5s",
    "LCHAT_DUE_SWEEP": "30s",
    "LCHAT_MAX_INSTANCES": "40",  # resident space processes (0 = no limit)
    "LCHAT_MAX_REGISTERED": "",  # instance rows add-instance accepts (default: 10 x the above)
    "LCHAT_SIDECAR_COMMAND": "/opt/lchat/live/{host}-bot",
    "LCHAT_BACKUP_CONFIG": "/etc/litestream.yml",  # an external Litestream's (CLI; absent = none)
    "LCHAT_BACKUP_BUCKET": "",  # the router's own fleet backup (absent = none)
    "LCHAT_BACKUP_REGION": "",
    "LCHAT_BACKUP_PREFIX": "",
    "LCHAT_BACKUP_ENDPOINT": "",
    "LCHAT_BACKUP_BOX": "",  # this box's segment of the layout (default: its host name)
    "LCHAT_BACKUP_INTERVAL": "10s",
    "LCHAT_BACKUP_EXTRA": "",
    "LCHAT_BACKUP_KEY": "",  # AES-256 (base64) for the spaces' env files; unset: not backed up
    "LCHAT_MESH_SELF": "",
    "LCHAT_MESH_DOMAINS": "",
    "LCHAT_MESH_TOKEN": "",
    "LCHAT_MESH_TOKEN_ACCEPT": "",  # during a token rotation: accepted too, never sent
    "LCHAT_MESH_REGION": "",
    "LCHAT_MESH_HEARTBEAT": "15s",
    "LCHAT_MESH_DEAD_AFTER": "45s",
    "LCHAT_MESH_OUTAGE_TOLERANCE": "15m",
    "LCHAT_MESH_CA_FILE": "",
    "LCHAT_MESH_BUCKET": "",  # s3://BUCKET[/PREFIX][?...]: the heartbeats' own bucket
    "LCHAT_CLOUD_REGION": "",  # add-instance's default --home-region
    "LCHAT_CLOUD_ID_LEDGER": "",  # s3://BUCKET[/PREFIX][?region=&endpoint=] or file:PATH
    "LCHAT_REGION_BUCKETS": "",  # REGION=s3://BUCKET[/PREFIX][?...],... (lchat relocate)
    "LCHAT_WILDCARD_DOMAINS": "",
    "LCHAT_METRICS_ADDR": "off",
    "LCHAT_HTTP_REDIRECT": "on",
    "LCHAT_DIAL_RETRY": "13s",
    "LCHAT_HEADER_TIMEOUT": "10s",
    "LCHAT_KEEPALIVE_TIMEOUT": "60s",
    "LCHAT_UPSTREAM_TIMEOUT": "5m",
    "LCHAT_SEND_TIMEOUT": "60s",
    "LCHAT_MAX_HEADER_BYTES": "65536",
    "LCHAT_MAX_HEADERS": "100",
    "LCHAT_TUNNEL_IDLE_TIMEOUT": "10m",
    "LCHAT_MAX_BODY": "100MiB",
    "LCHAT_TLS_FIRST_CONTACT_WAIT": "10s",
    "LCHAT_ACCESS_LOG": "off",
}

# Names that belong to a space's own environment or to tools beside us; never warned about.
_NOT_OURS = frozenset(
    {
        "LCHAT_HOST",
        "LCHAT_SOCKET",
        "LCHAT_DB",
        "LCHAT_ADMIN_TOKEN",
        "LCHAT_BOT_TOKEN",
        "LCHAT_BOT_EVERY",
        "LCHAT_BOT_ROOM",
        "LCHAT_BOT_MESSAGE",
        "LCHAT_BOT_LISTEN",
        "LCHAT_SIDECAR_URL",
        "LCHAT_BUILD",
        # The build tree and the release feed: read by lchat/release/settings.py (the CLI's
        # `release`, `deploy`, `rollback`, `fleet`), and LCHAT_OPT_DIR below for the commands'
        # defaults.
        "LCHAT_OPT_DIR",
        "LCHAT_RELEASE_URL",
        "LCHAT_RELEASE_MIRROR_URL",
        "LCHAT_RELEASE_PUBKEY",
    }
)


def load(
    env_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, str | None] | None = None,
    systemd_present: bool | None = None,
) -> BoxConfig:
    """Build the box's settings. ``flags`` maps variable names to values given on the command line."""
    environ = os.environ if environ is None else environ
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    explicit = env_file is not None
    path = env_file if env_file is not None else DEFAULT_ENV_FILE
    file_env = read_env_file(path, must_exist=explicit)

    merged: dict[str, str] = {}
    for source in (file_env, environ, given):
        merged.update({k: v for k, v in source.items() if k.startswith("LCHAT_")})

    def get(name: str) -> str:
        return merged.get(name, DEFAULTS[name]).strip()

    warnings = tuple(
        f"unknown variable {name} is ignored"
        for name in sorted(merged)
        if name not in DEFAULTS and name not in _NOT_OURS
    )

    data_dir = _directory("LCHAT_DATA_DIR", get("LCHAT_DATA_DIR"))
    run_dir = _directory("LCHAT_RUN_DIR", get("LCHAT_RUN_DIR"))
    registry = get("LCHAT_REGISTRY") or os.path.join(data_dir, "registry.db")
    acme_cache = get("LCHAT_ACME_CACHE") or os.path.join(data_dir, "acme")
    registry = _directory("LCHAT_REGISTRY", registry)
    acme_cache = _directory("LCHAT_ACME_CACHE", acme_cache)

    cert_cache = _cert_cache(get("LCHAT_CERT_CACHE"))
    cert_cache_key = cert_cache_previous_key = b""
    if cert_cache == "s3":
        if not get("LCHAT_HIBERNATE_BUCKET"):
            raise ConfigError(
                "LCHAT_CERT_CACHE=s3 keeps certificates in the hibernation bucket: set "
                "LCHAT_HIBERNATE_BUCKET"
            )
        cert_cache_key = _cert_cache_key(get("LCHAT_CERT_CACHE_KEY"))
        cert_cache_previous_key, previous_warning = _cert_cache_previous_key(
            get("LCHAT_CERT_CACHE_KEY_PREVIOUS"), cert_cache_key
        )
        warnings += previous_warning
    cert_cache_sync = parse_duration("LCHAT_CERT_CACHE_SYNC", get("LCHAT_CERT_CACHE_SYNC"))
    if cert_cache_sync <= 0:
        raise ConfigError("LCHAT_CERT_CACHE_SYNC must be a positive duration")
    wildcard_domains = _domains("LCHAT_WILDCARD_DOMAINS", get("LCHAT_WILDCARD_DOMAINS"))
    acme = _acme(get, wildcard_domains)
    hibernate = _hibernate(get)
    mesh = _mesh(get)
    if mesh is not None and get("LCHAT_MESH_TOKEN_ACCEPT") == mesh.token:
        warnings += (
            "LCHAT_MESH_TOKEN_ACCEPT equals LCHAT_MESH_TOKEN: it adds nothing (mid-rotation, it "
            "should hold the other value; after it, remove the line)",
        )
    if (
        mesh is not None
        and hibernate is not None
        and hibernate.lease_ttl < 2 * mesh.outage_tolerance
    ):
        warnings += (
            f"LCHAT_LEASE_TTL={hibernate.lease_ttl:g}s is shorter than twice "
            f"LCHAT_MESH_OUTAGE_TOLERANCE={mesh.outage_tolerance:g}s: during an outage of the "
            "bucket, a space's lease can expire before the tolerance is over, and its box stands "
            "it down then (docs/lease.md, Settings)",
        )
    max_instances, max_registered = _capacity(get)
    cloud_region, id_ledger = _cloud(get)

    cfg = BoxConfig(
        env_file=path,
        data_dir=data_dir,
        run_dir=run_dir,
        registry=os.path.abspath(registry),
        acme_cache=os.path.abspath(acme_cache),
        cert_cache=cert_cache,
        cert_cache_key=cert_cache_key,
        cert_cache_previous_key=cert_cache_previous_key,
        cert_cache_sync=cert_cache_sync,
        acme=acme,
        https_addr=parse_address("LCHAT_HTTPS_ADDR", get("LCHAT_HTTPS_ADDR")),
        http_addr=parse_address("LCHAT_HTTP_ADDR", get("LCHAT_HTTP_ADDR")),
        fallback_url=_fallback_url(get("LCHAT_FALLBACK_URL")),
        units=_units(get("LCHAT_UNITS"), systemd_present),
        isolation=_isolation(get("LCHAT_ISOLATION")),
        space_uids=_uid_range(get("LCHAT_SPACE_UIDS")),
        space_command=_space_command(_under_opt(merged, "LCHAT_SPACE_COMMAND")),
        sidecar_command=_space_command(
            _under_opt(merged, "LCHAT_SIDECAR_COMMAND"), "LCHAT_SIDECAR_COMMAND"
        ),
        hibernate=hibernate,
        mesh=mesh,
        backup=_backup(get, hibernate, mesh),
        wildcard_domains=wildcard_domains,
        proxy=_proxy(get),
        metrics_addr=parse_address("LCHAT_METRICS_ADDR", get("LCHAT_METRICS_ADDR")),
        http_redirect=_switch("LCHAT_HTTP_REDIRECT", get("LCHAT_HTTP_REDIRECT")),
        warnings=warnings,
        file_env=file_env,
        env={**file_env, **environ},
        max_instances=max_instances,
        max_registered=max_registered,
        cloud_region=cloud_region,
        id_ledger=id_ledger,
        region_buckets=_region_buckets(get, hibernate, mesh),
    )
    if (
        cfg.mesh is not None
        and cfg.mesh.self_url.startswith("http://")
        and cfg.https_addr is not None
        and cfg.http_redirect
    ):
        raise ConfigError(
            f"LCHAT_MESH_SELF={cfg.mesh.self_url} is plain http, but LCHAT_HTTP_REDIRECT=on "
            f"answers plain http with a redirect: peers could not reach this box. Use an https "
            f"LCHAT_MESH_SELF, or LCHAT_HTTP_REDIRECT=off"
        )
    return cfg


def read_env_file(path: str, must_exist: bool = False) -> dict[str, str]:
    """Parse a systemd-style ``KEY=VALUE`` file: comments, blank lines, ``export``, quotes.

    An unquoted value ends at `` #`` (the seeds write inline comments). A line that is not an
    assignment is an error naming the file and line: a typo must not silently drop a setting.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        if must_exist:
            raise ConfigError(f"--env-file {path}: no such file") from None
        return {}
    except OSError as e:
        raise ConfigError(f"--env-file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"--env-file {path}: not UTF-8 text") from e
    except ValueError as e:  # a NUL byte in the path
        raise ConfigError(f"--env-file {path!r}: {e}") from e
    result: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export ") :].lstrip()
        name, sep, value = stripped.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"{path}:{number}: expected NAME=VALUE")
        result[name] = _unquote(value, f"{path}:{number}")
    return result


def parse_duration(name: str, text: str) -> float:
    """Parse ``15m``, ``90s``, ``1h30m``, ``250ms`` (Go's duration syntax) into seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ConfigError(f"{name}={text!r} is not a duration (examples: 15m, 90s, 1h30m)")
    return sum(float(n) * units[u] for n, u in parts)


# Binary multiples, as nginx reads ``1k``/``1m``/``1g``; "KB"/"MB" are refused as ambiguous.
_SIZE_UNITS = {
    "": 1,
    "k": 1 << 10,
    "K": 1 << 10,
    "KiB": 1 << 10,
    "m": 1 << 20,
    "M": 1 << 20,
    "MiB": 1 << 20,
    "g": 1 << 30,
    "G": 1 << 30,
    "GiB": 1 << 30,
}
_MAX_SIZE = (1 << 63) - 1  # what a 64-bit length can hold


def parse_size(name: str, text: str) -> int:
    """Parse a byte count: ``1048576``, ``512k``, ``100MiB``, ``2G`` (k/K/KiB, m/M/MiB, g/G/GiB:
    binary multiples) into bytes."""
    match = re.fullmatch(r"([0-9]+)([A-Za-z]*)", text)
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ConfigError(
            f"{name}={text!r} is not a size in bytes (examples: 1048576, 512k, 100MiB, 2G)"
        )
    size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size > _MAX_SIZE:
        raise ConfigError(f"{name}={text!r} is too large")
    return size


def parse_address(name: str, text: str) -> str | None:
    """``:443``, ``127.0.0.1:8080``, ``[::1]:8080`` or a Twisted endpoint string; ``off`` disables."""
    if text in ("", "off", "none"):
        return None
    match = re.fullmatch(r"(?:\[([0-9a-fA-F:.]+)\]|([A-Za-z0-9.\-]*)):(\d{1,5})", text)
    # ``tcp:8080`` or ``ssl:443`` is an endpoint string, not HOST:PORT: an interface name given
    # bare must be an address (it has a dot) or ``localhost``, never an endpoint type.
    bare = match.group(2) if match else None
    if bare and "." not in bare and bare.lower() != "localhost":
        match = None
    if match:
        v6, v4, port = match.groups()
        if int(port) > 65535:
            raise ConfigError(f"{name}={text!r}: port out of range")
        if v6:
            return f"tcp6:{port}:interface=" + v6.replace(":", r"\:")
        return f"tcp:{port}" + (f":interface={v4}" if v4 else "")
    try:
        # Only the syntax is checked: the endpoint is built and dropped, never listened on, and
        # the parsers merely store the reactor they are given, so none is needed here.
        serverFromString(_NO_REACTOR, text)
    except Exception as e:  # parsers also read files (ssl: certificates) and raise what they like
        raise ConfigError(
            f"{name}={text!r} is neither HOST:PORT nor a Twisted endpoint string ({e})"
        ) from e
    return text


def _unquote(value: str, where: str) -> str:
    if re.match(r"\s+#", value):  # ``NAME= # comment`` (as the seeds write): an empty value
        return ""
    value = value.strip()
    if value[:1] in ("'", '"'):
        quote = value[0]
        end = value.find(quote, 1)
        if end == -1:
            raise ConfigError(f"{where}: unterminated quote")
        rest = value[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise ConfigError(f"{where}: text after the closing quote")
        return value[1:end]
    comment = re.search(r"\s#", value)
    return value[: comment.start()].rstrip() if comment else value


def _directory(name: str, text: str) -> str:
    if not text:
        raise ConfigError(f"{name} is empty")
    if "\x00" in text:
        raise ConfigError(f"{name} contains a NUL byte")
    return os.path.abspath(text)


def _fallback_url(text: str) -> str:
    if not text:
        return ""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"LCHAT_FALLBACK_URL={text!r} must be an absolute http(s) URL")
    if not text.isascii() or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        # it becomes a Location header: no spaces, control characters or raw non-ASCII
        raise ConfigError(f"LCHAT_FALLBACK_URL={text!r} must be a plain ASCII URL (percent-encode)")
    return text


def _units(text: str, systemd_present: bool | None) -> Units:
    if text == "auto":
        if systemd_present is None:
            systemd_present = os.path.isdir("/run/systemd/system") and bool(
                shutil.which("systemctl")
            )
        return "systemd" if systemd_present else "builtin"
    if text in ("systemd", "builtin"):
        return "systemd" if text == "systemd" else "builtin"
    raise ConfigError(f"LCHAT_UNITS must be auto, systemd or builtin, not {text!r}")


def _isolation(text: str) -> Isolation:
    if text in ("auto", "on", "off"):
        return cast(Isolation, text)
    raise ConfigError(f"LCHAT_ISOLATION must be auto, on or off, not {text!r}")


def _uid_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        low, high = 0, -1
    # Below 1000: system users; 65534: nobody; from 61184: systemd's dynamic users.
    if not sep or not 1000 <= low <= high <= 61183:
        raise ConfigError(
            f"LCHAT_SPACE_UIDS must be a range FIRST-LAST within 1000-61183, not {text!r}"
        )
    return low, high


def _under_opt(merged: Mapping[str, str], name: str) -> str:
    """``name``'s value; unset, its default under ``LCHAT_OPT_DIR`` when that is set (the build
    tree ``lchat deploy`` repoints: ``<opt>/live/{host}``, lchat/builds.py)."""
    if name in merged:
        return merged[name].strip()
    opt = merged.get("LCHAT_OPT_DIR", "").strip().rstrip("/")
    default = DEFAULTS[name]
    if opt and default.startswith("/opt/lchat/"):
        return shlex.quote(opt + default[len("/opt/lchat") :])
    return default


def _space_command(text: str, name: str = "LCHAT_SPACE_COMMAND") -> tuple[str, ...]:
    if "\x00" in text:
        raise ConfigError(f"{name} contains a NUL byte")
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"{name}={text!r}: {e}") from e
    if not argv:
        raise ConfigError(f"{name} is empty")
    return tuple(argv)


def _domains(name: str, text: str) -> tuple[str, ...]:
    result = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            result.append(hosts.normalise(item))
        except hosts.InvalidHost as e:
            raise ConfigError(f"{name}: {e}") from e
    return tuple(result)


def _switch(name: str, text: str) -> bool:
    if text not in ("on", "off"):
        raise ConfigError(f"{name} must be on or off, not {text!r}")
    return text == "on"


def _proxy(get: _Getter) -> ProxyConfig:
    def positive(name: str) -> float:
        value = parse_duration(name, get(name))
        if value <= 0:
            raise ConfigError(f"{name} must be a positive duration")
        return value

    def count(name: str, low: int, high: int) -> int:
        text = get(name)
        if not text.isdigit() or not low <= int(text) <= high:
            raise ConfigError(f"{name}={text!r} must be a whole number from {low} to {high}")
        return int(text)

    dial_retry = parse_duration("LCHAT_DIAL_RETRY", get("LCHAT_DIAL_RETRY"))  # 0 = no retry
    return ProxyConfig(
        dial_retry=dial_retry,
        header_timeout=positive("LCHAT_HEADER_TIMEOUT"),
        keepalive_timeout=positive("LCHAT_KEEPALIVE_TIMEOUT"),
        upstream_timeout=positive("LCHAT_UPSTREAM_TIMEOUT"),
        send_timeout=positive("LCHAT_SEND_TIMEOUT"),
        max_header_bytes=count("LCHAT_MAX_HEADER_BYTES", 1024, 1 << 20),
        max_headers=count("LCHAT_MAX_HEADERS", 8, 10000),
        tunnel_idle_timeout=positive("LCHAT_TUNNEL_IDLE_TIMEOUT"),
        max_body=parse_size("LCHAT_MAX_BODY", get("LCHAT_MAX_BODY")),
        first_contact_wait=parse_duration(
            "LCHAT_TLS_FIRST_CONTACT_WAIT", get("LCHAT_TLS_FIRST_CONTACT_WAIT")
        ),
        access_log=_switch("LCHAT_ACCESS_LOG", get("LCHAT_ACCESS_LOG")),
    )


def _capacity(get: _Getter) -> tuple[int, int]:
    """(LCHAT_MAX_INSTANCES, LCHAT_MAX_REGISTERED): whole numbers, 0 = no limit; the second
    defaults to ten times the first."""

    def limit(name: str, text: str) -> int:
        if not re.fullmatch(r"[0-9]{1,9}", text):
            raise ConfigError(f"{name}={text!r} must be a whole number (0: no limit)")
        return int(text)

    instances = limit("LCHAT_MAX_INSTANCES", get("LCHAT_MAX_INSTANCES"))
    registered_text = get("LCHAT_MAX_REGISTERED")
    registered = (
        limit("LCHAT_MAX_REGISTERED", registered_text) if registered_text else 10 * instances
    )
    return instances, registered


def _cloud(get: _Getter) -> tuple[str, Where | None]:
    """LCHAT_CLOUD_REGION (validated as LCHAT_MESH_REGION is) and LCHAT_CLOUD_ID_LEDGER."""
    region = get("LCHAT_CLOUD_REGION")
    if region and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", region):
        raise ConfigError(
            f"LCHAT_CLOUD_REGION={region!r}: letters, digits, '.', '_' and '-' (at most 64)"
        )
    text = get("LCHAT_CLOUD_ID_LEDGER")
    try:
        ledger = parse_where(text, keys=False) if text else None
    except ValueError as e:
        raise ConfigError(f"LCHAT_CLOUD_ID_LEDGER={e}") from e
    return region, ledger


def parse_bucket_url(what: str, url: str) -> Where:
    """:func:`lchat.objstore.where.parse_where`, a refusal a :class:`ConfigError` beginning
    with ``what``."""
    try:
        return parse_where(url)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from e


def mesh_bucket(cfg: BoxConfig) -> Where:
    """Where the mesh's heartbeats live (``<prefix>/mesh/members/``): ``LCHAT_MESH_BUCKET``, else
    the hibernation bucket. Only for a box with a mesh (which always has a hibernation bucket)."""
    assert cfg.mesh is not None and cfg.hibernate is not None
    return cfg.mesh.bucket or cfg.hibernate.where


def _region_buckets(
    get: _Getter, hibernate: HibernateConfig | None, mesh: MeshConfig | None
) -> dict[str, Where]:
    """``LCHAT_REGION_BUCKETS=REGION=URL,REGION=URL``: each URL in ``LCHAT_CLOUD_ID_LEDGER``'s form
    (``s3://BUCKET[/PREFIX][?region=R&endpoint=URL]`` or ``file:PATH``), plus optional
    ``access_key_env=NAME&secret_key_env=NAME`` naming the variables with that region's keys.

    The box's own region (``LCHAT_MESH_REGION``) keeps its replicas in ``LCHAT_HIBERNATE_*``: its
    entry may be left out (it is then implied) and, if given, must name that same bucket, prefix
    and endpoint, since a second spelling of "here" could only disagree with the one in use."""
    text = get("LCHAT_REGION_BUCKETS").strip()
    if not text:
        return {}
    if hibernate is None:
        raise ConfigError(
            "LCHAT_REGION_BUCKETS names other regions' hibernation buckets: set this box's own "
            "LCHAT_HIBERNATE_BUCKET too"
        )
    found: dict[str, Where] = {}
    for item in (part.strip() for part in text.split(",")):
        region, equals, url = item.partition("=")
        region, url = region.strip(), url.strip()
        if not equals or not url:
            raise ConfigError(
                f"LCHAT_REGION_BUCKETS: {item!r} is not REGION=s3://BUCKET[/PREFIX][?region=R"
                f"&endpoint=URL] (entries separated by commas)"
            )
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", region):
            raise ConfigError(
                f"LCHAT_REGION_BUCKETS: region {region!r}: letters, digits, '.', '_' and '-'"
            )
        if region in found:
            raise ConfigError(f"LCHAT_REGION_BUCKETS names region {region!r} twice")
        found[region] = parse_bucket_url(f"LCHAT_REGION_BUCKETS: {region}", url)
    own_region = mesh.region if mesh is not None else ""
    if own_region:
        own = hibernate.where
        given = found.get(own_region)
        if given is None:
            found[own_region] = own
        elif not given.same_place(own) or (
            given.s3_region and own.s3_region and given.s3_region != own.s3_region
        ):
            raise ConfigError(
                f"LCHAT_REGION_BUCKETS: the entry for this box's own region {own_region!r} "
                f"({given.bucket}, prefix {given.prefix!r}, endpoint {given.endpoint or '-'}) is "
                f"not its LCHAT_HIBERNATE_* bucket ({own.bucket}, prefix {own.prefix!r}, endpoint "
                f"{own.endpoint or '-'}): make them the same, or leave this region out"
            )
    return {r: found[r] for r in sorted(found)}


# LCHAT_LEASE_TTL's defaults. Off a mesh the TTL is the only way a dead holder's lease frees up
# (renewed every TTL/3: 12 writes per awake space-hour). On a mesh box the holder's heartbeat
# fences its leases, so a peer takes over a dead box's spaces within dead_after; the TTL is only
# the backstop for a lease its live box leaked (renewed every 40 min: at most 3 lease requests
# per awake space-hour with the acquire and the release).
SOLO_LEASE_TTL = "15m"
MESH_LEASE_TTL = "2h"


def _hibernate(get: _Getter) -> HibernateConfig | None:
    idle = parse_duration("LCHAT_HIBERNATE_IDLE", get("LCHAT_HIBERNATE_IDLE"))
    if idle <= 0:
        raise ConfigError("LCHAT_HIBERNATE_IDLE must be a positive duration")
    ttl_text = get("LCHAT_LEASE_TTL") or (
        MESH_LEASE_TTL if get("LCHAT_MESH_SELF") else SOLO_LEASE_TTL
    )
    lease_ttl = parse_duration("LCHAT_LEASE_TTL", ttl_text)
    if lease_ttl < 3:
        raise ConfigError("LCHAT_LEASE_TTL must be at least 3s (it is renewed at a third)")
    sweeps = {}
    for name in ("LCHAT_HIBERNATE_SWEEP", "LCHAT_DUE_SWEEP"):
        sweeps[name] = parse_duration(name, get(name))
        if sweeps[name] <= 0:
            raise ConfigError(f"{name} must be a positive duration")
    where = _bucket(get, "LCHAT_HIBERNATE")
    if where is None:
        return None
    bucket, endpoint, prefix = where
    return HibernateConfig(
        bucket=bucket,
        region=get("LCHAT_HIBERNATE_REGION"),
        prefix=prefix,
        endpoint=endpoint.rstrip("/"),
        idle=idle,
        lease_ttl=lease_ttl,
        sweep=sweeps["LCHAT_HIBERNATE_SWEEP"],
        due_sweep=sweeps["LCHAT_DUE_SWEEP"],
    )


def _bucket(get: _Getter, stem: str) -> tuple[str, str, str] | None:
    """``<stem>_BUCKET``, ``_ENDPOINT`` and ``_PREFIX`` checked: (bucket, endpoint, prefix), or
    None when the bucket is not set."""
    bucket = get(f"{stem}_BUCKET")
    if not bucket:
        return None
    if bucket.startswith("file:"):
        try:
            bucket = file_bucket(bucket)
        except ValueError as e:
            raise ConfigError(f"{stem}_BUCKET={e}") from e
    elif not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise ConfigError(f"{stem}_BUCKET={bucket!r} is neither an S3 bucket name nor file:PATH")
    endpoint = get(f"{stem}_ENDPOINT")
    if endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"{stem}_ENDPOINT={endpoint!r} must be an http(s) URL such as "
                f"https://s3.example.net"
            )
    prefix = get(f"{stem}_PREFIX").strip("/")
    if "\x00" in prefix or ".." in prefix.split("/"):
        raise ConfigError(f"{stem}_PREFIX={prefix!r} is not a safe key prefix")
    return bucket, endpoint.rstrip("/"), prefix


def _backup(
    get: _Getter, hibernate: HibernateConfig | None, mesh: MeshConfig | None
) -> BackupConfig | None:
    interval = parse_duration("LCHAT_BACKUP_INTERVAL", get("LCHAT_BACKUP_INTERVAL"))
    if interval <= 0:
        raise ConfigError("LCHAT_BACKUP_INTERVAL must be a positive duration")
    extra = tuple(p for p in re.split(r"[\s,]+", get("LCHAT_BACKUP_EXTRA")) if p)
    for pattern in extra:
        if "\x00" in pattern or pattern.startswith("/") or ".." in pattern.split("/"):
            raise ConfigError(
                f"LCHAT_BACKUP_EXTRA: {pattern!r} must be a glob relative to LCHAT_DATA_DIR "
                f"(such as home.db or services/*.db)"
            )
    where = _bucket(get, "LCHAT_BACKUP")
    if where is None:
        return None
    bucket, endpoint, prefix = where
    box = get("LCHAT_BACKUP_BOX") or (mesh.self_host if mesh is not None else socket.gethostname())
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", box) or box in (".", ".."):
        raise ConfigError(
            f"LCHAT_BACKUP_BOX={box!r} must be a name of letters, digits, '.', '_' and '-' "
            f"(it is a key segment of the backup layout; default: this box's host name)"
        )
    region = get("LCHAT_BACKUP_REGION")
    if hibernate is not None and (hibernate.bucket, hibernate.endpoint) == (bucket, endpoint):
        # One bucket, two layouts: <hibernate prefix>/<host>/ and <backup prefix>/<box>/<db>/.
        inside = hibernate.prefix
        if not prefix or prefix == inside or (inside and prefix.startswith(inside + "/")):
            raise ConfigError(
                f"LCHAT_BACKUP_PREFIX={prefix!r}: the backup shares the hibernation bucket "
                f"{bucket}, so it needs a prefix of its own, outside LCHAT_HIBERNATE_PREFIX="
                f"{inside!r} (such as backup)"
            )
    key_text = get("LCHAT_BACKUP_KEY")
    return BackupConfig(
        bucket=bucket,
        region=region,
        prefix=prefix,
        endpoint=endpoint,
        box=box,
        interval=interval,
        extra=extra,
        env_key=aes_key("LCHAT_BACKUP_KEY", key_text) if key_text else b"",
    )


def _cert_cache(text: str) -> CertCache:
    if text not in ("dir", "s3"):
        raise ConfigError(f"LCHAT_CERT_CACHE must be dir or s3, not {text!r}")
    return "s3" if text == "s3" else "dir"


def _cert_cache_key(text: str) -> bytes:
    if not text:
        raise ConfigError(
            "LCHAT_CERT_CACHE=s3 needs LCHAT_CERT_CACHE_KEY: private keys are encrypted before "
            "they reach the bucket (make one with `openssl rand -base64 32`, the same on every box)"
        )
    return aes_key("LCHAT_CERT_CACHE_KEY", text)


def _cert_cache_previous_key(text: str, current: bytes) -> tuple[bytes, tuple[str, ...]]:
    """``LCHAT_CERT_CACHE_KEY_PREVIOUS``: checked like the current key (a typo fails the boot,
    not the first read of an old entry); equal to the current key, it is ignored with a warning
    (harmless, but a sign the rotation was set up wrong)."""
    if not text:
        return b"", ()
    previous = aes_key("LCHAT_CERT_CACHE_KEY_PREVIOUS", text)
    if previous == current:
        return b"", (
            "LCHAT_CERT_CACHE_KEY_PREVIOUS equals LCHAT_CERT_CACHE_KEY: ignored (mid-rotation it "
            "holds the old key; after it, remove the line)",
        )
    return previous, ()


def aes_key(name: str, text: str) -> bytes:
    """An AES-256 key given in base64 (``openssl rand -base64 32``), checked."""
    padded = text + "=" * (-len(text) % 4)
    try:
        if re.fullmatch(r"[A-Za-z0-9+/]+=*", padded):
            key = base64.b64decode(padded, validate=True)
        else:
            key = base64.urlsafe_b64decode(padded.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise ConfigError(f"{name} is not base64 (`openssl rand -base64 32`)") from None
    if len(key) != 32:
        raise ConfigError(
            f"{name} must be 32 bytes (AES-256) in base64, not {len(key)} bytes "
            f"(`openssl rand -base64 32`)"
        )
    return key


def _acme(get: _Getter, wildcard_domains: tuple[str, ...]) -> AcmeConfig | None:
    directory = get("LCHAT_ACME_DIRECTORY")
    if directory in ("off", ""):
        return None
    parts = urlsplit(directory)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"LCHAT_ACME_DIRECTORY={directory!r} must be the URL of an ACME directory (e.g. "
            f"{LETS_ENCRYPT}) or off"
        )
    if not re.fullmatch(r"[\x21-\x7e]{1,2000}", directory):
        # It is written into every certificate file and bucket entry as the issuer's name.
        raise ConfigError(f"LCHAT_ACME_DIRECTORY={directory!r} must be a plain ASCII URL")
    if parts.scheme == "http" and not hosts.is_loopback(parts.hostname):
        # RFC 8555 requires TLS: over plain http anyone on the path could hand us any chain.
        raise ConfigError(f"LCHAT_ACME_DIRECTORY={directory!r} must be https")
    email = get("LCHAT_ACME_EMAIL")
    if email and not re.fullmatch(r"[^@\s,]+@[^@\s,]+\.[^@\s,]+", email):
        raise ConfigError(f"LCHAT_ACME_EMAIL={email!r} is not an email address")
    ca_file = get("LCHAT_ACME_CA_FILE")
    if ca_file and not os.path.isfile(ca_file):
        raise ConfigError(f"LCHAT_ACME_CA_FILE={ca_file!r} is not a file")
    provider = get("LCHAT_DNS_PROVIDER")
    if provider not in ("dnsimple", "route53"):
        raise ConfigError(f"LCHAT_DNS_PROVIDER must be dnsimple or route53, not {provider!r}")
    token = get("LCHAT_DNSIMPLE_TOKEN")
    if wildcard_domains and provider == "dnsimple" and not token:
        raise ConfigError(
            "LCHAT_WILDCARD_DOMAINS needs DNS-01: set LCHAT_DNSIMPLE_TOKEN, or "
            "LCHAT_DNS_PROVIDER=route53 (the box's own AWS credentials), or "
            "LCHAT_ACME_DIRECTORY=off to serve wildcard files placed by hand"
        )
    dnsimple_url = get("LCHAT_DNSIMPLE_URL").rstrip("/")
    route53_endpoint = get("LCHAT_ROUTE53_ENDPOINT").rstrip("/")
    for name, url in (
        ("LCHAT_DNSIMPLE_URL", dnsimple_url),
        ("LCHAT_ROUTE53_ENDPOINT", route53_endpoint),
    ):
        if url and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname):
            raise ConfigError(f"{name}={url!r} must be an http(s) URL")
    if dnsimple_url and urlsplit(dnsimple_url).scheme == "http":
        # The token rides in every request: only over TLS (plain http only to this machine).
        if not hosts.is_loopback(urlsplit(dnsimple_url).hostname or ""):
            raise ConfigError(
                f"LCHAT_DNSIMPLE_URL={dnsimple_url!r} must be https (the API token rides in "
                f"every request)"
            )
    account = get("LCHAT_DNSIMPLE_ACCOUNT")
    if account and not account.isdigit():
        raise ConfigError(f"LCHAT_DNSIMPLE_ACCOUNT={account!r} must be a numeric account id")
    zone_id = get("LCHAT_ROUTE53_ZONE_ID")
    if zone_id and not re.fullmatch(r"(/hostedzone/)?[A-Z0-9]{1,32}", zone_id):
        raise ConfigError(f"LCHAT_ROUTE53_ZONE_ID={zone_id!r} is not a hosted zone id")
    timeout = parse_duration("LCHAT_DNS_PROPAGATION_TIMEOUT", get("LCHAT_DNS_PROPAGATION_TIMEOUT"))
    if not 0 < timeout <= MAX_DNS_TIMEOUT:
        # An order must end well inside the shared cache's 10-minute issuance lock.
        raise ConfigError("LCHAT_DNS_PROPAGATION_TIMEOUT must be a positive duration up to 5m")
    return AcmeConfig(
        directory=directory,
        email=email,
        ca_file=os.path.abspath(ca_file) if ca_file else "",
        dns_provider="route53" if provider == "route53" else "dnsimple",
        dnsimple_token=token,
        dnsimple_url=dnsimple_url or DNSIMPLE_URL,
        dnsimple_account=account,
        route53_zone_id=zone_id.removeprefix("/hostedzone/"),
        route53_endpoint=route53_endpoint,
        dns_resolvers=_resolvers(get("LCHAT_DNS_RESOLVERS")),
        dns_timeout=timeout,
    )


def _resolvers(text: str) -> tuple[tuple[str, int], ...]:
    result = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d{1,5}))?|([0-9.]+)(?::(\d{1,5}))?", item)
        try:
            if match is None:
                raise ValueError(item)
            address = match.group(1) or match.group(3)
            port = int(match.group(2) or match.group(4) or 53)
            ipaddress.ip_address(address)
            if not 0 < port < 65536:
                raise ValueError(item)
        except ValueError:
            raise ConfigError(
                f"LCHAT_DNS_RESOLVERS: {item!r} is not IP, IP:PORT or [IPv6]:PORT"
            ) from None
        result.append((address, port))
    return tuple(result)


def _mesh(get: _Getter) -> MeshConfig | None:
    self_url = get("LCHAT_MESH_SELF")
    if not self_url:
        return None
    parts = urlsplit(self_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"LCHAT_MESH_SELF={self_url!r} must be a URL with an http(s) scheme and a host"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"LCHAT_MESH_SELF={self_url!r} must not have a path, query or fragment")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"LCHAT_MESH_SELF={self_url!r} must not carry user information")
    try:
        parts.port  # noqa: B018 -- raises on a malformed port
    except ValueError as e:
        raise ConfigError(f"LCHAT_MESH_SELF={self_url!r}: {e}") from e
    domains = _domains("LCHAT_MESH_DOMAINS", get("LCHAT_MESH_DOMAINS"))
    if not domains:
        raise ConfigError(
            "LCHAT_MESH_SELF is set but LCHAT_MESH_DOMAINS is empty: name the domains"
        )
    token = get("LCHAT_MESH_TOKEN")
    if not token:
        raise ConfigError(
            "LCHAT_MESH_SELF is set but LCHAT_MESH_TOKEN is empty: set the shared token"
        )
    # The token is a bearer on the public port and the key of every heartbeat's and forwarded
    # marker's MAC: a short one could be guessed (issue 29). The value is never in a message.
    for name, value in (
        ("LCHAT_MESH_TOKEN", token),
        ("LCHAT_MESH_TOKEN_ACCEPT", get("LCHAT_MESH_TOKEN_ACCEPT")),
    ):
        if value and len(value) < MIN_MESH_TOKEN:
            raise ConfigError(
                f"{name} is {len(value)} characters: at least {MIN_MESH_TOKEN} are needed "
                "(make one with: openssl rand -hex 32)"
            )
    if not get("LCHAT_HIBERNATE_BUCKET"):
        raise ConfigError(
            "LCHAT_MESH_SELF needs LCHAT_HIBERNATE_BUCKET: the mesh rides on the bucket"
        )
    region = get("LCHAT_MESH_REGION")
    if region and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", region):
        raise ConfigError(
            f"LCHAT_MESH_REGION={region!r}: letters, digits, '.', '_' and '-' (at most 64)"
        )
    heartbeat = parse_duration("LCHAT_MESH_HEARTBEAT", get("LCHAT_MESH_HEARTBEAT"))
    dead_after = parse_duration("LCHAT_MESH_DEAD_AFTER", get("LCHAT_MESH_DEAD_AFTER"))
    if heartbeat <= 0 or dead_after < 2 * heartbeat:
        raise ConfigError(
            "LCHAT_MESH_DEAD_AFTER must be at least twice LCHAT_MESH_HEARTBEAT (a missed beat "
            "must not kill a member)"
        )
    tolerance = parse_duration("LCHAT_MESH_OUTAGE_TOLERANCE", get("LCHAT_MESH_OUTAGE_TOLERANCE"))
    if tolerance < dead_after:
        raise ConfigError(
            "LCHAT_MESH_OUTAGE_TOLERANCE must be at least LCHAT_MESH_DEAD_AFTER (how long spaces "
            "keep serving on the peers' word while the bucket is out of reach)"
        )
    ca_file = get("LCHAT_MESH_CA_FILE")
    if ca_file and not os.path.isfile(ca_file):
        raise ConfigError(f"LCHAT_MESH_CA_FILE={ca_file!r} is not a file")
    bucket_url = get("LCHAT_MESH_BUCKET").strip()
    bucket = parse_bucket_url("LCHAT_MESH_BUCKET", bucket_url) if bucket_url else None
    accept_token = get("LCHAT_MESH_TOKEN_ACCEPT")
    return MeshConfig(
        self_url=self_url.rstrip("/"),
        domains=domains,
        token=token,
        region=region,
        heartbeat=heartbeat,
        dead_after=dead_after,
        outage_tolerance=tolerance,
        ca_file=ca_file,
        bucket=bucket,
        # Equal to the token it accepts nothing more: dropped here, and load() warns.
        accept_token="" if accept_token == token else accept_token,
    )
