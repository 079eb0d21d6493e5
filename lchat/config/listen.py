"""Addresses: ``HOST:PORT`` (``:PORT``, ``[IPv6]:PORT``), one grammar for the listeners
(``LCHAT_HTTPS_ADDR``, ``LCHAT_HTTP_ADDR``, ``LCHAT_METRICS_ADDR``, which also take a Twisted
endpoint string) and the DNS resolvers (``LCHAT_DNS_RESOLVERS``, whose port defaults to 53)."""

from __future__ import annotations

import ipaddress
import re

from twisted.internet.endpoints import serverFromString

from lchat.config.values import ConfigError, comma_list

_NO_REACTOR = object()  # what an endpoint string is parsed with, to check it (never used)
# HOST is an IPv6 address in brackets, else names and IPv4 addresses; the port may be left out.
_HOST_PORT = re.compile(r"(?:\[([0-9a-fA-F:.]+)\]|([A-Za-z0-9.\-]*))(?::(\d{1,5}))?")


def host_port(text: str) -> tuple[str, str | None, bool] | None:
    """``text`` as (host, port or None, whether the host was an IPv6 address in brackets), or
    None when it is not ``HOST[:PORT]``."""
    match = _HOST_PORT.fullmatch(text)
    if match is None:
        return None
    v6, host, port = match.groups()
    return (v6, port, True) if v6 is not None else (host, port, False)


def parse_address(name: str, text: str) -> str | None:
    """``:443``, ``127.0.0.1:8080``, ``[::1]:8080`` or a Twisted endpoint string; ``off`` disables."""
    if text in ("", "off", "none"):
        return None
    host, port, bracketed = host_port(text) or ("", None, False)
    # ``tcp:8080`` or ``ssl:443`` is an endpoint string, not HOST:PORT: an interface name given
    # bare must be an address (it has a dot) or ``localhost``, never an endpoint type.
    if port is not None and (bracketed or "." in host or host.lower() in ("", "localhost")):
        if int(port) > 65535:
            raise ConfigError(f"{name}={text!r}: port out of range")
        if bracketed:
            return f"tcp6:{port}:interface=" + host.replace(":", r"\:")
        return f"tcp:{port}" + (f":interface={host}" if host else "")
    try:
        # Only the syntax is checked: the endpoint is built and dropped, never listened on, and
        # the parsers merely store the reactor they are given, so none is needed here.
        serverFromString(_NO_REACTOR, text)
    except Exception as e:  # parsers also read files (ssl: certificates) and raise what they like
        raise ConfigError(
            f"{name}={text!r} is neither HOST:PORT nor a Twisted endpoint string ({e})"
        ) from e
    return text


def parse_resolvers(text: str) -> tuple[tuple[str, int], ...]:
    """``LCHAT_DNS_RESOLVERS``: comma-separated ``IP``, ``IP:PORT`` or ``[IPv6]:PORT``."""
    result = []
    for item in comma_list(text):
        parsed = host_port(item)
        try:
            if parsed is None:
                raise ValueError(item)
            address, port_text, _ = parsed
            port = int(port_text or 53)
            ipaddress.ip_address(address)
            if not 0 < port < 65536:
                raise ValueError(item)
        except ValueError:
            raise ConfigError(
                f"LCHAT_DNS_RESOLVERS: {item!r} is not IP, IP:PORT or [IPv6]:PORT"
            ) from None
        result.append((address, port))
    return tuple(result)
