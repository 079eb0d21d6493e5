"""Rate limits and the client address they are keyed on (docs/home.md, "Limits").

Home is on the open internet: anyone may register an account with a software authenticator. Every
cost a client can make home pay is bounded by a **keyed token bucket** (:class:`TokenBuckets`):

- per client address: every request; failed authentications (a 401: a bad link token, proof or
  passkey assertion); registrations; plus one bucket for all registrations together;
- per account, only once a link token proved it (so nobody can spend a victim's allowance
  before logging in as them): authenticated requests, vault writes, link tokens minted,
  devices revoked (each a marker every replica lists).

Invariants:

- **A refusal writes nothing and costs nothing.** :meth:`Limits.take` first checks every bucket
  it is given and takes from them only if all have room; a refused request is answered ``429``
  with ``Retry-After`` (the seconds until the bucket holds the cost again, rounded up).
- **Failures never lock an account.** Failures are counted per client address only: an attacker
  failing logins from its address slows itself, never the victim's logins from theirs.
- **Memory is bounded.** Each limit tracks at most ``max_keys`` keys; past that the least
  recently touched key is forgotten (which forgives it: an attacker would need that many
  addresses to reset its own), and buckets that filled up again are dropped as new keys come.
- Time is the injected ``clock`` (unix seconds): ``task.Clock().seconds`` in tests.

The client address (:func:`client_address`): on the unix socket only the router connects (mode
0660), and it appends the address it accepted the connection from as the **last**
``X-Forwarded-For`` entry (earlier entries are whatever the client sent, never believed). On
``LCHAT_HOME_TCP`` the peer's own address counts, unless it is one of
``LCHAT_HOME_TRUSTED_PROXIES`` (a load balancer that appends the same way). IPv6 addresses are
keyed by their /64: one host is usually given a whole /64.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from attrs import define, field, frozen
from prometheus_client import Counter, Gauge
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.logger import Logger
from twisted.web.http_headers import Headers

_log = Logger(namespace="lchat.home")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
DEFAULT_MAX_KEYS = 100_000  # tracked keys per limit (~150 bytes each)
LOG_EVERY = 60.0  # seconds: at most one log line per limit in this time, with a count

LIMITED = Counter(
    "lchat_home_limited_total",
    "Requests refused with 429 by a rate limit, by limit (ip, failures_ip, register_ip, register, "
    "account, vault_writes, mints, revocations)",
    ["limit"],
)
TRACKED = Gauge(
    "lchat_home_limit_keys",
    "Keys (client addresses, accounts) a rate limit tracks now; bounded by LCHAT_HOME_LIMIT_KEYS",
    ["limit"],
)
EVICTED = Counter(
    "lchat_home_limit_evictions_total",
    "Keys a rate limit forgot while still short of a full bucket, because it tracked "
    "LCHAT_HOME_LIMIT_KEYS keys (a steady rise: raise it, or many addresses are at work)",
    ["limit"],
)


@frozen
class Rate:
    """``count`` per ``seconds``: a bucket of ``count`` tokens, refilled at ``count/seconds`` a
    second. ``count == 0`` disables the limit."""

    count: int
    seconds: float

    @property
    def enabled(self) -> bool:
        return self.count > 0

    def __str__(self) -> str:
        return f"{self.count}/{self.seconds:g}" if self.enabled else "off"


class RateLimited(Exception):
    """A limit refused a request: answer 429 with ``Retry-After: ceil(retry_after)``."""

    def __init__(self, limit: str, retry_after: float) -> None:
        super().__init__(f"too many requests ({limit}): retry in {math.ceil(retry_after)} s")
        self.limit = limit
        self.retry_after = retry_after

    @property
    def header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


@define
class TokenBuckets:
    """One limit: a token bucket per key, at most ``max_keys`` keys (see the module docstring)."""

    name: str
    rate: Rate
    clock: Callable[[], float]
    max_keys: int = DEFAULT_MAX_KEYS
    # key -> (tokens, when they were counted); least recently touched first.
    _buckets: OrderedDict[str, tuple[float, float]] = field(factory=OrderedDict)

    def __attrs_post_init__(self) -> None:
        if self.max_keys < 1:
            raise ValueError("a limit tracks at least one key")
        TRACKED.labels(self.name).set(0)

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: str, now: float) -> float:
        got = self._buckets.get(key)
        if got is None:
            return float(self.rate.count)
        tokens, at = got
        refill = max(0.0, now - at) * self.rate.count / self.rate.seconds
        return min(float(self.rate.count), tokens + refill)

    def wait(self, key: str, cost: float = 1.0) -> float:
        """Seconds until ``key``'s bucket holds ``cost`` (0.0: now). Takes nothing."""
        if not self.rate.enabled:
            return 0.0
        missing = cost - self._level(key, self.clock())
        return 0.0 if missing <= 1e-9 else missing * self.rate.seconds / self.rate.count

    def spend(self, key: str, cost: float = 1.0) -> None:
        """Take ``cost`` from ``key``'s bucket (it may go below zero: a failure already
        happened and is counted whatever the level)."""
        if not self.rate.enabled:
            return
        now = self.clock()
        level = self._level(key, now)
        self._buckets[key] = (level - cost, now)
        self._buckets.move_to_end(key)
        self._trim(now)

    def _trim(self, now: float) -> None:
        # Buckets that filled up again carry no information: drop them from the old end, a
        # few per call (amortised), then enforce the bound.
        for _ in range(2):
            if not self._buckets:
                break
            key = next(iter(self._buckets))
            if self._level(key, now) < self.rate.count:
                break
            del self._buckets[key]
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
            EVICTED.labels(self.name).inc()
        TRACKED.labels(self.name).set(len(self._buckets))


