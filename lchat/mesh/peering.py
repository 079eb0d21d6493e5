"""The half of the membership that talks to the peers (docs/lease.md, "Witnesses"): beats to
every peer of the witness's roster once per heartbeat, on a loop of their own that no bucket
operation holds up, faster while a write waits for them (:meth:`PeerBeating.writes_known`); the
answer to theirs (:meth:`PeerBeating.receive_beat`), with the relay of their heartbeat into the
bucket when they cannot reach it; the probe of a lease holder about to be judged dead; and the
last beat of a drain (``leaving``). What the answers say is kept by
:class:`lchat.mesh.witness.Witnesses`; what they do to this box's deadline, by
:class:`lchat.mesh.liveness.Liveness`.

:class:`PeerBeating` is mixed into :class:`lchat.mesh.membership.Membership` alone, which owns the
state declared on it (the heartbeat body, the bucket's reachability).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from attrs import evolve
from prometheus_client import Counter
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.liveness import Liveness
from lchat.mesh.members import KeyPrefix, call_hooks, describe_failure, log, member_key
from lchat.mesh.placement import normalise_member_url
from lchat.mesh.witness import (
    BeatMessage,
    BeatReply,
    MessageError,
    Peer,
    PeerCallError,
    PeerChannel,
    Witnesses,
    normal_holds,
)
from lchat.objstore import ObjectStore

# The witness (lchat.mesh.witness, docs/lease.md): seconds a beat to a peer may take (at most;
# never more than the heartbeat, at least 1 s), a peer's relay of our heartbeat inside it, a
# probe of a holder about to be judged dead, and the fast rounds a write waits for while the
# bucket is out of reach.
PEER_TIMEOUT = 5.0
RELAY_TIMEOUT = 2.0
PROBE_TIMEOUT = 1.0
FAST_ROUND = 0.25
FAST_WANTED = 2.0
_PEER_BEATS = Counter(
    "lchat_mesh_peer_beats_total",
    "Beats this box sent its peers, by outcome: ok (answered), failed (no usable answer), "
    "stale (no usable answer, but a later beat was answered: not counted), "
    "relayed (answered, and the peer wrote this box's heartbeat into the bucket for it)",
    ["outcome"],
)
_PROBES = Counter(
    "lchat_mesh_probes_total",
    "Probes of a lease holder about to be judged dead, by outcome: answered (alive: not taken "
    "over), silent (no answer within the probe timeout), known_silent (its last two beats went "
    "unanswered within a heartbeat: not asked again)",
    ["outcome"],
)
for _outcome in ("answered", "silent", "known_silent"):
    _PROBES.labels(_outcome)
_RELAYS = Counter(
    "lchat_mesh_relays_total",
    "Heartbeats of peers this box wrote into the bucket for them, by outcome",
    ["outcome"],
)
for _outcome in ("ok", "failed", "relayed"):
    _PEER_BEATS.labels(_outcome)
for _outcome in ("ok", "failed"):
    _RELAYS.labels(_outcome)


class PeerBeating:
    """Beats to the peers and the answers to theirs (the module docstring)."""

    # The membership's, read here (this half's own state is set by _init_peering):
    url: str
    heartbeat: float
    body: Heartbeat  # this process's heartbeat, as it beats now
    keys: HeartbeatKeys
    witnesses: Witnesses
    liveness: Liveness
    _reactor: IReactorTime
    _monotonic: Callable[[], float]
    _peers: PeerChannel | None
    _store: ObjectStore
    _hib: KeyPrefix
    _put_failed: bool
    _stopping: bool

    def _init_peering(self, reactor: IReactorTime, heartbeat: float, dead_after: float) -> None:
        """The state of this half (the membership's constructor calls this once)."""
        # A beat to a peer: long enough for its relay (RELAY_TIMEOUT) and a round trip.
        self.peer_timeout = min(max(heartbeat, 1.0), PEER_TIMEOUT)
        self.relay_timeout = min(RELAY_TIMEOUT, self.peer_timeout / 2)
        self.probe_timeout = min(PROBE_TIMEOUT, dead_after / 4)
        self.rounds = 0  # completed rounds of beats to the peers
        self._on_unreachable: list[Callable[[str], object]] = []
        self._peer_loop = LoopingCall(self._peer_round)
        self._peer_loop.clock = reactor
        self._fast_loop = LoopingCall(self._fast_round)
        self._fast_loop.clock = reactor
        self._fast_until = -math.inf  # fast witness rounds wanted until then (monotonic)
        # What the activator tells the witness (:meth:`report`).
        self._backlog: Callable[[], bool] = lambda: False
        self._holds: Callable[[], Iterable[str]] = tuple
        self._backlog_seen: float | None = None  # when _backlog() last said yes (monotonic)
        self._witness_waiters: list[Deferred[bool]] = []
        self._relayed_by: str | None = None  # the peer whose relay landed our last beat (logged)

    def report(self, backlog: Callable[[], bool], holds: Callable[[], Iterable[str]]) -> None:
        """What this box's beats tell its peers: ``backlog()``, whether it holds writes older
        than their class promises that are not in the bucket yet; ``holds()``, the hosts awake
        here."""
        self._backlog = backlog
        self._holds = holds

    def on_unreachable(self, fn: Callable[[str], object]) -> None:
        """``fn(url)`` when a peer that answered this box's last beat does not answer the next
        (the proxy aborts its connections to it: a request waiting on it would wait for TCP)."""
        self._on_unreachable.append(fn)

    def holding(self, host: str) -> str | None:
        """The peer that said, within ``dead_after``, that ``host`` is awake on it (a routing
        hint that needs no bucket read)."""
        return self.witnesses.holding(host, self._monotonic())

    def peer_unreachable(self, url: str) -> bool:
        """Did our last beat to ``url`` go unanswered, silently? (One its port refused is not
        out of reach but stopping or dead: nothing of it serves a space, so a request for one
        of its spaces goes to the activator, which meets its lease, released or judged.)"""
        peer = self.witnesses.peers.get(url)
        return peer is not None and peer.failed >= 1 and not peer.refused

    def witness_status(self) -> dict[str, Any]:
        """What ``GET /status`` shows of the witness: what keeps this box alive, and each peer's
        part (seconds are ages on this box's monotonic clock)."""
        now = self._monotonic()
        w1 = self.liveness.on_own_beat(now)
        alive = self.liveness.alive()
        peers = [
            {
                "url": peer.url,
                "required": peer.required,
                "heard": None if peer.heard is None else round(now - peer.heard, 1),
                "accepted": None if math.isinf(peer.accepted) else round(now - peer.accepted, 1),
                "knows_backlog": self.witnesses.knows_backlog(peer),
                "says_backlog": peer.backlog,
                "unanswered": peer.failed,
                "older_lchat": peer.legacy,
            }
            for peer in sorted(self.witnesses.peers.values(), key=lambda p: p.url)
        ]
        return {
            "alive_by": ("bucket" if w1 else "peers") if alive else None,
            "bucket_reachable": not self._put_failed,
            "backlog": self._backlog_flag(),
            "writes_safe": self.writes_safe(),
            "peers": peers,
        }

    def kick(self, url: str) -> None:
        """Beat ``url`` now, unless a kick is on its way to it already (a request found it out
        of reach: it is back in reach as soon as it answers, not at the next round)."""
        peer = self.witnesses.peers.get(url)
        if self._peers is None or self._stopping or peer is None or peer.kicked:
            return
        peer.kicked = True

        def done(_: object) -> None:
            peer.kicked = False

        sending = self._send(peer, self._message(), self.probe_timeout, track=False)
        Deferred.fromCoroutine(sending).addBoth(done)

    def silent_for(self, url: str) -> float:
        """Seconds since ``url`` was last heard (this box's monotonic clock; since this process
        started when never)."""
        peer = self.witnesses.peers.get(url)
        heard = peer.heard if peer is not None and peer.heard is not None else None
        return self._monotonic() - (heard if heard is not None else self.witnesses.started)

    def answered_since(self, url: str, since: float) -> bool:
        """Has ``url`` answered a beat of ours since ``since`` (our monotonic clock), and the
        last one?"""
        peer = self.witnesses.peers.get(url)
        return peer is not None and peer.failed == 0 and (peer.heard or -math.inf) > since

    def writes_safe(self) -> bool:
        """May a write be acknowledged that cannot ship now (its space's backlog is older than its
        class promises)? Only while every required peer knows this box holds such writes and has
        heard from it lately (then none takes it over by its silence: docs/lease.md, "Writes
        during an outage"); with no required peer (none may judge it by silence), while its own
        heartbeat lands (the bucket is slow, not out of reach)."""
        if not self.liveness.alive():
            return False
        if not self.witnesses.required():
            return not self._put_failed and self.liveness.landed is not None
        return self.witnesses.all_know_backlog(self._monotonic())

    def want_witness(self, seconds: float = FAST_WANTED) -> None:
        """Send beats to the peers every :data:`FAST_ROUND` for the next ``seconds``: a write
        waits for them to know about the backlog (:meth:`writes_known`)."""
        if self._peers is None or self._stopping:
            return
        self._fast_until = max(self._fast_until, self._monotonic() + seconds)
        if not self._fast_loop.running:
            self._fast_loop.start(min(FAST_ROUND, self.heartbeat), now=True).addErrback(
                lambda f: log.failure("mesh: fast witness loop crashed", f)
            )

    def writes_known(self, timeout: float) -> Deferred[bool]:
        """Fires True as soon as :meth:`writes_safe`, False after ``timeout`` seconds."""
        if self.writes_safe():
            return defer.succeed(True)
        self.want_witness()
        waiter: Deferred[bool] = Deferred()
        self._witness_waiters.append(waiter)

        def expire() -> None:
            if waiter in self._witness_waiters:
                self._witness_waiters.remove(waiter)
                waiter.callback(False)

        self._reactor.callLater(timeout, expire)
        return waiter

    def _backlog_flag(self) -> bool:
        """What our beats say of the backlog: yes while there is one, and after it ended until a
        heartbeat sent since has landed, unless our own landed heartbeat covers us now (a peer
        told "no more" may judge this box by its silence from then on: only W1 makes that safe
        at once)."""
        now = self._monotonic()
        if self._backlog():
            self._backlog_seen = now
            return True
        seen = self._backlog_seen
        landed = self.liveness.landed
        if seen is None or (landed is not None and landed > seen):
            return False
        return not self.liveness.on_own_beat(now)

    async def _goodbye(self) -> None:
        """The drain is over (every lease released or left to expire, the heartbeat deleted or
        left to age): tell the peers this process writes nothing more, so that whatever lease
        it could not release is taken over at once rather than after ``dead_after``. Best
        effort, bounded; never fails."""
        if self._peers is None:
            return
        message = self._message(leaving=True)
        calls = [
            Deferred.fromCoroutine(self._send(peer, message, min(1.0, self.peer_timeout)))
            for peer in self.witnesses.roster()
        ]
        if calls:
            await defer.DeferredList(calls, consumeErrors=True)
        close = getattr(self._peers, "close", None)
        if close is not None:
            await close()

    def _message(self, leaving: bool = False) -> BeatMessage:
        return BeatMessage(
            heartbeat=self.body,
            seq=self.witnesses.next_seq(),
            relay=self._put_failed and not leaving and not self.liveness.leaving,
            backlog=self._backlog_flag(),
            holds=normal_holds(self._holds()),
            leaving=leaving,
        )

    def _peer_round(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._round(fast=False))

    def _fast_round(self) -> Deferred[None] | None:
        if self._monotonic() >= self._fast_until or self._stopping:
            if self._fast_loop.running:
                self._fast_loop.stop()
            return None
        return Deferred.fromCoroutine(self._round(fast=True))

    async def _round(self, fast: bool) -> None:
        """One beat to every peer of the roster that has none on its way (each answered or given
        up on within :attr:`peer_timeout`; the next round does not wait for a slow one)."""
        if self._stopping or self._peers is None:
            return
        message = self._message()
        calls = []
        for peer in self.witnesses.roster():
            # At most one beat on its way to a peer, except that a beat saying "backlog" does
            # not wait behind one saying "none": a write waits for the peer to know, and the
            # answer to the older beat cannot tell it (fc28: under load, that wait behind a slow
            # regular beat outlasted WITNESS_WAIT and a write was refused, bucket and peer up).
            if peer.in_flight and (peer.in_flight_backlog or not message.backlog):
                continue
            calls.append(Deferred.fromCoroutine(self._send(peer, message, self.peer_timeout)))
        if not fast:
            self.rounds += 1
        if calls and not fast:
            # The regular round waits (bounded) so that the loop never stacks rounds up; the fast
            # one does not wait at all: a slow peer is skipped until it answers.
            await defer.DeferredList(calls, consumeErrors=True)

    async def _send(
        self,
        peer: Peer,
        message: BeatMessage,
        timeout: float,  # noqa: ASYNC109 -- Twisted: the channel enforces it
        track: bool = True,
    ) -> tuple[bool, int | None]:
        """Send ``message`` to ``peer``: (answered, the HTTP status of a refusal). What an answer
        says is recorded. ``track``: a round's beat (at most one on its way to a peer); a probe
        is not."""
        assert self._peers is not None
        epoch = self.body.epoch
        sent = self._monotonic()
        # (What it is told may let it judge this box sooner: our deadline may move now.)
        self.witnesses.sent(peer, message.seq, message.backlog)
        self.liveness.recheck()
        if track:
            peer.in_flight += 1
            peer.in_flight_backlog = message.backlog
        try:
            raw = await self._peers.call(peer.url, message.to_json(), timeout)
            reply = BeatReply.parse(raw)
            if normalise_member_url(reply.heartbeat.url) != peer.url:
                raise PeerCallError(peer.url, f"answered as {reply.heartbeat.url!r}")
        except CancelledError:
            raise
        except Exception as e:
            status = getattr(e, "status", None)
            refused = bool(getattr(e, "refused", False))
            was = peer.failed
            if not self.witnesses.not_answered(
                peer, message.seq, self._monotonic(), legacy=status == 404, refused=refused
            ):
                _PEER_BEATS.labels("stale").inc()
                return False, status
            _PEER_BEATS.labels("failed").inc()
            # Silent: what waits on it would wait for TCP, so its connections are aborted.
            # Refused: a draining router closes its port and still answers the requests it has
            # (aborting them would fail answers on their way); a dead one's kernel resets them.
            if was == 0 and status is None and not refused:
                call_hooks(self._on_unreachable, "unreachable hook", peer.url)
            if was == 1 and not message.leaving:
                log.warn(
                    "mesh: {peer} does not answer this box's beats ({error})",
                    peer=peer.url,
                    error=e if isinstance(e, MessageError) else describe_failure(e, timeout),
                )
            return False, status
        finally:
            if track:
                peer.in_flight -= 1
        _PEER_BEATS.labels("ok").inc()
        was_failing = peer.failed >= 2
        if self.liveness.missed():
            return True, None
        self.witnesses.confirmed(
            peer, reply, sent, message.seq, message.backlog, self._monotonic(), self.body.epoch
        )
        if was_failing:
            log.info("mesh: {peer} answers this box's beats again", peer=peer.url)
        if reply.relayed and message.relay:
            _PEER_BEATS.labels("relayed").inc()
            if self._relayed_by != peer.url:
                self._relayed_by = peer.url
                log.warn(
                    "mesh: {url} reachable via peer {peer}: its heartbeat landed in the bucket "
                    "through it (this box cannot reach the bucket itself)",
                    url=self.url,
                    peer=peer.url,
                )
            self.liveness.beat_landed(sent, epoch)
        else:
            self.liveness.recheck()
        self._wake_witness_waiters()
        return True, None

    def _wake_witness_waiters(self) -> None:
        if self._witness_waiters and self.writes_safe():
            waiters, self._witness_waiters = self._witness_waiters, []
            for waiter in waiters:
                waiter.callback(True)

    async def receive_beat(self, message: BeatMessage) -> BeatReply:
        """A peer's beat (the mesh API has checked its token): record it, relay its heartbeat
        into the bucket when it asks and ours lands, answer with ours."""
        url = normalise_member_url(message.heartbeat.url)
        if url == self.url:
            raise MessageError("a beat from this box itself")
        if not message.heartbeat.process:
            raise MessageError("the heartbeat names no process")
        message = evolve(message, heartbeat=evolve(message.heartbeat, url=url))
        self.liveness.missed()  # (lapses now if past its deadline: the answer still goes out)
        seq = self.witnesses.next_seq()
        backlog = self._backlog_flag()
        self.witnesses.answered(message, self._monotonic(), seq, backlog)
        if message.leaving:
            log.info("mesh: {peer} has drained: it writes nothing more", peer=url)
        self.liveness.recheck()
        relayed = False
        if message.relay and not self._put_failed and not self._stopping:
            if self.keys.check(message.heartbeat) is None:
                # (It would be no member's in the bucket: not worth a write.)
                _RELAYS.labels("failed").inc()
                log.warn(
                    "mesh: not relaying the heartbeat of {peer}: its MAC does not verify under "
                    "LCHAT_MESH_TOKEN (an older lchat, or another token)",
                    peer=url,
                )
            else:
                relayed = await self._relay(message.heartbeat)
        return BeatReply(
            heartbeat=self.body,
            seq=seq,
            backlog=backlog,
            relayed=relayed,
            holds=normal_holds(self._holds()),
        )

    async def _relay(self, heartbeat: Heartbeat) -> bool:
        """Write a peer's heartbeat into the bucket for it (it cannot: docs/lease.md). True once
        the write succeeded; bounded by :attr:`relay_timeout`."""
        putting = Deferred.fromCoroutine(
            self._store.put(
                member_key(self._hib, heartbeat.url),
                heartbeat.to_json(),
                content_type="application/json",
            )
        )
        putting.addTimeout(self.relay_timeout, self._reactor)
        try:
            await putting
        except CancelledError:
            raise
        except Exception as e:
            _RELAYS.labels("failed").inc()
            log.warn(
                "mesh: could not relay the heartbeat of {peer} ({error})",
                peer=heartbeat.url,
                error=describe_failure(e, self.relay_timeout),
            )
            return False
        _RELAYS.labels("ok").inc()
        return True

    async def probe(self, url: str) -> bool:
        """Is the box at ``url`` there? One beat to it, bounded by :attr:`probe_timeout`: any
        answer of its mesh API says yes (even a refusal: something runs there). When our last two
        beats to it went unanswered, the latest within a heartbeat, and nothing was heard of it
        since, that is the answer already (no second wait)."""
        if self._peers is None:
            return False
        peer = self.witnesses.peers.get(url)
        if peer is None:
            # Not a URL whose heartbeat authenticated, nor one that beat this box with the
            # token: a lease naming it was not written by a mesh box (or by one long gone).
            # The mesh token never goes to it: it does not answer.
            log.info(
                "mesh: not probing {url}: no authenticated heartbeat of it is known here", url=url
            )
            return False
        now = self._monotonic()
        if (
            peer.failed >= 2
            and peer.failed_at is not None
            and now - peer.failed_at < self.heartbeat
            and (peer.heard is None or peer.heard < peer.failed_at)
        ):
            # Our last two beats went unanswered, the latest within a heartbeat, and it said
            # nothing since (a box that reaches us beats us): one more would only time out.
            _PROBES.labels("known_silent").inc()
            return False
        answered, status = await self._send(peer, self._message(), self.probe_timeout, track=False)
        _PROBES.labels("answered" if answered or status is not None else "silent").inc()
        return answered or status is not None
