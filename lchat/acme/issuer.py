"""The issuer: which certificates to get, when, and how often to try.

- **Host policy.** A per-host certificate is ordered only for a host the registry has and serves
  (``ready``), or this box's own mesh name: strangers pointing DNS at the box cannot burn the CA's
  rate limit. The first TLS handshake for such a host without a certificate asks for one
  (:meth:`Issuer.want`, from the SNI callback: a few dict lookups, never a wait); that handshake and
  any others until the file lands get the default certificate, or fail at once.
- **One order per name.** Concurrent asks for one name join the order in flight; with the shared
  cache (``LCHAT_CERT_CACHE=s3``) a lock in the bucket makes that one order per *fleet*, and the
  other boxes install the result from the bucket.
- **Wildcards** (``LCHAT_WILDCARD_DOMAINS``) by DNS-01, checked at start and every 12 h, renewed
  when missing or due. Hosts under a wildcard domain wait for it rather than order their own; if
  the wildcard fails they get per-host certificates (HTTP-01) until it succeeds: degraded, never an
  outage.
- **Renewal.** Every certificate is renewed ``renew_before`` (30 days; a third of the lifetime for
  certificates shorter-lived than 90 days) before it expires, a little earlier by a jitter derived
  from its serial (so a fleet's renewals spread), and the new file is served from the next
  handshake.
- **Failures** back off per name (1 min doubling to 1 h, longer when the CA says we are rate
  limited), are logged with the stage that failed and counted.

Orders run in a small thread pool of their own, so a slow CA never starves the reactor's pool
(certificate scans, the registry, replication).
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from prometheus_client import Counter, Gauge
from twisted.application.service import Service
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime
from twisted.internet.task import LoopingCall, deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from lchat import certfiles, hosts, lease, tls
from lchat.acme.cache import CacheEntryError, Certificate, CertName, LocalCache, SharedCache
from lchat.acme.client import AcmeAccount, IssuanceError
from lchat.acme.http01 import ChallengeResponder
from lchat.backoff import Backoff
from lchat.deferutil import settled
from lchat.objstore import ObjectStoreError

DAY = 86400.0
RENEW_BEFORE = 30 * DAY
RENEWAL_CHECK = 3600.0
WILDCARD_CHECK = 12 * 3600.0
BACKOFF = (60.0, 3600.0)  # after a failed issuance: the first delay, the cap (then +-10% jitter)
SHARED_POLL_CAP = 15.0  # waiting on another box's order: it takes seconds; a lost holder, minutes
ORDER_THREADS = 4
WEEK = 7 * DAY  # also: a renewal this close to expiry no longer waits for the bucket's lock
ISSUED_PER_WEEK = 3  # certificates per name this box obtains in 7 days at most (a loop guard)
CA_STAGES = ("order", "validation", "finalize")  # failures the CA reported
STOP_BUDGET = 5.0  # seconds an order in flight gets to end at shutdown

_log = Logger(namespace="lchat.acme")

ORDERS = Counter("lchat_acme_orders_total", "ACME orders placed, by certificate type", ["type"])
ISSUANCES = Counter(
    "lchat_acme_issuances_total",
    "Certificates obtained or failed, by type and outcome (issued: by our order; shared: taken "
    "from the shared cache)",
    ["type", "outcome"],
)
FAILURES = Counter(
    "lchat_acme_failures_total",
    "Failed issuances by type and the stage that failed",
    ["type", "stage"],
)
IN_PROGRESS = Gauge("lchat_acme_in_progress", "Issuances under way")
RENEWAL_LAG = Gauge(
    "lchat_acme_renewal_lag_seconds",
    "How long past its renewal time the most overdue certificate is (0: none overdue)",
)
for _kind in ("host", "wildcard"):
    ORDERS.labels(_kind)
    for _outcome in ("issued", "shared", "failed"):
        ISSUANCES.labels(_kind, _outcome)


class Issuer(Service):
    """Obtains and renews the box's certificates into ``local``; serves nothing itself."""

    def __init__(
        self,
        reactor: IReactorTime,  # and, once an order runs, IReactorFromThreads (adapted to it then)
        *,
        store: tls.CertStore,
        local: LocalCache,
        account: AcmeAccount,
        may_issue: Callable[[str], bool],
        http01: ChallengeResponder | None,
        monotonic: Callable[[], float],  # DNS-01: the propagation wait's deadline (a worker thread)
        dns: Any = None,  # lchat.acme.dns01.DNSProvider
        wildcard_domains: Sequence[str] = (),
        dns_resolvers: Sequence[tuple[str, int]] = (),
        dns_timeout: float = 120.0,
        shared: SharedCache | None = None,
        renew_before: float = RENEW_BEFORE,
        renewal_check: float = RENEWAL_CHECK,
        wildcard_check: float = WILDCARD_CHECK,
        backoff: tuple[float, float] = BACKOFF,
        order_deadline: float = 120.0,
        shared_poll: float = 2.0,
        rng: random.Random | None = None,
        own_hosts: Sequence[str] = (),
        wanted: tls.CertificateWanted | None = None,  # the store's cue: want() is connected to it
    ) -> None:
        self._reactor = reactor
        self._store = store
        self._local = local
        self._account = account
        self._may_issue = may_issue
        self._http01 = http01
        self._dns = dns
        self._monotonic = monotonic
        self.wildcard_domains = tuple(wildcard_domains)
        self._dns_resolvers = tuple(dns_resolvers)
        self._dns_timeout = dns_timeout
        self._shared = shared
        self.renew_before = renew_before
        self._renewal_check = renewal_check
        self._wildcard_check = wildcard_check
        self._backoff = Backoff(*backoff, jitter=(0.9, 1.1))
        self._order_deadline = order_deadline
        self._shared_poll = shared_poll
        # This box's own names (its mesh self host): peers need them before anyone connects.
        self._own_hosts = tuple(own_hosts)
        self._rng = rng or random.Random()  # noqa: S311 -- jitter, not secrets
        self._inflight: dict[CertName, Deferred[None]] = {}
        self._issued_at: dict[CertName, list[float]] = {}  # when this box obtained each name
        self._unserved: dict[CertName, Certificate] = {}  # obtained, not (yet) in service
        # name -> (failures in a row, when the next try may start, stage, message)
        self._failures: dict[CertName, tuple[int, float, str, str]] = {}
        # A wildcard domain is "pending" until its first attempt ends: hosts under it wait.
        self._wildcards: dict[str, str] = {d: "pending" for d in self.wildcard_domains}
        self._loops: list[LoopingCall] = []
        self._retries: dict[CertName, Any] = {}
        self._pool = self._new_pool()
        self._no_http01_logged = False
        self._unfileable: set[str] = set()
        self.orders: dict[str, int] = {"host": 0, "wildcard": 0}  # this issuer's, for tests
        if wanted is not None:
            wanted.connect(self.want)

    # -- asking -------------------------------------------------------------------------------

    def want(self, host: str) -> bool:
        """A handshake for ``host`` found no certificate: get one if policy allows. Never raises,
        never waits (it runs inside OpenSSL's SNI callback, or before a held handshake). True
        when a certificate for it is on the way (its own, or its wildcard): only then is the
        handshake worth holding (lchat.proxy.tls_accept)."""
        try:
            self._want(host)
        except Exception:
            _log.failure("acme: deciding whether to issue for {host} failed", host=host)
            return False
        domain = self._wildcard_domain(host)
        coming = [CertName("host", host)] + ([CertName.wildcard(domain)] if domain else [])
        return any(name in self._inflight for name in coming)

    def _want(self, host: str) -> None:
        if not self.running:
            return
        name = CertName("host", host)
        if name in self._inflight or not self._may_issue(host):
            return
        if not self._may_try(name):
            return
        try:
            name.path(self._local.directory)
        except hosts.InvalidHost as e:
            # No file could hold it (a host named wildcard-…): ordering would issue a
            # certificate that can never be served, again and again.
            if host not in self._unfileable:
                self._unfileable.add(host)
                _log.warn(
                    "acme: {host} cannot have a certificate file of its own ({error}); only a "
                    "wildcard or default.pem can serve it",
                    host=host,
                    error=str(e),
                )
            return
        domain = self._wildcard_domain(host)
        if domain is not None and self._wildcards.get(domain) != "failed":
            # Its wildcard is on the way. Asked although it is "ok": the file went away (deleted,
            # refused, expired) — get it again now rather than at the next 12-hourly check.
            wildcard = CertName.wildcard(domain)
            if (
                self._wildcards.get(domain) == "ok"
                and wildcard not in self._inflight
                and self._may_try(wildcard)
            ):
                self._wildcards[domain] = "pending"
                self.start(wildcard, "missing")
            return
        if self._http01 is None:
            if not self._no_http01_logged:
                self._no_http01_logged = True
                _log.warn(
                    "acme: no certificate for {host}, and per-host issuance needs HTTP-01 on port "
                    "80 (LCHAT_HTTP_ADDR is off); use a wildcard (LCHAT_WILDCARD_DOMAINS)",
                    host=host,
                )
            return
        self.start(name, "first contact")

    def start(self, name: CertName, reason: str) -> Deferred[None]:
        """Obtain ``name`` now (joining an attempt in flight). Fires when the attempt ends,
        whatever its outcome (failures are logged and counted, never raised)."""
        running = self._inflight.get(name)
        if running is None:
            running = Deferred()
            self._inflight[name] = running
            # Not from inside the caller's stack (an SNI callback): the next reactor turn.
            self._reactor.callLater(0, self._begin, name, reason, running)
        return settled(running)

    def _begin(self, name: CertName, reason: str, done: Deferred[None]) -> None:
        d = Deferred.fromCoroutine(self._obtain(name, reason))

        def finished(result: object) -> None:
            self._inflight.pop(name, None)
            done.callback(None)

        d.addErrback(lambda f: _log.failure("acme: issuing {name} failed", f, name=name.label))
        d.addBoth(finished)

    # -- obtaining ----------------------------------------------------------------------------

    async def _obtain(self, name: CertName, reason: str) -> None:
        IN_PROGRESS.inc()
        started = self._reactor.seconds()
        try:
            outcome = await self._obtain_once(name, reason)
        except IssuanceError as e:
            self._failed(name, e)
            return
        except ObjectStoreError as e:
            self._failed(name, IssuanceError("shared", f"the shared cache: {e}"))
            return
        except Exception as e:
            # Anything unforeseen still backs off: a bug must not turn into an order per handshake.
            _log.failure("acme: issuing {name} failed unexpectedly", name=name.label)
            self._failed(name, IssuanceError("internal", f"{type(e).__name__}: {e}"))
            return
        finally:
            IN_PROGRESS.dec()
        self._failures.pop(name, None)
        if name.kind == "wildcard":
            self._wildcards[name.name] = "ok"
        ISSUANCES.labels(name.kind, outcome).inc()
        _log.info(
            "acme: {name} certificate {how} in {seconds:.1f}s",
            name=name.label,
            how="issued" if outcome == "issued" else "taken from the shared cache",
            seconds=self._reactor.seconds() - started,
        )

    async def _obtain_once(self, name: CertName, reason: str) -> str:
        kept = self._unserved.get(name)
        if kept is not None and self._reactor.seconds() < self._due(kept):
            # Issued earlier but never served (a refused write, a full disk): put that one in
            # service again. An order must never be the answer to a local failure.
            await self._install(name, kept)
            return "issued"
        self._check_guard(name)  # before any lock: a box that will not order must not block others
        shared = self._shared
        if shared is None:
            await self._order(name, reason)
            return "issued"
        held = None
        waited = False
        polls = Backoff(self._shared_poll, max(self._shared_poll, SHARED_POLL_CAP)).delays()
        deadline = self._reactor.seconds() + shared.lock_ttl + 30
        while True:
            if not self.running:
                raise IssuanceError("stopped", "the router is stopping")
            if await self._from_shared(name):
                return "shared"
            try:
                held = await shared.lock(name)
                break
            except lease.LeaseHeld as e:
                if e.owner == shared.lock_owner:
                    # Our own failed order keeps it: the fleet's next try comes when it expires.
                    raise IssuanceError(
                        "shared",
                        "the last order failed; its issuance lock holds every box back until it "
                        "expires",
                        retry_after=e.retry_after,
                    ) from e
                if not waited:
                    waited = True
                    _log.info(
                        "acme: {name} is being issued by {owner}; waiting for it in the shared cache",
                        name=name.label,
                        owner=e.owner,
                    )
            except ObjectStoreError as e:
                served = self._store.certificates().get(name.label)
                if served is not None and served.not_after - self._reactor.seconds() > WEEK:
                    # A renewal can wait for the bucket; every box renewing alone cannot.
                    raise IssuanceError(
                        "shared",
                        f"cannot take the issuance lock ({e}); the served certificate is still "
                        f"valid, so its renewal waits for the bucket",
                    ) from e
                # Nothing valid to serve (or not for long): a certificate now beats a perfectly
                # single order.
                _log.warn(
                    "acme: cannot take the issuance lock for {name} ({error}); ordering without it",
                    name=name.label,
                    error=e,
                )
                break
            if not self.running:
                raise IssuanceError("stopped", "the router is stopping")
            if self._reactor.seconds() > deadline:
                raise IssuanceError(
                    "shared", "another box held the issuance lock and no certificate appeared"
                )
            await deferLater(self._reactor, polls.next(), lambda: None)
        keep_lock = False
        try:
            if not self.running:
                raise IssuanceError("stopped", "the router is stopping")
            if held is not None and await self._from_shared(name):
                return "shared"  # finished by another box between our look and our lock
            await self._order(name, reason)
            return "issued"
        except IssuanceError as e:
            # A failed order keeps the lock until it expires: the other boxes, waiting on it, do
            # not each try (and fail) the same order; the fleet retries once per lock lifetime.
            # Only for what the CA said: another box would be told the same. A failure of this
            # box's own (its network, its configuration, its guard) lets the others try.
            keep_lock = held is not None and e.stage in CA_STAGES
            if keep_lock:
                _log.info(
                    "acme: keeping the issuance lock of {name} until it expires ({ttl:.0f}s): "
                    "no box retries it sooner",
                    name=name.label,
                    ttl=shared.lock_ttl,
                )
            raise
        finally:
            if held is not None and not keep_lock:
                await lease.release(self._reactor, shared.store, held, 10.0)

    async def _from_shared(self, name: CertName) -> bool:
        """Install the bucket's copy when it is good for a while yet. True if we may stop."""
        assert self._shared is not None
        try:
            cert = await self._shared.fetch(name)
        except ObjectStoreError as e:
            _log.warn(
                "acme: cannot read the shared cache for {name}: {error}", name=name.label, error=e
            )
            return False
        if cert is None:
            return False
        if cert.origin != self._account.directory_url:
            return False  # another CA's (staging, a file placed by hand): get our own
        if self._reactor.seconds() >= self._due(cert):
            return False  # due itself: renew it
        served = self._store.certificates().get(name.label)
        if served is not None and served.serial == cert.serial:
            return True
        await self._install(name, cert)
        return True

    def _check_guard(self, name: CertName) -> None:
        now = self._reactor.seconds()
        recent = [t for t in self._issued_at.get(name, []) if now - t < WEEK]
        self._issued_at[name] = recent
        if len(recent) >= ISSUED_PER_WEEK:
            # A loop guard under the CA's duplicate limit (Let's Encrypt: 5 a week): whatever
            # makes certificates not last, ordering more would only lock the name out for a week.
            raise IssuanceError(
                "limit",
                f"this box obtained {len(recent)} certificates for {name.label} in the last 7 "
                f"days; not ordering another (look for why they do not stay in service)",
                retry_after=WEEK - (now - recent[0]),
            )

    async def _order(self, name: CertName, reason: str) -> Certificate:
        self._check_guard(name)
        back = IReactorFromThreads(self._reactor)  # the order's worker thread reports through it
        _log.info(
            "acme: ordering a certificate for {name} ({reason})", name=name.label, reason=reason
        )
        solver: Any
        if name.kind == "host":
            if self._http01 is None:
                raise IssuanceError(
                    "challenge", "HTTP-01 needs the port-80 listener (LCHAT_HTTP_ADDR)"
                )
            solver = HTTP01Solver(back, self._http01, self._shared)
        else:
            if self._dns is None:
                raise IssuanceError("dns", "no DNS provider for DNS-01")
            solver = DNS01Solver(
                self._dns,
                self._dns_resolvers,
                self._dns_timeout,
                self._account.sleep,
                self._monotonic,
            )

        def placed() -> None:
            back.callFromThread(self._count_order, name.kind)

        issued = await self._run(
            lambda: self._account.issue(
                [name.label], solver, deadline=self._order_deadline, on_order=placed
            )
        )
        self._issued_at.setdefault(name, []).append(self._reactor.seconds())
        cert = Certificate.parse(issued.key_pem, issued.chain_pem, self._account.directory_url)
        self._unserved[name] = cert  # until it is in service
        if self._shared is not None:
            # First into the bucket: the fleet gets it even if this box cannot serve it.
            try:
                await self._shared.publish(name, cert)
            except (ObjectStoreError, CacheEntryError) as e:
                _log.warn(
                    "acme: cannot upload {name} to the shared cache ({error}); the sync retries",
                    name=name.label,
                    error=e,
                )
        await self._install(name, cert)
        return cert

    async def _install(self, name: CertName, cert: Certificate) -> None:
        """Write ``cert`` into the cache directory and see it served; else ``install`` fails
        (backed off like any failure) and the certificate is kept to be installed again."""
        try:
            await self._run(lambda: self._local.install(name, cert))
        except OSError as e:
            self._unserved[name] = cert
            raise IssuanceError("install", f"cannot write it: {e.strerror or e}") from e
        await self._store.rescan()
        served = self._store.certificates().get(name.label)
        if served is None or served.serial != cert.serial:
            self._unserved[name] = cert
            why = self._store.refused().get(name.path(self._local.directory), "not loaded")
            raise IssuanceError("install", f"obtained, but not served: {why}")
        self._unserved.pop(name, None)

    def _count_order(self, kind: str) -> None:
        ORDERS.labels(kind).inc()
        self.orders[kind] = self.orders.get(kind, 0) + 1

    def _failed(self, name: CertName, error: IssuanceError) -> None:
        if error.stage == "stopped":
            _log.info("acme: {name} issuance abandoned: the router is stopping", name=name.label)
            return
        count = self._failures[name][0] + 1 if name in self._failures else 1
        delay = self._backoff.delay(count)
        if error.retry_after:
            delay = max(delay, error.retry_after)
        delay = self._backoff.jittered(delay, self._rng)
        self._failures[name] = (count, self._reactor.seconds() + delay, error.stage, str(error))
        FAILURES.labels(name.kind, error.stage).inc()
        ISSUANCES.labels(name.kind, "failed").inc()
        _log.error(
            "acme: {name} issuance failed ({stage}): {error}; next attempt in {delay:.0f}s",
            name=name.label,
            stage=error.stage,
            error=str(error),
            delay=delay,
            failures=count,
        )
        if name.kind == "wildcard":
            if self._wildcards.get(name.name) != "failed":
                _log.warn(
                    "acme: *.{domain} is not available: hosts under it get per-host "
                    "certificates until it is issued",
                    domain=name.name,
                )
            self._wildcards[name.name] = "failed"
            if self.running:
                self._schedule_retry(name, delay)

    def _schedule_retry(self, name: CertName, delay: float) -> None:
        previous = self._retries.pop(name, None)
        if previous is not None and previous.active():
            previous.cancel()
        self._retries[name] = self._reactor.callLater(delay, self.start, name, "retry")

    def _may_try(self, name: CertName) -> bool:
        failed = self._failures.get(name)
        return failed is None or self._reactor.seconds() >= failed[1]

    def _wildcard_domain(self, host: str) -> str | None:
        parent = host.partition(".")[2]
        return parent if parent in self._wildcards else None

    def _run(self, f: Callable[[], Any]) -> Deferred[Any]:
        return deferToThreadPool(IReactorFromThreads(self._reactor), self._pool, f)

    def status(self) -> dict[str, Any]:
        """What the admin API's ``/status`` shows under ``acme``."""
        now = self._reactor.seconds()
        return {
            "directory": self._account.directory_url,
            "issuing": sorted(n.label for n in self._inflight),
            "failing": {
                n.label: {
                    "failures": count,
                    "stage": stage,
                    "error": message,
                    "retry_in": round(max(0.0, when - now), 1),
                }
                for n, (count, when, stage, message) in sorted(
                    self._failures.items(), key=lambda item: item[0].label
                )
            },
            "wildcards": dict(sorted(self._wildcards.items())),
            "orders": dict(self.orders),
        }

    # -- renewal ------------------------------------------------------------------------------

    def renew_time(self, not_after: float, serial: int, not_before: float | None) -> float:
        """When a certificate is due: ``renew_before`` ahead of expiry (a third of its lifetime
        when that is shorter), minus up to a day of jitter derived from the serial."""
        before = self.renew_before
        if not_before is not None and not_after > not_before:
            before = min(before, (not_after - not_before) / 3)
        window = min(DAY, before / 10)
        return not_after - before - window * ((serial % 10007) / 10007)

    def _due(self, cert: Certificate | certfiles.Loaded) -> float:
        """When a certificate is due. One issued by another ACME directory than ours (we
        switched from staging, or to another CA) is due now; a file placed by hand (no marker)
        follows the schedule like any other."""
        if cert.origin and cert.origin != self._account.directory_url:
            return 0.0
        return self.renew_time(cert.not_after, cert.serial, cert.not_before)

    def check_renewals(self) -> None:
        """Start every renewal that is due (the periodic check; also callable by tests)."""
        now = self._reactor.seconds()
        lag = 0.0
        served = self._store.certificates()
        for loaded in served.values():
            if loaded.kind == "default":
                continue
            name = CertName("wildcard" if loaded.kind == "wildcard" else "host", loaded.name)
            due = self._due(loaded)
            if now < due:
                continue
            scheduled = self.renew_time(loaded.not_after, loaded.serial, loaded.not_before)
            if loaded.kind == "host":
                if not self._may_issue(loaded.name) or self._http01 is None:
                    continue  # not ours to renew (removed, or no HTTP-01): it lapses
                wildcard = served.get("*." + loaded.name.partition(".")[2])
                if wildcard is not None and now < self._due(wildcard):
                    continue  # a good wildcard covers it: no need for its own
            elif loaded.name not in self._wildcards:
                continue  # a wildcard placed by hand, for a domain we do not issue
            lag = max(lag, now - scheduled)  # a foreign CA's is due early, not late
            if name not in self._inflight and self._may_try(name):
                self.start(name, "renewal")
        RENEWAL_LAG.set(lag)
        for host in self._own_hosts:
            if not hosts.is_normal(host):
                continue  # an IP address: no CA issues for it over HTTP-01 here
            if host not in served and "*." + host.partition(".")[2] not in served:
                self.want(host)

    def check_wildcards(self) -> None:
        """Start every configured wildcard that is missing or due."""
        now = self._reactor.seconds()
        served = self._store.certificates()
        for domain in self.wildcard_domains:
            loaded = served.get("*." + domain)
            name = CertName.wildcard(domain)
            if loaded is not None and now < self._due(loaded):
                self._wildcards[domain] = "ok"
                continue
            if name not in self._inflight and self._may_try(name):
                self.start(name, "missing" if loaded is None else "renewal")

    # -- service ------------------------------------------------------------------------------

    @staticmethod
    def _new_pool() -> ThreadPool:
        pool = ThreadPool(minthreads=0, maxthreads=ORDER_THREADS, name="lchat-acme")
        # Order threads never hold the process up at exit: one stuck in a CA request that the
        # router no longer waits for just ends with it.
        pool.threadFactory = functools.partial(threading.Thread, daemon=True)  # type: ignore[assignment]
        return pool

    def startService(self) -> None:
        super().startService()
        self._account.stopping.clear()
        if self._pool.joined:
            self._pool = self._new_pool()  # started again after a stop
        self._pool.start()
        for period, check in (
            (self._wildcard_check, self.check_wildcards),
            (self._renewal_check, self.check_renewals),
        ):
            loop = LoopingCall(check)
            loop.clock = self._reactor
            # Spread boxes that started together: the first check now, the rest jittered.
            loop.start(period * self._rng.uniform(0.95, 1.05), now=True).addErrback(
                lambda f: _log.failure("acme: a certificate check loop died", f)
            )
            self._loops.append(loop)

    def stopService(self) -> Deferred[None]:
        if not self.running:
            return succeed(None)  # stopped already (twice is harmless)
        super().stopService()
        self._account.stopping.set()
        for loop in self._loops:
            if loop.running:
                loop.stop()
        self._loops.clear()
        for call in self._retries.values():
            if call.active():
                call.cancel()
        self._retries.clear()
        waiting = list(self._inflight.values())

        async def drain() -> None:
            if waiting:
                # Each attempt notices ``stopping`` between steps; give them a moment to end.
                ended: Deferred[Any] = gatherResults([settled(d) for d in waiting])
                ended.addTimeout(STOP_BUDGET, self._reactor)
                try:
                    await ended
                except Exception:
                    _log.warn("acme: an order was still running at shutdown")
            # Threads stuck in a CA request end on their own timeouts; do not wait for them.
            threading.Thread(target=self._pool.stop, name="lchat-acme-stop", daemon=True).start()

        return Deferred.fromCoroutine(drain())


