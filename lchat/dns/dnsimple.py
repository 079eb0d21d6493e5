"""DNSimple's v2 API (:class:`DNSimple`): a DNS-01 provider. Blocking; see :mod:`lchat.dns`."""

from __future__ import annotations

import email.utils
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import requests

from lchat import hosts
from lchat.backoff import Backoff
from lchat.dns.records import (
    MAX_PAGES,
    MESSAGE_MAX,
    DNSProviderError,
    TXTRecord,
    in_zone,
    log,
    log_added,
    longest_zone,
    normalise_fqdn,
    unquote_txt,
)

DEFAULT_DNSIMPLE_URL = "https://api.dnsimple.com"

# DNSimple: attempts are 1 + retries; backoff doubles from 0.5 s up to 5 s (equal jitter), and a
# Retry-After longer than _RETRY_AFTER_CAP is cut to it: a rate limit that resets in an hour is a
# failure to report, not a reason to hold the issuer's thread for an hour.
_BACKOFF = Backoff(0.5, 5.0, jitter=(0.5, 1.0))
_RETRY_AFTER_CAP = 10.0
_PER_PAGE = 100  # DNSimple's maximum page size


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
        log_added(self.name, fqdn, value, f"zone {zone}, record {record_id}")
        return TXTRecord(fqdn, value, f"{zone}/{record_id}")

    def remove_txt(self, record: TXTRecord) -> None:
        zone, sep, record_id = record.provider_id.rpartition("/")
        if not sep or not zone or not record_id:
            raise DNSProviderError(
                f"dnsimple: remove TXT {record.fqdn}: {record.provider_id!r} is not a DNSimple record id"
            )
        fqdn = normalise_fqdn(record.fqdn)
        if not in_zone(fqdn, zone):
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
        log.info(
            "acme: dns {provider}: TXT {fqdn} "
            + ("removed" if removed else "was already gone")
            + " (zone {zone}, record {record_id})",
            provider=self.name,
            fqdn=fqdn,
            zone=zone,
            record_id=record_id,
            records=removed,
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
        zone = longest_zone(fqdn, names)
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
            if not isinstance(total, int) or page >= min(total, MAX_PAGES):
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
    return message[:MESSAGE_MAX]


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
