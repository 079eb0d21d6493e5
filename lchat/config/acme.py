"""Certificates: issuance (``LCHAT_ACME_*``, ``LCHAT_DNS*``, ``LCHAT_DNSIMPLE_*``,
``LCHAT_ROUTE53_*``) and the certificate cache (``LCHAT_CERT_CACHE*``): docs/certificates.md."""

from __future__ import annotations

import os
import re
from typing import Literal
from urllib.parse import urlsplit

from attrs import field, frozen

from lchat import hosts
from lchat.config.listen import parse_resolvers
from lchat.config.values import ConfigError, Getter, aes_key, one_of, parse_duration

LETS_ENCRYPT = "https://acme-v02.api.letsencrypt.org/directory"
DNSIMPLE_URL = "https://api.dnsimple.com"
DNSProvider = Literal["dnsimple", "route53"]
MAX_DNS_TIMEOUT = 300.0
CertCache = Literal["dir", "s3"]


@frozen
class AcmeConfig:
    """Certificate issuance (``LCHAT_ACME_DIRECTORY`` not ``off``)."""

    directory: str  # the ACME directory URL
    email: str = ""  # account contact (optional)
    ca_file: str = ""  # CA bundle for the directory's own TLS ("" = system trust)
    dns_provider: DNSProvider = "dnsimple"
    dnsimple_token: str = field(default="", repr=False)
    dnsimple_url: str = DNSIMPLE_URL
    dnsimple_account: str = ""  # needed only with a user token (an account token names its own)
    route53_zone_id: str = ""
    route53_endpoint: str = ""
    dns_resolvers: tuple[tuple[str, int], ...] = ()  # () = the system's resolver
    dns_timeout: float = 120.0  # how long to wait for a TXT record to be visible


def read_acme(get: Getter, wildcard_domains: tuple[str, ...]) -> AcmeConfig | None:
    directory = get("LCHAT_ACME_DIRECTORY")
    if directory in ("off", ""):
        return None
    parts = urlsplit(directory)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"LCHAT_ACME_DIRECTORY={directory!r} must be the URL of an ACME directory (e.g. "
            f"{LETS_ENCRYPT}) or off"
        )
    if not re.fullmatch(r"[\x21-\x7e]{1,2000}", directory):
        # It is written into every certificate file and bucket entry as the issuer's name.
        raise ConfigError(f"LCHAT_ACME_DIRECTORY={directory!r} must be a plain ASCII URL")
    if parts.scheme == "http" and not hosts.is_loopback(parts.hostname):
        # RFC 8555 requires TLS: over plain http anyone on the path could hand us any chain.
        raise ConfigError(f"LCHAT_ACME_DIRECTORY={directory!r} must be https")
    email = get("LCHAT_ACME_EMAIL")
    if email and not re.fullmatch(r"[^@\s,]+@[^@\s,]+\.[^@\s,]+", email):
        raise ConfigError(f"LCHAT_ACME_EMAIL={email!r} is not an email address")
    ca_file = get("LCHAT_ACME_CA_FILE")
    if ca_file and not os.path.isfile(ca_file):
        raise ConfigError(f"LCHAT_ACME_CA_FILE={ca_file!r} is not a file")
    provider = one_of("LCHAT_DNS_PROVIDER", get("LCHAT_DNS_PROVIDER"), "dnsimple", "route53")
    token = get("LCHAT_DNSIMPLE_TOKEN")
    if wildcard_domains and provider == "dnsimple" and not token:
        raise ConfigError(
            "LCHAT_WILDCARD_DOMAINS needs DNS-01: set LCHAT_DNSIMPLE_TOKEN, or "
            "LCHAT_DNS_PROVIDER=route53 (the box's own AWS credentials), or "
            "LCHAT_ACME_DIRECTORY=off to serve wildcard files placed by hand"
        )
    dnsimple_url = get("LCHAT_DNSIMPLE_URL").rstrip("/")
    route53_endpoint = get("LCHAT_ROUTE53_ENDPOINT").rstrip("/")
    for name, url in (
        ("LCHAT_DNSIMPLE_URL", dnsimple_url),
        ("LCHAT_ROUTE53_ENDPOINT", route53_endpoint),
    ):
        if url and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname):
            raise ConfigError(f"{name}={url!r} must be an http(s) URL")
    # The token rides in every request: only over TLS (plain http only to this machine).
    dnsimple = urlsplit(dnsimple_url)
    if dnsimple.scheme == "http" and not hosts.is_loopback(dnsimple.hostname or ""):
        raise ConfigError(
            f"LCHAT_DNSIMPLE_URL={dnsimple_url!r} must be https (the API token rides in every "
            "request)"
        )
    account = get("LCHAT_DNSIMPLE_ACCOUNT")
    if account and not account.isdigit():
        raise ConfigError(f"LCHAT_DNSIMPLE_ACCOUNT={account!r} must be a numeric account id")
    zone_id = get("LCHAT_ROUTE53_ZONE_ID")
    if zone_id and not re.fullmatch(r"(/hostedzone/)?[A-Z0-9]{1,32}", zone_id):
        raise ConfigError(f"LCHAT_ROUTE53_ZONE_ID={zone_id!r} is not a hosted zone id")
    timeout = parse_duration("LCHAT_DNS_PROPAGATION_TIMEOUT", get("LCHAT_DNS_PROPAGATION_TIMEOUT"))
    if not 0 < timeout <= MAX_DNS_TIMEOUT:
        # An order must end well inside the shared cache's 10-minute issuance lock.
        raise ConfigError("LCHAT_DNS_PROPAGATION_TIMEOUT must be a positive duration up to 5m")
    return AcmeConfig(
        directory=directory,
        email=email,
        ca_file=os.path.abspath(ca_file) if ca_file else "",
        dns_provider="route53" if provider == "route53" else "dnsimple",
        dnsimple_token=token,
        dnsimple_url=dnsimple_url or DNSIMPLE_URL,
        dnsimple_account=account,
        route53_zone_id=zone_id.removeprefix("/hostedzone/"),
        route53_endpoint=route53_endpoint,
        dns_resolvers=parse_resolvers(get("LCHAT_DNS_RESOLVERS")),
        dns_timeout=timeout,
    )


