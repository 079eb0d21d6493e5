"""Hostnames: normalisation, validation, and the only road from a hostname to a file name.

Every name that reaches the disk (``<data>/<host>.db``, ``<run>/<host>.sock`` ...) is built here, from a
name that passed :func:`normalise`. Nothing taken from the network or the command line is ever joined onto
a path anywhere else (docs/design.md §10, invariant 3).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from urllib.parse import urlsplit

import idna

MAX_NAME = 253
MAX_LABEL = 63
# Unix socket paths are limited to 108 bytes (sun_path) including the NUL; stay clear of it.
MAX_SOCKET_PATH = 100

_DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_PORT = re.compile(r"^[0-9]{1,5}$")
# What may appear in a Host header at all before we look closer (RFC 3986 reg-name + IP literals):
# printable ASCII only. A byte >= 0x80 is never decoded, case-folded or IDNA-mapped here: read as
# Latin-1, "\xaa" is "ª", which NFKC/UTS-46 map to "a", and "\xad" (a soft hyphen) vanishes, so
# "ch\xaat.example.com" would reach chat.example.com. An internationalised name travels as its
# A-label (xn--...), as every HTTP client sends it. Used with fullmatch (a "$" would let "\n" end it).
_HOST_HEADER_CHARS = re.compile(r"[A-Za-z0-9.\-_:\[\]%~!$&'()*+,;=]+")


class InvalidHost(ValueError):
    """A hostname that is not a valid space name. The message says why, for the operator."""


def normalise(raw: str) -> str:
    """Return the canonical form of a space hostname, or raise :class:`InvalidHost`.

    Lowercases, strips a ``:port`` and one trailing dot, converts internationalised names to their
    A-label (punycode) form, then checks RFC 1123 labels and lengths. A space name must have at least
    two labels (so no space can collide with box files such as ``registry.db`` or ``router.sock``),
    may not look like an IP address, and its last label may not end in ``-bot`` (so no space's files
    collide with another space's ``<host>-bot.env``).
    """
    if not isinstance(raw, str):
        raise InvalidHost("hostname must be text")
    if raw == "":
        raise InvalidHost("hostname is empty")
    if len(raw) > 2 * MAX_NAME:
        raise InvalidHost("hostname is too long")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in raw):
        raise InvalidHost("hostname contains whitespace or control characters")
    name = _strip_port(raw)
    if name.endswith("."):
        name = name[:-1]
    if name == "" or name.startswith(".") or ".." in name:
        raise InvalidHost(f"hostname {raw!r} has an empty label")
    if _is_ip_literal(name):
        raise InvalidHost(f"{raw!r} is an IP address, not a space hostname")
    name = _to_ascii(name, raw)
    if len(name) > MAX_NAME:
        raise InvalidHost(f"hostname is longer than {MAX_NAME} characters")
    labels = name.split(".")
    for label in labels:
        if len(label) > MAX_LABEL:
            raise InvalidHost(
                f"hostname label {label[:20]!r}... is longer than {MAX_LABEL} characters"
            )
        if not _LABEL.match(label):
            raise InvalidHost(f"hostname label {label!r} is not letters, digits and inner hyphens")
    if len(labels) < 2:
        raise InvalidHost(f"hostname {name!r} needs at least two labels (e.g. chat.example.com)")
    if labels[-1].isdigit():
        raise InvalidHost(f"hostname {name!r} ends in a numeric label")
    if labels[-1].endswith("-bot"):
        raise InvalidHost(f"hostname {name!r}: a last label ending in '-bot' is reserved")
    return name


def parse_host_header(value: str) -> str:
    """Parse an HTTP ``Host`` header into the name to look up in the registry.

    A syntactically broken header raises :class:`InvalidHost` (the caller answers 400), and so does
    any character outside printable ASCII (a control character, or anything >= 0x80 however the
    caller decoded the bytes): only an A-label (``xn--...``) names an internationalised host here,
    so no header can fold onto a registered name (:func:`normalise` alone still takes U-labels,
    for names an operator types). A well-formed header that is simply not a space name (an IP
    literal, ``localhost``) is returned lowercased, so the lookup misses and the caller answers 404
    like any unknown host.
    """
    if (
        value == ""
        or len(value) > 2 * MAX_NAME
        or not value.isascii()
        or not _HOST_HEADER_CHARS.fullmatch(value)
    ):
        raise InvalidHost("malformed Host header")
    try:
        return normalise(value)
    except InvalidHost:
        pass
    name = _strip_port(value).rstrip(".").lower()
    if _is_ip_literal(name) or _LABEL.fullmatch(name):
        return name
    raise InvalidHost("malformed Host header")


def covers(domain: str, host: str) -> bool:
    """True when ``host`` equals ``domain`` or is directly under it (one more label, no deeper)."""
    if host == domain:
        return True
    suffix = "." + domain
    if not host.endswith(suffix):
        return False
    head = host[: -len(suffix)]
    return head != "" and "." not in head


def is_normal(host: str) -> bool:
    """True when ``host`` is already in canonical form."""
    try:
        return normalise(host) == host
    except InvalidHost:
        return False


# --- file names -------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address: where plain http may carry a secret (tests)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


SPACES = "spaces"  # <data>/spaces/<host>/, <run>/spaces/<host>/: a box that isolates its spaces


def isolated(data_dir: str) -> bool:
    """Does this box give every space its own directories (and user)? The layout on disk is the
    switch: ``<data>/spaces`` exists (lchat/isolation.py creates it; bootstrap migrates to it)."""
    return os.path.isdir(os.path.join(data_dir, SPACES))


def space_dir(data_dir: str, host: str) -> str:
    """``<data>/spaces/<host>``: an isolated space's own directory (its database and journals)."""
    return os.path.join(os.path.abspath(data_dir), SPACES, _checked(host))


def db_path(data_dir: str, host: str) -> str:
    """The space's SQLite database: ``<data>/spaces/<host>/<host>.db`` on a box that isolates its
    spaces, else ``<data>/<host>.db``."""
    if isolated(data_dir):
        return _space_file(space_dir(data_dir, host), host, ".db")
    return _space_file(data_dir, host, ".db")


def env_path(data_dir: str, host: str) -> str:
    """``<data>/<host>.env``: the space's environment (mode 0600; holds its admin token)."""
    return _space_file(data_dir, host, ".env")


def bot_env_path(data_dir: str, host: str) -> str:
    """``<data>/<host>-bot.env``: a staged bot sidecar's environment."""
    return _space_file(data_dir, host, "-bot.env")


def socket_path(run_dir: str, host: str, *, isolated: bool = False) -> str:
    """``<run>/<host>.sock`` (``isolated``: ``<run>/spaces/<host>/<host>.sock``, in a directory of
    the space's own), or a hashed name when that would not fit in a unix socket address."""
    directory = os.path.join(run_dir, SPACES, _checked(host)) if isolated else run_dir
    path = _space_file(directory, host, ".sock")
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(_checked(host).encode("ascii")).hexdigest()[:32]
    hashed = os.path.join(os.path.abspath(run_dir), f"h-{digest}.sock")
    if isolated:
        hashed = os.path.join(os.path.abspath(run_dir), SPACES, f"h-{digest}", "s.sock")
    if len(os.fsencode(hashed)) > MAX_SOCKET_PATH:
        raise InvalidHost(f"run directory {run_dir!r} is too long for unix socket paths")
    return hashed


def _space_file(directory: str, host: str, suffix: str) -> str:
    name = _checked(host) + suffix
    base = os.path.abspath(directory)
    path = os.path.join(base, name)
    # Belt and braces: a normalised name has no separators, but never trust that silently.
    if os.path.dirname(path) != base or os.path.basename(path) != name:
        raise InvalidHost(f"hostname {host!r} does not make a safe file name")
    return path


def _checked(host: str) -> str:
    canonical = normalise(host)
    if canonical != host:
        raise InvalidHost(f"hostname {host!r} is not normalised (expected {canonical!r})")
    return canonical


def _strip_port(value: str) -> str:
    if value.startswith("["):
        end = value.find("]")
        if end == -1:
            raise InvalidHost("malformed IPv6 literal")
        rest = value[end + 1 :]
        if rest and not (rest.startswith(":") and _PORT.match(rest[1:]) and int(rest[1:]) <= 65535):
            raise InvalidHost("malformed port")
        return value[: end + 1]
    if value.count(":") == 1:
        name, port = value.split(":")
        if not _PORT.match(port) or int(port) > 65535:
            raise InvalidHost("malformed port")
        return name
    if ":" in value:
        raise InvalidHost("hostname contains ':'")
    return value


def _is_ip_literal(name: str) -> bool:
    candidate = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False  # "[garbage]" is not an IP literal (nor a hostname: both callers refuse it)
    return True


def _to_ascii(name: str, raw: str) -> str:
    if name.isascii():
        return name.lower()
    try:
        return idna.encode(name, uts46=True).decode("ascii")
    except (idna.IDNAError, UnicodeError) as e:
        raise InvalidHost(f"hostname {raw!r} is not a valid internationalised name: {e}") from e


def normalise_member_url(url: str) -> str:
    """Return the canonical form of a mesh member's base URL, or raise :class:`ValueError`.

    Scheme and host lowercase, no trailing slash, the scheme's default port omitted (an explicit
    other port is kept). Anything that is not a bare ``http(s)://host[:port]`` base URL (a path,
    query, fragment, user info, a bad port, no host) is refused rather than guessed at, since two
    boxes guessing differently would disagree about ownership. Idempotent. Part of the mesh's
    placement wire format (:mod:`lchat.mesh.placement`); config names the box by it too.
    """
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"member URL {url!r} must use http or https")
    host = parts.hostname  # lowercased, brackets of an IPv6 literal removed
    if not host:
        raise ValueError(f"member URL {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"member URL {url!r} must not carry user info")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"member URL {url!r} must not have a path, query or fragment")
    port = parts.port  # raises ValueError when malformed or out of range
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc = f"{netloc}:{port}"
    return f"{scheme}://{netloc}"
