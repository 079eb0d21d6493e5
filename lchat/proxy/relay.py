"""Serving one request and relaying its response: route, dial (or take a pooled connection),
write the head and body upstream, relay what comes back (UpstreamConnection's handler interface),
send a request again elsewhere when a mesh peer could not take it, and end each exchange.
"""

from __future__ import annotations

from typing import cast

from prometheus_client import Counter
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.proxy.client import ClientConnection
from lchat.proxy.exchange import client_head, closes_after, upstream_head
from lchat.proxy.hot import CLOSE_LINE, REPLAY_LIMIT, Exchange
from lchat.proxy.http import (
    INTERNAL,
    LAST_CHUNK,
    REFUSED,
    Header,
    Valve,
    chunk,
    end_to_end,
    head_bytes,
    simple_response,
    status_line,
)
from lchat.proxy.upstream import PEER_UNREACHABLE, DialFailed, UpstreamConnection
from lchat.router import SAFE_METHODS, LocalResponse, LocalSocket, RemotePeer, Target, plain

_log = Logger(namespace="lchat.proxy")

# How much longer than upstream_timeout a worker process waits for the control process's answer
# through the hop (lchat.controlhop): control may first hold the request while the space wakes, up
# to the activator's queue budget (lchat.hibernation.space.Budgets.queue, 30 s; the layers keep the
# front door from importing it: tests/test_proxy_hop.py holds the two equal), and then its own
# upstream_timeout runs. Without it a long poll that waited for a wake would be cut by the worker
# first, and its client would get the worker's 504 for a request control is still serving.
HOP_SLACK = 30.0
# The refusals a mesh peer marks X-Lchat-Refused (lchat.mesh.routing): the request was not
# processed there, so it is routed again without that peer (the mesh's reroute, told which).
REFUSALS = {"stopping": "stopping", "not_holding": "it does not hold the space"}
# The internal header a hop target's answer keeps (client_head): control's drain refusal, for the
# mesh peer that forwarded the request through this worker.
_KEEP_REFUSED = frozenset({REFUSED})
_KEEP_NONE: frozenset[bytes] = frozenset()

_reroutes = Counter(
    "lchat_proxy_reroutes_total",
    "Requests routed again without a mesh peer that could not take them, by why",
    # unreachable, closed (a safe request closed unanswered), stopping (refused by a drain)
    ["why"],
)


