"""``lchat relocate --move-dns``: repoint a relocated space's address records at its new region.

Optional, and not needed for correctness: the wildcard record and the mesh's forward-to-owner
already route a relocated space through the DNS-TTL window; a record of the host's own that names
the destination region's boxes only saves the forwarding hop (docs/mesh.md, "Relocating a space").

Two parts, both blocking (the relocate command is synchronous, and Route53 is botocore):
:func:`destination_addresses` (the destination region's live boxes' addresses), then
:func:`move_dns` (the host's own ``A``/``AAAA`` records made exactly those, through the box's
Route53 DNS-01 provider). A zone's wildcard record is never touched.

Every refusal and failure is a :class:`MoveDNSError` whose message says what to fix; nothing is
written when one is raised before the Route53 change.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from attrs import frozen

from lchat import hosts
from lchat.config import BoxConfig
from lchat.dns import (
    AddressChange,
    DNSProviderError,
    Route53,
    canonical_addresses,
    make_provider,
)
from lchat.handover import HandoverError
from lchat.objstore.aws import NoCredentials, box_credentials

DEFAULT_TTL = 60  # seconds: short, so a later move (or a move back) is seen soon

Resolve = Callable[[str], list[str]]


class MoveDNSError(HandoverError):
    """``--move-dns`` refused or failed; the message names what to fix."""


def system_resolve(name: str) -> list[str]:
    """``name``'s A and AAAA addresses from the system resolver (``getaddrinfo``), deduplicated
    and sorted; ``OSError`` (``socket.gaierror``) when it does not resolve."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    found = {str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
    return list(canonical_addresses(found))


def destination_addresses(
    member_urls: Sequence[str], resolve: Resolve = system_resolve
) -> list[str]:
    """The addresses the host's records should name: those of the boxes whose
    ``LCHAT_MESH_SELF`` URLs are ``member_urls`` (the destination region's live boxes).

    An IP-literal URL host is used as it is; a name is resolved with ``resolve`` (A and AAAA).
    Deduplicated, IPv4 first, each family in numeric order. Raises :class:`MoveDNSError` for no
    URL at all, a URL that is not a member URL, and a name that does not resolve (naming it)."""
    if not member_urls:
        raise MoveDNSError(
            "--move-dns: the destination region has no live box, so there is no address to point "
            "the record at; DNS left as it is"
        )
    found: list[str] = []
    for url in member_urls:
        try:
            host = urlsplit(hosts.normalise_member_url(url)).hostname or ""
        except ValueError as e:
            raise MoveDNSError(f"--move-dns: {e}") from None
        try:
            found.append(str(ipaddress.ip_address(host)))
            continue
        except ValueError:
            pass  # a name
        try:
            addresses = resolve(host)
        except (OSError, UnicodeError) as e:
            raise MoveDNSError(
                f"--move-dns: {host} (the LCHAT_MESH_SELF of destination box {url}) does not "
                f"resolve ({e}); DNS left as it is: fix its name or give that box an IP-literal "
                f"LCHAT_MESH_SELF"
            ) from None
        if not addresses:
            raise MoveDNSError(
                f"--move-dns: {host} (the LCHAT_MESH_SELF of destination box {url}) resolves to "
                f"no address; DNS left as it is"
            )
        found.extend(addresses)
    try:
        return list(canonical_addresses(found))
    except ValueError as e:
        raise MoveDNSError(f"--move-dns: a destination box's address: {e}") from None


@frozen
class MovedDNS:
    """What ``--move-dns`` did: the Route53 change, and warnings an operator should read."""

    change: AddressChange
    warnings: tuple[str, ...] = ()

    @property
    def line(self) -> str:
        """``dns: <host> A 10.0.0.1 → 10.0.0.9 (Route53 zone Z..)``: each family that had or has
        addresses; ``(none)`` for a family that had none or has none any more."""
        c = self.change
        if not c.changed:
            return (
                f"dns: {c.fqdn} {_describe(c.after)} already (Route53 zone {c.zone_id}): "
                f"nothing to change"
            )
        parts = []
        for rtype, version in (("A", 4), ("AAAA", 6)):
            old = [a for a in c.before if ipaddress.ip_address(a).version == version]
            new = [a for a in c.after if ipaddress.ip_address(a).version == version]
            if old or new:
                parts.append(f"{rtype} {', '.join(old) or '(none)'} → {', '.join(new) or '(none)'}")
        return f"dns: {c.fqdn} {'; '.join(parts)} (Route53 zone {c.zone_id}, TTL {c.ttl}s)"

    def as_json(self) -> dict[str, Any]:
        """For ``lchat relocate --json``'s ``dns`` member."""
        c = self.change
        return {
            "host": c.fqdn,
            "provider": "route53",
            "zone_id": c.zone_id,
            "before": list(c.before),
            "after": list(c.after),
            "ttl": c.ttl,
            "changed": c.changed,
            "change_id": c.change_id,
            "warnings": list(self.warnings),
        }


