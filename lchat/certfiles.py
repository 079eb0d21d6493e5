"""The certificate directory's files (``LCHAT_ACME_CACHE``): their names, and one file read and
checked into a TLS context ready to serve (lchat.tls's store serves them).

One PEM file per name, holding the private key and the certificate chain, leaf first; every file
mode 0600 or stricter:

- ``<host>.pem``: the certificate of one host, served only while ``<host>`` is in the registry;
- ``wildcard-<domain>.pem``: a ``*.<domain>`` certificate, served to any direct subdomain
  ``x.<domain>`` (not to ``<domain>`` itself, nor to ``a.b.<domain>``), registered or not;
- ``default.pem`` (optional): served when nothing above matches, or when the client sends no SNI;
  without it such handshakes fail.

Every other file (ACME account keys, ``*.tmp``, ``dev-ca.pem``) is ignored. A host whose first
label starts with ``wildcard-`` cannot have a file of its own. File names are only ever built by
:func:`cert_path` and :func:`wildcard_cert_path`. Each certificate's context is built from the
very bytes that were checked (:func:`load_file`), with :func:`server_context`'s settings.
"""

from __future__ import annotations

import os
import re
import ssl
import stat
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Literal

from attrs import field, frozen
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from lchat import hosts

Kind = Literal["host", "wildcard", "default"]
KINDS: tuple[Kind, ...] = ("host", "wildcard", "default")

ALPN = b"http/1.1"  # the front door speaks HTTP/1.1 only
WILDCARD_PREFIX = "wildcard-"
DEFAULT_FILE = "default.pem"
SUFFIX = ".pem"

# One fingerprint per file: what changes when it is rewritten, replaced or chmod-ed.
Fingerprint = tuple[int, int, int, int, int]


# --- file names ---------------------------------------------------------------------------------


def cert_path(directory: str, host: str) -> str:
    """``<dir>/<host>.pem``: a host's key and chain. ``host`` must already be normalised."""
    name = _checked(host)
    if name.startswith(WILDCARD_PREFIX):
        raise hosts.InvalidHost(
            f"{host}: names starting with {WILDCARD_PREFIX!r} are wildcard certificate files; "
            f"this host can only be served by a wildcard or the default certificate"
        )
    return _join(directory, name + SUFFIX)


def wildcard_cert_path(directory: str, domain: str) -> str:
    """``<dir>/wildcard-<domain>.pem``: the ``*.<domain>`` key and chain."""
    return _join(directory, WILDCARD_PREFIX + _checked(domain) + SUFFIX)


def default_cert_path(directory: str) -> str:
    """``<dir>/default.pem``: served when no other certificate matches."""
    return _join(directory, DEFAULT_FILE)


def _checked(name: str) -> str:
    canonical = hosts.normalise(name)
    if canonical != name:
        raise hosts.InvalidHost(f"{name!r} is not normalised (expected {canonical!r})")
    return canonical


def _join(directory: str, filename: str) -> str:
    base = os.path.abspath(directory)
    path = os.path.join(base, filename)
    if os.path.dirname(path) != base or os.path.basename(path) != filename:
        raise hosts.InvalidHost(f"{filename!r} does not make a safe file name")
    return path


def role_of(filename: str) -> tuple[Kind, str] | None:
    """What a file in the cache directory is: ``(kind, name)``, or None for a file we ignore.

    ``name`` is the host for ``host``, the domain for ``wildcard`` and ``"default"``. Only canonical
    names count (the file names :func:`cert_path` would build).
    """
    if filename == DEFAULT_FILE:
        return ("default", "default")
    if not filename.endswith(SUFFIX):
        return None
    stem = filename[: -len(SUFFIX)]
    kind: Kind = "host"
    if stem.startswith(WILDCARD_PREFIX):
        kind, stem = "wildcard", stem[len(WILDCARD_PREFIX) :]
    return (kind, stem) if hosts.is_normal(stem) else None


def _misnamed(filename: str) -> str | None:
    """For a ``.pem`` we ignore because its name is not canonical: the name it should have."""
    if not filename.endswith(SUFFIX) or role_of(filename) is not None:
        return None
    stem = filename[: -len(SUFFIX)]
    prefix = WILDCARD_PREFIX if stem.startswith(WILDCARD_PREFIX) else ""
    try:
        canonical = hosts.normalise(stem[len(prefix) :])
    except hosts.InvalidHost:
        return None  # not meant as a certificate name (an ACME account key, dev-ca.pem ...)
    return prefix + canonical + SUFFIX


