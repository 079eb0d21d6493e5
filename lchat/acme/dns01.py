"""DNS-01 challenge records: the challenge TXT goes to ``_acme-challenge.<domain>`` through the
box's DNS host (:mod:`lchat.dns`: DNSimple or Route53), and :func:`wait_for_txt` waits until the
zone's authoritative servers see it. Wildcard certificates can only be validated over DNS-01.

Everything here is *blocking* (DNS queries, sleeps): the ACME issuer calls it from its worker
thread, never from the reactor (docs/design.md §10, invariant 6).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence

import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver
from attrs import field, frozen

from lchat.dns.records import DNSProviderError, log, normalise_fqdn


class PropagationTimeout(DNSProviderError):
    """A TXT value did not become visible in time. The message names the name and what was seen."""


@frozen
class _Target:
    """One server the propagation wait asks: ``label`` in logs and errors, ``resolver`` to ask."""

    label: str
    resolver: dns.resolver.Resolver = field(eq=False)


class _NoServers(Exception):
    """Discovery found no authoritative server to ask; the message says why."""


def wait_for_txt(
    fqdn: str,
    values: Collection[str],
    *,
    resolvers: Sequence[tuple[str, int]] = (),
    timeout: float = 120.0,
    interval: float = 2.0,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    query_timeout: float = 5.0,
    discovery: dns.resolver.Resolver | None = None,
    authoritative_port: int = 53,
) -> None:
    """Block until every one of ``values`` is in the TXT answer for ``fqdn``.

    With ``resolvers`` each ``(ip, port)`` must see all of them (the authoritative servers, or a
    test's DNS server). Without, the authoritative name servers of the zone holding ``fqdn`` are
    found through the ``discovery`` resolver (the system's by default): the zone apex
    (``zone_for_name``), its NS set, and each NS name's A and AAAA addresses (names that do not
    resolve are skipped). Each of those servers is asked directly (RD off, TCP on truncation, at
    ``authoritative_port``; a server with several addresses answers through the first that
    responds, IPv4 first) and must see all the values. A recursive resolver is not asked because
    our first poll, just after the record is created, usually gets NXDOMAIN, and a recursive
    resolver caches that for the zone's negative TTL, which can be longer than ``timeout``. If
    discovery finds no server (no zone, no NS, no address, every lookup failing), the discovery
    resolver itself is polled as the last resort, with one warning.

    NXDOMAIN, an empty answer, SERVFAIL and timeouts all mean "not yet". A server that has seen
    everything is not asked again. After ``timeout`` seconds (discovery included) raise
    :class:`PropagationTimeout` naming the name and what each lagging server saw. Discovery
    errors never raise; only a system with no resolver configured at all (no discovery resolver
    given) raises :class:`DNSProviderError` at once, since there is nothing to poll.
    """
    fqdn = normalise_fqdn(fqdn)
    wanted = set(values)
    deadline = clock() + timeout
    if resolvers:
        targets = [_Target(_where(t), _resolver(t, query_timeout)) for t in resolvers]
    else:
        targets = _authoritative_targets(
            fqdn, discovery, authoritative_port, query_timeout, clock, deadline
        )
    seen: dict[int, str] = {}
    pending = list(range(len(targets)))
    polls = 0
    while True:
        polls += 1
        still: list[int] = []
        for i in pending:
            got, why = _query_txt(targets[i].resolver, fqdn)
            if wanted <= got:
                continue
            missing = len(wanted - got)
            seen[i] = why or f"{len(got)} TXT values seen, {missing} of ours missing"
            still.append(i)
        pending = still
        if not pending:
            log.info(
                "acme: dns TXT {fqdn} visible at {where} after {polls} polls",
                fqdn=fqdn,
                where=", ".join(t.label for t in targets),
                polls=polls,
            )
            return
        remaining = deadline - clock()
        if remaining <= 0:
            lagging = "; ".join(f"{targets[i].label}: {seen[i]}" for i in pending)
            raise PropagationTimeout(
                f"TXT {fqdn} not visible after {timeout:.0f}s ({polls} polls): {lagging}"
            )
        log.debug(
            "acme: dns TXT {fqdn} not visible yet at {where}; polling again",
            fqdn=fqdn,
            where=", ".join(targets[i].label for i in pending),
        )
        sleep(min(interval, remaining))


def _authoritative_targets(
    fqdn: str,
    discovery: dns.resolver.Resolver | None,
    port: int,
    query_timeout: float,
    clock: Callable[[], float],
    deadline: float,
) -> list[_Target]:
    """The zone's authoritative servers to poll, or, when none can be found, the discovery
    resolver itself (with a warning)."""
    finder = discovery if discovery is not None else _resolver(None, query_timeout)
    try:
        zone, servers, skipped = _discover(fqdn, finder, query_timeout, clock, deadline)
    except _NoServers as exc:
        fallback = copy.copy(finder)  # the caller's resolver (or the system's), with our timeouts
        fallback.timeout = fallback.lifetime = query_timeout
        label = "the system resolver" if discovery is None else "the discovery resolver"
        log.warn(
            "acme: dns TXT {fqdn}: cannot find the authoritative name servers of its zone "
            "({why}); polling {where} instead, whose cached NXDOMAIN can outlast the wait: "
            "set LCHAT_DNS_RESOLVERS to the zone's authoritative servers",
            fqdn=fqdn,
            why=str(exc),
            where=label,
        )
        return [_Target(label, fallback)]
    targets = [
        _Target(
            f"{name} ({', '.join(_where((a, port)) for a in addresses)})",
            _authoritative_resolver(addresses, port, query_timeout),
        )
        for name, addresses in servers
    ]
    log.info(
        "acme: dns TXT {fqdn}: polling the authoritative servers of zone {zone}: {servers}{skipped}",
        fqdn=fqdn,
        zone=zone,
        servers=", ".join(t.label for t in targets),
        skipped=f" (skipped, no address: {'; '.join(skipped)})" if skipped else "",
    )
    return targets


def _discover(
    fqdn: str,
    finder: dns.resolver.Resolver,
    query_timeout: float,
    clock: Callable[[], float],
    deadline: float,
) -> tuple[str, list[tuple[str, list[str]]], list[str]]:
    """``(zone, [(ns name, [addresses])], [skipped ns name: why])`` for the zone holding ``fqdn``,
    every lookup through ``finder``; raises :class:`_NoServers` when no server has an address."""
    try:
        apex = dns.resolver.zone_for_name(fqdn + ".", resolver=finder, lifetime=query_timeout)
    except (dns.exception.DNSException, OSError) as exc:
        raise _NoServers(f"finding the zone: {_describe(exc)}") from None
    zone = apex.to_text().rstrip(".").lower()
    if not zone:
        raise _NoServers("the only zone above it is the root")
    try:
        answer = finder.resolve(
            apex, dns.rdatatype.NS, search=False, raise_on_no_answer=False, lifetime=query_timeout
        )
    except (dns.exception.DNSException, OSError) as exc:
        raise _NoServers(f"NS {zone}: {_describe(exc)}") from None
    names = sorted(
        {str(getattr(rdata, "target", "")).rstrip(".").lower() for rdata in answer.rrset or ()}
        - {""}
    )
    if not names:
        raise _NoServers(f"zone {zone} has no NS records")
    servers: list[tuple[str, list[str]]] = []
    skipped: list[str] = []
    for name in names:
        addresses: list[str] = []
        failures: list[str] = []
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            if clock() >= deadline:
                failures.append("out of time")
                break
            try:
                found = finder.resolve(
                    name + ".",
                    rdtype,
                    search=False,
                    raise_on_no_answer=False,
                    lifetime=query_timeout,
                )
            except (dns.exception.DNSException, OSError) as exc:
                failures.append(f"{dns.rdatatype.to_text(rdtype)} {_describe(exc)}")
                continue
            addresses += [str(rdata) for rdata in found.rrset or ()]
        if addresses:
            servers.append((name, addresses))
        else:
            skipped.append(f"{name}: {', '.join(failures) or 'no A or AAAA records'}")
    if not servers:
        raise _NoServers(f"no address for the name servers of zone {zone} ({'; '.join(skipped)})")
    return zone, servers, skipped


def _where(target: tuple[str, int]) -> str:
    host, port = target
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolver(target: tuple[str, int] | None, query_timeout: float) -> dns.resolver.Resolver:
    try:
        if target is None:
            resolver = dns.resolver.Resolver()
        else:
            resolver = dns.resolver.Resolver(configure=False)
            resolver.nameservers = [dns.nameserver.Do53Nameserver(target[0], target[1])]
    except dns.exception.DNSException as exc:  # no /etc/resolv.conf, say
        raise DNSProviderError(f"cannot set up a DNS resolver: {exc}") from None
    resolver.timeout = query_timeout
    resolver.lifetime = query_timeout
    return resolver


def _authoritative_resolver(
    addresses: Sequence[str], port: int, query_timeout: float
) -> dns.resolver.Resolver:
    """Non-recursive queries to one name server at any of its addresses, in order (dnspython goes
    on to the next on a timeout or network error, and retries over TCP when UDP is truncated)."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(a, port) for a in addresses]
    resolver.flags = 0  # RD off: the server answers from its own zone data
    resolver.timeout = query_timeout
    resolver.lifetime = query_timeout * len(addresses)
    return resolver


def _describe(exc: BaseException) -> str:
    if isinstance(exc, dns.resolver.NXDOMAIN):
        return "NXDOMAIN"
    if isinstance(exc, dns.resolver.NoRootSOA):
        return "no SOA record at the name or any name above it"
    if isinstance(exc, dns.exception.Timeout):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def _query_txt(resolver: dns.resolver.Resolver, fqdn: str) -> tuple[set[str], str]:
    """The TXT values the resolver answers for ``fqdn``, and why there are none if so."""
    try:
        answer = resolver.resolve(
            fqdn + ".", dns.rdatatype.TXT, search=False, raise_on_no_answer=False
        )
    except (dns.exception.DNSException, OSError) as exc:
        return set(), _describe(exc)
    got: set[str] = set()
    for rdata in answer.rrset or ():
        strings: Sequence[bytes] = getattr(rdata, "strings", ())
        got.add(b"".join(strings).decode("utf-8", "replace"))
    return got, "" if got else "no TXT records"
