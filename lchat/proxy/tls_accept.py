"""The HTTPS front door's accept loop: stdlib TLS on uvloop's SSL transport, a certificate chosen
per SNI name by the certificate store, and the first handshake of a new host held while its
certificate is issued.

Connections are accepted here by hand (non-blocking ``accept``, in batches) and handed to uvloop
with ``loop.connect_accepted_socket(factory, sock, ssl=store.server_ssl_context)``; the store's SNI
callback switches each one to its host's, its wildcard's or the default context.

**First contact.** While something obtains certificates on demand (the ACME issuer listens on the
store's cue), each connection's ClientHello is first *peeked* (``recv(MSG_PEEK)``: the bytes stay
queued in the kernel for OpenSSL) to read its SNI name: at once when it is accepted (it usually
is queued by then), else as its bytes arrive. A host eligible for on-demand issuance
(known, no certificate of its own nor a wildcard: :meth:`CertStore.holds_for`) is held: the
issuer is cued and the handshake waits, up to ``hold`` seconds, for the rescan that brings the
certificate (:meth:`CertStore.wait_for`). A new space's first visitor so gets a valid certificate
instead of the default, as with Caddy's on-demand TLS and Go's autocert.

Invariants:

- until uvloop owns a connection nothing reads from it but the peek, which consumes nothing;
- only a host :meth:`CertStore.holds_for` calls eligible ever waits, for ``hold`` seconds at most;
  every other connection goes to TLS as soon as its ClientHello is in (or at once, with nothing
  obtaining certificates on demand);
- a host whose hold ended without a certificate is not held again for :data:`RETRY_HOLD_AFTER`
  seconds (its issuance is failing: visitors would wait for nothing), nor is one the issuer
  declines;
- at most ``max_held`` connections are held at once; beyond that they are served at once;
- a connection that closes without sending a byte is not a failed handshake; one that sends
  nothing is closed after ``peek_timeout`` (or, unpeeked, after ``handshake_timeout``).
"""

from __future__ import annotations

import _socket
import asyncio
import errno
import socket
from collections.abc import Callable
from typing import Any

import uvloop
from attrs import define, field, frozen
from prometheus_client import Counter, Gauge
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat import tls
from lchat.proxy.handshakes import HandshakeNotes, classify_ssl_failure, handshake_notes

_SSLProtocol: Any
try:  # uvloop's SSL protocol, which connect_accepted_socket(ssl=) puts over a TCP transport
    from uvloop.loop import SSLProtocol as _SSLProtocol  # type: ignore[attr-defined,no-redef]
except ImportError:  # (a uvloop that moved it: the plain call, and TLS closes that wait)
    _SSLProtocol = None

ACCEPT_BATCH = 64  # connections accepted per wake-up (then the loop serves others)
ACCEPT_PAUSE = 1.0  # seconds without accepting after running out of file descriptors
PEEK_CAP = 16 * 1024  # bytes of ClientHello looked at, at most (it fits one TLS record)
DEFAULT_MAX_HELD = 1000
RETRY_HOLD_AFTER = 60.0  # the ACME issuer's first back-off after a failed issuance
_GAVE_UP_PRUNE = 4096  # entries in the "hold timed out" memory before expired ones are dropped

_log = Logger(namespace="lchat.tls")

_held = Gauge(
    "lchat_tls_held_handshakes",
    "TLS handshakes being held until their host's certificate is issued",
)
_holds = Counter(
    "lchat_tls_holds_total",
    "TLS handshakes held for an on-demand certificate, by how the hold ended (issued: the "
    "certificate came; timeout: served without it; declined: the issuer gave up early)",
    ["outcome"],
)
for _outcome in ("issued", "timeout", "declined"):
    _holds.labels(_outcome)
_silent = Counter(
    "lchat_tls_silent_connections_total",
    "Connections closed because they sent no ClientHello within the peek timeout",
)


# --- reading the SNI name from a ClientHello ------------------------------------------------------