class Relay(ClientConnection):
    """A client connection that serves its requests, one at a time (see the module docstring)."""

    __slots__ = ()  # (ClientConnection has them all)

    # -- serving -------------------------------------------------------------------------------

    def _serve(self, ex: Exchange) -> None:
        assert self.valve is not None and ex.head is not None
        self._active = ex
        self._stats.in_flight += 1
        # Straight calls when the answer is at hand (the hot path); Deferreds only when it is not.
        try:
            target = self.proxy.router.route(ex.head)
        except Exception:
            self._route_failed(Failure(), ex)
        else:
            self._dispatch(target, ex)

    def _dispatch(self, target: Target | Deferred[Target], ex: Exchange) -> None:
        """Go on with ``ex`` once the router answered (at once, or with a Deferred)."""
        kind = type(target)  # (isinstance on a Deferred is an ABC's check: slower)
        if kind is LocalSocket or kind is RemotePeer or kind is LocalResponse:
            self._routed(cast(Target, target), ex)
        else:
            cast(Deferred[Target], target).addCallbacks(
                self._routed, self._route_failed, callbackArgs=(ex,), errbackArgs=(ex,)
            )
        if ex.upstream is None and not ex.response_started and not self._closed:
            # Routing or dialing goes on asynchronously: stop reading until it is done. (The
            # common case, a pooled connection to a known host, completes above without it.)
            assert self.valve is not None
            self.valve.close("routing")

    def _route_failed(self, failure: Failure, ex: Exchange) -> None:
        _log.failure("routing {host} failed", failure, host=ex.head.host if ex.head else "?")
        self._routed(plain(500, "500 Internal Server Error", label="error"), ex)

    def _routed(self, target: Target, ex: Exchange) -> None:
        if self._closed or ex is not self._active:
            return
        ex.target = target
        if isinstance(target, LocalResponse):
            self._answer_locally(ex, target)
            return
        if type(target) is LocalSocket and target.inflight is not None:
            self._observe(ex)
        pooled = self.proxy.pool.take_idle(target)
        if pooled is not None:
            self._connected(pooled, ex)
            return
        d = self.proxy.pool.dial(target)
        d.addCallbacks(self._connected, self._dial_failed, callbackArgs=(ex,), errbackArgs=(ex,))

    def _dial_failed(self, failure: Failure, ex: Exchange) -> None:
        if self._closed or ex is not self._active:
            return
        why = failure.value.why if isinstance(failure.value, DialFailed) else str(failure.value)
        target = ex.target
        if isinstance(target, RemotePeer) and target.member:
            # A mesh peer that does not answer (stopping, or gone before its heartbeat aged
            # out): route again without it. Nothing was sent, so this is safe.
            refused = isinstance(failure.value, DialFailed) and failure.value.refused
            self._reroute(
                ex, target, "refused" if refused else "unreachable", f"unreachable ({why})"
            )
            return
        if isinstance(target, LocalSocket) and target.kind == "hop":
            # A worker process whose control process does not answer (restarting, or gone: the
            # worker exits with it): nothing a space did.
            _log.warn(
                "the control process's hop socket {path} unreachable for {host}: {why}",
                path=target.path,
                host=target.host,
                why=why,
            )
            self._answer_locally(
                ex,
                plain(502, "502 Bad Gateway: the router is not answering", label="unreachable"),
            )
            return
        _log.warn(
            "upstream for {host} unreachable: {why}", host=ex.head.host if ex.head else "?", why=why
        )
        self._answer_locally(
            ex, plain(502, "502 Bad Gateway: the space is not answering", label="unreachable")
        )

    def _reroute(self, ex: Exchange, target: RemotePeer, why: str, detail: str) -> None:
        """Route ``ex`` again without the mesh peer ``target`` (the router's ``reroute``: the
        mesh leaves it out a while), told ``why`` (unreachable, refused, closed, stopping)."""
        assert ex.head is not None and target.member
        _reroutes.labels(why).inc()
        # A drain's refusals are expected (a few per peer connection): not a warning.
        emit = _log.info if why in REFUSALS else _log.warn
        emit(
            "peer {peer} {why} for {host}: routing without it",
            peer=f"{target.address}:{target.port}",
            host=target.host,
            why=detail,
        )
        self._disarm()  # an upstream deadline armed for the peer is not this routing's
        self._observe(ex, started=False)
        try:
            again = self.proxy.router.reroute(ex.head, target, why)
        except Exception:
            self._route_failed(Failure(), ex)
            return
        if isinstance(again, Deferred):
            again.addCallbacks(
                self._routed, self._route_failed, callbackArgs=(ex,), errbackArgs=(ex,)
            )
        else:
            self._routed(again, ex)

    def _connected(self, upstream: UpstreamConnection, ex: Exchange) -> None:
        if self._closed or ex is not self._active:
            upstream.abort()
            return
        assert ex.head is not None and ex.target is not None and self.valve is not None
        ex.upstream = upstream
        upstream.begin(self, ex.method)
        origin = ex.origin
        if origin is None:
            upstream.write(upstream_head(ex, self._client_bytes, self.proxy.scheme))
        else:  # (on the control process's hop socket: the worker's client)
            upstream.write(upstream_head(ex, *origin))
        if ex.body:
            for piece in ex.body:
                upstream.write(chunk(piece) if ex.chunked else piece)
                ex.sent(piece)
            ex.body.clear()
        if not ex.upgrade and (ex.body_complete or (not ex.chunked and not ex.length)):
            # All of it is here and now upstream (a request without a body is whole at its head:
            # its message ends in this very parse, with nothing to stream). _request_sent, inline:
            # this is every small request's path.
            if ex.chunked:
                upstream.write(LAST_CHUNK)
            upstream.request_sent = True
            if not ex.response_started:
                self._deadline = self.proxy.reactor.seconds() + self.cfg.upstream_timeout
                self._timer_action = Relay._upstream_timed_out
        elif not ex.upgrade:
            # The client's body now flows straight through; a full upstream pauses the client.
            ex.streaming = True
            upstream.backpressure = self
            if upstream.write_paused:
                self.valve.close(Valve.PEER_FULL)
        else:
            self._request_sent(ex, upstream)
        if self.valve.reasons:
            self.valve.open("routing")

    def _request_sent(self, ex: Exchange, upstream: UpstreamConnection) -> None:
        """The whole request is upstream: now the space has ``upstream_timeout`` to answer (the
        control process through the hop, HOP_SLACK more: _upstream_timed_out)."""
        upstream.request_sent = not ex.upgrade
        if not ex.response_started:
            self._arm(self.cfg.upstream_timeout, Relay._upstream_timed_out)

    def _upgrade_ready(self, ex: Exchange) -> None:
        """The upgrade request's head is parsed; the bytes after it wait for the 101."""
        # Nothing more is read until the upstream decides: either 101 (splice) or a normal answer.
        assert self.valve is not None
        self.valve.close("upgrade")

    # -- the response (UpstreamConnection's handler interface) ---------------------------------

    def informational(self, status: int, reason: bytes, headers: list[Header]) -> None:
        ex = self._active
        if ex is None or ex.version != "1.1":
            return  # HTTP/1.0 clients do not understand 1xx
        assert self.transport is not None
        # Stripped of the router's internal markers as a final head is (_response_head): a 100
        # or 103 is the space's word too. (The one-read paths never take a 1xx: oneread.response
        # and its C twin accept 2xx-5xx only, so every 1xx head comes through here.)
        self._send(head_bytes(status_line(status, reason), end_to_end(headers, drop=INTERNAL)))

    def response_head(
        self,
        status: int,
        reason: bytes,
        headers: list[Header],
        length: int | None,
        chunked: bool,
        raw_head: bytes | None = None,
    ) -> None:
        ex = self._active
        if ex is None or self.transport is None:
            return
        if status == 503 and self._refused_unprocessed(ex, headers):
            return
        ex.replay = None  # answered: never sent again
        self._disarm()
        ex.status = status
        ex.response_started = True
        ex.close_after = closes_after(ex, self.proxy.draining)
        target = ex.target
        extra = target.response_headers if isinstance(target, LocalSocket) else ()
        if raw_head is not None and ex.version == "1.1" and not extra:
            # Nothing in it to drop or rewrite (UpstreamConnection checked): as it came, with
            # Connection: close added last when this answer ends the connection.
            self._send(raw_head[:-2] + CLOSE_LINE if ex.close_after else raw_head)
        else:
            # Control's answer through the hop keeps its drain refusal: the client may be the
            # mesh peer that forwarded the request (only control's own answer can carry it:
            # every space's and peer's answer has it dropped there).
            hop = isinstance(target, LocalSocket) and target.kind == "hop"
            keep = _KEEP_REFUSED if hop else _KEEP_NONE
            self._send(client_head(ex, status, reason, headers, length, extra, keep))
        if self._output_paused:
            self._pause_upstream(ex)  # the client has not read what came before yet

    def _refused_unprocessed(self, ex: Exchange, headers: list[Header]) -> bool:
        """A mesh peer's 503 marked ``X-Lchat-Refused``: it refused the request without
        processing it because it is draining (``stopping``) or does not hold the space its word
        said it held (``not_holding``: lchat.mesh.routing, a failed-over space slept) — only a
        peer router's own answer can carry the marker; every space's response has it dropped.
        Send the request
        elsewhere, once, if all of it is at hand (or, refused before the client finished
        sending it, will be: then once it is), and return True. Otherwise the 503 is relayed
        like any other (its marker dropped with every internal header)."""
        target = ex.target
        if not isinstance(target, RemotePeer) or not target.member or ex.rerouted:
            return False
        why = next((v.strip().decode("latin-1") for n, v in headers if n.lower() == REFUSED), "")
        if why not in REFUSALS:
            return False  # a 503 of the space itself: the client's to see
        coming = (
            not ex.body_complete
            and ex.replay is not None
            and not ex.chunked
            and (ex.length or 0) <= REPLAY_LIMIT
        )
        if not ex.at_hand() and not coming:
            _log.info(
                "peer {peer} refused {host} unprocessed ({why}), but the request's body is "
                "not kept (over {limit} bytes, or chunked and still arriving): relaying its 503",
                why=REFUSALS[why],
                peer=f"{target.address}:{target.port}",
                host=target.host,
                limit=REPLAY_LIMIT,
            )
            return False
        upstream, ex.upstream = ex.upstream, None
        if upstream is not None:
            upstream.abort()  # the rest of this answer is not wanted, nor is the connection
        ex.rerouted = True
        ex.rewind()  # what went upstream is back in ex.body; the rest is buffered behind it
        if coming:
            ex.refused_by = target  # on_message_complete sends it on (the body timer runs)
            ex.refused_why = why
        else:
            self._reroute(ex, target, why, f"refused it unprocessed ({REFUSALS[why]})")
        return True

    def response_body(self, data: bytes) -> None:
        ex = self._active
        if ex is None or self.transport is None or not data:
            return
        ex.bytes_out += len(data)
        self._stats.bytes_down += len(data)
        self._send(chunk(data) if ex.response_chunked else data)

    def response_view(self, view: memoryview, nbytes: int) -> bool:
        """``response_body`` of ``view[:nbytes]`` (a read into our own buffer, lchat.proxy.bulk),
        written at once; False, having done nothing, when it cannot go that way."""
        ex = self._active
        transport = self.transport
        if ex is None or transport is None or ex.response_chunked or self._batch is not None:
            return False
        ex.bytes_out += nbytes
        self._stats.bytes_down += nbytes
        transport.write(view[:nbytes])
        self.bulk_written += nbytes
        if transport.get_write_buffer_size():
            self._buffers.lend(transport, self)  # uvloop kept a view of the unsent rest
        return True

    def response_complete(self) -> None:
        ex = self._active
        if ex is None or self.transport is None:
            return
        if ex.response_chunked:
            self._send(LAST_CHUNK)
        ex.response_complete = True
        upstream, ex.upstream = ex.upstream, None
        if upstream is not None:
            if upstream.valve is not None:
                upstream.valve.open(Valve.PEER_FULL)  # an idle pooled connection must read
            if upstream.request_sent and upstream.reusable:
                self.proxy.pool.release(upstream)
            else:
                upstream.abort()
        if ex.body_complete or ex.close_after:
            self._finish(ex)

    def switched(self, reason: bytes, headers: list[Header], tail: bytes) -> None:
        """The upstream answered 101: relay it and splice raw bytes both ways from now on."""
        ex = self._active
        if ex is None or self.transport is None or ex.upstream is None or not ex.upgrade:
            if ex is not None and ex.upstream is not None:
                ex.upstream.abort()
            return
        self._disarm()
        ex.status = 101
        ex.response_started = True
        kept = end_to_end(headers, drop=INTERNAL)
        if isinstance(ex.target, LocalSocket) and ex.target.response_headers:
            kept.extend(ex.target.response_headers)
        upgrade = [v for n, v in headers if n.lower() == b"upgrade"][:1]
        kept += [(b"Connection", b"Upgrade"), *((b"Upgrade", v) for v in upgrade)]
        self._send(head_bytes(status_line(101, reason), kept))
        if tail:
            self._send(tail)
        self._spliced = True
        self._stats.upgraded += 1
        upstream = ex.upstream
        upstream.request_sent = True
        if ex.upgrade_tail:
            upstream.write(ex.upgrade_tail)
            ex.upgrade_tail = b""
        # Backpressure both ways for the life of the tunnel (the client's side: see
        # pause_writing).
        assert self.valve is not None and upstream.valve is not None
        if self._output_paused:
            self._pause_upstream(ex)
        upstream.backpressure = self
        if upstream.write_paused:
            self.valve.close(Valve.PEER_FULL)
        self._tunnel_moved = self.proxy.reactor.seconds()
        self.valve.open("upgrade")
        self.valve.open("routing")
        self._log_access(ex)

    def upstream_data(self, data: bytes) -> None:
        if self.transport is not None:
            self._stats.bytes_down += len(data)
            self._tunnel_moved = self.proxy.reactor.seconds()
            self._send(data)

    def upstream_failed(self, why: str, started: bool) -> None:
        ex = self._active
        if ex is None or self.transport is None:
            return
        upstream, ex.upstream = ex.upstream, None
        if upstream is not None:
            upstream.abort()
        if self._spliced:
            # The space closed the tunnel (or died): close the client's side too. (It ends
            # the request, and its in-flight ticket, when the client's connection is gone.)
            self._closing()
            return
        if not started and not ex.response_started:
            # Can the request be sent again? All of it must still be here (Exchange.replay).
            resendable = not ex.upgrade and ex.at_hand()
            # A reused keep-alive connection the space (or peer) had just closed: the close
            # crossed our request, which was never read. One try on a *new* connection (another
            # idle one may have been closed in the same breath). What went upstream must all be
            # kept; a body still arriving follows it there (the client's side waits meanwhile).
            if (
                why == "closed before responding"
                and upstream is not None
                and upstream.reused
                and not ex.retried
                and not ex.upgrade
                and ex.replay is not None
                and isinstance(ex.target, LocalSocket | RemotePeer)
            ):
                ex.retried = True
                ex.rewind()
                assert self.valve is not None
                self.valve.open(Valve.PEER_FULL)  # (the closed connection's fullness is over)
                if not ex.body_complete:
                    self.valve.close("routing")  # _connected opens it
                d = self.proxy.pool.dial(ex.target)
                d.addCallbacks(
                    self._connected, self._dial_failed, callbackArgs=(ex,), errbackArgs=(ex,)
                )
                return
            target = ex.target
            if (
                why in ("closed before responding", PEER_UNREACHABLE)
                and isinstance(target, RemotePeer)
                and target.member
                and not ex.rerouted
                and resendable
                and ex.method in SAFE_METHODS
            ):
                # A peer that closed a forwarded request unanswered is stopping: a safe method
                # can be sent again, elsewhere (an unsafe one may have been acted on).
                ex.rerouted = True
                ex.rewind()
                self._reroute(ex, target, "closed", "closed before responding")
                return
            to = (
                "a peer"
                if isinstance(target, RemotePeer)
                else "the control process"
                if isinstance(target, LocalSocket) and target.kind == "hop"
                else "its space"
            )
            conn = "reused" if upstream is not None and upstream.reused else "new"
            _log.warn(
                "upstream for {host} failed: {why} ({method} to {to} on a {conn} connection"
                "{retry}{resend})",
                host=ex.head.host if ex.head else "?",
                why=why,
                method=ex.method.decode("latin-1"),
                to=to,
                conn=conn,
                retry=", a retry" if ex.retried else "",
                resend="" if resendable else ", not resendable",
            )
            self._answer_locally(
                ex,
                plain(502, "502 Bad Gateway: the space failed to answer", label="upstream-error"),
            )
            return
        _log.warn(
            "upstream for {host} broke off mid-response: {why}",
            host=ex.head.host if ex.head else "?",
            why=why,
        )
        self._abort()

    # -- endings -------------------------------------------------------------------------------

    def _answer_locally(self, ex: Exchange, response: LocalResponse) -> None:
        assert self.transport is not None
        self._disarm()
        ex.status = response.status
        ex.response_started = ex.response_complete = True
        if ex.upstream is not None:
            ex.upstream.abort()
            ex.upstream = None
        ex.close_after = closes_after(ex, self.proxy.draining)
        body = b"" if ex.method == b"HEAD" else response.body
        raw = simple_response(response.status, body, response.headers, close=ex.close_after)
        ex.bytes_out = len(body)
        self._send(raw)
        self._finish(ex)

    def _finish(self, ex: Exchange) -> None:
        if ex is not self._active:
            return
        self._active = None
        self._served += 1
        self._stats.in_flight -= 1
        target = ex.target
        if type(target) is LocalSocket and not self.cfg.access_log:
            # _log_access, inline (every request's path): only the count.
            key = (target.kind, ex.status)
            self._stats.requests[key] = self._stats.requests.get(key, 0) + 1
        else:
            self._log_access(ex)
        if ex.observed:
            self._observe(ex, started=False)
        assert self.transport is not None and self.valve is not None
        if ex.close_after:
            self._closing(quick=ex.client_closes and ex.body_complete)
            return
        valve = self.valve
        if not self._waiting and not self._closed:
            # Nothing pipelined (the common case): idle keep-alive, or the next head arriving.
            if valve.reasons:
                valve.open("routing")
                valve.open("pipelined")
            if self._parsing is None:
                self._arm(self.cfg.keepalive_timeout, Relay._idle_timed_out)
            else:
                self._arm(self.cfg.header_timeout, Relay._header_timed_out)
            return
        valve.open("routing")
        self._serve_waiting()

    def _serve_waiting(self) -> None:
        """Serve the pipelined requests in order while the client's output has room (else
        resume_writing continues); once none waits, read the client again. A loop, not
        recursion: answers that complete at once (local ones) would nest a few stack frames per
        queued request."""
        if self._serving_queue:
            return  # an answer completed inside the loop below: it goes on from there
        assert self.valve is not None
        self._serving_queue = True
        try:
            while (
                self._active is None
                and self._waiting
                and not self._output_paused
                and not self._closed
            ):
                nxt = self._waiting.popleft()
                if not self._waiting:
                    self.valve.open("pipelined")
                self._serve(nxt)
        finally:
            self._serving_queue = False
        if self._active is None and not self._waiting and not self._closed:
            self.valve.open("pipelined")
            if self._parsing is None:
                self._arm(self.cfg.keepalive_timeout, Relay._idle_timed_out)
            else:
                self._arm(self.cfg.header_timeout, Relay._header_timed_out)

    def drain(self) -> None:
        """The router is stopping (ProxyFactory.close): close this connection now if it sits idle
        between requests, or is an upgraded tunnel (its space is stopping; its client
        reconnects). One that has not carried a request yet is left to send its first: it was
        opened a moment ago, and its request may be on the wire now (a mesh peer's pool dials
        just before writing). Cutting it would leave a POST's fate unknown to its sender;
        answered, it is refused (marked for a peer, which sends it elsewhere) and closed. Its
        header timeout still bounds it."""
        if self._closed:
            return
        if self._spliced or (self._active is None and self._parsing is None and self._served):
            self._closing()

    def _observe(self, ex: Exchange, started: bool = True) -> None:
        """The request is routed to its target: take the target's in-flight ticket, if it has
        one (an awake hibernating space); ``started`` False hands it back (once, either way)."""
        target = ex.target
        if ex.observed is started or type(target) is not LocalSocket or target.inflight is None:
            return
        ex.observed = started
        ticket = target.inflight
        try:
            (ticket.request_started if started else ticket.request_ended)(ex.upgrade)
        except Exception:
            _log.failure("in-flight ticket of {host} failed", host=target.host)

    def _log_access(self, ex: Exchange) -> None:
        target = ex.target
        host_class: str
        if type(target) is LocalSocket:
            host_class = target.kind
        elif isinstance(target, RemotePeer):
            host_class = "peer"
        elif isinstance(target, LocalResponse):
            host_class = target.label
        else:
            host_class = "none"
        self._stats.count(host_class, ex.status)
        if self.cfg.access_log and ex.head is not None:
            _log.info(
                'access {client} {host} "{method} {target} HTTP/{version}" {status} {bytes} {ms}ms',
                client=ex.head.client,  # (through the hop: the worker's client, hop_origin)
                host=ex.head.host,
                method=ex.method.decode("latin-1"),
                target=ex.head.target.decode("latin-1")[:512],
                version=ex.version,
                status=ex.status,
                bytes=ex.bytes_out,
                ms=round((self.proxy.reactor.seconds() - ex.started) * 1000, 1),
            )

    def _upstream_timed_out(self) -> None:
        ex = self._active
        if ex is None or ex.response_started:
            return
        target = ex.target
        if type(target) is LocalSocket and target.kind == "hop" and not ex.hop_waited:
            # The control process through the hop: it gets HOP_SLACK more, once (here rather
            # than in the deadline every request arms: nothing on the path of those answered).
            ex.hop_waited = True
            self._arm(HOP_SLACK, Relay._upstream_timed_out)
            return
        _log.warn(
            "upstream for {host} did not answer in time", host=ex.head.host if ex.head else "?"
        )
        self._answer_locally(ex, plain(504, "504 Gateway Timeout", label="timeout"))

    def resume_writing(self) -> None:
        """The unsent output drained (to the low-water mark): carry on where pause_writing
        stopped."""
        if not self._output_unpaused():
            return
        ex = self._active
        if ex is not None and ex.upstream is not None and ex.upstream.valve is not None:
            ex.upstream.valve.open(Valve.PEER_FULL)
        assert self.valve is not None
        self.valve.open("output")
        if self._active is None and self._waiting and not self._closed:
            self._serve_waiting()
