"""DNS-01 challenge records: put a TXT value at ``_acme-challenge.<domain>``, take it away again,
and wait until resolvers see it.

Wildcard certificates can only be validated over DNS-01, so the box writes the challenge TXT
through its DNS host's API: DNSimple (``LCHAT_DNSIMPLE_TOKEN``) by default, or Route53
(``LCHAT_DNS_PROVIDER=route53``) with the box's own AWS credentials from botocore's standard
chain, so no DNS secret sits on disk.

Everything here is *blocking* (plain synchronous HTTP and DNS): the ACME issuer calls it from its
worker thread, never from the reactor (docs/design.md §10, invariant 6). Constructors do no I/O, so a
provider may be built at boot on the reactor thread; the first call does the lookups.

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

Route53 also repoints a host's address records (:meth:`Route53.point_address`, for ``lchat
relocate --move-dns``): the one write here that is not a challenge TXT.
"""

from __future__ import annotations

import copy
import email.utils
import ipaddress
import re
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

import botocore.config  # type: ignore[import-untyped]
import botocore.exceptions  # type: ignore[import-untyped]
import botocore.session  # type: ignore[import-untyped]
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver
import requests
from attrs import field, frozen
from twisted.logger import Logger

from lchat import hosts
from lchat.backoff import Backoff

log = Logger(namespace="lchat.acme.dns")

DEFAULT_DNSIMPLE_URL = "https://api.dnsimple.com"

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_MAX_NAME = 253

# DNSimple: attempts are 1 + retries; backoff doubles from 0.5 s up to 5 s (equal jitter), and a
# Retry-After longer than _RETRY_AFTER_CAP is cut to it: a rate limit that resets in an hour is a
# failure to report, not a reason to hold the issuer's thread for an hour.
_BACKOFF = Backoff(0.5, 5.0, jitter=(0.5, 1.0))
_RETRY_AFTER_CAP = 10.0
_PER_PAGE = 100  # DNSimple's maximum page size
_MAX_PAGES = 100  # a listing longer than this is a broken server, not an account
_MESSAGE_MAX = 300  # how much of an error body goes into an exception message

# Route53 address records: a listing page while reading every set at one name (a name with more
# sets than _ADDRESS_PAGES pages is refused, not guessed at), and the TTL bounds Route53 takes.
_ADDRESS_PAGE = "100"
_ADDRESS_PAGES = 10
_MAX_TTL = 2147483647

# Route53: a change refused as invalid (a DELETE whose set changed since we read it) is retried
# from a fresh read this often.
_CAS_ATTEMPTS = 5
_INSYNC_POLL = 2.0


class DNSProviderError(Exception):
    """A DNS provider call failed. The message names the provider and what failed, never a token."""


class PropagationTimeout(DNSProviderError):
    """A TXT value did not become visible in time. The message names the name and what was seen."""


@frozen
class TXTRecord:
    """One TXT value we put at ``fqdn``: what ``add_txt`` returns and ``remove_txt`` takes."""

    fqdn: str  # e.g. "_acme-challenge.example.com": lowercase, no trailing dot
    value: str
    provider_id: str  # DNSimple: "<zone>/<record id>"; Route53: "<hosted zone id>"


class DNSProvider(Protocol):
    """A DNS host we can write TXT records into. Every method blocks (call it from a thread)."""

    name: str  # "dnsimple" | "route53"

    def add_txt(self, fqdn: str, value: str) -> TXTRecord: ...

    def remove_txt(self, record: TXTRecord) -> None: ...


def normalise_fqdn(fqdn: str) -> str:
    """``fqdn`` lowercased without its trailing dot, or ``ValueError`` if it is not a DNS name we
    write to (ASCII labels of letters, digits, ``-`` and ``_``: ``_acme-challenge`` has one)."""
    name = fqdn.strip().lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > _MAX_NAME:
        raise ValueError(f"{fqdn!r} is not a DNS name")
    for label in name.split("."):
        if not _LABEL.match(label):
            raise ValueError(f"{fqdn!r} is not a DNS name (label {label!r})")
    return name


def _in_zone(fqdn: str, zone: str) -> bool:
    """The name is the zone or below it, at a label boundary (``a.bexample.com`` is not in
    ``example.com``)."""
    return fqdn == zone or fqdn.endswith("." + zone)


def _longest_zone(fqdn: str, zones: Collection[str]) -> str | None:
    matches = [zone for zone in zones if _in_zone(fqdn, zone)]
    return max(matches, key=len) if matches else None


def quote_txt(value: str) -> str:
    """``value`` as Route53 wants TXT text: quoted character-strings of at most 255 bytes each,
    ``"`` and ``\\`` escaped, bytes outside printable ASCII as a three-digit *octal* escape (Route53's
    rule; RFC 1035 zone files use decimal). ACME values are base64url and need none of it."""
    data = value.encode("utf-8")
    chunks = [data[i : i + 255] for i in range(0, len(data), 255)] or [b""]
    return " ".join('"' + "".join(_escape_byte(b) for b in chunk) + '"' for chunk in chunks)


