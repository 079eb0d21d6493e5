"""What every DNS provider writes and returns: a TXT record, the provider's interface and error,
and the text of DNS names and TXT values."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Protocol

from attrs import frozen
from twisted.logger import Logger

log = Logger(namespace="lchat.acme.dns")

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_MAX_NAME = 253
MAX_PAGES = 100  # a listing longer than this is a broken server, not an account
MESSAGE_MAX = 300  # how much of an error body goes into an exception message


class DNSProviderError(Exception):
    """A DNS provider call failed. The message names the provider and what failed, never a token."""


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


def in_zone(fqdn: str, zone: str) -> bool:
    """The name is the zone or below it, at a label boundary (``a.bexample.com`` is not in
    ``example.com``)."""
    return fqdn == zone or fqdn.endswith("." + zone)


def longest_zone(fqdn: str, zones: Collection[str]) -> str | None:
    matches = [zone for zone in zones if in_zone(fqdn, zone)]
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


def log_added(provider: str, fqdn: str, value: str, where: str) -> None:
    log.info(
        "acme: dns {provider}: TXT {fqdn} added ({where})",
        provider=provider,
        fqdn=fqdn,
        where=where,
    )
    log.debug(
        "acme: dns {provider}: TXT {fqdn} value {value}", provider=provider, fqdn=fqdn, value=value
    )
