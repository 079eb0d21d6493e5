"""``lchat certs``: the certificate cache — every certificate this box has, and the shared cache's.

One row per name: host or wildcard, issuer, not-after, and where it is (``dir``: this box's
``LCHAT_ACME_CACHE``; ``s3``: the shared cache in the bucket; ``dir+s3``: both, the same
certificate; a row per copy when they differ). The bucket's entries are read (one LIST, one GET
each) but never decrypted: the listing needs no key. An entry sealed with another cache key than
``LCHAT_CERT_CACHE_KEY`` says so in its note (``LCHAT_CERT_CACHE_KEY_PREVIOUS``'s, during a
rotation, or one this box cannot read at all).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from collections.abc import Callable
from typing import Any

from attrs import asdict, define
from cryptography import x509

from lchat import admin_client, certfiles
from lchat.acme.cache import CacheEntryError, CertName, describe, key_id
from lchat.buckets import open_bucket
from lchat.certfiles import issuer_name
from lchat.cli import runner
from lchat.config import BoxConfig
from lchat.objstore import ObjectStoreError
from lchat.reactors import Reactor

SUMMARY = "list the certificate cache: name, kind, issuer, not-after, source (dir or s3)"
STATUS_TIMEOUT = 3.0


@define
class Row:
    name: str
    kind: str
    issuer: str
    not_after: str
    serial: str
    source: str
    note: str = ""
    origin: str = ""  # the ACME directory that issued it ("" = placed by hand)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list")


def run(args: argparse.Namespace, cfg: BoxConfig, out: Callable[[str], None]) -> int:
    rows = _local_rows(cfg.acme_cache)
    if cfg.cert_cache == "s3":
        assert cfg.hibernate is not None
        hib = cfg.hibernate

        async def main(reactor: Reactor) -> list[Row]:
            store = await open_bucket(reactor, cfg, hib.where)
            try:
                return await _shared_rows(store, hib.key("certs") + "/", *_key_ids(cfg))
            finally:
                await store.close()

        try:
            rows = _merge(rows, runner.run(main))
        except ObjectStoreError as e:
            raise CertsError(f"cannot read the shared certificate cache: {e}") from e
    rows.sort(key=lambda r: (r.kind != "default", r.name.lstrip("*."), r.source))
    if args.json:
        out(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    if not rows:
        where = " or the shared cache" if cfg.cert_cache == "s3" else ""
        out(f"no certificates in {cfg.acme_cache}{where}")
        for line in _issuer_lines(_router_acme(cfg)):
            out(line)
        return 0
    width = max(len("NAME"), *(len(r.name) for r in rows))
    issuer_width = max(len("ISSUER"), *(len(r.issuer) for r in rows))
    out(f"{'NAME':<{width}}  {'KIND':<8}  {'ISSUER':<{issuer_width}}  {'NOT-AFTER':<20}  SOURCE")
    for r in rows:
        line = f"{r.name:<{width}}  {r.kind:<8}  {r.issuer:<{issuer_width}}  {r.not_after:<20}  {r.source}"
        out(line + (f"  ({r.note})" if r.note else ""))
    for line in _issuer_lines(_router_acme(cfg)):
        out(line)
    return 0


def _router_acme(cfg: BoxConfig) -> dict[str, Any] | None:
    """The running router's issuer view (``GET /status``, ``acme``), or None."""
    try:
        response = admin_client.status(cfg.admin_socket, timeout=STATUS_TIMEOUT)
        body = response.json() if response.status == 200 else None
    except (admin_client.Unreachable, admin_client.ProtocolError, ValueError):
        return None  # not running (or not answering): the files are all there is to show
    acme = body.get("acme") if isinstance(body, dict) else None
    return acme if isinstance(acme, dict) else None


def _issuer_lines(acme: dict[str, Any] | None) -> list[str]:
    """What the running router's issuer is doing: names being issued, names failing."""
    if not acme:
        return []
    lines = []
    issuing = [str(n) for n in acme.get("issuing") or []]
    if issuing:
        lines.append("issuing now: " + ", ".join(_printable(n) for n in issuing))
    failing = acme.get("failing") or {}
    for name, f in sorted(failing.items()) if isinstance(failing, dict) else []:
        if not isinstance(f, dict):
            continue
        lines.append(
            f"failing: {_printable(str(name))}: {f.get('failures', '?')} in a row, last at "
            f"{_printable(str(f.get('stage', '?')))}: {_printable(str(f.get('error', '')))}; "
            f"next try in {f.get('retry_in', '?')}s"
        )
    for domain, state in sorted((acme.get("wildcards") or {}).items()):
        if state != "ok":
            lines.append(f"wildcard *.{_printable(str(domain))}: {_printable(str(state))}")
    return lines