def read_cert_cache(get: Getter) -> tuple[CertCache, bytes, bytes, tuple[str, ...]]:
    """``LCHAT_CERT_CACHE`` and, for ``s3``, its keys: (kind, key, previous key, warnings)."""
    if one_of("LCHAT_CERT_CACHE", get("LCHAT_CERT_CACHE"), "dir", "s3") == "dir":
        return "dir", b"", b"", ()
    if not get("LCHAT_HIBERNATE_BUCKET"):
        raise ConfigError(
            "LCHAT_CERT_CACHE=s3 keeps certificates in the hibernation bucket: set "
            "LCHAT_HIBERNATE_BUCKET"
        )
    if not get("LCHAT_CERT_CACHE_KEY"):
        raise ConfigError(
            "LCHAT_CERT_CACHE=s3 needs LCHAT_CERT_CACHE_KEY: private keys are encrypted before "
            "they reach the bucket (make one with `openssl rand -base64 32`, the same on every box)"
        )
    key = aes_key("LCHAT_CERT_CACHE_KEY", get("LCHAT_CERT_CACHE_KEY"))
    # The key being rotated away from: checked like the current key (a typo fails the boot, not
    # the first read of an old entry); equal to the current key, it is ignored with a warning
    # (harmless, but a sign the rotation was set up wrong).
    previous_text = get("LCHAT_CERT_CACHE_KEY_PREVIOUS")
    if not previous_text:
        return "s3", key, b"", ()
    previous = aes_key("LCHAT_CERT_CACHE_KEY_PREVIOUS", previous_text)
    if previous != key:
        return "s3", key, previous, ()
    warning = (
        "LCHAT_CERT_CACHE_KEY_PREVIOUS equals LCHAT_CERT_CACHE_KEY: ignored (mid-rotation it holds "
        "the old key; after it, remove the line)"
    )
    return "s3", key, b"", (warning,)