CLIENT_HELLO = 1
SERVER_NAME_EXTENSION = 0
HOST_NAME = 0
MAX_RECORD = 16384  # TLSPlaintext.length at most (RFC 8446 section 5.1)


@frozen
class Incomplete:
    """A prefix of a ClientHello: nothing can be decided before ``needed`` bytes (counted from the
    first) are in."""

    needed: int


def client_hello_server_name(data: bytes) -> str | Incomplete | None:
    """The SNI host name in the ClientHello ``data`` starts with (the A-label, decoded as latin-1
    like the stdlib's SNI callback does), None when ``data`` is not a TLS ClientHello, is
    malformed or names no host, or :class:`Incomplete` for a prefix of one. Never raises.

    Handles a ClientHello split over several TLS records (each at most :data:`MAX_RECORD`) as
    well as over several TCP segments. Decides as early as it can: one byte that cannot start a
    TLS handshake record is enough to say None.
    """
    message = b""  # the handshake message, reassembled from the records' payloads
    offset = 0
    while True:
        header = data[offset : offset + 5]
        # type 22 (handshake), then the legacy version's major byte, 3
        if header[:1] not in (b"", b"\x16") or header[1:2] not in (b"", b"\x03"):
            return None
        if len(header) < 5:
            return Incomplete(offset + 5)
        length = int.from_bytes(header[3:5], "big")
        if not 0 < length <= MAX_RECORD:
            return None
        end = offset + 5 + length
        if len(data) < end:
            return Incomplete(end)
        message += data[offset + 5 : end]
        offset = end
        if message[0] != CLIENT_HELLO:
            return None
        if len(message) >= 4:
            total = 4 + int.from_bytes(message[1:4], "big")
            if len(message) >= total:
                return _server_name(message[4:total])


def _server_name(body: bytes) -> str | None:
    # ClientHello (RFC 8446 section 4.1.2): legacy_version(2) random(32) session_id<0..32>
    # cipher_suites<2..2^16-2> compression_methods<1..2^8-1> extensions<8..2^16-1>
    at: int | None = 34
    at = _skip(body, at, 1)  # legacy_session_id
    at = _skip(body, at, 2)  # cipher_suites
    at = _skip(body, at, 1)  # legacy_compression_methods
    end = _skip(body, at, 2)  # extensions: (extension_type(2), extension_data<0..2^16-1>)
    if at is None or end is None:
        return None
    extension = _entry(body, at + 2, end, 2, SERVER_NAME_EXTENSION) or b""
    # ServerNameList (RFC 6066 section 3): server_name_list<1..2^16-1> of
    # (name_type(1), opaque HostName<1..2^16-1>)
    names = _skip(extension, 0, 2)
    name = _entry(extension, 2, names, 1, HOST_NAME) if names is not None else None
    return name.decode("latin-1") if name else None


def _skip(body: bytes, at: int | None, width: int) -> int | None:
    """Past a vector whose length takes ``width`` bytes at ``at``; None if it overruns."""
    if at is None or at + width > len(body):
        return None
    after = at + width + int.from_bytes(body[at : at + width], "big")
    return after if after <= len(body) else None


def _entry(data: bytes, at: int, end: int, width: int, wanted: int) -> bytes | None:
    """The value of the first entry of kind ``wanted`` in ``data[at:end]``, a list of (kind
    (``width`` bytes), value<0..2^16-1>); None if there is none, or the list overruns first."""
    while at + width + 2 <= end:
        kind = int.from_bytes(data[at : at + width], "big")
        size = int.from_bytes(data[at + width : at + width + 2], "big")
        at += width + 2
        if at + size > end:
            return None
        if kind == wanted:
            return data[at : at + size]
        at += size
    return None


