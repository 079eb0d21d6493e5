"""DNS hosts we write records into: DNSimple (``LCHAT_DNSIMPLE_TOKEN``, the default) and Route53
(``LCHAT_DNS_PROVIDER=route53``, with the box's own AWS credentials, so no DNS secret sits on
disk). ACME's DNS-01 challenge (:mod:`lchat.acme.dns01`) puts its TXT values through them, and
``lchat relocate --move-dns`` repoints a host's address records through Route53
(:meth:`Route53.point_address`): the one write that is not a challenge TXT.

Everything here is *blocking* (plain synchronous HTTP): callers run it in a worker thread, never
on the reactor (docs/design.md §10, invariant 6). Constructors do no I/O, so a provider may be
built at boot on the reactor thread; the first call does the lookups.

Semantics both providers keep:
- A TXT value at a name is a set member. ``add_txt`` of a value already there is a no-op that
  returns the existing record, and ``remove_txt`` drops *that value* and nothing else: other
  values at the same name survive (the wildcard and the bare domain share
  ``_acme-challenge.<domain>``, so two challenges for one name are normal; so is an unrelated
  TXT a human put there). Two holders of one (name, value) pair, which only happens when two
  orders share one authorization, must therefore not interleave their add and remove.
- ``remove_txt`` is idempotent: a record that is already gone is success.
- Errors are :class:`DNSProviderError` with a message that names the provider and the operation,
  and never contains a token.

"""

from __future__ import annotations

from collections.abc import Callable

import botocore.session  # type: ignore[import-untyped]

from lchat.dns.dnsimple import DEFAULT_DNSIMPLE_URL, DNSimple
from lchat.dns.records import DNSProvider, DNSProviderError, TXTRecord
from lchat.dns.route53 import AddressChange, Route53, canonical_addresses


def make_provider(
    name: str,
    *,
    dnsimple_token: str = "",
    dnsimple_url: str = "",
    route53_zone_id: str = "",
    route53_endpoint: str = "",
    dnsimple_account: str = "",
    route53_session: botocore.session.Session | None = None,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    now: Callable[[], float],
) -> DNSProvider:
    """The provider ``LCHAT_DNS_PROVIDER`` names (empty: DNSimple, the default), or ``ValueError``
    naming the variable to fix (invariant 7: misconfiguration fails at boot). Does no I/O.

    The providers block in worker threads: ``sleep`` waits between polls and retries, ``clock``
    (monotonic) bounds waits, ``now`` (unix seconds) reads an HTTP-date ``Retry-After``.

    ``route53_session`` is the botocore session whose credentials Route53 uses: the router's,
    resolved once at boot (``lchat.objstore.aws.ResolvedCredentials.session``); without it,
    botocore's default chain over the process environment."""
    kind = name.strip().lower() or "dnsimple"
    if kind == "dnsimple":
        if not dnsimple_token.strip():
            raise ValueError(
                "LCHAT_DNSIMPLE_TOKEN is required for the dnsimple DNS provider "
                "(or set LCHAT_DNS_PROVIDER=route53)"
            )
        return DNSimple(
            dnsimple_token.strip(),
            sleep=sleep,
            now=now,
            base_url=dnsimple_url or DEFAULT_DNSIMPLE_URL,
            account_id=dnsimple_account,
        )
    if kind == "route53":
        return Route53(
            zone_id=route53_zone_id,
            endpoint_url=route53_endpoint,
            session=route53_session,
            sleep=sleep,
            clock=clock,
        )
    raise ValueError(
        f"LCHAT_DNS_PROVIDER={name!r} is not a DNS provider we know (dnsimple or route53)"
    )


__all__ = [
    "AddressChange",
    "DNSProvider",
    "DNSProviderError",
    "DNSimple",
    "Route53",
    "TXTRecord",
    "canonical_addresses",
    "make_provider",
]
