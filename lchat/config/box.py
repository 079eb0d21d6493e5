"""BoxConfig: ``router.env`` + the process environment + twistd flags -> validated, typed settings.

Precedence, lowest first: the env file (``--env-file``, default ``/data/router.env``; absent is fine
unless named explicitly), the process environment, command-line flags. Anything wrong fails here, at
boot, with a message naming the variable (docs/design.md §10, invariant 7). Secrets never appear in a repr.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
from collections.abc import Mapping
from typing import Literal, cast
from urllib.parse import urlsplit

from attrs import field, frozen

from lchat import hosts
from lchat.config.acme import (
    DNSIMPLE_URL,
    LETS_ENCRYPT,
    AcmeConfig,
    CertCache,
    read_acme,
    read_cert_cache,
)
from lchat.config.hibernate import BackupConfig, HibernateConfig, read_backup, read_hibernate
from lchat.config.listen import parse_address
from lchat.config.mesh import MeshConfig, read_cloud, read_mesh, read_region_buckets
from lchat.config.values import (
    ConfigError,
    Getter,
    domains,
    one_of,
    parse_duration,
    parse_size,
    positive_duration,
    read_env_file,
    switch,
)
from lchat.objstore.where import Where

DEFAULT_ENV_FILE = "/data/router.env"

Units = Literal["systemd", "builtin"]
Isolation = Literal["auto", "on", "off"]


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


def read_proxy(get: Getter) -> ProxyConfig:
    def count(name: str, low: int, high: int) -> int:
        text = get(name)
        if not text.isdigit() or not low <= int(text) <= high:
            raise ConfigError(f"{name}={text!r} must be a whole number from {low} to {high}")
        return int(text)

    dial_retry = parse_duration("LCHAT_DIAL_RETRY", get("LCHAT_DIAL_RETRY"))  # 0 = no retry
    return ProxyConfig(
        dial_retry=dial_retry,
        header_timeout=positive_duration(get, "LCHAT_HEADER_TIMEOUT"),
        keepalive_timeout=positive_duration(get, "LCHAT_KEEPALIVE_TIMEOUT"),
        upstream_timeout=positive_duration(get, "LCHAT_UPSTREAM_TIMEOUT"),
        send_timeout=positive_duration(get, "LCHAT_SEND_TIMEOUT"),
        max_header_bytes=count("LCHAT_MAX_HEADER_BYTES", 1024, 1 << 20),
        max_headers=count("LCHAT_MAX_HEADERS", 8, 10000),
        tunnel_idle_timeout=positive_duration(get, "LCHAT_TUNNEL_IDLE_TIMEOUT"),
        max_body=parse_size("LCHAT_MAX_BODY", get("LCHAT_MAX_BODY")),
        first_contact_wait=parse_duration(
            "LCHAT_TLS_FIRST_CONTACT_WAIT", get("LCHAT_TLS_FIRST_CONTACT_WAIT")
        ),
        access_log=switch("LCHAT_ACCESS_LOG", get("LCHAT_ACCESS_LOG")),
    )


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
    proxy: ProxyConfig = field(factory=ProxyConfig)
    metrics_addr: str | None = None  # optional TCP endpoint serving /metrics
    http_redirect: bool = True  # with HTTPS on, plain HTTP answers 301 (else it proxies too)
    acme: AcmeConfig | None = None  # None: no issuance, the cache is served as it is
    backup: BackupConfig | None = None  # None: no fleet backup (LCHAT_BACKUP_BUCKET unset)
    cert_cache_key: bytes = field(default=b"", repr=False)  # AES-256 key for keys in the bucket
    # LCHAT_CERT_CACHE_KEY_PREVIOUS: the key being rotated away from: entries sealed with it are
    # still read, and re-sealed with cert_cache_key (lchat.acme.cache); b"": none.
    cert_cache_previous_key: bytes = field(default=b"", repr=False)
    cert_cache_sync: float = 60.0  # how often the shared cache is listed for new certificates
    # LCHAT_MAX_INSTANCES: always-on space processes (add-instance, hibernate --off);
    # LCHAT_MAX_REGISTERED: instance rows add-instance accepts (on a mesh: per owner);
    # LCHAT_MAX_AWAKE: hibernating spaces awake at once. 0 = no limit (docs/hibernation.md).
    max_instances: int = 40
    max_registered: int = 400
    max_awake: int = 0
    # LCHAT_SPACE_MEMORY: the least a wake needs (bytes; more once spaces are measured);
    # LCHAT_MEMORY_RESERVE: memory wakes leave free (None: max(512 MiB, 5 % of the total)).
    space_memory: int = 32 << 20
    memory_reserve: int | None = None
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
    # LCHAT_WORKERS: 1 = one process serves everything (as before workers existed); N >= 2 = a
    # control process plus N data-plane worker processes sharing the public ports with
    # SO_REUSEPORT (docs/performance.md, "Many cores"). The default here is 1 so that a
    # BoxConfig built by hand is today's single process; load() resolves `auto`.
    workers: int = 1
    # Every LCHAT_* setting as load() merged it (env file < process environment < flags), flags
    # included: what the control process hands its workers in their environment, so that a
    # worker runs on exactly the control process's settings (an edit to router.env while the
    # box runs never reaches a restarted worker half-way). Holds secrets: never in a repr.
    settings: Mapping[str, str] = field(factory=dict, repr=False)

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
    "LCHAT_MAX_INSTANCES": "40",  # always-on space processes (0 = no limit)
    "LCHAT_MAX_REGISTERED": "",  # instance rows add-instance accepts (default: 10 x the above)
    "LCHAT_MAX_AWAKE": "0",  # hibernating spaces awake at once (0 = no cap: memory decides)
    "LCHAT_SPACE_MEMORY": "32MiB",  # the least one awake space is counted as
    "LCHAT_MEMORY_RESERVE": "",  # memory wakes leave free (default: max(512MiB, 5% of total))
    "LCHAT_SIDECAR_COMMAND": "/opt/lchat/live/{host}-bot",
    "LCHAT_BACKUP_CONFIG": "/etc/litestream.yml",  # an external Litestream's (absent = none)
    "LCHAT_BACKUP_BUCKET": "",  # the router's own fleet backup (absent = none)
    "LCHAT_BACKUP_REGION": "",
    "LCHAT_BACKUP_PREFIX": "",
    "LCHAT_BACKUP_ENDPOINT": "",
    "LCHAT_BACKUP_BOX": "",  # this box's segment of the layout (default: its host name)
    "LCHAT_BACKUP_INTERVAL": "10s",
    "LCHAT_BACKUP_EXTRA": "",  # more globs beside the default *.db; `none`: not *.db
    "LCHAT_BACKUP_KEY": "",  # AES-256 (base64) for the spaces' env files; unset: not backed up
    "LCHAT_BACKUP_ENV": "",  # `unprotected`: start without LCHAT_BACKUP_KEY though env files exist
    "LCHAT_MESH_SELF": "",
    "LCHAT_MESH_DOMAINS": "",
    "LCHAT_MESH_TOKEN": "",
    "LCHAT_MESH_TOKEN_ACCEPT": "",  # during a token rotation: accepted too, never sent
    "LCHAT_MESH_REGION": "",
    "LCHAT_MESH_HEARTBEAT": "15s",
    "LCHAT_MESH_DEAD_AFTER": "45s",
    "LCHAT_MESH_OUTAGE_TOLERANCE": "15m",
    "LCHAT_MESH_CA_FILE": "",
    "LCHAT_MESH_SYNC": "5m",  # anti-entropy of the spaces' settings (lchat.mesh.sync)
    "LCHAT_MESH_BUCKET": "",  # s3://BUCKET[/PREFIX][?...]: the heartbeats' own bucket
    "LCHAT_CLOUD_REGION": "",  # add-instance's default --home-region
    "LCHAT_CLOUD_ID_LEDGER": "",  # s3://BUCKET[/PREFIX][?region=&endpoint=] or file:PATH
    "LCHAT_REGION_BUCKETS": "",  # REGION=s3://BUCKET[/PREFIX][?...],... (lchat relocate)
    # A duration or `off`: serve a space whose home region has had no live box that long, from
    # that region's bucket (docs/mesh.md, "Regional failover")
    "LCHAT_REGION_FAILOVER_AFTER": "off",
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
    "LCHAT_WORKERS": "auto",  # data-plane processes; auto: one per core this process may use
}

MAX_AUTO_WORKERS = 64  # `auto` on a bigger box: each worker holds its own tables and memory
MAX_WORKERS = 256


# Names that belong to a space's own environment or to tools beside us; never warned about.
_NOT_OURS = frozenset(
    "LCHAT_HOST LCHAT_SOCKET LCHAT_DB LCHAT_ADMIN_TOKEN LCHAT_BOT_TOKEN LCHAT_BOT_EVERY "
    "LCHAT_BOT_ROOM LCHAT_BOT_MESSAGE LCHAT_BOT_LISTEN LCHAT_SIDECAR_URL LCHAT_BUILD".split()
    # The build tree and the release feed: read by lchat/release/settings.py (the CLI's
    # `release`, `deploy`, `rollback`, `fleet`), and LCHAT_OPT_DIR below for the commands'
    # defaults.
    + "LCHAT_OPT_DIR LCHAT_RELEASE_URL LCHAT_RELEASE_MIRROR_URL LCHAT_RELEASE_PUBKEY".split()
    + "LCHAT_RELEASE_CHANNEL LCHAT_RELEASE_WINDOW".split()  # the release agent's
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

    data_dir = _directory(get, "LCHAT_DATA_DIR")
    run_dir = _directory(get, "LCHAT_RUN_DIR")
    registry = _directory(get, "LCHAT_REGISTRY", os.path.join(data_dir, "registry.db"))
    acme_cache = _directory(get, "LCHAT_ACME_CACHE", os.path.join(data_dir, "acme"))

    cert_cache, cert_cache_key, cert_cache_previous_key, previous_warning = read_cert_cache(get)
    warnings += previous_warning
    cert_cache_sync = positive_duration(get, "LCHAT_CERT_CACHE_SYNC")
    wildcard_domains = domains("LCHAT_WILDCARD_DOMAINS", get("LCHAT_WILDCARD_DOMAINS"))
    acme = read_acme(get, wildcard_domains)
    hibernate = read_hibernate(get)
    mesh = read_mesh(get)
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
    max_instances, max_registered, max_awake = _capacity(get)
    space_memory = parse_size("LCHAT_SPACE_MEMORY", get("LCHAT_SPACE_MEMORY"))
    if space_memory < 1 << 20:
        raise ConfigError(
            f"LCHAT_SPACE_MEMORY={get('LCHAT_SPACE_MEMORY')!r} is below 1MiB: no space runs in "
            "that (examples: 32MiB, 64M)"
        )
    reserve_text = get("LCHAT_MEMORY_RESERVE")
    memory_reserve = parse_size("LCHAT_MEMORY_RESERVE", reserve_text) if reserve_text else None
    cloud_region, id_ledger = read_cloud(get)
    region_buckets = read_region_buckets(get, hibernate, mesh)
    warnings += _failover_warnings(get, hibernate, mesh, region_buckets)

    cfg = BoxConfig(
        env_file=path,
        data_dir=data_dir,
        run_dir=run_dir,
        registry=registry,
        acme_cache=acme_cache,
        cert_cache=cert_cache,
        cert_cache_key=cert_cache_key,
        cert_cache_previous_key=cert_cache_previous_key,
        cert_cache_sync=cert_cache_sync,
        acme=acme,
        https_addr=parse_address("LCHAT_HTTPS_ADDR", get("LCHAT_HTTPS_ADDR")),
        http_addr=parse_address("LCHAT_HTTP_ADDR", get("LCHAT_HTTP_ADDR")),
        fallback_url=_fallback_url(get("LCHAT_FALLBACK_URL")),
        units=_units(get("LCHAT_UNITS"), systemd_present),
        isolation=cast(
            Isolation, one_of("LCHAT_ISOLATION", get("LCHAT_ISOLATION"), "auto", "on", "off")
        ),
        space_uids=_uid_range(get("LCHAT_SPACE_UIDS")),
        space_command=_command(merged, "LCHAT_SPACE_COMMAND"),
        sidecar_command=_command(merged, "LCHAT_SIDECAR_COMMAND"),
        hibernate=hibernate,
        mesh=mesh,
        backup=read_backup(get, hibernate, mesh),
        wildcard_domains=wildcard_domains,
        proxy=read_proxy(get),
        metrics_addr=parse_address("LCHAT_METRICS_ADDR", get("LCHAT_METRICS_ADDR")),
        http_redirect=switch("LCHAT_HTTP_REDIRECT", get("LCHAT_HTTP_REDIRECT")),
        warnings=warnings,
        file_env=file_env,
        env={**file_env, **environ},
        max_instances=max_instances,
        max_registered=max_registered,
        max_awake=max_awake,
        space_memory=space_memory,
        memory_reserve=memory_reserve,
        cloud_region=cloud_region,
        id_ledger=id_ledger,
        region_buckets=region_buckets,
        workers=_workers(get("LCHAT_WORKERS")),
        settings=dict(merged),
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


def _directory(get: Getter, name: str, default: str = "") -> str:
    text = get(name) or default
    if not text:
        raise ConfigError(f"{name} is empty")
    if "\x00" in text:
        raise ConfigError(f"{name} contains a NUL byte")
    return os.path.abspath(text)


def _failover_warnings(
    get: Getter,
    hibernate: HibernateConfig | None,
    mesh: MeshConfig | None,
    region_buckets: Mapping[str, Where],
) -> tuple[str, ...]:
    """A regional failover consented to where it can do nothing: said at start, not refused (a
    fleet-wide env file may carry it to boxes without a mesh or per-region buckets)."""
    text = get("LCHAT_REGION_FAILOVER_AFTER")
    if text.lower() == "off":
        return ()
    if mesh is None:
        return (
            f"LCHAT_REGION_FAILOVER_AFTER={text} has no effect without the mesh (LCHAT_MESH_SELF)",
        )
    here = hibernate.where if hibernate is not None else None
    if here is None or all(where.same_place(here) for where in region_buckets.values()):
        return (
            f"LCHAT_REGION_FAILOVER_AFTER={text} has no effect: LCHAT_REGION_BUCKETS names no "
            "region whose bucket is not this box's (a space in a shared bucket is served by any "
            "box already)",
        )
    return ()


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
    if one_of("LCHAT_UNITS", text, "auto", "systemd", "builtin") != "auto":
        return cast(Units, text)
    if systemd_present is None:
        systemd_present = os.path.isdir("/run/systemd/system") and bool(shutil.which("systemctl"))
    return "systemd" if systemd_present else "builtin"


def _workers(text: str, cores: int | None = None) -> int:
    """LCHAT_WORKERS: ``auto`` (the cores this process may run on, at most
    :data:`MAX_AUTO_WORKERS`) or a whole number from 1 to :data:`MAX_WORKERS`."""
    if text.lower() == "auto":
        if cores is None:
            cores = len(os.sched_getaffinity(0))
        return max(1, min(cores, MAX_AUTO_WORKERS))
    if not re.fullmatch(r"[0-9]{1,4}", text) or not 1 <= int(text) <= MAX_WORKERS:
        raise ConfigError(
            f"LCHAT_WORKERS={text!r} must be `auto` (one per core) or a whole number from 1 "
            f"(one process, no workers) to {MAX_WORKERS}"
        )
    return int(text)


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


def _command(merged: Mapping[str, str], name: str) -> tuple[str, ...]:
    """``name``'s command line; unset, its default under ``LCHAT_OPT_DIR`` when that is set (the
    build tree ``lchat deploy`` repoints: ``<opt>/live/{host}``, lchat/builds.py)."""
    text = merged[name].strip() if name in merged else DEFAULTS[name]
    opt = merged.get("LCHAT_OPT_DIR", "").strip().rstrip("/")
    if name not in merged and opt and text.startswith("/opt/lchat/"):
        text = shlex.quote(opt + text[len("/opt/lchat") :])
    if "\x00" in text:
        raise ConfigError(f"{name} contains a NUL byte")
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"{name}={text!r}: {e}") from e
    if not argv:
        raise ConfigError(f"{name} is empty")
    return tuple(argv)


def _capacity(get: Getter) -> tuple[int, int, int]:
    """(LCHAT_MAX_INSTANCES, LCHAT_MAX_REGISTERED, LCHAT_MAX_AWAKE): whole numbers, 0 = no
    limit; the second defaults to ten times the first."""

    def limit(name: str, text: str) -> int:
        if not re.fullmatch(r"[0-9]{1,9}", text):
            raise ConfigError(f"{name}={text!r} must be a whole number (0: no limit)")
        return int(text)

    instances = limit("LCHAT_MAX_INSTANCES", get("LCHAT_MAX_INSTANCES"))
    registered_text = get("LCHAT_MAX_REGISTERED")
    registered = (
        limit("LCHAT_MAX_REGISTERED", registered_text) if registered_text else 10 * instances
    )
    return instances, registered, limit("LCHAT_MAX_AWAKE", get("LCHAT_MAX_AWAKE"))


def mesh_bucket(cfg: BoxConfig) -> Where:
    """Where the mesh's heartbeats live (``<prefix>/mesh/members/``): ``LCHAT_MESH_BUCKET``, else
    the hibernation bucket. Only for a box with a mesh (which always has a hibernation bucket)."""
    assert cfg.mesh is not None and cfg.hibernate is not None
    return cfg.mesh.bucket or cfg.hibernate.where
