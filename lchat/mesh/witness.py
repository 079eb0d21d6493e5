"""Peers witness each other's liveness, so that the bucket's health is not the fleet's
(docs/lease.md, "Witnesses"; issue 28).

Every mesh box sends its heartbeat to every peer it knows, once per ``LCHAT_MESH_HEARTBEAT``,
over the mesh API (``POST /api/mesh/beat``: :class:`BeatMessage`, answered by a
:class:`BeatReply`), besides writing it into the bucket. This module is the bookkeeping of those
exchanges, on one box, for both sides of the lease rule:

**As a holder** (this box writes on its leases), the bucket alone gives it ``W1``: alive until
``dead_after - margin`` after the last heartbeat that *landed* was sent (written by this box, or
relayed into the bucket by a peer that can reach it: :attr:`BeatMessage.relay`). The peers give
it ``W2`` (:meth:`Witnesses.holder_deadline`): alive while every *required* peer — every peer this
box has answered a beat of, and so may judge it by its silence — is known to have heard from it
within ``dead_after - margin``, or is known to have been told that this box holds writes the
bucket lacks (:attr:`BeatMessage.backlog`: a peer told so never takes it over by silence); and
never longer than ``LCHAT_MESH_OUTAGE_TOLERANCE`` after the last landed heartbeat. The box is
alive while either holds.

**As a taker** (this box judges a peer that holds a lease, lchat.mesh.fence), a peer whose
heartbeat in the bucket is too old is dead only when (:meth:`Witnesses.silent`) this box has
*permission* to judge it by silence — it holds an answer of the peer's current process to one of
its own beats, received in this box's current epoch, so the peer counts it as required — and has
not heard from it for ``dead_after``, and the peer's last word was that it holds no writes the
bucket lacks; or when its heartbeat is gone, or older than the outage tolerance allows any holder
to last (:meth:`Witnesses.slow_after`). Either way a direct probe must fail too.

Why the two sides agree (the proof is docs/lease.md's): a peer with permission is required by
the holder until the holder *retires* it (:meth:`Witnesses.retire`), which it does only on a
listing that shows the peer's heartbeat stale while the peer has been silent for ``dead_after``:
then the peer's own liveness (``W1`` and ``W2``, which needs this box's acceptance) had lapsed,
and a lapse ends its epoch, and with it every permission it held.

Nothing here does I/O or reads a clock of its own: the caller passes its monotonic time.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from attrs import define, field, frozen

from lchat import hosts
from lchat.mesh.heartbeat import Heartbeat

INF = math.inf
BEAT_PATH = "/api/mesh/beat"
MAX_HOLDS = 1000  # hosts listed in one message (a routing hint: the rest are found by the lease)
MAX_MESSAGE = 64 * 1024  # bytes of a message or a reply
HOLDS_BYTES = 32 * 1024  # the hosts a message lists take at most this much of it
_HOST = re.compile(r"[a-z0-9.-]{1,253}")


class MessageError(ValueError):
    """A beat message or reply that is not one; the text says why."""


class PeerCallError(Exception):
    """A call to a peer's mesh API (a beat: lchat.mesh.client.MeshCallError for the others) got no
    usable answer. ``status``: the HTTP status it answered with, None
    when no answer came at all (unreachable, timed out). ``refused``: its port refused the
    connection (the host is up and nothing listens: its router is stopping or dead)."""

    def __init__(
        self, peer: str, what: str, status: int | None = None, *, refused: bool = False
    ) -> None:
        super().__init__(f"{peer}: {what}")
        self.peer = peer
        self.status = status
        self.refused = refused


class PeerChannel(Protocol):
    """How a beat reaches a peer's mesh API (lchat.mesh.client.PeerBeats over verified HTTPS with
    the mesh token; a model's own in tests)."""

    async def call(self, url: str, body: bytes, timeout: float) -> bytes:  # noqa: ASYNC109
        """POST ``body`` to :data:`BEAT_PATH` at ``url``; the answer's body, or
        :class:`PeerCallError` (a non-2xx answer, or none within ``timeout`` seconds)."""
        ...