# --- solvers (called in the order's worker thread) ------------------------------------------------


class HTTP01Solver:
    """Publishes key authorisations on our port-80 responder, and in the bucket for the box the
    CA may reach instead (shared cache)."""

    kind = "http-01"

    def __init__(
        self,
        reactor: IReactorFromThreads,
        responder: ChallengeResponder,
        shared: SharedCache | None,
    ) -> None:
        self._reactor = reactor
        self._responder = responder
        self._shared = shared

    def present(self, domain: str, token: str, validation: str) -> object:
        self._responder.publish(token, validation)
        if (shared := self._shared) is not None:
            try:
                on_reactor(self._reactor, lambda: shared.put_challenge(token, validation))
            except Exception as e:
                _log.warn(
                    "acme: cannot share the challenge for {domain} in the bucket ({error}): only "
                    "this box can answer it",
                    domain=domain,
                    error=e,
                )
        return token

    def ready(self, handles: Sequence[object]) -> None:
        return None

    def cleanup(self, handle: object) -> None:
        token = str(handle)
        self._responder.withdraw(token)
        if (shared := self._shared) is not None:
            try:
                on_reactor(self._reactor, lambda: shared.delete_challenge(token))
            except Exception as e:
                _log.debug("acme: removing a shared challenge failed: {error}", error=e)