@define
class Limits:
    """Every limit of one process, by name (:data:`NAMES`), on one clock."""

    buckets: dict[str, TokenBuckets]
    clock: Callable[[], float]
    _refused: dict[str, int] = field(factory=dict)  # since the last log line, per limit
    _logged: dict[str, float] = field(factory=dict)

    @classmethod
    def build(
        cls, rates: dict[str, Rate], clock: Callable[[], float], max_keys: int = DEFAULT_MAX_KEYS
    ) -> Limits:
        unknown = set(rates) - set(NAMES)
        if unknown:
            raise ValueError(f"unknown limits: {sorted(unknown)}")
        return cls(
            {
                name: TokenBuckets(name, rates.get(name, Rate(0, 1)), clock, max_keys)
                for name in NAMES
            },
            clock,
        )

    def take(self, wanted: Iterable[tuple[str, str]], cost: float = 1.0) -> None:
        """Take ``cost`` from each ``(limit, key)`` if every one has room; else take nothing and
        raise :class:`RateLimited` for the one that must be waited for longest."""
        wanted = list(wanted)
        self.check(wanted, cost)
        for name, key in wanted:
            self.buckets[name].spend(key, cost)

    def check(self, wanted: Sequence[tuple[str, str]], cost: float = 1.0) -> None:
        """:class:`RateLimited` if one of the buckets lacks ``cost``; takes nothing."""
        worst: tuple[float, str] = (0.0, "")
        for name, key in wanted:
            delay = self.buckets[name].wait(key, cost)
            if delay > worst[0]:
                worst = (delay, name)
        if worst[0] > 0:
            self._refuse(worst[1])
            raise RateLimited(worst[1], worst[0])

    def _refuse(self, name: str) -> None:
        LIMITED.labels(name).inc()
        self._refused[name] = self._refused.get(name, 0) + 1
        now = self.clock()
        if now - self._logged.get(name, float("-inf")) >= LOG_EVERY:
            _log.warn(
                "home: rate limit {limit} ({rate}) refused {count} request(s) with 429 (logged "
                "at most once a minute per limit; lchat_home_limited_total counts each)",
                limit=name,
                rate=str(self.buckets[name].rate),
                count=self._refused[name],
            )
            self._logged[name] = now
            self._refused[name] = 0

    def describe(self) -> dict[str, str]:
        return {name: str(b.rate) for name, b in self.buckets.items()}


NAMES = (
    "ip",  # every request, per client address
    "failures_ip",  # 401s, per client address
    "register_ip",  # registrations begun, per client address
    "register",  # registrations begun, all addresses together (key "*")
    "account",  # authenticated requests, per account
    "vault_writes",  # vault PUTs, per account
    "mints",  # link tokens minted, per account
    "revocations",  # devices revoked, per account
)


def parse_trusted(text: str) -> tuple[IPNetwork, ...]:
    """``LCHAT_HOME_TRUSTED_PROXIES``: comma-separated addresses or CIDR networks. ValueError
    naming the bad entry."""
    return tuple(
        ipaddress.ip_network(p.strip(), strict=False) for p in text.split(",") if p.strip()
    )


def address_key(text: str) -> str:
    """The key a client address is limited by: an IPv4 address as is, an IPv6 one by its /64
    (an IPv4-mapped one as IPv4), anything else (not an address) as the text itself, bounded."""
    text = text.strip()
    try:
        addr = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return text[:64] or "unknown"
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class _Request(Protocol):
    """What :func:`client_address` reads of a request (twisted.web's, or a test's)."""

    requestHeaders: Headers

    def getClientAddress(self) -> Any: ...


def client_address(request: _Request, trusted: Sequence[IPNetwork] = ()) -> str:
    """The limiting key of the client a request came from (see the module docstring)."""
    peer: Any = request.getClientAddress()
    if isinstance(peer, IPv4Address | IPv6Address):
        try:
            ip = ipaddress.ip_address(peer.host)
        except ValueError:
            return address_key(str(peer.host))
        if not any(ip in net for net in trusted):
            return address_key(str(ip))
    # The router (unix socket) or a trusted proxy: the last X-Forwarded-For entry is what it
    # saw; everything before it came from the client and proves nothing.
    values = request.requestHeaders.getRawHeaders(b"x-forwarded-for") or []
    last = values[-1].split(b",")[-1].decode("latin-1").strip() if values else ""
    return address_key(last) if last else "local"
