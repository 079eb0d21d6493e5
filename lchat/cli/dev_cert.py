"""``lchat dev-cert``: a throwaway local CA and certificates, to try HTTPS on a dev machine.

The CA (``dev-ca.pem``, key ``dev-ca.key``) is made once in the output directory and reused, so it
only has to be trusted once. Each name gets ``<host>.pem`` (or ``wildcard-<domain>.pem`` for
``*.<domain>``) in the router's certificate layout (see ``lchat/certfiles.py``), mode 0600. A certificate
this CA issued that is still good for a while is kept; a file it did not issue is never overwritten.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import secrets
from collections.abc import Callable, Sequence

from attrs import frozen
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lchat import certfiles, hosts
from lchat.config import BoxConfig
from lchat.files import write_atomic

SUMMARY = "make a local test CA and certificates for trying HTTPS (not for production)"
CA_CERT = "dev-ca.pem"
CA_KEY = "dev-ca.key"
CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_WITHIN_DAYS = 30  # a kept leaf must stay valid at least this long
SKEW = datetime.timedelta(hours=1)  # backdate notBefore: a clock a little behind still accepts it


class DevCertError(Exception):
    """Why dev-cert stopped; one line for the operator."""


@frozen
class Issued:
    name: str  # host or *.domain
    path: str
    created: bool
    not_after: datetime.datetime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "names",
        nargs="+",
        metavar="HOST",
        help="hostnames to make certificates for (*.DOMAIN for a wildcard)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where the CA and certificates go (default: LCHAT_ACME_CACHE, <data>/acme)",
    )


def run(args: argparse.Namespace, cfg: BoxConfig | None, out: Callable[[str], None]) -> int:
    """The command: ``args.out`` or ``cfg.acme_cache``; ``cfg`` also says which HTTPS port to show."""
    directory = os.path.abspath(args.out or (cfg.acme_cache if cfg else ""))
    port = https_port(cfg.https_addr) if cfg else None
    ca_path, ca_created, issued = make_dev_certs(directory, args.names)
    out(f"dev CA: {ca_path} ({'created' if ca_created else 'kept'})")
    for item in issued:
        state = "created" if item.created else "kept"
        out(f"{item.name}: {item.path} ({state}, expires {item.not_after:%Y-%m-%d})")
    example = issued[0].name.replace("*", "www")
    authority = example + (f":{port}" if port not in (None, 443) else "")
    out("")
    out("Trust it for one command:")
    out(f"  curl --cacert {ca_path} https://{authority}/api/version")
    out("or skip verification (tests only): curl -k ...")
    out(
        f"Browsers: import {ca_path} as a certificate authority, on this machine only "
        f"(anyone holding {os.path.join(directory, CA_KEY)} can sign for any name)."
    )
    return 0


def https_port(address: str | None) -> int | None:
    """The port of a ``tcp:PORT...`` endpoint string, for the example URL."""
    match = re.match(r"tcp6?:(\d+)", address or "")
    return int(match.group(1)) if match else None


def make_dev_certs(
    directory: str, names: Sequence[str], now: datetime.datetime | None = None
) -> tuple[str, bool, list[Issued]]:
    """Ensure the CA and one certificate per name. Returns (CA path, CA created, certificates)."""
    now = now or datetime.datetime.now(datetime.UTC)
    targets = [_target(directory, name) for name in names]  # all names checked before any write
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca_cert, ca_key, ca_created = _ensure_ca(directory, now)
    issued = [_ensure_leaf(path, name, ca_cert, ca_key, now) for name, path in targets]
    return os.path.join(directory, CA_CERT), ca_created, issued


def _target(directory: str, raw: str) -> tuple[str, str]:
    """(certificate name, file path) for a command-line name."""
    try:
        if raw.startswith("*."):
            domain = hosts.normalise(raw[2:])
            return "*." + domain, certfiles.wildcard_cert_path(directory, domain)
        host = hosts.normalise(raw)
        return host, certfiles.cert_path(directory, host)
    except hosts.InvalidHost as e:
        raise DevCertError(str(e)) from e


def _ensure_ca(
    directory: str, now: datetime.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, bool]:
    cert_path = os.path.join(directory, CA_CERT)
    key_path = os.path.join(directory, CA_KEY)
    have = [os.path.exists(p) for p in (cert_path, key_path)]
    if all(have):
        try:
            with open(cert_path, "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
            with open(key_path, "rb") as f:
                key = serialization.load_pem_private_key(f.read(), password=None)
        except (ValueError, TypeError) as e:
            raise DevCertError(f"{cert_path} / {key_path} do not load ({e}); remove both") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey) or _spki(key.public_key()) != _spki(
            cert.public_key()
        ):
            raise DevCertError(f"{key_path} is not the key of {cert_path}; remove both")
        if cert.not_valid_after_utc <= now + datetime.timedelta(days=LEAF_DAYS):
            raise DevCertError(
                f"the dev CA {cert_path} expires too soon; remove {CA_CERT} and {CA_KEY} "
                f"(and the certificates it issued) to start over"
            )
        return cert, key, False
    if any(have):
        missing = cert_path if not have[0] else key_path
        raise DevCertError(f"{missing} is missing; remove {CA_CERT} and {CA_KEY} to start over")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "lchat dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"lchat dev CA {secrets.token_hex(4)}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    # Key first: a certificate without its key would make the next run refuse to go on.
    write_atomic(key_path, _key_pem(key), 0o600)
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key, True


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    """Digital signatures; and certificates and CRLs too, for the CA."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def _ensure_leaf(
    path: str,
    name: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
) -> Issued:
    if os.path.exists(path):
        kept = _keepable(path, name, ca_cert, now)
        if kept is not None:
            return Issued(name, path, False, kept)
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = now + datetime.timedelta(days=LEAF_DAYS)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            # The CA certificate's own key: _ensure_ca refuses a key pair that does not match.
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    # The layout: private key, then the chain, leaf first (the CA is the client's trust root).
    write_atomic(path, _key_pem(key) + cert.public_bytes(serialization.Encoding.PEM), 0o600)
    return Issued(name, path, True, not_after)


def _keepable(
    path: str, name: str, ca_cert: x509.Certificate, now: datetime.datetime
) -> datetime.datetime | None:
    """The expiry of an existing certificate worth keeping; None to reissue it.

    Raises when the file is not ours to replace (another CA issued it, or it does not parse).
    """
    try:
        with open(path, "rb") as f:
            leaf = x509.load_pem_x509_certificate(f.read())
        leaf.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise DevCertError(
            f"{path} exists and was not issued by the dev CA ({e.__class__.__name__}); "
            f"not overwriting it (remove it first if it is yours to replace)"
        ) from e
    kind: certfiles.Kind = "wildcard" if name.startswith("*.") else "host"
    loaded = certfiles.load_file(path, kind, name.removeprefix("*."), now.timestamp())
    if isinstance(loaded, certfiles.Refused):
        return None
    not_after = leaf.not_valid_after_utc
    if not_after - now < datetime.timedelta(days=RENEW_WITHIN_DAYS):
        return None
    return not_after


def _spki(key: CertificatePublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