def _describe(addresses: Sequence[str]) -> str:
    v4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
    v6 = [a for a in addresses if ipaddress.ip_address(a).version == 6]
    return "; ".join(
        f"{rtype} {', '.join(family)}" for rtype, family in (("A", v4), ("AAAA", v6)) if family
    )


def route53_from_config(cfg: BoxConfig) -> Route53:
    """The Route53 provider the router's ACME issuer builds (``lchat.tap``): the
    ``LCHAT_ROUTE53_ZONE_ID`` / ``LCHAT_ROUTE53_ENDPOINT`` settings, and the AWS credentials the
    standard chain resolves from the process environment over the env file's ``AWS_*``. Blocking
    (the chain may read files or ask the instance role)."""
    acme = cfg.acme
    assert acme is not None and acme.dns_provider == "route53"
    try:
        aws = box_credentials(cfg)
    except NoCredentials as e:
        raise MoveDNSError(f"--move-dns: LCHAT_DNS_PROVIDER=route53: {e}") from None
    provider = make_provider(
        "route53",
        route53_zone_id=acme.route53_zone_id,
        route53_endpoint=acme.route53_endpoint,
        route53_session=aws.session,
        sleep=time.sleep,
        clock=time.monotonic,
        now=time.time,
    )
    assert isinstance(provider, Route53)
    return provider


def require_route53(cfg: BoxConfig, host: str) -> None:
    """Raise :class:`MoveDNSError` unless the box's DNS-01 provider is Route53. No I/O: the
    relocate command may call it before it copies or flips anything, to refuse ``--move-dns``
    up front rather than after the move."""
    acme = cfg.acme
    if acme is None:
        raise MoveDNSError(
            "--move-dns repoints DNS through the box's DNS-01 provider, which must be Route53 "
            "(LCHAT_DNS_PROVIDER=route53), but ACME is off on this box (LCHAT_ACME_DIRECTORY=off), "
            f"so no DNS provider is configured; {host}'s record was left as it is: repoint it by "
            "hand, or re-run without --move-dns"
        )
    if acme.dns_provider != "route53":
        raise MoveDNSError(
            f"--move-dns works with Route53 only, and this box's DNS-01 provider is "
            f"{acme.dns_provider} (LCHAT_DNS_PROVIDER={acme.dns_provider}); {host}'s record was "
            f"left as it is: repoint it at the destination's boxes by hand, or re-run without "
            f"--move-dns"
        )


def move_dns(
    cfg: BoxConfig,
    host: str,
    addresses: Sequence[str],
    *,
    ttl: int = DEFAULT_TTL,
    provider_factory: Callable[[BoxConfig], Route53] = route53_from_config,
) -> MovedDNS:
    """Make ``host``'s own address records exactly ``addresses`` through the box's Route53
    DNS-01 provider; what was there before and what is there now.

    Refused, before anything is written, unless the box's DNS provider is Route53
    (``LCHAT_DNS_PROVIDER=route53``, which is read only with ACME on). Re-running with the same
    addresses is a no-op (``change.changed`` is False). Addresses that are not public (private,
    loopback, ...) are written, with a warning: the record is public, and the mesh URL that
    named them may be the box's internal address."""
    try:
        name = hosts.normalise(host)
    except hosts.InvalidHost as e:
        raise MoveDNSError(f"--move-dns: {e}") from None
    require_route53(cfg, name)
    try:
        provider = provider_factory(cfg)
        change = provider.point_address(name, addresses, ttl)
    except DNSProviderError as e:
        raise MoveDNSError(f"--move-dns: {e}") from None
    warnings = tuple(
        f"{address} is not a public address, and {name}'s record is public: is LCHAT_MESH_SELF "
        f"the box's public address?"
        for address in change.after
        if not ipaddress.ip_address(address).is_global
    )
    return MovedDNS(change, warnings)