def _escape_byte(b: int) -> str:
    if b in (0x22, 0x5C):
        return "\\" + chr(b)
    if 0x20 <= b < 0x7F:
        return chr(b)
    return f"\\{b:03o}"


def unquote_txt(text: str, *, octal: bool = False) -> str:
    """The TXT value a presentation string stands for: quoted strings are unescaped and joined
    (``"ab" "cd"`` is ``abcd``); text without quotes is taken as it is. ``\\DDD`` is decimal
    (RFC 1035, DNSimple) or, with ``octal``, octal (Route53). DNSimple answers quoted content since
    late 2023 (older records may be stored unquoted); Route53 always quotes."""
    text = text.strip()
    if not text.startswith('"'):
        return text
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        if text[i] != '"':
            i += 1  # the blanks between strings
            continue
        i += 1
        while i < n and text[i] != '"':
            c = text[i]
            if c == "\\" and i + 1 < n:
                digits = text[i + 1 : i + 4]
                if len(digits) == 3 and all(
                    d in ("01234567" if octal else "0123456789") for d in digits
                ):
                    out.append(int(digits, 8 if octal else 10) & 0xFF)
                    i += 4
                    continue
                c = text[i + 1]
                i += 1
            out += c.encode("utf-8")
            i += 1
        i += 1  # the closing quote
    return out.decode("utf-8", "replace")


def _log_added(provider: str, fqdn: str, value: str, where: str) -> None:
    log.info(
        "acme: dns {provider}: TXT {fqdn} added ({where})",
        provider=provider,
        fqdn=fqdn,
        where=where,
    )
    log.debug(
        "acme: dns {provider}: TXT {fqdn} value {value}", provider=provider, fqdn=fqdn, value=value
    )


# -- DNSimple ------------------------------------------------------------------------------------


