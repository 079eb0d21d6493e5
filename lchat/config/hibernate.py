"""The box's buckets of its own: hibernation (``LCHAT_HIBERNATE_*``: parked databases, leases,
the mesh's heartbeats by default) and the fleet backup (``LCHAT_BACKUP_*``, docs/backup.md)."""

from __future__ import annotations

import re
import socket
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from attrs import asdict, field, frozen

from lchat.config.values import ConfigError, Getter, aes_key, parse_duration, positive_duration
from lchat.objstore.where import Where, file_bucket

if TYPE_CHECKING:
    from lchat.config.mesh import MeshConfig


@frozen
class BucketSettings:
    """A bucket given in parts: ``<stem>_BUCKET``, ``_REGION``, ``_PREFIX``, ``_ENDPOINT``."""

    bucket: str
    region: str
    prefix: str
    endpoint: str

    @property
    def where(self) -> Where:
        """The bucket as one value (``region`` is its S3 signing region)."""
        return Where(self.bucket, self.prefix, self.region, self.endpoint)

    def key(self, *parts: str) -> str:
        """An object key under the configured prefix."""
        return self.where.key(*parts)


@frozen
class HibernateConfig(BucketSettings):
    idle: float  # seconds with nothing in flight before a space sleeps
    lease_ttl: float = 900.0  # a space's lease lives this long unless renewed (renewed at a third)
    sweep: float = 5.0  # the idle sweep's period
    due_sweep: float = 30.0  # the due-wake sweep's period (worst-case lateness of a due wake)


@frozen
class BackupConfig(BucketSettings):
    """The router's own backup of every database it does not hibernate (docs/backup.md)."""

    box: str  # this box's segment: <prefix>/<box>/<database name>/
    interval: float = 10.0  # the longest a commit waits before it is in the backup
    # Globs under the data dir: the databases backed up beside the registry and the instances
    # (LCHAT_BACKUP_EXTRA; EVERY_DB unless it says `none`).
    extra: tuple[str, ...] = ()
    # AES-256 key for the spaces' env files (their secrets) in the backup; b"": not backed up.
    env_key: bytes = field(default=b"", repr=False)
    # LCHAT_BACKUP_ENV=unprotected: the operator accepts running without env_key while env files
    # exist (else the router refuses to start; lchat.backup.envfiles.unprotected).
    env_unprotected: bool = False
    # LCHAT_BACKUP_CONFIG: an external Litestream's config; the databases it lists are left out
    # (two replicators on one database corrupt each other). An absent file lists nothing.
    external_config: str = "/etc/litestream.yml"


EVERY_DB = "*.db"  # LCHAT_BACKUP_EXTRA's default: every top-level database of the data dir
NO_DEFAULT = "none"  # in LCHAT_BACKUP_EXTRA: not EVERY_DB (only the globs given beside it)
UNPROTECTED = "unprotected"  # LCHAT_BACKUP_ENV's one value


# LCHAT_LEASE_TTL's defaults. Off a mesh the TTL is the only way a dead holder's lease frees up
# (renewed every TTL/3: 12 writes per awake space-hour). On a mesh box the holder's heartbeat
# fences its leases, so a peer takes over a dead box's spaces within dead_after; the TTL is only
# the backstop for a lease its live box leaked (renewed every 40 min: at most 3 lease requests
# per awake space-hour with the acquire and the release).
SOLO_LEASE_TTL = "15m"
MESH_LEASE_TTL = "2h"


