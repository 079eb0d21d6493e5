"""The certificate store: the certificates the HTTPS front door serves, and its SNI callback.

The files are ``LCHAT_ACME_CACHE``'s (their names and checks: lchat.certfiles). The most specific
wins: host, then wildcard, then default.

The directory is rescanned every few seconds; a file whose (inode, size, mtime, mode) changed is
re-read in a thread and becomes a *new* context, so a context a connection already uses is never
mutated. A changed file that is refused keeps the certificate loaded from it before (until it
expires); a loaded certificate that expires stops being served.

The front door (:mod:`lchat.proxy.tls_accept`, on uvloop's SSL transport) serves with
:attr:`CertStore.server_ssl_context`, which holds no certificate: its SNI callback switches each
connection to the context of its host, its wildcard or the default (:meth:`CertStore.select`).

On-demand issuance: when the ACME issuer listens on the store's :class:`CertificateWanted` cue, a
known host without a certificate is *held* (:meth:`CertStore.holds_for`): the front door waits
(:meth:`CertStore.wait_for`) until a rescan brings its certificate, so its first visitor gets a
valid one rather than the default.

Session tickets: with ``ticket_key_file`` (a box's worker processes), the dispatch context
encrypts and decrypts TLS session tickets with the key in that file (:mod:`lchat.ticketkeys`), so
a client resumes on whichever worker its reconnect reaches. The file is re-read by the scan when
it changes (its writer rotates it) and installed on the reactor thread. A key that cannot be read
or installed costs full handshakes only: it is logged, never fatal. Without the file (one
process), OpenSSL's own per-context key is used, as it always was.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterable

from attrs import frozen
from prometheus_client import Counter, Gauge
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from lchat import hosts, ticketkeys
from lchat.certfiles import (
    KINDS,
    Fingerprint,
    Kind,
    Loaded,
    Refused,
    Scan,
    cert_path,
    scan,
    server_context,
    utc_date,
)
from lchat.deferutil import fire, settled
from lchat.proxy.handshakes import NotedSSLObject, handshake_notes
from lchat.routesource import RouteSource
from lchat.threads import RunInThread

DEFAULT_SCAN_INTERVAL = 10.0
SNI_NAMES_CACHED = 4096  # SNI names whose normalised host is remembered (then forgotten at once)

_log = Logger(namespace="lchat.tls")

_failures = Counter(
    "lchat_tls_handshake_failures_total", "TLS handshakes that did not complete", ["reason"]
)
_certificates = Gauge("lchat_tls_certificates", "Certificates being served, by kind", ["kind"])
_expiry = Gauge(
    "lchat_tls_certificate_expiry_seconds",
    "notAfter of each certificate being served (unix time)",
    ["name"],
)
_refused = Gauge("lchat_tls_refused_files", "Certificate files refused (see the log for why)")
_expiring = Gauge(
    "lchat_tls_certificates_expiring",
    "Certificates being served, by time left until they expire (7d: within a week, 30d: within "
    "a month, 90d, later)",
    ["within"],
)
DAY = 86400.0
EXPIRY_BUCKETS: tuple[tuple[str, float], ...] = (
    ("7d", 7 * DAY),
    ("30d", 30 * DAY),
    ("90d", 90 * DAY),
    ("later", float("inf")),
)
for _bucket, _ in EXPIRY_BUCKETS:
    _expiring.labels(_bucket)
_ticket_key_shared = Gauge(
    "lchat_tls_ticket_key_shared",
    "1 while the listener's session tickets use the shared key file (LCHAT_WORKERS >= 2), else 0",
)
_ticket_key_installs = Counter(
    "lchat_tls_ticket_key_installs_total",
    "Session-ticket keys read from the shared key file and installed, by outcome",
    ["outcome"],
)
for _outcome in ("ok", "failed"):
    _ticket_key_installs.labels(_outcome)


@frozen
class _KeyRead:
    """The ticket key file as a scan found it (in the scan's thread)."""

    fingerprint: Fingerprint | None  # None: no such file
    key: bytes | None  # None: see ``error``
    error: str = ""


_UNREAD: Fingerprint = (-1, -1, -1, -1, -1)  # no scan has looked at the key file yet


def _read_key(path: str, previous: Fingerprint | None) -> _KeyRead | None:
    """The key in ``path`` if the file changed since ``previous`` (else None). Blocking."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if previous is None:
            return None
        return _KeyRead(None, None, f"{path} does not exist")
    except OSError as e:
        return _KeyRead(None, None, f"cannot read {path}: {e.strerror or e}")
    fingerprint = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
    if fingerprint == previous:
        return None
    try:
        return _KeyRead(fingerprint, ticketkeys.read(path))
    except ticketkeys.TicketKeyError as e:
        return _KeyRead(fingerprint, None, str(e))


@frozen
class _FileState:
    fingerprint: Fingerprint
    serving: Loaded | None  # what this file serves (possibly an earlier, good version of it)
    refusal: str = ""  # why its current content is not served


# --- the store ----------------------------------------------------------------------------------

IsKnown = Callable[[str], bool]


def known_hosts(routes: RouteSource, also: Iterable[str] = ()) -> IsKnown:
    """``is_known`` backed by the router's live registry snapshot: a host with a row, any status,
    plus ``also`` (this box's own mesh-self name, whose certificate the route API needs)."""
    extra = frozenset(also)

    def is_known(host: str) -> bool:
        return host in extra or routes.table.get(host) is not None

    return is_known


class CertificateWanted:
    """The cue from the certificate store to whoever obtains certificates (the ACME issuer, which
    connects itself when it is built): a handshake for a known host found no certificate for it.
    Called inside OpenSSL's SNI callback (or by the front door while it holds a handshake), so
    the listener must not block or raise.

    The listener may answer ``False`` to say it will not obtain one (policy, a back-off after
    failures): the front door then holds nothing for that host. Any other answer (``None``
    included) means a certificate may be on its way.
    """

    def __init__(self) -> None:
        self._listener: Callable[[str], bool | None] | None = None

    @property
    def connected(self) -> bool:
        return self._listener is not None

    def connect(self, listener: Callable[[str], bool | None]) -> None:
        if self._listener is not None:
            raise RuntimeError("a certificate cue has one listener")
        self._listener = listener

    def __call__(self, host: str) -> bool:
        """Cue the listener; False if there is none or it declined."""
        if self._listener is None:
            return False
        return self._listener(host) is not False


class CertStore(Service):
    """The certificates in ``directory``, kept current, and the SNI callback that picks one.

    Everything heavy (reading files, parsing, building contexts) runs through ``run_in_thread``;
    the SNI callback is a few dict lookups on the reactor thread. Scans are serialised.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        directory: str,
        is_known: IsKnown,
        run_in_thread: RunInThread,
        interval: float = DEFAULT_SCAN_INTERVAL,
        wanted: CertificateWanted | None = None,
        ticket_key_file: str | None = None,
    ) -> None:
        self._reactor = reactor
        self.directory = os.path.abspath(directory)
        self._is_known = is_known
        self._run_in_thread = run_in_thread
        self._interval = interval
        self._clock = reactor.seconds  # unix time: certificates expire by it
        self._files: dict[str, _FileState] = {}
        self._hosts: dict[str, Loaded] = {}
        self._wildcards: dict[str, Loaded] = {}
        self._default: Loaded | None = None
        self._waiters: dict[str, list[Deferred[bool]]] = {}  # host -> wait_for()s not yet fired
        self._scanned = False
        self._running: Deferred[None] | None = None
        self._waiting: list[Deferred[None]] = []
        self._poller: LoopingCall | None = None
        self._missing_logged = False
        self._error_logged = ""
        self._misnamed_logged: set[str] = set()
        self._no_cert_logged: set[str] = set()
        self._published: set[str] = set()  # expiry gauge labels we set
        self.handshake_failures: dict[str, int] = {}
        # Told (on the reactor, inside the SNI callback) about a known host that has neither a
        # certificate of its own nor a wildcard: the ACME issuer's cue.
        self._wanted = wanted
        # The listener's context: no certificate of its own, it only dispatches on SNI.
        self._ssl_dispatch = server_context()
        self._ssl_dispatch.sni_callback = self._ssl_server_name
        self._ssl_dispatch.sslobject_class = NotedSSLObject
        try:
            # TLS 1.3 resumes from stateless tickets: OpenSSL's server-side cache of every
            # full handshake's session is a cost per connection that buys nothing here.
            ticketkeys.no_session_cache(self._ssl_dispatch)
        except ticketkeys.TicketKeyError as e:
            _log.info("tls: OpenSSL's session cache stays on ({why})", why=str(e))
        # SNI name as the stdlib hands it -> its normalised host (None: none possible). Pure, so
        # never stale: what the host is served is decided afresh per handshake. Normalising
        # (IDNA, the IP-literal check) was the SNI callback's main cost.
        self._sni_hosts: dict[str, str | None] = {}
        # Session tickets (the module docstring): the file, what the last scan saw of it, and
        # whether a key from it is installed on the dispatch context.
        self.ticket_key_file = ticket_key_file
        self._key_fingerprint: Fingerprint | None = _UNREAD
        self._key_installed = False
        self._key_logged = ""
        self._listeners: list[Callable[[], object]] = []

    # -- what the listener uses

    @property
    def server_ssl_context(self) -> ssl.SSLContext:
        """The context to serve TLS with (the front door): it holds no certificate and switches
        each connection, in its SNI callback, to the context of the certificate :meth:`select`
        picks. Handshakes through it note what they saw in :data:`handshake_notes`, when the
        caller set one."""
        return self._ssl_dispatch

    def select(self, server_name: bytes | None) -> Loaded | None:
        """The most specific certificate for an SNI name (the raw bytes, None for no SNI): host
        (if registered), wildcard, default; None when nothing matches (the handshake then fails).
        Cues the issuer, as a handshake does, for a known host that has no certificate."""
        return self._select_host(sni_host(server_name))

    def _select_host(self, host: str | None) -> Loaded | None:
        if host is not None:
            loaded = self._certificate_for(host)
            if loaded is not None:
                return loaded
            if self._wanted is not None and self._wanted.connected and self._is_known(host):
                self._wanted(host)
            elif (
                self._default is None and host not in self._no_cert_logged and self._is_known(host)
            ):
                self._no_cert_logged.add(host)  # bounded: registered hosts only
                _log.warn(
                    "tls: no certificate for {host} (expected {file} or a wildcard)",
                    host=host,
                    file=_safe(lambda: cert_path(self.directory, host)),
                )
        return self._default

    def _certificate_for(self, host: str) -> Loaded | None:
        """The host's own certificate (if registered), else its wildcard's; never the default."""
        loaded = self._hosts.get(host)
        if loaded is not None and self._is_known(host):
            return loaded
        return self._wildcards.get(host.partition(".")[2])

    def _ssl_server_name(
        self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        # The stdlib's SNI callback (on the event loop, inside the handshake): a few dict lookups.
        # It must not raise (OpenSSL would abort the handshake with an internal_error alert).
        try:
            host = None
            if server_name is not None:
                cached = self._sni_hosts
                host = cached.get(server_name, _UNSEEN)
                if host is _UNSEEN:
                    # The stdlib hands the name over as the A-label decoded as latin-1: undo that.
                    host = sni_host(server_name.encode("latin-1"))
                    if len(cached) >= SNI_NAMES_CACHED:
                        cached.clear()  # names from scanners: bounded, and rebuilt cheaply
                    cached[server_name] = host
            loaded = self._select_host(host)
            notes = handshake_notes.get()
            if notes is not None:
                notes.server_name = server_name or ""
                notes.sni = True
                notes.certificate = loaded is not None
            if loaded is not None:
                connection.context = loaded.ssl_context
        except Exception:
            _log.failure("tls: choosing a certificate for {name!r} failed", name=server_name)

    # -- on-demand issuance: the front door holds a first handshake while its certificate comes

    @property
    def on_demand(self) -> bool:
        """Something obtains certificates on demand (the ACME issuer listens on the cue): only
        then may a handshake be worth holding, and the front door reads its SNI name first."""
        return self._wanted is not None and self._wanted.connected

    @property
    def has_default(self) -> bool:
        """A default certificate is served to names nothing else matches."""
        return self._default is not None

    def holds_for(self, host: str) -> bool:
        """``host`` (normalised) is eligible for on-demand issuance right now: something obtains
        certificates on demand, the host is known, and neither its own certificate nor a
        wildcard covers it. A handshake for any other name is never held."""
        return self.on_demand and self._is_known(host) and self._certificate_for(host) is None

    def want(self, host: str) -> bool:
        """Cue the issuer for ``host`` (as the SNI callback does); False if nothing listens or it
        declined (then waiting for a certificate is pointless)."""
        return self._wanted is not None and self._wanted(host)

    def wait_for(self, host: str, timeout: float) -> Deferred[bool]:
        """Fires True as soon as a certificate of its own or a wildcard serves ``host``
        (normalised; at once if one already does), False after ``timeout`` seconds on the
        store's clock. Cancelling it forgets the wait. Waiting cues nobody: see :meth:`want`."""
        if self._certificate_for(host) is not None:
            return succeed(True)
        d: Deferred[bool] = Deferred(canceller=lambda d: self._forget(host, d))
        self._waiters.setdefault(host, []).append(d)
        return d.addTimeout(timeout, self._reactor, onTimeoutCancel=lambda _, __: False)

    def _forget(self, host: str, waiter: Deferred[bool]) -> None:
        waiters = self._waiters.get(host, [])
        if waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[host]

    def give_up(self, host: str) -> None:
        """Whoever obtains certificates will not get one for ``host`` (normalised) now: its
        :meth:`wait_for` waiters fire False at once, as after a timeout, so held handshakes are
        served without it (a worker hears this from the control process, where the issuer
        runs)."""
        waiters = self._waiters.pop(host, None)
        if waiters:
            fire(waiters, False)

    def subscribe(self, listener: Callable[[], object]) -> None:
        """Call ``listener()`` after every rebuild that changed what is served (a certificate
        loaded, replaced, removed or expired), once the new set is in place and the waiters it
        serves have fired; never after a scan that changed nothing. A listener must not raise
        (it is logged if it does) and must not block."""
        self._listeners.append(listener)

    def _release_waiters(self) -> None:
        ready = [host for host in self._waiters if self._certificate_for(host) is not None]
        for host in ready:
            fire(self._waiters.pop(host), True)

    # -- what operators and tests look at

    def certificates(self) -> dict[str, Loaded]:
        """Every certificate being served, by label (``host``, ``*.domain``, ``default``)."""
        return {s.serving.label: s.serving for s in self._files.values() if s.serving is not None}

    def refused(self) -> dict[str, str]:
        """Every file whose current content is refused: path -> why."""
        return {
            os.path.join(self.directory, f): s.refusal for f, s in self._files.items() if s.refusal
        }

    # -- loading

    def load_initial(self) -> None:
        """Scan synchronously, for use while building the service, before the reactor runs (so the
        listener never answers a handshake before the certificates are in, nor before the
        ticket key is). Blocking."""
        if self.ticket_key_file is not None:
            self._install_key(_read_key(self.ticket_key_file, self._key_fingerprint))
        self._apply(scan(self.directory, {}, self._clock()))

    def rescan(self) -> Deferred[None]:
        """Scan now; fires once a scan that started after this call has been applied."""
        waiter: Deferred[None] = Deferred()
        if self._running is not None:
            self._waiting.append(waiter)
        else:
            self._start([waiter])
        return waiter

    def _start(self, waiters: list[Deferred[None]]) -> None:
        previous = {f: s.fingerprint for f, s in self._files.items()}
        now = self._clock()
        key_file, key_seen = self.ticket_key_file, self._key_fingerprint
        d: Deferred[tuple[_KeyRead | None, Scan]] = self._run_in_thread(
            lambda: (
                _read_key(key_file, key_seen) if key_file is not None else None,
                scan(self.directory, previous, now),
            )
        )
        done: Deferred[None] = d.addCallback(self._apply_both)
        done.addErrback(lambda f: _log.failure("tls: certificate scan failed", f))
        self._running = done

        def finished(_: object) -> None:
            self._running = None
            if self._waiting:
                again, self._waiting = self._waiting, []
                self._start(again)
            fire(waiters, None)

        done.addBoth(finished)

    def _apply_both(self, results: tuple[_KeyRead | None, Scan]) -> None:
        key, certificates = results
        self._install_key(key)  # first: the handshakes a rebuild releases resume across workers
        self._apply(certificates)

    def _install_key(self, read: _KeyRead | None) -> None:
        """On the reactor thread, between handshakes: the dispatch context is never changed
        while OpenSSL is inside one of its callbacks."""
        if read is None:
            return
        self._key_fingerprint = read.fingerprint
        why = read.error
        if read.key is not None:
            try:
                ticketkeys.install(self._ssl_dispatch, read.key)
            except ticketkeys.TicketKeyError as e:
                why = str(e)
            else:
                _ticket_key_installs.labels("ok").inc()
                _ticket_key_shared.set(1)
                if not self._key_installed or self._key_logged:
                    _log.info(
                        "tls: session tickets are shared across workers (key {path})",
                        path=self.ticket_key_file,
                    )
                self._key_installed = True
                self._key_logged = ""
                return
        _ticket_key_installs.labels("failed").inc()
        if why != self._key_logged:
            self._key_logged = why
            if self._key_installed:
                _log.warn("tls: keeping the session ticket key installed before: {why}", why=why)
            else:
                _ticket_key_shared.set(0)
                _log.warn(
                    "tls: session tickets are not shared across workers: {why} (a reconnect "
                    "through another worker makes a full handshake)",
                    why=why,
                )

    def _apply(self, result: Scan) -> None:
        if result.error:
            self._scanned = True
            if result.error != self._error_logged:
                self._error_logged = result.error
                _log.error("tls: {error}; keeping the certificates loaded", error=result.error)
            return
        self._error_logged = ""
        if result.missing:
            if not self._missing_logged:
                self._missing_logged = True
                _log.warn(
                    "tls: certificate directory {directory} does not exist: no certificates "
                    "are served until it does (LCHAT_ACME_CACHE)",
                    directory=self.directory,
                )
        else:
            self._missing_logged = False
        for filename, better in result.misnamed.items():
            if filename not in self._misnamed_logged:
                self._misnamed_logged.add(filename)
                _log.warn(
                    "tls: ignoring {file}: certificate files use canonical names; rename it {better}",
                    file=os.path.join(self.directory, filename),
                    better=better,
                )
        dirty = not self._scanned or bool(result.changed)
        self._scanned = True
        for filename in sorted(set(self._files) - set(result.seen)):
            dirty = True
            gone = self._files.pop(filename).serving
            if gone is not None:
                _log.info(
                    "tls: {name} certificate removed ({file})", name=gone.label, file=gone.path
                )
        for filename, outcome in result.changed.items():
            self._files[filename] = self._updated(self._files.get(filename), outcome)
        now = self._clock()
        for filename, state in list(self._files.items()):
            loaded = state.serving
            if loaded is not None and loaded.not_after <= now:
                dirty = True
                _log.error(
                    "tls: {name} certificate expired at {date}: no longer served ({file})",
                    name=loaded.label,
                    date=utc_date(loaded.not_after),
                    file=loaded.path,
                )
                why = f"its certificate expired at {utc_date(loaded.not_after)}"
                self._files[filename] = _FileState(state.fingerprint, None, why)
        if dirty:
            self._rebuild()
        self._publish_expiry(now)

    def _publish_expiry(self, now: float) -> None:
        # Every scan (a few seconds apart): time passing moves certificates between buckets.
        counts = dict.fromkeys((b for b, _ in EXPIRY_BUCKETS), 0)
        for loaded in self.certificates().values():
            left = loaded.not_after - now
            for bucket, limit in EXPIRY_BUCKETS:
                if left <= limit:
                    counts[bucket] += 1
                    break
        for bucket, count in counts.items():
            _expiring.labels(bucket).set(count)

    def _updated(self, old: _FileState | None, outcome: Loaded | Refused) -> _FileState:
        previous = old.serving if old is not None else None
        if isinstance(outcome, Refused):
            _log.error(
                "tls: refusing {file}: {why}",
                file=outcome.path,
                why=outcome.why,
            )
            if previous is not None:
                _log.warn(
                    "tls: still serving the {name} certificate loaded earlier (expires {date})",
                    name=previous.label,
                    date=utc_date(previous.not_after),
                )
            return _FileState(outcome.fingerprint, previous, outcome.why)
        if previous is not None:
            _log.info(
                "tls: {name} certificate replaced (serial {old:x} -> {new:x}, expires {date})",
                name=outcome.label,
                old=previous.serial,
                new=outcome.serial,
                date=utc_date(outcome.not_after),
            )
        else:
            _log.info(
                "tls: loaded certificate for {name} (expires {date})",
                name=outcome.label,
                date=utc_date(outcome.not_after),
                file=outcome.path,
            )
        return _FileState(outcome.fingerprint, outcome, "")

    def _rebuild(self) -> None:
        # Whole new dicts, swapped in: the SNI callback never sees a half-applied scan.
        by_kind: dict[Kind, dict[str, Loaded]] = {k: {} for k in KINDS}
        for state in self._files.values():
            if state.serving is not None:
                by_kind[state.serving.kind][state.serving.name] = state.serving
        self._hosts = by_kind["host"]
        self._wildcards = by_kind["wildcard"]
        self._default = by_kind["default"].get("default")
        self._no_cert_logged.clear()  # say it again if a change did not bring one
        for kind in KINDS:
            _certificates.labels(kind).set(len(by_kind[kind]))
        serving = self.certificates()
        for label in set(self._published) - set(serving):
            _expiry.remove(label)
        for label, loaded in serving.items():
            _expiry.labels(label).set(loaded.not_after)
        self._published = set(serving)
        _refused.set(sum(1 for s in self._files.values() if s.refusal))
        self._release_waiters()  # what they run sees this scan whole
        for listener in list(self._listeners):  # last: they may push this set elsewhere
            try:
                listener()
            except Exception:
                _log.failure("tls: a certificate-change listener failed")

    # -- handshake failures

    def handshake_failed(self, reason: str, server_name: str, peer: str, detail: str) -> None:
        self.handshake_failures[reason] = self.handshake_failures.get(reason, 0) + 1
        _failures.labels(reason).inc()
        _log.debug(
            "tls: handshake failed ({reason}) from {peer} for {server_name}: {detail}",
            reason=reason,
            peer=peer,
            server_name=server_name or "(no SNI)",
            detail=detail,
        )

    # -- service

    def startService(self) -> None:
        super().startService()
        self._poller = LoopingCall(self._poll)
        self._poller.clock = self._reactor
        self._poller.start(self._interval, now=not self._scanned).addErrback(
            lambda f: _log.failure("tls: certificate scan loop died", f)
        )

    def stopService(self) -> Deferred[None] | None:
        if self._poller is not None and self._poller.running:
            self._poller.stop()
        super().stopService()
        if self._running is None:
            return None
        return settled(self._running)  # a scan in its thread lands before the reactor stops

    def _poll(self) -> Deferred[None]:
        return succeed(None) if self._running is not None else self.rescan()


_UNSEEN = "\0"  # not a host name: the cache's "not looked up yet"


def sni_host(server_name: bytes | None) -> str | None:
    """An SNI name as the registry spells hosts (normalised), or None for no name or one that is
    not a valid host name (no host can have it)."""
    if not server_name:
        return None
    try:
        return hosts.normalise(server_name.decode("ascii"))
    except (UnicodeDecodeError, hosts.InvalidHost):
        return None


def _safe(build: Callable[[], str]) -> str:
    try:
        return build()
    except hosts.InvalidHost as e:
        return f"(none possible: {e})"
