"""The mesh's settings (``LCHAT_MESH_*``: docs/mesh.md), the cloud's (``LCHAT_CLOUD_*``: the
default home region, the shared id ledger) and every region's bucket (``LCHAT_REGION_BUCKETS``)."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from attrs import field, frozen

from lchat.config.values import ConfigError, Getter, domains, parse_bucket_url, parse_duration
from lchat.objstore.where import Where, parse_where

if TYPE_CHECKING:
    from lchat.config.hibernate import HibernateConfig

# A region's label (LCHAT_MESH_REGION, LCHAT_CLOUD_REGION, LCHAT_REGION_BUCKETS' keys).
REGION_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_LABEL_CHARACTERS = "letters, digits, '.', '_' and '-'"
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
    # LCHAT_MESH_SYNC: how often this box compares its spaces' settings generations with every
    # live peer's and takes the newer (lchat.mesh.sync, docs/mesh.md, "Anti-entropy").
    sync: float = 300.0
    # LCHAT_REGION_FAILOVER_AFTER: the operator's consent to serve, on this box and from its home
    # region's own bucket, a space whose home region has had no live box for this long (docs/
    # mesh.md, "Regional failover"). None ("off", the default): such a space gets 503
    # region_down until a box of its region is back. Never below ``dead_after``.
    region_failover_after: float | None = None

    @property
    def self_host(self) -> str:
        """The hostname of ``self_url``: requests addressed to it are for this box's mesh API."""
        return (urlsplit(self.self_url).hostname or "").lower()


def read_mesh(get: Getter) -> MeshConfig | None:
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
    names = domains("LCHAT_MESH_DOMAINS", get("LCHAT_MESH_DOMAINS"))
    if not names:
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
    region = _region(get, "LCHAT_MESH_REGION")
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
    sync = parse_duration("LCHAT_MESH_SYNC", get("LCHAT_MESH_SYNC"))
    if sync < 1:
        raise ConfigError("LCHAT_MESH_SYNC must be at least 1s (the settings' anti-entropy)")
    failover = _failover_after(get, dead_after)
    ca_file = get("LCHAT_MESH_CA_FILE")
    if ca_file and not os.path.isfile(ca_file):
        raise ConfigError(f"LCHAT_MESH_CA_FILE={ca_file!r} is not a file")
    bucket_url = get("LCHAT_MESH_BUCKET").strip()
    bucket = parse_bucket_url("LCHAT_MESH_BUCKET", bucket_url) if bucket_url else None
    accept_token = get("LCHAT_MESH_TOKEN_ACCEPT")
    return MeshConfig(
        self_url=self_url.rstrip("/"),
        domains=names,
        token=token,
        region=region,
        heartbeat=heartbeat,
        dead_after=dead_after,
        outage_tolerance=tolerance,
        sync=sync,
        region_failover_after=failover,
        ca_file=ca_file,
        bucket=bucket,
        # Equal to the token it accepts nothing more: dropped here, and load() warns.
        accept_token="" if accept_token == token else accept_token,
    )


def _failover_after(get: Getter, dead_after: float) -> float | None:
    """``LCHAT_REGION_FAILOVER_AFTER``: ``off`` (None), or a duration of at least
    ``LCHAT_MESH_DEAD_AFTER`` (a region is not known to be empty before its last box could be
    judged gone: a shorter grace would only ever equal that)."""
    text = get("LCHAT_REGION_FAILOVER_AFTER").strip()
    if text.lower() == "off":
        return None
    after = parse_duration("LCHAT_REGION_FAILOVER_AFTER", text)
    if after < dead_after:
        raise ConfigError(
            f"LCHAT_REGION_FAILOVER_AFTER={text} is shorter than LCHAT_MESH_DEAD_AFTER="
            f"{get('LCHAT_MESH_DEAD_AFTER')}: a region counts as empty only once its last box is "
            f"judged gone; set it to at least that, or to off"
        )
    return after


def read_cloud(get: Getter) -> tuple[str, Where | None]:
    """LCHAT_CLOUD_REGION and LCHAT_CLOUD_ID_LEDGER."""
    region = _region(get, "LCHAT_CLOUD_REGION")
    text = get("LCHAT_CLOUD_ID_LEDGER")
    try:
        ledger = parse_where(text, keys=False) if text else None
    except ValueError as e:
        raise ConfigError(f"LCHAT_CLOUD_ID_LEDGER={e}") from e
    return region, ledger


def _region(get: Getter, name: str) -> str:
    """``name``'s region label, or ""."""
    region = get(name)
    if region and not REGION_LABEL.fullmatch(region):
        raise ConfigError(f"{name}={region!r}: {_LABEL_CHARACTERS} (at most 64)")
    return region


def read_region_buckets(
    get: Getter, hibernate: HibernateConfig | None, mesh: MeshConfig | None
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
        if not REGION_LABEL.fullmatch(region):
            raise ConfigError(f"LCHAT_REGION_BUCKETS: region {region!r}: {_LABEL_CHARACTERS}")
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