def read_hibernate(get: Getter) -> HibernateConfig | None:
    idle = positive_duration(get, "LCHAT_HIBERNATE_IDLE")
    ttl_text = get("LCHAT_LEASE_TTL") or (
        MESH_LEASE_TTL if get("LCHAT_MESH_SELF") else SOLO_LEASE_TTL
    )
    lease_ttl = parse_duration("LCHAT_LEASE_TTL", ttl_text)
    if lease_ttl < 3:
        raise ConfigError("LCHAT_LEASE_TTL must be at least 3s (it is renewed at a third)")
    sweep = positive_duration(get, "LCHAT_HIBERNATE_SWEEP")
    due_sweep = positive_duration(get, "LCHAT_DUE_SWEEP")
    at = _bucket(get, "LCHAT_HIBERNATE")
    if at is None:
        return None
    return HibernateConfig(
        **asdict(at),
        idle=idle,
        lease_ttl=lease_ttl,
        sweep=sweep,
        due_sweep=due_sweep,
    )


def _bucket(get: Getter, stem: str) -> BucketSettings | None:
    """``<stem>_BUCKET``, ``_REGION``, ``_ENDPOINT`` and ``_PREFIX`` checked, or None when the
    bucket is not set."""
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
    return BucketSettings(bucket, get(f"{stem}_REGION"), prefix, endpoint.rstrip("/"))


def read_backup(
    get: Getter, hibernate: HibernateConfig | None, mesh: MeshConfig | None
) -> BackupConfig | None:
    interval = positive_duration(get, "LCHAT_BACKUP_INTERVAL")
    given = [p for p in re.split(r"[\s,]+", get("LCHAT_BACKUP_EXTRA")) if p]
    # Every top-level database by default (the seeds' "every /data/*.db"); `none` drops the
    # default, and any other glob adds to what remains.
    default = [] if NO_DEFAULT in given else [EVERY_DB]
    extra = tuple(dict.fromkeys(default + [p for p in given if p != NO_DEFAULT]))
    for pattern in extra:
        if "\x00" in pattern or pattern.startswith("/") or ".." in pattern.split("/"):
            raise ConfigError(
                f"LCHAT_BACKUP_EXTRA: {pattern!r} must be a glob relative to LCHAT_DATA_DIR "
                f"(such as home.db or services/*.db)"
            )
    at = _bucket(get, "LCHAT_BACKUP")
    if at is None:
        return None
    box = get("LCHAT_BACKUP_BOX") or (mesh.self_host if mesh is not None else socket.gethostname())
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", box) or box in (".", ".."):
        raise ConfigError(
            f"LCHAT_BACKUP_BOX={box!r} must be a name of letters, digits, '.', '_' and '-' "
            f"(it is a key segment of the backup layout; default: this box's host name)"
        )
    if hibernate is not None and (hibernate.bucket, hibernate.endpoint) == (at.bucket, at.endpoint):
        # One bucket, two layouts: <hibernate prefix>/<host>/ and <backup prefix>/<box>/<db>/.
        inside, prefix = hibernate.prefix, at.prefix
        if not prefix or prefix == inside or (inside and prefix.startswith(inside + "/")):
            raise ConfigError(
                f"LCHAT_BACKUP_PREFIX={prefix!r}: the backup shares the hibernation bucket "
                f"{at.bucket}, so it needs a prefix of its own, outside LCHAT_HIBERNATE_PREFIX="
                f"{inside!r} (such as backup)"
            )
    key_text = get("LCHAT_BACKUP_KEY")
    env_policy = get("LCHAT_BACKUP_ENV")
    if env_policy not in ("", UNPROTECTED):
        raise ConfigError(
            f"LCHAT_BACKUP_ENV={env_policy!r}: the only value is {UNPROTECTED} (run without "
            f"LCHAT_BACKUP_KEY, the spaces' env files not in the backup); unset: the key is "
            f"required once any env file exists"
        )
    return BackupConfig(
        **asdict(at),
        box=box,
        interval=interval,
        extra=extra,
        env_key=aes_key("LCHAT_BACKUP_KEY", key_text) if key_text else b"",
        env_unprotected=env_policy == UNPROTECTED,
        external_config=get("LCHAT_BACKUP_CONFIG").strip() or "/etc/litestream.yml",
    )