def _heartbeat_of(data: object) -> Heartbeat:
    if not isinstance(data, dict):
        raise MessageError("heartbeat must be an object")
    try:
        return Heartbeat.parse(json.dumps(data).encode())
    except ValueError as e:
        raise MessageError(f"heartbeat: {e}") from None


def _holds_of(data: object) -> tuple[str, ...]:
    if not isinstance(data, list) or len(data) > MAX_HOLDS:
        raise MessageError(f"holds must be a list of at most {MAX_HOLDS} hosts")
    out = []
    for host in data:
        if not isinstance(host, str) or not _HOST.fullmatch(host):
            raise MessageError("holds must name hosts")
        out.append(host)
    return tuple(out)


def _flag(data: Mapping[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise MessageError(f"{name} must be a boolean")
    return value


def _encode(heartbeat: Heartbeat, seq: int, holds: tuple[str, ...], **flags: bool) -> bytes:
    """A message's or a reply's JSON: the heartbeat body, ``seq``, ``holds`` and the flags."""
    data: dict[str, Any] = {"heartbeat": json.loads(heartbeat.to_json()), "seq": seq}
    data.update(flags)
    data["holds"] = list(holds[:MAX_HOLDS])
    return json.dumps(data, separators=(",", ":")).encode()


def _decode(body: bytes, *flags: str) -> dict[str, Any]:
    """A message's or a reply's fields, checked: the heartbeat, ``seq``, ``holds`` and the
    ``flags`` named (absent: false)."""
    if len(body) > MAX_MESSAGE:
        raise MessageError(f"larger than {MAX_MESSAGE} bytes")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise MessageError("not JSON") from None
    if not isinstance(data, dict):
        raise MessageError("not a JSON object")
    heartbeat = _heartbeat_of(data.get("heartbeat"))
    seq = data.get("seq")
    if type(seq) is not int or not 0 <= seq < 2**53:
        raise MessageError("seq must be a non-negative integer")
    fields = {"heartbeat": heartbeat, "seq": seq, "holds": _holds_of(data.get("holds", []))}
    return fields | {name: _flag(data, name) for name in flags}


@frozen
class BeatMessage:
    """What a box sends its peers once per heartbeat (``POST /api/mesh/beat``).

    ``seq`` increases with every message (and reply) a process sends: a receiver keeps what the
    highest one said, so a late message cannot take back a newer word. ``backlog``: the sender
    holds commits older than their replication class promises, not yet in the bucket (a peer
    told so never takes its spaces over by its silence alone). ``relay``: the sender could not
    write its heartbeat into the bucket itself; a receiver that can writes it for it.
    ``holds``: the hosts awake on the sender (a hint for routing, at most :data:`MAX_HOLDS`).
    ``leaving``: the sender has drained (released its leases, deleted its heartbeat) and writes
    nothing more."""

    heartbeat: Heartbeat
    seq: int
    relay: bool = False
    backlog: bool = False
    holds: tuple[str, ...] = ()
    leaving: bool = False

    def to_json(self) -> bytes:
        return _encode(self.heartbeat, self.seq, self.holds, relay=self.relay,
                       backlog=self.backlog, leaving=self.leaving)  # fmt: skip

    @classmethod
    def parse(cls, body: bytes) -> BeatMessage:
        return cls(**_decode(body, "relay", "backlog", "leaving"))


@frozen
class BeatReply:
    """A peer's answer to a :class:`BeatMessage`: its own heartbeat and word (``seq``,
    ``backlog``, ``holds``, as in a message), and whether it wrote the sender's heartbeat into
    the bucket (``relayed``: the write succeeded before this answer was sent)."""

    heartbeat: Heartbeat
    seq: int
    backlog: bool = False
    relayed: bool = False
    holds: tuple[str, ...] = ()

    def to_json(self) -> bytes:
        return _encode(self.heartbeat, self.seq, self.holds, backlog=self.backlog,
                       relayed=self.relayed)  # fmt: skip

    @classmethod
    def parse(cls, body: bytes) -> BeatReply:
        return cls(**_decode(body, "backlog", "relayed"))


def normal_holds(names: Iterable[str]) -> tuple[str, ...]:
    """The hosts of a ``holds`` list, normalised and bounded: at most :data:`MAX_HOLDS` of them,
    in at most :data:`HOLDS_BYTES` (garbage dropped; the rest are found by reading the lease)."""
    out: list[str] = []
    size = 0
    for name in names:
        try:
            host = hosts.normalise(name)
        except hosts.InvalidHost:
            continue
        size += len(host) + 3  # (as JSON: quotes and a comma)
        if len(out) >= MAX_HOLDS or size > HOLDS_BYTES:
            break
        out.append(host)
    return tuple(out)


@define
class Peer:
    """What this box knows of one peer, and what the peer may know of this box."""

    url: str
    # -- what it told us ------------------------------------------------------------------------
    process: str = ""  # its router process, from its latest message ("": not heard yet)
    region: str = ""
    version: str = ""
    heard: float | None = None  # our monotonic time of its latest authentic message (any process)
    seq: int = -1  # the highest seq seen from ``process``
    backlog: bool = False  # what that message said
    # Permission to judge it by its silence: an answer of its process ``granted_by`` to one of
    # our beats reached us in our epoch ``granted_in`` (it counts us as required since).
    granted_by: str = ""
    granted_in: str = ""
    holds: frozenset[str] = frozenset()
    leaving: bool = False  # its process drained and writes nothing more
    # A live older lchat (its heartbeat names no process, or it answered a beat 404): it judges
    # by the bucket alone, so this box has no W2 while it is in the view.
    legacy: bool = False
    # -- what it may know of us (holder side) ----------------------------------------------------
    required: bool = False  # we answered a beat of it: it may have permission to judge us
    # A lower bound on the send time of our latest message it received: it cannot judge us by
    # silence before ``accepted + dead_after``.
    accepted: float = -INF
    accepted_seq: int = -1  # the seq of our latest message it is known to have received...
    accepted_backlog: bool = False  # ...and what that said
    clear_sent_seq: int = -1  # the highest seq of any message we sent it saying "no backlog"
    failed: int = 0  # our beats to it that failed in a row (0: the last one was answered)
    failed_at: float | None = None  # when (our clock) the last of them gave up
    refused: bool = False  # the last of them was refused (its router stopping or dead), not silent
    in_flight: int = 0  # beats of our rounds on their way to it (at most two)...
    in_flight_backlog: bool = False  # ...and whether the latest says we hold a backlog
    kicked: bool = False  # an extra beat (a request found it out of reach) is on its way


@define
class Witnesses:
    """The peers of one box and the rule both sides apply (see the module docstring).

    ``dead_after``: LCHAT_MESH_DEAD_AFTER; ``margin``: the holder's safety margin (a tenth of it);
    ``tolerance``: LCHAT_MESH_OUTAGE_TOLERANCE, the longest a holder lives on its peers' word,
    counted from its first heartbeat that did not land (``heartbeat`` after the last that did)."""

    self_url: str
    dead_after: float
    margin: float
    tolerance: float
    heartbeat: float = 0.0
    peers: dict[str, Peer] = field(factory=dict)
    _seq: int = 0
    # When this box's process started (monotonic): a peer never heard is treated as heard then.
    started: float = 0.0

    # -- the roster ----------------------------------------------------------------------------

    def peer(self, url: str) -> Peer:
        return self.peers.setdefault(url, Peer(url))

    def know(self, urls: Iterable[str]) -> list[Peer]:
        """Peers seen in a listing of the bucket: beaten from now on (not required by that).
        Returns those that were not known before."""
        return [self.peer(u) for u in urls if u != self.self_url and u not in self.peers]

    def roster(self) -> list[Peer]:
        """The peers to send beats to: every one known, but those that drained and are not
        heard again."""
        return [p for p in self.peers.values() if not p.leaving]

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- messages ------------------------------------------------------------------------------

    def sent(self, peer: Peer, seq: int, backlog: bool) -> None:
        """We sent ``peer`` a message (a beat or an answer) numbered ``seq``."""
        if not backlog:
            peer.clear_sent_seq = max(peer.clear_sent_seq, seq)

    def _heard(self, peer: Peer, heartbeat: Heartbeat, seq: int, backlog: bool, now: float) -> None:
        peer.heard = now if peer.heard is None else max(peer.heard, now)
        peer.region, peer.version = heartbeat.region, heartbeat.version
        peer.legacy = False
        process = heartbeat.process
        if process != peer.process:
            # Another process of that box: what the old one said and granted is void.
            peer.process, peer.seq, peer.backlog = process, -1, False
            peer.granted_by = peer.granted_in = ""
            peer.leaving = False
        if seq > peer.seq:
            peer.seq, peer.backlog = seq, backlog

    def answered(
        self, message: BeatMessage, now: float, reply_seq: int, reply_backlog: bool
    ) -> Peer:
        """We answer ``message`` (its sender is authenticated) with a reply numbered
        ``reply_seq``: the sender may judge us by silence from now on, so it is required; it
        cannot do so before it receives an answer of ours, sent no earlier than now."""
        peer = self.peer(message.heartbeat.url)
        self._heard(peer, message.heartbeat, message.seq, message.backlog, now)
        if message.seq >= peer.seq:
            peer.holds = frozenset(normal_holds(message.holds))
            peer.leaving = message.leaving
        if not peer.required:
            peer.required = True
            peer.accepted = max(peer.accepted, now)
        self.sent(peer, reply_seq, reply_backlog)
        return peer

    def confirmed(
        self,
        peer: Peer,
        reply: BeatReply,
        sent_at: float,
        sent_seq: int,
        sent_backlog: bool,
        now: float,
        epoch: str,
    ) -> None:
        """Our message numbered ``sent_seq``, sent at ``sent_at``, was answered by ``reply``."""
        self._heard(peer, reply.heartbeat, reply.seq, reply.backlog, now)
        if reply.seq >= peer.seq:
            peer.holds = frozenset(normal_holds(reply.holds))
        peer.granted_by, peer.granted_in = peer.process, epoch
        peer.accepted = max(peer.accepted, sent_at)
        if sent_seq > peer.accepted_seq:
            peer.accepted_seq, peer.accepted_backlog = sent_seq, sent_backlog
        peer.failed = 0
        peer.refused = False

    def not_answered(
        self, peer: Peer, seq: int, now: float, legacy: bool = False, refused: bool = False
    ) -> bool:
        """Our message numbered ``seq`` got no usable answer. Returns whether that counts: not
        when a later message of ours was answered meanwhile (a beat sent during a cut that times
        out after the link healed says nothing of the peer now; counted, it would mark a peer
        that answers out of reach and abort the requests on their way to it)."""
        if seq < peer.accepted_seq:
            return False
        peer.failed += 1
        peer.failed_at = now
        peer.refused = refused
        if legacy:
            peer.legacy = True
        return True

    # -- the holder's side ---------------------------------------------------------------------

    def knows_backlog(self, peer: Peer) -> bool:
        """Has ``peer`` been told, by every message of ours it may hold as its latest, that we
        hold writes the bucket lacks? Then it never judges us by silence."""
        return peer.accepted_backlog and peer.clear_sent_seq < peer.accepted_seq

    def _judges_us_at(self, peer: Peer) -> float:
        """The earliest time (our monotonic clock, before the margin) ``peer`` may judge us dead
        by our silence."""
        if self.knows_backlog(peer):
            return INF
        return peer.accepted + self.dead_after

    def holder_deadline(self, landed: float | None) -> float:
        """``W2``: until when the peers' word keeps this box alive (``-inf``: it does not).

        ``landed``: when the last heartbeat that landed in the bucket was sent (None: none yet:
        a box is alive only from its first landed heartbeat). A live older lchat among the
        peers judges by the bucket alone, so then there is no ``W2``."""
        if landed is None or any(p.legacy for p in self.peers.values()):
            return -INF
        until = landed + self.heartbeat + self.tolerance
        for peer in self.peers.values():
            if peer.required:
                until = min(until, self._judges_us_at(peer) - self.margin)
        return until

    def required(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.required]

    def all_know_backlog(self, now: float) -> bool:
        """Every required peer knows we hold writes the bucket lacks (none takes us over by our
        silence), and one of them at least has heard from us within ``dead_after - margin``
        (this box is not isolated): a write acknowledged now is safe until it ships, unless this
        box is then cut off from bucket and peers past the outage tolerance (docs/lease.md,
        "Writes during an outage")."""
        required = self.required()
        fresh = now - (self.dead_after - self.margin)
        return (
            bool(required)
            and all(self.knows_backlog(p) for p in required)
            and any(p.accepted > fresh for p in required)
        )

    def retire(self, ages: Mapping[str, float | None], now: float) -> list[Peer]:
        """A listing of the bucket, read at ``now``: ``ages`` maps each listed member's URL to
        the age of its heartbeat (bucket clock; None: garbage). A required peer whose heartbeat
        is gone or at least ``dead_after`` old, and from which nothing has been heard for
        ``dead_after``, had lapsed (its liveness needs ours to hear it): it holds no permission
        any more, and is no longer required. Returns the peers retired."""
        retired = []
        for peer in self.peers.values():
            if not peer.required:
                continue
            age = ages.get(peer.url)
            stale = age is None or age >= self.dead_after
            heard = peer.heard if peer.heard is not None else self.started
            if stale and now - heard >= self.dead_after:
                peer.required = False
                peer.accepted, peer.accepted_seq, peer.accepted_backlog = -INF, -1, False
                peer.clear_sent_seq = -1
                retired.append(peer)
        return retired

    def forget(self, urls: Iterable[str]) -> None:
        """Peers whose heartbeat has been gone from the bucket long enough that nobody beats them
        (the janitor's age) and that are not required: dropped from the roster."""
        for url in urls:
            peer = self.peers.get(url)
            if peer is not None and not peer.required:
                del self.peers[url]

    # -- the taker's side ----------------------------------------------------------------------

    def silent(self, url: str, process: str | None, epoch: str, now: float) -> str | None:
        """May this box judge the peer at ``url`` dead by its silence (its heartbeat in the bucket
        is too old already)? None if so, else why not. ``process``: the peer's process as its
        heartbeat in the bucket names it (None: gone)."""
        peer = self.peers.get(url)
        if peer is None or not peer.granted_by:
            return "no answer of it was ever received here"
        if peer.leaving:
            return None  # it drained: it writes nothing more
        if peer.granted_in != epoch:
            return "its answer was received before this box's liveness lapsed"
        if process is not None and process and process != peer.granted_by:
            return "another process of it beats now"
        if peer.backlog:
            return "it holds writes the bucket lacks"
        heard = peer.heard if peer.heard is not None else self.started
        if now - heard < self.dead_after:
            return f"it was heard {now - heard:.1f}s ago"
        return None

    def slow_after(self) -> float:
        """How old (bucket clock) a holder's heartbeat must be for any box to judge it dead
        without its permission: past the longest a holder lives on its peers' word
        (``heartbeat + tolerance`` on a clock up to a tenth slow), plus ``dead_after``."""
        lives = self.heartbeat + self.tolerance
        return lives / (1 - self.margin / self.dead_after) + self.dead_after

    def holding(self, host: str, now: float) -> str | None:
        """The peer that said, within ``dead_after``, that ``host`` is awake on it."""
        best: Peer | None = None
        for peer in self.peers.values():
            if host in peer.holds and peer.heard is not None and now - peer.heard < self.dead_after:
                if best is None or (best.heard or 0) < peer.heard:
                    best = peer
        return best.url if best is not None else None

    def heard_within(self, seconds: float, now: float) -> list[Peer]:
        return [
            p
            for p in self.peers.values()
            if p.heard is not None and now - p.heard < seconds and not p.leaving
        ]
