"""Placement (docs/design.md §9): which live mesh member owns an in-scope hostname.

Pure functions, no I/O. Every box computes ownership independently from the same membership view,
so the arithmetic below is a wire format: it must give the same answer on every box and in every
future version. Change it and a mixed fleet disagrees about every host.

Scope. Only a host equal to or directly under one of ``LCHAT_MESH_DOMAINS`` takes part in
placement (:func:`in_scope`); every other host is always served locally.

Member URL normalisation (:func:`normalise_member_url`). A member is named by its
``LCHAT_MESH_SELF`` URL as it appears in its heartbeat, normalised: scheme and host lowercase,
no trailing slash, the default port (80 for http, 443 for https) omitted, any other port kept.
Example: ``HTTPS://Box-1.Example.NET:443/`` normalises to ``https://box-1.example.net``.

Score specification (byte for byte)::

    score(member_url, host) =
        int.from_bytes(
            hashlib.sha256(member_url.encode("utf-8") + b"\\n" + host.encode("ascii")).digest()[:8],
            "big",
        )

    where member_url is the normalised member URL (above) and host is the normalised hostname
    (punycode A-labels, lowercase, no port, no trailing dot: lchat.hosts.normalise). The score is
    an unsigned 64-bit integer: the first 8 bytes of the SHA-256 digest, read big-endian.

Worked example: member_url ``https://box-1.example.net`` and host ``chat.11ch.example.com`` give
score ``0x4048325c79d4d38f`` (4632007589512926095).

Ownership (:func:`owner`, :func:`ranked`). Rendezvous (highest-random-weight) hashing over the
live members, self included: the candidate with the highest score owns the host. Ties
(practically impossible) are broken by the larger normalised member URL string. Candidates: if
the route's ``home_region`` is non-empty and at least one live member advertises exactly that
region, only those members; otherwise (empty ``home_region``, or no live member in it) the whole
fleet — availability wins over residency.

Because each (member, host) score never changes, adding a member moves only the hosts it now wins
(about 1/(N+1) of them, all to it) and removing a member moves only the hosts it owned.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from lchat import hosts
from lchat.hosts import normalise_member_url  # part of this wire format; config needs it too


class Candidate(Protocol):
    """A live mesh member as placement sees it."""

    @property
    def url(self) -> str:
        """The member's ``LCHAT_MESH_SELF`` URL, normalised (:func:`normalise_member_url`)."""
        ...

    @property
    def region(self) -> str:
        """The member's ``LCHAT_MESH_REGION`` ("" = region-agnostic)."""
        ...


C = TypeVar("C", bound=Candidate)


def in_scope(host: str, domains: Sequence[str]) -> bool:
    """True when the (normalised) ``host`` is equal to or directly under one of ``domains``."""
    return any(hosts.covers(domain, host) for domain in domains)


def score(member_url: str, host: str) -> int:
    """The rendezvous score of ``member_url`` for ``host``, exactly as the module docstring says.

    Both arguments must already be normalised; this function hashes the bytes it is given.
    """
    digest = hashlib.sha256(member_url.encode("utf-8") + b"\n" + host.encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big")


def ranked(host: str, members: Sequence[C], home_region: str = "") -> list[C]:
    """The eligible ``members`` ordered best first for ``host`` (the owner, then its failovers).

    ``host`` is normalised here (:func:`lchat.hosts.normalise`, which raises
    :class:`~lchat.hosts.InvalidHost` for a non-space name) and so is each member URL
    (:class:`ValueError` for a malformed one), so a caller that forgot cannot make this box
    disagree with its peers. The order does not depend on the order of ``members``.
    """
    name = hosts.normalise(host)
    # Those in ``home_region`` if any, else all of them.
    eligible = [m for m in members if m.region == home_region] if home_region else []
    keyed = []
    for member in eligible or members:
        url = normalise_member_url(member.url)
        # Region only orders exact duplicates of one URL, which membership never produces.
        keyed.append(((score(url, name), url, member.region), member))
    keyed.sort(key=lambda pair: pair[0], reverse=True)
    return [member for _, member in keyed]


def owner(host: str, members: Sequence[C], home_region: str = "") -> C | None:
    """The member that owns ``host`` among the live ``members`` (self included); None if none."""
    best = ranked(host, members, home_region)
    return best[0] if best else None


class Row(Protocol):
    """A registry row as the per-owner count sees it (lchat.registry.Route)."""

    @property
    def host(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def home_region(self) -> str: ...

    @property
    def always_on_here(self) -> bool: ...

    @property
    def lives_at(self) -> str: ...


def owner_of(row: Row, members: Sequence[Candidate], self_url: str) -> str | None:
    """The normalised URL of the box a row's space counts for: an always-on row the box it runs
    on (this one, or its ``lives_at`` peer), a hibernating one its owner among ``members``
    (None: no member is live, or a malformed ``lives_at``)."""
    if row.always_on_here:
        return normalise_member_url(self_url)
    if row.lives_at:
        try:
            return normalise_member_url(row.lives_at)
        except ValueError:
            return None
    placed = owner(row.host, members, row.home_region)
    return normalise_member_url(placed.url) if placed is not None else None


def registered_by_owner(
    rows: Iterable[Row], members: Sequence[Candidate], self_url: str, domains: Sequence[str]
) -> dict[str, int]:
    """Instance rows per box (normalised URL) they count for (:func:`owner_of`): the
    ``LCHAT_MAX_REGISTERED`` ceiling on a mesh is per owner. A row neither in the mesh
    ``domains`` nor placed by a home region lives on this box alone: it counts for this box."""
    counts: dict[str, int] = {}
    me = normalise_member_url(self_url)
    for row in rows:
        if row.kind != "instance":
            continue
        placed = bool(row.home_region) or in_scope(row.host, domains)
        url = owner_of(row, members, self_url) if placed else me
        if url is not None:
            counts[url] = counts.get(url, 0) + 1
    return counts