class DNSimple:
    """DNSimple's v2 API with an account API token (``Authorization: Bearer``).

    The account comes from ``GET /v2/whoami`` unless given (looked up once). The zone of a name is
    the longest zone of the account that is the name or a suffix of it at a label boundary, so
    ``_acme-challenge.a.sub.example.com`` goes to ``sub.example.com`` when the account has both
    that and ``example.com``; the record name sent is relative to it (``_acme-challenge.a``, or
    ``_acme-challenge`` at the apex).

    Every request has a timeout; 429, 5xx, timeouts and connection errors are retried ``retries``
    times with a short jittered backoff (honouring ``Retry-After`` up to a cap), then raise
    :class:`DNSProviderError`. A create whose answer was lost may have happened anyway, so a retry
    can leave a duplicate record; ``remove_txt`` removes every record of the name holding our
    value, so duplicates do not outlive the challenge.
    """

    name = "dnsimple"

    def __init__(
        self,
        token: str,
        *,
        sleep: Callable[[float], None],  # between retries (this runs in a worker thread)
        now: Callable[[], float],  # unix seconds: an HTTP-date Retry-After is measured by it
        base_url: str = DEFAULT_DNSIMPLE_URL,
        account_id: str = "",
        ttl: int = 60,
        timeout: float = 30.0,
        retries: int = 4,
    ) -> None:
        if not token:
            raise ValueError("dnsimple: an API token is required")
        base = (base_url or DEFAULT_DNSIMPLE_URL).rstrip("/")
        parts = urlsplit(base)
        # The token is a bearer credential: it travels only over TLS, except to a loopback test
        # server (invariant 4: no verification bypass, no plain-text secrets on the wire).
        if parts.scheme != "https" and not (
            parts.scheme == "http" and hosts.is_loopback(parts.hostname or "")
        ):
            raise ValueError(
                f"dnsimple: API URL {base!r} must be https (plain http only to a loopback address)"
            )
        self._token = token
        self._base = base
        self._account = account_id.strip()
        self._ttl = ttl
        self._timeout = timeout
        self._retries = max(0, retries)
        self._sleep = sleep
        self._now = now
        self._lock = threading.Lock()
        self._session = requests.Session()
        self._session.headers.update(
            {
                "Authorization": f"Bearer {token}",
                "Accept": "application/json",
                "User-Agent": "lchat-acme-dns01",
            }
        )

    def __repr__(self) -> str:
        return f"<DNSimple {self._base} account={self._account or '?'}>"

    def close(self) -> None:
        """Close the connection pool (the provider opens a new one if used again)."""
        self._session.close()

    # -- DNSProvider -----------------------------------------------------------------------------

    def add_txt(self, fqdn: str, value: str) -> TXTRecord:
        fqdn = normalise_fqdn(fqdn)
        account = self._account_id()
        zone = self._zone_for(account, fqdn)
        relative = self._relative(fqdn, zone)
        records_path = f"/v2/{_q(account)}/zones/{_q(zone)}/records"
        for existing in self._txt_records(records_path, relative):
            if unquote_txt(str(existing.get("content", ""))) == value:
                log.info(
                    "acme: dns {provider}: TXT {fqdn} already present (zone {zone}, record {record_id})",
                    provider=self.name,
                    fqdn=fqdn,
                    zone=zone,
                    record_id=existing.get("id"),
                )
                return TXTRecord(fqdn, value, f"{zone}/{existing.get('id')}")
        body = self._json(
            "POST",
            records_path,
            what=f"create TXT {fqdn} in zone {zone}",
            json_body={"name": relative, "type": "TXT", "content": value, "ttl": self._ttl},
            ok=(200, 201),
        )
        data = body.get("data")
        if not isinstance(data, dict) or "id" not in data:
            raise DNSProviderError(
                f"dnsimple: create TXT {fqdn} in zone {zone}: the answer has no record id"
            )
        record_id = str(data["id"])
        _log_added(self.name, fqdn, value, f"zone {zone}, record {record_id}")
        return TXTRecord(fqdn, value, f"{zone}/{record_id}")

    def remove_txt(self, record: TXTRecord) -> None:
        zone, sep, record_id = record.provider_id.rpartition("/")
        if not sep or not zone or not record_id:
            raise DNSProviderError(
                f"dnsimple: remove TXT {record.fqdn}: {record.provider_id!r} is not a DNSimple record id"
            )
        fqdn = normalise_fqdn(record.fqdn)
        if not _in_zone(fqdn, zone):
            raise DNSProviderError(f"dnsimple: remove TXT {fqdn}: the record names zone {zone}")
        account = self._account_id()
        records_path = f"/v2/{_q(account)}/zones/{_q(zone)}/records"
        gone = self._delete(records_path, record_id, fqdn)
        # Duplicates of our value (a create retried after its answer was lost) go too.
        removed = 0 if gone else 1
        for other in self._txt_records(records_path, self._relative(fqdn, zone)):
            if str(other.get("id")) == record_id:
                continue
            if unquote_txt(str(other.get("content", ""))) == record.value:
                if not self._delete(records_path, str(other.get("id")), fqdn):
                    removed += 1
        if removed:
            log.info(
                "acme: dns {provider}: TXT {fqdn} removed (zone {zone}, record {record_id})",
                provider=self.name,
                fqdn=fqdn,
                zone=zone,
                record_id=record_id,
                records=removed,
            )
        else:
            log.info(
                "acme: dns {provider}: TXT {fqdn} was already gone (zone {zone}, record {record_id})",
                provider=self.name,
                fqdn=fqdn,
                zone=zone,
                record_id=record_id,
            )

    # -- lookups ---------------------------------------------------------------------------------

    def _account_id(self) -> str:
        with self._lock:
            if self._account:
                return self._account
            body = self._json("GET", "/v2/whoami", what="whoami")
            data = body.get("data")
            account = data.get("account") if isinstance(data, dict) else None
            if not isinstance(account, dict) or account.get("id") is None:
                raise DNSProviderError(
                    "dnsimple: whoami names no account: the token is a user token; "
                    "use an account API token (or set LCHAT_DNSIMPLE_ACCOUNT to the account id)"
                )
            self._account = str(account["id"])
            log.info(
                "acme: dns {provider}: using account {account}",
                provider=self.name,
                account=self._account,
            )
            return self._account

    def _zone_for(self, account: str, fqdn: str) -> str:
        # name_like is a substring filter; every zone that can hold the name contains its last two
        # labels, so that narrows the listing without missing one.
        labels = fqdn.split(".")
        like = ".".join(labels[-2:])
        names = [
            str(zone.get("name", "")).lower().rstrip(".")
            for zone in self._paged(
                f"/v2/{_q(account)}/zones", {"name_like": like}, what=f"list zones like {like}"
            )
        ]
        zone = _longest_zone(fqdn, names)
        if zone is None:
            seen = ", ".join(sorted(names)[:10]) or "none"
            raise DNSProviderError(
                f"dnsimple: no zone in account {account} holds {fqdn} (zones like {like}: {seen})"
            )
        return zone

    @staticmethod
    def _relative(fqdn: str, zone: str) -> str:
        return "" if fqdn == zone else fqdn[: -(len(zone) + 1)]

    def _txt_records(self, records_path: str, relative: str) -> list[dict[str, Any]]:
        return [
            r
            for r in self._paged(
                records_path,
                {"name": relative, "type": "TXT"},
                what=f"list TXT records {relative or '@'} in {records_path}",
            )
            # The filters are the server's; check them ourselves rather than delete on trust.
            if str(r.get("type", "")).upper() == "TXT"
            and str(r.get("name", "")).lower() == relative
        ]

    def _delete(self, records_path: str, record_id: str, fqdn: str) -> bool:
        """Delete one record; True if it was already gone (404)."""
        resp = self._request(
            "DELETE",
            f"{records_path}/{_q(record_id)}",
            what=f"delete TXT {fqdn} record {record_id}",
            ok=(200, 204, 404),
        )
        return resp.status_code == 404

    def _paged(
        self, path: str, params: Mapping[str, str], *, what: str
    ) -> Iterator[dict[str, Any]]:
        page = 1
        while True:
            body = self._json(
                "GET",
                path,
                what=what,
                params={**params, "page": str(page), "per_page": str(_PER_PAGE)},
            )
            data = body.get("data")
            if not isinstance(data, list):
                raise DNSProviderError(f"dnsimple: {what}: the answer has no list of data")
            yield from (item for item in data if isinstance(item, dict))
            pagination = body.get("pagination")
            total = pagination.get("total_pages") if isinstance(pagination, dict) else None
            if not isinstance(total, int) or page >= min(total, _MAX_PAGES):
                return
            page += 1

    # -- HTTP ------------------------------------------------------------------------------------

    def _json(
        self,
        method: str,
        path: str,
        *,
        what: str,
        params: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
        ok: Collection[int] = (200,),
    ) -> dict[str, Any]:
        resp = self._request(method, path, what=what, params=params, json_body=json_body, ok=ok)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise self._error(
                f"{what}: HTTP {resp.status_code} with a body that is not a JSON object"
            )
        return body

    def _request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        params: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
        ok: Collection[int] = (200,),
    ) -> requests.Response:
        attempts = self._retries + 1
        url = self._base + path
        for attempt in range(1, attempts + 1):
            retry_after: float | None = None
            try:
                resp = self._session.request(
                    method, url, params=params, json=json_body, timeout=self._timeout
                )
            except (requests.Timeout, requests.ConnectionError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            except requests.RequestException as exc:
                raise self._error(f"{what}: {type(exc).__name__}: {exc}") from None
            else:
                status = resp.status_code
                if status in ok:
                    return resp
                reason = f"HTTP {status}: {_error_message(resp)}"
                if status != 429 and status < 500:
                    raise self._error(f"{what}: {reason}")
                retry_after = _retry_after(resp.headers.get("Retry-After"), self._now())
            if attempt == attempts:
                raise self._error(f"{what} failed after {attempts} attempts: {reason}")
            delay = (
                _BACKOFF.jittered(_BACKOFF.delay(attempt)) if retry_after is None else retry_after
            )
            log.warn(
                "acme: dns {provider}: {what} failed (attempt {attempt}/{attempts}): {reason}; "
                "retrying in {delay:.1f}s",
                provider=self.name,
                what=what,
                attempt=attempt,
                attempts=attempts,
                reason=self._scrub(reason),
                delay=delay,
            )
            self._sleep(delay)
        raise AssertionError("unreachable")

    def _scrub(self, text: str) -> str:
        # Belt and braces: nothing we build contains the token, but a server or an exception
        # string might echo a header back.
        return text.replace(self._token, "<token>")

    def _error(self, message: str) -> DNSProviderError:
        return DNSProviderError(self._scrub(f"dnsimple: {message}"))


def _q(segment: str) -> str:
    return quote(segment, safe="")


def _error_message(resp: requests.Response) -> str:
    """DNSimple's error shape is ``{"message": ..., "errors": {field: [..]}}``; else the text."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        message: str = body["message"]
        errors = body.get("errors")
        if isinstance(errors, dict) and errors:
            message += " (" + "; ".join(f"{k}: {v}" for k, v in errors.items()) + ")"
    else:
        message = " ".join(str(resp.text or resp.reason or "").split())
    return message[:_MESSAGE_MAX]


def _retry_after(value: str | None, now: float) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), capped; None when absent or bad."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - now
    return min(max(seconds, 0.0), _RETRY_AFTER_CAP)


# -- Route53 -------------------------------------------------------------------------------------


@frozen
class _RRSet:
    ttl: int
    raw: tuple[str, ...]  # the ResourceRecords values exactly as Route53 listed them

    def values(self) -> list[str]:
        return [unquote_txt(v, octal=True) for v in self.raw]


@frozen
class AddressChange:
    """What :meth:`Route53.point_address` found at a host and what it left there.

    ``before`` and ``after`` are the addresses of the host's own plain ``A`` and ``AAAA`` sets,
    IPv4 first, each family in numeric order, in ``ipaddress``'s canonical text; ``()`` when the
    host had (has) none. ``change_id`` is Route53's change id, ``""`` when the records already
    were exactly these (a re-run): then nothing was written and ``before == after``.
    """

    fqdn: str  # the host itself: lowercase, no trailing dot, never a wildcard
    zone_id: str  # the bare hosted zone id ("Z123...")
    before: tuple[str, ...]
    after: tuple[str, ...]
    ttl: int  # of the sets written (of the sets found, when nothing changed)
    change_id: str

    @property
    def changed(self) -> bool:
        return bool(self.change_id)


def canonical_addresses(addresses: Iterable[str]) -> tuple[str, ...]:
    """``addresses`` as canonical text (``ipaddress``), deduplicated, IPv4 first, each family in
    numeric order; ``ValueError`` naming the first that is not a unicast host address (an IP
    with a zone index, the unspecified address or a multicast group cannot be an A/AAAA value)."""
    parsed: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for text in addresses:
        try:
            ip = ipaddress.ip_address(str(text).strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an IP address") from None
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            raise ValueError(f"{text!r} has a zone index: it means nothing outside one machine")
        if ip.is_unspecified or ip.is_multicast:
            raise ValueError(f"{text!r} is not a host's address (unspecified or multicast)")
        parsed.add(ip)
    return tuple(str(ip) for ip in sorted(parsed, key=lambda ip: (ip.version, int(ip))))


def _as_listed(rrset: _RRSet | None) -> tuple[str, ...]:
    """A listed address set's values in canonical order; a value that is not an address (Route53
    never lists one) is kept as it is, so it counts as different from anything we write."""
    if rrset is None:
        return ()
    try:
        return canonical_addresses(rrset.raw)
    except ValueError:
        return rrset.raw


def _family(addresses: Iterable[str], rtype: str) -> tuple[str, ...]:
    version = 4 if rtype == "A" else 6
    return tuple(a for a in addresses if ipaddress.ip_address(a).version == version)


class Route53:
    """Route53 through botocore's ``route53`` client and the standard credential chain
    (environment, shared config/profile, container or instance role).

    The hosted zone is ``zone_id`` when given, else the public zone with the longest name that is
    the record's name or a suffix of it. A name's TXT values are one RRSet, and an ``UPSERT``
    *replaces* the set, so we read the set and write it back with our value merged in (or dropped):
    ``UPSERT`` of the merged set, or ``DELETE`` of the set exactly as read when ours was its last
    value (a DELETE whose values no longer match is refused, and then we read again and retry).
    Merging lowers the set's TTL to ours if it was higher (a resolver holding the old answer for an
    hour would hide the challenge); removing keeps the TTL it finds.

    The read-modify-write is serialised within the process (one lock per provider), not across
    processes: two boxes writing the same name at the same moment could lose one value. The
    compare-and-swap Route53 offers (``DELETE`` old + ``CREATE`` new in one batch) is not used
    because moto refuses such a batch whenever the new set equals one created earlier (it checks
    the CREATE before applying the DELETE), which is exactly what removing the second of two
    challenge values produces, and moto is what the tests and the lead's harness run against.

    With ``wait_insync`` each change is followed until ``GetChange`` says ``INSYNC``, for at most
    ``timeout`` seconds; past that it logs a warning and returns, since the record *is* written
    (and ``remove_txt`` needs the record to clean up) and visibility is :func:`wait_for_txt`'s job.

    :meth:`point_address` (``lchat relocate --move-dns``) writes a host's ``A``/``AAAA`` sets under
    the same lock, zone lookup, retry and INSYNC wait. Its batches never CREATE a set, so the moto
    quirk above does not reach them: an ``UPSERT`` per family that stays and a ``DELETE`` (exactly
    as read) per family that goes, all in one batch, which real Route53 applies atomically.
    """

    name = "route53"

    def __init__(
        self,
        *,
        zone_id: str = "",
        endpoint_url: str = "",
        region: str = "us-east-1",
        ttl: int = 60,
        timeout: float = 30.0,
        wait_insync: bool = True,
        session: botocore.session.Session | None = None,
        retries: int = 4,
        sleep: Callable[[float], None],  # between polls and retries (a worker thread)
        clock: Callable[[], float],  # monotonic: the INSYNC wait's deadline
    ) -> None:
        self._zone_id = _bare_zone_id(zone_id)
        self._zone_name = ""  # of the explicit zone, learnt on first use
        self._endpoint_url = endpoint_url
        self._region = region
        self._ttl = ttl
        self._timeout = timeout
        self._wait_insync = wait_insync
        self._session = session
        self._retries = max(0, retries)
        self._sleep = sleep
        self._clock = clock
        self._client: Any = None
        self._lock = threading.Lock()  # guards the lazy client
        self._write_lock = threading.Lock()  # one read-modify-write at a time

    def __repr__(self) -> str:
        return f"<Route53 zone={self._zone_id or 'auto'} endpoint={self._endpoint_url or 'aws'}>"

    # -- DNSProvider -----------------------------------------------------------------------------

    def add_txt(self, fqdn: str, value: str) -> TXTRecord:
        fqdn = normalise_fqdn(fqdn)
        zone_id = self._zone_for(fqdn)
        change = self._swap(
            zone_id,
            fqdn,
            what=f"add TXT {fqdn}",
            update=lambda values: None if value in values else [*values, value],
            adding=True,
        )
        if change is None:
            log.info(
                "acme: dns {provider}: TXT {fqdn} already present (zone {zone})",
                provider=self.name,
                fqdn=fqdn,
                zone=zone_id,
            )
        else:
            _log_added(self.name, fqdn, value, f"zone {zone_id}, change {change}")
        return TXTRecord(fqdn, value, zone_id)

    def remove_txt(self, record: TXTRecord) -> None:
        fqdn = normalise_fqdn(record.fqdn)
        zone_id = _bare_zone_id(record.provider_id)
        if not zone_id:
            raise DNSProviderError(f"route53: remove TXT {fqdn}: the record names no hosted zone")
        change = self._swap(
            zone_id,
            fqdn,
            what=f"remove TXT {fqdn}",
            update=lambda values: (
                [v for v in values if v != record.value] if record.value in values else None
            ),
            adding=False,
        )
        log.info(
            "acme: dns {provider}: TXT {fqdn} "
            + (
                "removed (zone {zone}, change {change})"
                if change
                else "was already gone (zone {zone})"
            ),
            provider=self.name,
            fqdn=fqdn,
            zone=zone_id,
            change=change,
        )

    # -- address records (lchat relocate --move-dns) --------------------------------------------

    def point_address(self, fqdn: str, addresses: Sequence[str], ttl: int = 60) -> AddressChange:
        """Make ``fqdn``'s own address records exactly ``addresses``: the IPv4 ones one ``A`` set,
        the IPv6 ones one ``AAAA`` set (each an ``UPSERT`` with ``ttl``), and a set of a family
        ``addresses`` has none of ``DELETE``d exactly as read, so an old ``AAAA`` cannot keep
        pointing at the old box. One change batch; a re-run finding exactly these addresses at
        this TTL writes nothing. Returns what was there and what is there now.

        ``fqdn`` is the host itself, never a wildcard: a host that a zone's ``*`` record serves
        gets a record of its own, which takes precedence over the wildcard and leaves it as it
        is. Refused with :class:`DNSProviderError` (nothing written): no address, a text that is
        not a unicast IP address, a wildcard name, a name in no hosted zone, and a name whose
        address records are not plain sets we may replace (a CNAME, an alias, a weighted /
        latency / failover set), which someone configured on purpose and must change by hand.
        """
        what = f"point {fqdn} at {', '.join(str(a) for a in addresses) or 'nothing'}"
        if "*" in fqdn:
            raise DNSProviderError(
                f"route53: {what}: {fqdn!r} is a wildcard name; only a host's own records are "
                "repointed (the wildcard stays as it is)"
            )
        try:
            name = normalise_fqdn(fqdn)
            wanted = canonical_addresses(addresses)
        except ValueError as exc:
            raise DNSProviderError(f"route53: {what}: {exc}") from None
        if not wanted:
            raise DNSProviderError(
                f"route53: point {name}: no address given (pointing a host at nothing would "
                "delete its records)"
            )
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 <= ttl <= _MAX_TTL:
            raise DNSProviderError(f"route53: point {name}: TTL {ttl!r} is not 0..{_MAX_TTL} s")
        what = f"point {name} at {', '.join(wanted)}"
        zone_id = self._zone_for(name)
        before: tuple[str, ...] = ()  # as the last plan read them: the answer's "before"

        def plan() -> list[dict[str, Any]] | None:
            nonlocal before
            current = self._read_addresses(zone_id, name, what)
            before = tuple(a for rtype in ("A", "AAAA") for a in _as_listed(current.get(rtype)))
            changes: list[dict[str, Any]] = []
            for rtype in ("A", "AAAA"):
                want = _family(wanted, rtype)
                have = current.get(rtype)
                if want and (have is None or have.ttl != ttl or _as_listed(have) != want):
                    changes.append(self._change("UPSERT", name, ttl, list(want), rtype))
                elif not want and have is not None:
                    # Exactly as read: if it changed since, Route53 refuses and we read again.
                    changes.append(self._change("DELETE", name, have.ttl, list(have.raw), rtype))
            return changes or None

        with self._write_lock:
            # Route53 takes a comment of at most 256 characters (many addresses would pass it).
            comment = f"lchat relocate --move-dns: {what}"[:256]
            change_id = self._apply_locked(zone_id, what, plan, comment=comment)
        if change_id is None:
            log.info(
                "dns {provider}: {fqdn} already points at {addresses} with TTL {ttl} "
                "(zone {zone}): nothing to change",
                provider=self.name,
                fqdn=name,
                addresses=", ".join(wanted),
                ttl=ttl,
                zone=zone_id,
            )
        else:
            log.info(
                "dns {provider}: {fqdn} repointed {before} -> {after}, TTL {ttl} "
                "(zone {zone}, change {change})",
                provider=self.name,
                fqdn=name,
                before=", ".join(before) or "(none)",
                after=", ".join(wanted),
                ttl=ttl,
                zone=zone_id,
                change=change_id,
            )
        return AddressChange(name, zone_id, before, wanted, ttl, change_id or "")

    def _read_addresses(self, zone_id: str, fqdn: str, what: str) -> dict[str, _RRSet]:
        """The plain ``A``/``AAAA`` sets at exactly ``fqdn`` by type (values as listed); raises
        :class:`DNSProviderError` when the name holds address records we must not replace."""
        found: dict[str, _RRSet] = {}
        start: dict[str, str] = {"StartRecordName": fqdn + "."}
        for _ in range(_ADDRESS_PAGES):
            listing = self._client_call(
                what,
                "list_resource_record_sets",
                HostedZoneId=zone_id,
                MaxItems=_ADDRESS_PAGE,
                **start,
            )
            for rrset in listing.get("ResourceRecordSets", []):
                name = str(rrset.get("Name", "")).lower().rstrip(".")
                if name != fqdn:
                    return found  # the listing is in name order from fqdn: its sets are done
                rtype = str(rrset.get("Type", ""))
                if rtype == "CNAME":
                    raise DNSProviderError(
                        f"route53: {what}: {fqdn} is a CNAME in zone {zone_id}, which no address "
                        "record may sit beside; change it by hand"
                    )
                if rtype not in ("A", "AAAA"):
                    continue
                if "SetIdentifier" in rrset or "ResourceRecords" not in rrset:
                    kind = "an alias" if "AliasTarget" in rrset else "a routing-policy set"
                    raise DNSProviderError(
                        f"route53: {what}: {fqdn}'s {rtype} record in zone {zone_id} is {kind} "
                        "(someone set it up on purpose); change it by hand"
                    )
                raw = tuple(str(r["Value"]) for r in rrset["ResourceRecords"])
                found[rtype] = _RRSet(int(rrset.get("TTL", self._ttl)), raw)
            if not listing.get("IsTruncated") or not listing.get("NextRecordName"):
                return found
            start = {"StartRecordName": str(listing["NextRecordName"])}
            if listing.get("NextRecordType"):
                start["StartRecordType"] = str(listing["NextRecordType"])
            if listing.get("NextRecordIdentifier"):
                start["StartRecordIdentifier"] = str(listing["NextRecordIdentifier"])
        raise DNSProviderError(
            f"route53: {what}: {fqdn} has more record sets than {_ADDRESS_PAGES} pages of "
            f"{_ADDRESS_PAGE}; not guessing which are its addresses"
        )

    # -- the read-modify-write -------------------------------------------------------------------

    def _swap(
        self,
        zone_id: str,
        fqdn: str,
        *,
        what: str,
        update: Callable[[list[str]], list[str] | None],
        adding: bool,
    ) -> str | None:
        """Apply ``update`` to the values at ``fqdn`` (None: nothing to do); the change's id."""
        with self._write_lock:
            return self._swap_locked(zone_id, fqdn, what=what, update=update, adding=adding)

    def _swap_locked(
        self,
        zone_id: str,
        fqdn: str,
        *,
        what: str,
        update: Callable[[list[str]], list[str] | None],
        adding: bool,
    ) -> str | None:
        def plan() -> list[dict[str, Any]] | None:
            current = self._read(zone_id, fqdn, what)
            old_values = current.values() if current else []
            new_values = update(old_values)
            if new_values is None:
                return None
            if new_values:
                ttl = self._ttl if current is None else current.ttl
                if adding:
                    ttl = min(ttl, self._ttl)
                # Values we did not touch go back byte for byte, as they were listed.
                kept = {
                    unquote_txt(raw, octal=True): raw for raw in (current.raw if current else ())
                }
                raws = [kept.get(v) or quote_txt(v) for v in new_values]
                return [self._change("UPSERT", fqdn, ttl, raws)]
            assert current is not None  # update() only empties a set that exists
            return [self._change("DELETE", fqdn, current.ttl, list(current.raw))]

        return self._apply_locked(zone_id, what, plan, comment=f"lchat acme dns-01: {what}")

    def _apply_locked(
        self,
        zone_id: str,
        what: str,
        plan: Callable[[], list[dict[str, Any]] | None],
        *,
        comment: str,
    ) -> str | None:
        """Submit the changes ``plan`` makes from a fresh read (None: nothing to do) as one batch,
        reading and planning again when Route53 refuses the batch as invalid (a set it DELETEs
        changed since the read), up to ``_CAS_ATTEMPTS`` times; then wait for INSYNC. The
        change's id, or None. The caller holds ``_write_lock``."""
        for attempt in range(1, _CAS_ATTEMPTS + 1):
            changes = plan()
            if changes is None:
                return None
            try:
                info = self._client_call(
                    what,
                    "change_resource_record_sets",
                    HostedZoneId=zone_id,
                    ChangeBatch={"Comment": comment, "Changes": changes},
                )["ChangeInfo"]
            except _Conflict as exc:
                if attempt == _CAS_ATTEMPTS:
                    raise DNSProviderError(
                        f"route53: {what} failed after {attempt} attempts: {exc}"
                    ) from None
                log.warn(
                    "acme: dns {provider}: {what}: Route53 refused the change ({why}); reading again",
                    provider=self.name,
                    what=what,
                    why=str(exc),
                )
                self._sleep(0.2 * attempt)
                continue
            change_id = str(info.get("Id", "")).rsplit("/", 1)[-1]
            self._insync(change_id, str(info.get("Status", "")), what)
            return change_id
        raise AssertionError("unreachable")

    def _read(self, zone_id: str, fqdn: str, what: str) -> _RRSet | None:
        listing = self._client_call(
            what,
            "list_resource_record_sets",
            HostedZoneId=zone_id,
            StartRecordName=fqdn + ".",
            StartRecordType="TXT",
            MaxItems="10",
        )
        for rrset in listing.get("ResourceRecordSets", []):
            name = str(rrset.get("Name", "")).lower().rstrip(".")
            if name != fqdn or rrset.get("Type") != "TXT":
                break  # the listing starts at (fqdn, TXT): anything else means there is no set
            if "SetIdentifier" in rrset or "ResourceRecords" not in rrset:
                continue  # a weighted/latency/alias set is not one we manage
            raw = tuple(str(r["Value"]) for r in rrset["ResourceRecords"])
            return _RRSet(int(rrset.get("TTL", self._ttl)), raw)
        return None

    @staticmethod
    def _change(
        action: str, fqdn: str, ttl: int, raws: list[str], rtype: str = "TXT"
    ) -> dict[str, Any]:
        return {
            "Action": action,
            "ResourceRecordSet": {
                "Name": fqdn + ".",
                "Type": rtype,
                "TTL": ttl,
                "ResourceRecords": [{"Value": raw} for raw in raws],
            },
        }

    def _insync(self, change_id: str, status: str, what: str) -> None:
        if not self._wait_insync or status == "INSYNC" or not change_id:
            return
        deadline = self._clock() + self._timeout
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                log.warn(
                    "acme: dns {provider}: {what}: change {change} still {status} after {timeout:.0f}s; "
                    "going on (wait_for_txt checks visibility)",
                    provider=self.name,
                    what=what,
                    change=change_id,
                    status=status,
                    timeout=self._timeout,
                )
                return
            self._sleep(min(_INSYNC_POLL, remaining))
            info = self._client_call(what, "get_change", Id=change_id)["ChangeInfo"]
            status = str(info.get("Status", ""))
            if status == "INSYNC":
                return

    # -- zones -----------------------------------------------------------------------------------

    def _zone_for(self, fqdn: str) -> str:
        if self._zone_id:
            if not self._zone_name:
                zone = self._client_call(
                    f"get hosted zone {self._zone_id}", "get_hosted_zone", Id=self._zone_id
                )["HostedZone"]
                self._zone_name = str(zone.get("Name", "")).lower().rstrip(".")
            if not _in_zone(fqdn, self._zone_name):
                raise DNSProviderError(
                    f"route53: {fqdn} is not in hosted zone {self._zone_id} ({self._zone_name})"
                )
            return self._zone_id
        by_name: dict[str, list[str]] = {}
        for zone in self._hosted_zones():
            if zone.get("Config", {}).get("PrivateZone"):
                continue  # a private zone answers inside its VPCs only, never to the CA
            name = str(zone.get("Name", "")).lower().rstrip(".")
            by_name.setdefault(name, []).append(_bare_zone_id(str(zone.get("Id", ""))))
        best = _longest_zone(fqdn, by_name)
        if best is None:
            raise DNSProviderError(
                f"route53: no public hosted zone holds {fqdn} "
                f"({len(by_name)} public zones visible to these credentials)"
            )
        ids = by_name[best]
        if len(ids) > 1:
            raise DNSProviderError(
                f"route53: {len(ids)} public hosted zones are named {best} ({', '.join(sorted(ids))}); "
                "give the zone id of the delegated one"
            )
        return ids[0]

    def _hosted_zones(self) -> Iterator[dict[str, Any]]:
        what = "list hosted zones"
        marker = ""
        for _ in range(_MAX_PAGES):
            kwargs = {"Marker": marker} if marker else {}
            page = self._client_call(what, "list_hosted_zones", **kwargs)
            yield from page.get("HostedZones", [])
            marker = str(page.get("NextMarker") or "")
            if not page.get("IsTruncated") or not marker:
                return

    # -- botocore --------------------------------------------------------------------------------

    def _get_client(self) -> Any:
        # Created on first use, not in __init__: resolving credentials may read files or ask the
        # instance metadata service, and the constructor may run on the reactor thread.
        with self._lock:
            if self._client is None:
                session = self._session or botocore.session.get_session()
                self._client = session.create_client(
                    "route53",
                    region_name=self._region,
                    endpoint_url=self._endpoint_url or None,
                    config=botocore.config.Config(
                        connect_timeout=self._timeout,
                        read_timeout=self._timeout,
                        retries={"max_attempts": self._retries + 1, "mode": "standard"},
                    ),
                )
            return self._client

    def _client_call(self, what: str, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self._get_client(), method)(**kwargs)
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
            code = str(error.get("Code") or f"HTTP {status}")
            message = " ".join(str(error.get("Message", "")).split())[:_MESSAGE_MAX]
            if code == "InvalidChangeBatch" and method == "change_resource_record_sets":
                raise _Conflict(f"{code}: {message}") from None
            raise DNSProviderError(f"route53: {what} failed: {code}: {message}") from None
        except botocore.exceptions.NoCredentialsError:
            raise DNSProviderError(
                f"route53: {what} failed: no AWS credentials found "
                "(environment, shared config/profile or instance role)"
            ) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise DNSProviderError(f"route53: {what} failed: {exc}") from None


class _Conflict(Exception):
    """A change batch Route53 refused as a whole (the set changed since we read it, or the batch is
    invalid for another reason: after the retries the message says which)."""


def _bare_zone_id(zone_id: str) -> str:
    """``/hostedzone/Z123`` (as AWS lists it) and ``Z123`` (as people write it) are one zone."""
    return zone_id.strip().rsplit("/", 1)[-1]


# -- propagation ---------------------------------------------------------------------------------


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
        if discovery is None:
            fallback, label = finder, _where(None)
        else:
            fallback = copy.copy(discovery)  # the caller's resolver, with our timeouts
            fallback.timeout = query_timeout
            fallback.lifetime = query_timeout
            label = "the discovery resolver"
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


def _where(target: tuple[str, int] | None) -> str:
    if target is None:
        return "the system resolver"
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


# -- configuration -------------------------------------------------------------------------------


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
    "PropagationTimeout",
    "Route53",
    "TXTRecord",
    "canonical_addresses",
    "make_provider",
    "normalise_fqdn",
    "quote_txt",
    "unquote_txt",
    "wait_for_txt",
]