class DNS01Solver:
    """TXT records through a DNS provider; ready once every resolver we check sees them."""

    kind = "dns-01"

    def __init__(
        self,
        provider: Any,
        resolvers: Sequence[tuple[str, int]],
        timeout: float,
        sleep: Callable[[float], None],  # raises IssuanceError "stopped" when the router stops
        clock: Callable[[], float],
    ) -> None:
        self._provider = provider
        self._resolvers = resolvers
        self._timeout = timeout
        self._sleep = sleep
        self._clock = clock

    def present(self, domain: str, token: str, validation: str) -> object:
        from lchat.acme import dns01

        fqdn = "_acme-challenge." + hosts.normalise(domain)
        try:
            return self._provider.add_txt(fqdn, validation)
        except dns01.DNSProviderError as e:
            raise IssuanceError("dns", str(e)) from e

    def ready(self, handles: Sequence[object]) -> None:
        from lchat.acme import dns01

        wanted: dict[str, list[str]] = {}
        for record in handles:
            wanted.setdefault(record.fqdn, []).append(record.value)  # type: ignore[attr-defined]
        for fqdn, values in wanted.items():
            try:
                dns01.wait_for_txt(
                    fqdn,
                    values,
                    resolvers=self._resolvers,
                    timeout=self._timeout,
                    sleep=self._sleep,
                    clock=self._clock,
                )
            except dns01.DNSProviderError as e:
                raise IssuanceError("dns", str(e)) from e

    def cleanup(self, handle: object) -> None:
        self._provider.remove_txt(handle)


def on_reactor(
    reactor: IReactorFromThreads,
    work: Callable[[], Coroutine[Any, Any, Any]],
    timeout: float = 15.0,
) -> Any:
    """From a worker thread: run the coroutine ``work()`` on the reactor and wait for it, at most
    ``timeout`` seconds (a stopped reactor must not strand the thread, as blockingCallFromThread
    would)."""
    done = threading.Event()
    outcome: list[Any] = []

    def finish(result: Any) -> None:
        outcome.append(result)
        done.set()

    reactor.callFromThread(lambda: Deferred.fromCoroutine(work()).addBoth(finish))
    if not done.wait(timeout):
        raise TimeoutError(f"the reactor did not answer within {timeout:.0f}s")
    result = outcome[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result