# --- the acceptor ---------------------------------------------------------------------------------

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class _Accepted(socket.socket):
    """An accepted connection whose ``family`` and ``type`` read as plain ints: the standard
    library's properties make an enum member on each read, and a connection's are read twice
    (``socket.accept``, then uvloop's ``connect_accepted_socket``): ~5 µs per connection."""

    __slots__ = ()
    family = _socket.socket.family  # type: ignore[assignment]
    type = _socket.socket.type  # type: ignore[assignment]


class TLSAcceptor:
    """Serves TLS on ``sock`` (bound, listening, non-blocking) on ``loop`` (the reactor's own):
    each accepted connection gets a protocol from ``protocol_factory`` once its handshake is
    done. Certificates, failure counts and on-demand issuance come from ``store``.

    ``hold``: how long a first handshake waits for its host's certificate (0: never);
    ``handshake_timeout``: the TLS handshake's bound, once uvloop has the connection;
    ``peek_timeout``: how long a connection may take to send its ClientHello while names are read
    (a client that connects and sends nothing is closed then); ``max_held``: connections held at
    once at most.

    The factory is called when uvloop takes the connection, before the handshake: a protocol whose
    handshake fails is dropped without any call.

    ``clock`` (``seconds``, ``callLater``): the front door's one clock, the reactor whose loop is
    ``loop`` (the proxy's deadlines run on it too), or a fake one in tests of the timing logic.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: ProtocolFactory,
        store: tls.CertStore,
        *,
        clock: IReactorTime,
        hold: float = 10.0,
        handshake_timeout: float = 10.0,
        peek_timeout: float = 10.0,
        max_held: int = DEFAULT_MAX_HELD,
    ) -> None:
        self._loop = loop
        self._clock = clock
        self._sock = sock
        self._family = int(sock.family)
        self._factory = protocol_factory
        self._store = store
        self.hold = hold
        self.handshake_timeout = handshake_timeout
        self.peek_timeout = peek_timeout
        self.max_held = max_held
        self._listening = False
        self._closed = False
        self._resume: IDelayedCall | None = None
        self._peeks: set[_Peek] = set()
        self._holds: dict[str, _Hold] = {}  # host -> the connections waiting for its certificate
        self._held = 0  # connections in self._holds
        self._full_logged = False
        self._gave_up: dict[str, float] = {}  # host -> when its last hold timed out
        self._handshakes: set[asyncio.Task[None]] = set()
        self._buffer = bytearray(PEEK_CAP)  # peeks land here (one loop, one peek at a time)
        # uvloop's SSLProtocol made here over a plain connection (_tls_protocol), or not.
        self._by_hand = _SSLProtocol is not None and isinstance(loop, uvloop.Loop)

    # -- the listening socket

    def start(self) -> None:
        """Accept connections as they come."""
        if self._listening or self._closed:
            return
        self._listening = True
        self._loop.add_reader(self._sock.fileno(), self._accept, ACCEPT_BATCH)

    def accept_backlog(self) -> None:
        """Accept, now, every connection the kernel has queued (a drain calls it just before
        :meth:`close`: a connection the kernel completed is served, not reset)."""
        if not self._closed:
            self._accept(None)

    def close(self) -> None:
        """Stop accepting and close the listening socket. Connections accepted already (reading
        their ClientHello, held, shaking hands or served) carry on."""
        if self._closed:
            return
        self._closed = True
        self._stop_listening()
        self._sock.close()

    @property
    def pending(self) -> int:
        """Connections accepted whose handshake has not ended yet (reading the ClientHello, held,
        or in TLS)."""
        return len(self._peeks) + self._held + len(self._handshakes)

    def _stop_listening(self) -> None:
        if self._resume is not None:
            if self._resume.active():
                self._resume.cancel()
            self._resume = None
        if self._listening:
            self._listening = False
            self._loop.remove_reader(self._sock.fileno())

    def _accept(self, limit: int | None) -> None:
        accepted = 0
        while limit is None or accepted < limit:
            try:
                fd, address = self._sock._accept()  # type: ignore[attr-defined]
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                accepted += 1  # reset while it waited in the queue
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause(e)
                else:
                    _log.error("tls: accepting a connection failed: {error}", error=e)
                return
            accepted += 1
            conn = _Accepted(self._family, socket.SOCK_STREAM, 0, fileno=fd)
            self._admit(conn, _peer(address))

    def _pause(self, error: OSError) -> None:
        # Out of descriptors (or memory): the queued connections would wake us again at once.
        _log.error(
            "tls: cannot accept connections ({error}); trying again in {delay}s (raise the "
            "file descriptor limit, LimitNOFILE=, if this recurs)",
            error=error.strerror or error,
            delay=ACCEPT_PAUSE,
        )
        if self._listening:
            self._stop_listening()
            self._resume = self._clock.callLater(ACCEPT_PAUSE, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._resume = None
        self.start()

    # -- each connection

    def _admit(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.setblocking(False)
        except OSError:
            conn.close()
            return
        if self.hold <= 0 or not self._store.on_demand:
            # Nothing is ever held: no need to know the name before TLS does.
            self._hand_over(conn, peer, HandshakeNotes())
            return
        # A client sends its ClientHello as soon as it is connected, so it is usually queued by
        # the time the connection is accepted: one peek now spares watching the socket (a
        # reader, a timer) for most connections. The rest go to _Peek.
        try:
            n = conn.recv_into(self._buffer, PEEK_CAP, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            n = -1
        except OSError:
            conn.close()  # reset before a byte: not a failed handshake (as in _Peek)
            return
        if n == 0:
            conn.close()  # closed without a byte: a TCP probe
            return
        if n > 0:
            result = client_hello_server_name(bytes(memoryview(self._buffer)[:n]))
            if not isinstance(result, Incomplete):
                self._peeked(conn, peer, result)
                return
        peek = _Peek(self, conn, peer)
        self._peeks.add(peek)
        try:
            peek.start()
        except (OSError, RuntimeError) as e:  # the loop refused to watch it: let TLS have it
            self._peeks.discard(peek)
            _log.warn(
                "tls: cannot read the ClientHello from {peer} first: {error}", peer=peer, error=e
            )
            self._hand_over(conn, peer, HandshakeNotes())

    def _peeked(self, conn: socket.socket, peer: str, name: str | None) -> None:
        """``conn``'s ClientHello is in (``name``: its SNI name), or will never be: hold it, or
        hand it to TLS."""
        notes = HandshakeNotes(server_name=name or "", peeked=True)
        host = tls.sni_host(name.encode("latin-1")) if name is not None else None
        if host is None or not self._may_hold(host):
            self._hand_over(conn, peer, notes)
            return
        if self._held >= self.max_held:
            if not self._full_logged:
                self._full_logged = True
                _log.warn(
                    "tls: {count} handshakes are held already (the most there may be): serving "
                    "{host} without waiting for its certificate",
                    count=self._held,
                    host=host,
                )
            self._hand_over(conn, peer, notes)
            return
        hold = self._holds.get(host)
        if hold is None:
            if not self._store.want(host):
                self._hand_over(conn, peer, notes)  # the issuer will not get one
                return
            hold = _Hold(host, self._clock.seconds())
            self._holds[host] = hold
            _log.info(
                "tls: holding the first handshake for {host} while its certificate is issued "
                "(up to {hold}s)",
                host=host,
                hold=self.hold,
            )
        hold.connections.append((conn, peer, notes))
        self._held += 1
        _held.inc()
        if hold.wait is None:
            # After the connection is in: the wait may fire at once.
            wait = self._store.wait_for(host, self.hold)
            hold.wait = wait
            wait.addCallback(self._release, hold).addErrback(self._release_failed, hold)

    def _may_hold(self, host: str) -> bool:
        if not self._store.holds_for(host):
            return False
        gave_up = self._gave_up.get(host)
        if gave_up is None:
            return True
        if self._clock.seconds() - gave_up < RETRY_HOLD_AFTER:
            return False
        del self._gave_up[host]
        return True

    def _release(self, issued: bool, hold: _Hold) -> None:
        if self._holds.get(hold.host) is hold:
            del self._holds[hold.host]
        count = len(hold.connections)
        self._held -= count
        _held.dec(count)
        if self._held < self.max_held:
            self._full_logged = False
        waited = self._clock.seconds() - hold.started
        # Not issued before the hold's end: the issuer gave up on it (CertStore.give_up).
        declined = not issued and waited < self.hold
        _holds.labels("issued" if issued else "declined" if declined else "timeout").inc(count)
        if issued:
            _log.info(
                "tls: certificate for {host} arrived after {seconds:.1f}s; completing {count} "
                "held handshake(s)",
                host=hold.host,
                seconds=waited,
                count=count,
            )
        else:
            self._remember_gave_up(hold.host)
            _log.warn(
                "tls: {why}: serving {what} to its {count} held handshake(s), and holding none "
                "for {retry}s (see the acme log lines for why its issuance is slow or failing)",
                why=(
                    f"the issuer will not obtain a certificate for {hold.host} now"
                    if declined
                    else f"no certificate for {hold.host} within {self.hold}s"
                ),
                what=(
                    "the default certificate"
                    if self._store.has_default
                    else "no certificate (no default.pem: the handshake fails)"
                ),
                count=count,
                retry=RETRY_HOLD_AFTER,
            )
        for conn, peer, notes in hold.connections:
            self._hand_over(conn, peer, notes)

    def _release_failed(self, failure: Failure, hold: _Hold) -> None:
        if not failure.check(CancelledError):
            _log.failure("tls: a held handshake for {host} failed", failure, host=hold.host)

    def _remember_gave_up(self, host: str) -> None:
        now = self._clock.seconds()
        if len(self._gave_up) >= _GAVE_UP_PRUNE:
            self._gave_up = {h: t for h, t in self._gave_up.items() if now - t < RETRY_HOLD_AFTER}
        self._gave_up[host] = now

    def _hand_over(self, conn: socket.socket, peer: str, notes: HandshakeNotes) -> None:
        task = self._loop.create_task(self._handshake(conn, peer, notes))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    def _tls_protocol(self) -> tuple[Any, Any, asyncio.Future[None]] | None:
        """(the application's protocol, uvloop's SSLProtocol over it, the handshake's future):
        what ``connect_accepted_socket(ssl=)`` makes inside, made here so that the TCP transport
        under it is ours to keep (ClientConnection.raw_transport: the TLS close at once). None
        when this loop or uvloop cannot (then uvloop is handed the connection whole, and closes
        it as it does: reading on until the client's close_notify)."""
        if not self._by_hand:
            return None
        app = self._factory()
        done = self._loop.create_future()
        try:
            protocol = _SSLProtocol(
                self._loop,
                app,
                self._store.server_ssl_context,
                done,
                server_side=True,
                server_hostname=None,
                ssl_handshake_timeout=self.handshake_timeout,
            )
        except TypeError as e:  # a uvloop whose SSLProtocol takes other arguments
            self._by_hand = False
            _log.warn(
                "tls: uvloop {version}'s SSLProtocol cannot be made here ({e}): TLS connections "
                "are handed to uvloop whole from now on, and wait for the client's close_notify "
                "when they close",
                version=uvloop.__version__,
                e=e,
            )
            return None
        return app, protocol, done

    async def _handshake(self, conn: socket.socket, peer: str, notes: HandshakeNotes) -> None:
        handshake_notes.set(notes)  # (seen in a copy of this task's context: HandshakeNotes)
        raw: Any = None  # (uvloop's TCPTransport)
        done: asyncio.Future[None] | None = None
        try:
            made = self._tls_protocol()
            if made is None:
                await self._loop.connect_accepted_socket(
                    self._factory,
                    conn,
                    ssl=self._store.server_ssl_context,
                    ssl_handshake_timeout=self.handshake_timeout,
                )
                return
            app, protocol, done = made
            raw, _ = await self._loop.connect_accepted_socket(lambda: protocol, conn)
            if hasattr(app, "raw_transport"):
                app.raw_transport = raw
            await done  # the handshake (a failure closes the connection: uvloop's _fatal_error)
        except OSError as e:  # ssl.SSLError included
            conn.close()  # a no-op once uvloop has taken it (it detaches the socket object)
            if notes.received:
                kind, detail = classify_ssl_failure(e, notes)
                self._store.handshake_failed(kind, notes.server_name, peer, detail)
        except Exception:
            conn.close()
            if raw is not None:
                raw.abort()
            _log.failure("tls: serving a connection from {peer} failed", peer=peer)
        except BaseException:  # cancelled (the loop shutting down)
            if raw is not None and done is not None and not done.done():
                raw.abort()  # (a handshake under way; once done, the connection is the app's)
            raise


@define(eq=False)
class _Hold:
    host: str
    started: float  # clock.seconds()
    connections: list[tuple[socket.socket, str, HandshakeNotes]] = field(factory=list)
    wait: Deferred[bool] | None = None


class _Peek:
    """Looks at one connection's ClientHello, without consuming it, until its SNI name is known
    (or it is clear there is none, or the client is not speaking TLS).

    A peek leaves the bytes queued, so the socket stays readable: to wait for the rest of a
    ClientHello split over TCP segments, its receive low-water mark (``SO_RCVLOWAT``) is raised
    to the length still needed, and restored before TLS takes over.
    """

    def __init__(self, acceptor: TLSAcceptor, conn: socket.socket, peer: str) -> None:
        self._acceptor = acceptor
        self._conn = conn
        self._peer = peer
        self._fd = conn.fileno()
        self._lowat = 1
        self._seen = 0  # bytes the last peek found
        self._timer: IDelayedCall | None = None

    def start(self) -> None:
        loop = self._acceptor._loop
        loop.add_reader(self._fd, self._readable)
        # Only once watching it: a failed add_reader leaves nothing behind.
        self._timer = self._acceptor._clock.callLater(self._acceptor.peek_timeout, self._timed_out)

    def _stop(self) -> None:
        acceptor = self._acceptor
        acceptor._peeks.discard(self)
        acceptor._loop.remove_reader(self._fd)
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        if self._lowat > 1:
            try:
                self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass  # gone: TLS finds out

    def _readable(self) -> None:
        acceptor = self._acceptor
        buffer = acceptor._buffer
        try:
            n = self._conn.recv_into(buffer, PEEK_CAP, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._stop()
            self._conn.close()
            if self._seen:
                acceptor._store.handshake_failed("closed", "", self._peer, str(e))
            return
        if n == 0:
            # Closed without a byte: a TCP probe (a load balancer's health check), not a failure.
            self._stop()
            self._conn.close()
            return
        self._seen = n
        result = client_hello_server_name(bytes(memoryview(buffer)[:n]))
        if isinstance(result, Incomplete):
            if n >= self._lowat and result.needed <= PEEK_CAP:
                try:
                    self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, result.needed)
                except OSError:
                    pass
                else:
                    self._lowat = result.needed
                    return
            # Woken with fewer bytes than the low-water mark: the peer closed mid-hello (or the
            # hello is too big to look at). TLS reads what there is and tells the failure.
            result = None
        self._stop()
        acceptor._peeked(self._conn, self._peer, result)

    def _timed_out(self) -> None:
        self._timer = None
        self._stop()
        self._conn.close()
        if self._seen:
            self._acceptor._store.handshake_failed(
                "closed",
                "",
                self._peer,
                f"no whole ClientHello within {self._acceptor.peek_timeout}s",
            )
        else:
            _silent.inc()
            _log.debug(
                "tls: closed a connection from {peer} that sent nothing in {seconds}s",
                peer=self._peer,
                seconds=self._acceptor.peek_timeout,
            )


def _peer(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address) or "(unix socket)"