# --- loading one file ---------------------------------------------------------------------------


@frozen
class Loaded:
    """A certificate ready to serve, with its TLS context (never mutated afterwards)."""

    kind: Kind
    name: str  # host, domain (wildcard) or "default"
    path: str
    fingerprint: Fingerprint
    not_after: float  # unix time
    serial: int
    ssl_context: ssl.SSLContext = field(eq=False, repr=False)  # what the SNI callback switches to
    not_before: float | None = None  # unix time
    issuer: str = ""  # the issuing CA's common name
    origin: str = ""  # the ACME directory that issued it (its marker line), "" = placed by hand

    @property
    def label(self) -> str:
        """How logs and metrics name it: ``chat.example.com``, ``*.example.com``, ``default``."""
        return "*." + self.name if self.kind == "wildcard" else self.name


@frozen
class Refused:
    path: str
    fingerprint: Fingerprint
    why: str


class _Refuse(Exception):
    pass


PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.DOTALL)


def load_file(path: str, kind: Kind, name: str, now: float) -> Loaded | Refused:
    """Read, check and build a context for one certificate file. Blocking: call it in a thread."""
    fingerprint: Fingerprint = (0, 0, 0, 0, 0)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            fingerprint = _fingerprint(st)
            if st.st_mode & 0o077:
                raise _Refuse(
                    f"mode {stat.S_IMODE(st.st_mode):04o} lets other users read its private key; "
                    f"run `chmod 600 {path}`"
                )
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(1 << 20)
        finally:
            os.close(fd)
        return _build(path, kind, name, fingerprint, data, now)
    except _Refuse as e:
        return Refused(path, fingerprint, str(e))
    except OSError as e:
        return Refused(path, fingerprint, f"cannot read it: {e.strerror or e}")


def _build(
    path: str, kind: Kind, name: str, fingerprint: Fingerprint, data: bytes, now: float
) -> Loaded:
    blocks = [(m.group(1), m.group(0)) for m in PEM_BLOCK.finditer(data)]
    keys = [pem for label, pem in blocks if label.endswith(b"PRIVATE KEY")]
    certs = [pem for label, pem in blocks if label == b"CERTIFICATE"]
    if len(keys) != 1:
        raise _Refuse(f"it holds {len(keys)} private keys, expected exactly one (PEM)")
    if not certs:
        raise _Refuse("it holds no certificate (expected the chain, leaf first, after the key)")
    try:
        key = serialization.load_pem_private_key(keys[0], password=None)
    except TypeError:
        raise _Refuse("its private key is encrypted; store it without a passphrase") from None
    except ValueError as e:
        raise _Refuse(f"its private key does not parse: {e}") from None
    try:
        chain = [x509.load_pem_x509_certificate(pem) for pem in certs]
    except ValueError as e:
        raise _Refuse(f"a certificate does not parse: {e}") from None
    leaf = chain[0]
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if leaf.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        raise _Refuse("its private key does not match the first (leaf) certificate")
    not_after = leaf.not_valid_after_utc.timestamp()
    if not_after <= now:
        raise _Refuse(f"its certificate expired at {utc_date(not_after)}")
    if kind != "default":
        _check_names(leaf, kind, name)
    try:
        ssl_context = _stdlib_context(keys[0], certs)
    except ssl.SSLError as e:
        raise _Refuse(f"OpenSSL will not use it: {e}") from None
    except OSError as e:
        raise _Refuse(f"cannot hand it to OpenSSL: {e.strerror or e}") from None
    return Loaded(
        kind,
        name,
        path,
        fingerprint,
        not_after,
        leaf.serial_number,
        ssl_context,
        not_before=leaf.not_valid_before_utc.timestamp(),
        issuer=issuer_name(leaf),
        origin=origin_of(data),
    )


def issuer_name(leaf: x509.Certificate) -> str:
    """The issuing CA's common name (else its whole distinguished name)."""
    names = leaf.issuer.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    value = names[0].value if names else leaf.issuer.rfc4514_string()
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


ORIGIN_MARKER = b"# lchat acme: "
_ORIGIN = re.compile(rb"# lchat acme: ([\x21-\x7e]{1,2000})\r?\n")