class CertsError(Exception):
    pass


def _local_rows(directory: str) -> list[Row]:
    try:
        filenames = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CertsError(f"cannot list {directory}: {e.strerror or e}") from e
    now = datetime.datetime.now(datetime.UTC).timestamp()
    rows = []
    for filename in filenames:
        role = certfiles.role_of(filename)
        if role is None:
            continue
        kind, name = role
        label = "*." + name if kind == "wildcard" else name
        path = os.path.join(directory, filename)
        loaded = certfiles.load_file(path, kind, name, now)
        if isinstance(loaded, certfiles.Refused):
            rows.append(Row(label, kind, "?", "?", "", "dir", f"refused: {_printable(loaded.why)}"))
            continue
        rows.append(
            Row(
                label,
                kind,
                _printable(loaded.issuer),
                _date(loaded.not_after),
                f"{loaded.serial:x}",
                "dir",
                origin=loaded.origin,
            )
        )
    return rows


def _key_ids(cfg: BoxConfig) -> tuple[str, str]:
    """The public ids of this box's cache key and previous key ("": none)."""
    current = key_id(cfg.cert_cache_key) if cfg.cert_cache_key else ""
    previous = key_id(cfg.cert_cache_previous_key) if cfg.cert_cache_previous_key else ""
    return current, previous


def _sealing_note(data: dict[str, Any], current: str, previous: str) -> str:
    """What the note says about the key an entry is sealed with ("" for this box's own)."""
    sealed = data.get("key")
    found = sealed.get("key_id") if isinstance(sealed, dict) else None
    if not current or found == current:
        return ""
    if previous and found == previous:
        return "; sealed with LCHAT_CERT_CACHE_KEY_PREVIOUS: the next sync re-seals it"
    return f"; sealed with cache key {_printable(str(found))}, which this box cannot read"


async def _shared_rows(store: Any, prefix: str, current: str = "", previous: str = "") -> list[Row]:
    rows = []
    for info in await store.list(prefix):
        rest = info.key[len(prefix) :]
        if "/" in rest or not rest.endswith(".json"):
            continue
        name = CertName.from_stem(rest[: -len(".json")])
        if name is None:
            continue
        got = await store.get(info.key)
        try:
            data = describe(got.body)
            # What is shown comes from the chain itself, not from the entry's own claims.
            leaf = x509.load_pem_x509_certificate(str(data.get("chain", "")).encode("ascii"))
        except (CacheEntryError, ValueError, UnicodeEncodeError) as e:
            rows.append(Row(name.label, name.kind, "?", "?", "", "s3", f"unusable: {e}"))
            continue
        rows.append(
            Row(
                name.label,
                name.kind,
                _printable(issuer_name(leaf)),
                _date(leaf.not_valid_after_utc.timestamp()),
                f"{leaf.serial_number:x}",
                "s3",
                f"issued by {_printable(str(data.get('issued_by') or '?'))}"
                + _sealing_note(data, current, previous),
                _printable(str(data.get("directory") or "")),
            )
        )
    return rows


def _merge(local: list[Row], shared: list[Row]) -> list[Row]:
    """One ``dir+s3`` row where both hold the same certificate (same serial)."""
    by_key = {(r.name, r.serial): r for r in local}
    merged = list(local)
    for row in shared:
        twin = by_key.get((row.name, row.serial)) if row.serial else None
        if twin is not None:
            twin.source = "dir+s3"
            twin.note = row.note
        else:
            merged.append(row)
    return merged


def _printable(text: str) -> str:
    """Bucket entries and certificates are other people's bytes: no terminal escapes."""
    cleaned = "".join(c if c.isprintable() else "?" for c in text)
    return cleaned if len(cleaned) <= 200 else cleaned[:200] + "..."


def _date(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