def origin_of(data: bytes) -> str:
    """The ACME directory named by a file's first line (``# lchat acme: <url>``, written by the
    issuer), or "" for a file placed by hand. PEM readers skip text outside the blocks."""
    match = _ORIGIN.match(data)
    return match.group(1).decode("ascii") if match else ""


def _check_names(leaf: x509.Certificate, kind: Kind, name: str) -> None:
    try:
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise _Refuse("its certificate has no subjectAltName (clients ignore the CN)") from None
    names = [n.lower() for n in sans.get_values_for_type(x509.DNSName)]
    if kind == "wildcard":
        wanted = "*." + name
        ok = wanted in names
    else:
        wanted = name
        ok = name in names or any(
            n.startswith("*.") and n[2:] != name and hosts.covers(n[2:], name) for n in names
        )
    if not ok:
        raise _Refuse(f"its certificate is for {', '.join(names) or 'no DNS name'}, not {wanted}")


def server_context() -> ssl.SSLContext:
    """A stdlib server context with the front door's protocol settings and no certificate: TLS 1.2
    or later, ALPN ``http/1.1`` only, no renegotiation.

    Set on the listener's context as well as on every per-name one: after the SNI switch OpenSSL
    keeps the protocol floor and options of the context the connection started on, and takes the
    ALPN choice from the new one. The stdlib's ALPN choice is strict: a client offering no
    ``http/1.1`` gets no ALPN at all (``SSL_TLSEXT_ERR_NOACK``) and the handshake carries on, as
    with a client that offered none (never ``h2``: the router speaks HTTP/1.1 only).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION  # a client-started renegotiation costs us, not it
    context.set_alpn_protocols([ALPN.decode("ascii")])
    return context


def _stdlib_context(key: bytes, chain: list[bytes]) -> ssl.SSLContext:
    # The stdlib loads keys and certificates from paths only. The bytes that passed the checks go
    # through an anonymous memory file, never through the original path again (it may have been
    # replaced, or chmod-ed, since it was read).
    context = server_context()
    fd = os.memfd_create("lchat-certificate", os.MFD_CLOEXEC)
    try:
        # The chain, leaf first, then the key; a block may lack its final newline (the last one).
        data = memoryview(b"".join(pem.rstrip(b"\r\n") + b"\n" for pem in [*chain, key]))
        while data:
            data = data[os.write(fd, data) :]
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return context


def _fingerprint(st: os.stat_result) -> Fingerprint:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


def utc_date(when: float) -> str:
    """``2026-01-31 12:00:00Z``: how logs and refusals write a certificate's dates."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


# --- scanning the directory -----------------------------------------------------------------------


@frozen
class Scan:
    """One listing of the directory: what is there, and what changed since the last."""

    missing: bool = False
    error: str = ""
    seen: Mapping[str, Fingerprint] = field(factory=dict)  # filename -> fingerprint now
    changed: Mapping[str, Loaded | Refused] = field(factory=dict)
    misnamed: Mapping[str, str] = field(factory=dict)  # filename -> the name it should have


def scan(directory: str, previous: Mapping[str, Fingerprint], now: float) -> Scan:
    """List the directory and load every certificate file that changed. Blocking."""
    try:
        filenames = sorted(os.listdir(directory))
    except FileNotFoundError:
        return Scan(missing=True)
    except OSError as e:
        return Scan(error=f"cannot list {directory}: {e.strerror or e}")
    seen: dict[str, Fingerprint] = {}
    changed: dict[str, Loaded | Refused] = {}
    misnamed: dict[str, str] = {}
    for filename in filenames:
        role = role_of(filename)
        if role is None:
            better = _misnamed(filename)
            if better is not None:
                misnamed[filename] = better
            continue
        path = os.path.join(directory, filename)
        try:
            st = os.stat(path)
        except OSError:
            continue  # gone meanwhile, or a dangling symlink
        if not stat.S_ISREG(st.st_mode):
            continue
        fingerprint = _fingerprint(st)
        if previous.get(filename) != fingerprint:
            outcome = load_file(path, role[0], role[1], now)
            if any(outcome.fingerprint):  # else it could not even be opened: keep the stat's
                fingerprint = outcome.fingerprint
            changed[filename] = outcome
        seen[filename] = fingerprint
    return Scan(seen=seen, changed=changed, misnamed=misnamed)
