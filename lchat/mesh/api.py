"""Route replication, the serving side (docs/design.md §9): how a peer hands this box its routes.

Every box's router serves this API on an internal unix socket and proxies to it the requests
addressed to its own ``LCHAT_MESH_SELF`` host. Bearer ``LCHAT_MESH_TOKEN`` (or, during a rotation,
``LCHAT_MESH_TOKEN_ACCEPT``: :mod:`lchat.mesh.tokens`), compared in constant time.

``POST /api/mesh/route``
    Body (``Content-Type: application/json``, at most :data:`MAX_BODY` bytes), exactly these fields::

        {"host": "a.chat.example.com", "kind": "instance", "version": "", "hibernate": true,
         "replication": "stream", "home_region": "", "env": {"LCHAT_ADMIN_TOKEN": "..."}}

    ``kind`` must be ``instance`` (services do not replicate) and ``hibernate`` true (only a
    hibernating space can live on any box) — or false for the "lives elsewhere" shape, with
    ``lives_at`` (an optional field, present exactly then): the ``LCHAT_MESH_SELF`` of the box
    that runs the space always-on (``lchat hibernate --off`` there), never this box's own. That
    shape writes only the row (not hibernating, ``lives_at`` normalised, no due time), over no row
    or a replicated one (:attr:`lchat.registry.Route.replicated`); the router forwards its
    requests to that box and never wakes it
    (:meth:`lchat.mesh.routing.MeshRouter.forward_elsewhere`). ``env`` holds at most
    :data:`~lchat.mesh.route_payload.MAX_ENV_KEYS` entries named ``LCHAT_[A-Z0-9_]{1,64}`` (not
    ``LCHAT_HOST``, ``LCHAT_SOCKET`` or ``LCHAT_DB``), each value a string of at most
    :data:`~lchat.mesh.route_payload.MAX_ENV_VALUE` bytes without line breaks or control
    characters. The host must be in this box's scope (:func:`lchat.mesh.route_payload.in_scope`:
    never a name outside the mesh's domains, so a token holder cannot make a box order
    certificates for names outside them). Any unknown field is refused. One field is optional: ``next_due``, the space's next scheduled wake (an integer of unix
    seconds, ``0 <= next_due < 2**53``; 0: none). Present, it replaces this box's value (the sender
    is the box that slept or due-woke the space, or a seed from one); absent (an older peer, or a
    row with no due time), this box's value is kept. Another is ``gen``, the sender's settings
    generation (a positive integer below 2**53): the settings are written only when they are newer
    than this box's (:func:`lchat.mesh.settings.newer`; an equal generation with other settings
    only from the host's owner, the sender naming itself in ``X-Lchat-Mesh-Sender``); otherwise
    the answer is 200 ``{"host", "result": "stale", "gen": <this box's>}`` and nothing but a
    ``next_due`` is written. A payload without ``gen`` never replaces a row that has one.

    Upsert: a new row is inserted ``ready`` and hibernating, its socket and database paths derived
    here (``hosts.py``), never taken from the payload; an existing hibernating instance row has its
    version, replication class and home region updated. Either way ``<data>/<host>.env`` is
    replaced, atomically and mode 0600, by exactly the ``env`` given: this *materialises* the route,
    so its first wake on this box needs nothing else. 201 ``{"host", "result": "created"}`` or 200
    ``{"host", "result": "updated"}``; 409 when the host is a service or a non-hibernating space on
    this box (a local space is never hijacked). Over no row but a tombstone of the host (removed
    here: :class:`lchat.registry.Tombstone`), only a payload whose ``gen`` is above the tombstone's
    creates it; otherwise 200 ``{"result": "stale", "gen": <the tombstone's>}``.

``DELETE /api/mesh/route/{host}``
    A tombstone, idempotent: removes the row, ``<data>/<host>.env`` and ``<data>/<host>-bot.env``;
    never member data (``<host>.db`` and its ``-wal``/``-shm`` stay). 200 ``{"host", "deleted":
    true|false}`` (an absent row is not an error, and its files are left alone); 409 as above; 400
    for a row out of scope. Optional ``?gen=N``: the sender's tombstone generation. This box keeps
    a tombstone of the host at ``max(N, the row's gen + 1)`` (without ``N``, an older peer's:
    ``max(now in ms, the row's gen + 1)``), over no row too when ``N`` is given; a row whose
    generation is ``N`` or more (added again since) stays, answered ``"result": "stale"``.

``GET /api/mesh/routes``
    200 ``{"routes": [payload, ...]}``: every in-scope hibernating instance row, with its env values
    (peers need them; the channel is authenticated), and every lives-elsewhere row (no env).

``POST /api/mesh/beat``
    A peer's heartbeat, straight from the peer (lchat.mesh.witness.BeatMessage): recorded by this
    box's membership, its heartbeat relayed into the bucket when it asks (and this box's own
    lands), answered with this box's (``BeatReply``, 200). 400 for a body that is not one, 404 when
    this router has no membership to give it to. Answered on the reactor, never in a thread: it
    is what keeps a box alive while the bucket is out of reach.

``GET /api/mesh/digest``
    200 ``{host: [settings_gen, settings_hash]}`` of every in-scope replicated row: what a peer's
    anti-entropy (:mod:`lchat.mesh.sync`) compares with its own. ``?tombstones=1``: ``{"rows":
    that, "tombstones": {host: gen}}`` (an older box ignores the query: the first shape). ``GET /api/mesh/routes?host=``
    lists that one host's row (none: an empty list), for the peer to fetch the newer one.

``GET /api/mesh/spaces``
    200: the spaces this box reports for ``lchat fleet``, by the ownership rule of
    :mod:`lchat.mesh.fleet` (state, version, awake-since, next-due, replication lag); 404 when
    the router serves no such view. Reads only.

``GET /api/mesh/stats/{host}``
    This box's own wake-free stats of ``host`` (:meth:`lchat.spacestats.SpaceStats.answer_here`:
    never forwarded again, never a wake), with its status (200, or the error's: 404
    ``unknown_host``, 409 ``not_local``, 503 ...), the body carrying ``box``: this box's
    ``LCHAT_MESH_SELF``. A peer asks it of the box that holds or owns a space (docs/mesh.md,
    "Wake-free stats on a mesh"). 404 without a ``reason`` when the router serves no stats.

``POST /api/mesh/hold`` ``{"host": H, "seconds": S}`` and ``POST /api/mesh/release`` ``{"host": H}``
    ``lchat relocate`` run on another box (docs/mesh.md, "Relocating a space"): the router's
    operator hold (:class:`lchat.hibernation.capacity.Holds`, as the admin's ``POST
    /sleep?hold=S``) placed first, then the space slept (final replica flushed, lease released);
    200 ``{"host", "held": S, "state", "box"}`` once it is asleep. Until the hold's deadline
    (``0 < S <= 3600``: a crashed caller never strands the space) or the release (200 ``{"host",
    "released": bool}``), no wake of it on this box: requests get 503 with a short Retry-After.
    404 with ``reason: unknown_host`` when H is not a hibernating instance here; 404 without a
    ``reason`` when this router has no activator (as an older lchat, which lacks the calls).

``POST /api/mesh/wake/{host}``
    This box's own readiness probe of ``host`` (:meth:`lchat.readiness.Readiness.answer_here`:
    never forwarded again): the activator's wake, ``GET /api/version`` on the space's socket,
    its sleep; answered when done (200 with ``seconds``, ``version``, ``build``; 503 with the
    wake's ``reason``; 404 ``unknown_host``), the body carrying ``box``. A peer's ``lchat probe``
    asks it of the space's owner (docs/operations.md, "Creating spaces"). 404 without a
    ``reason`` when the router serves no probe (no hibernation); an older lchat answers 404 too.

Anything malformed is 400 with ``{"error": ...}`` and nothing is written; a missing or wrong token
is 401, a wrong method 405, any other path 404. Failed authentication is rate-limited per client
address (:class:`lchat.mesh.tokens.AuthLimiter`): with its bucket empty, every request of that
client is answered 429 with ``Retry-After``, counted in ``lchat_mesh_auth_limited_total`` and
logged once per episode.

**``lives_at`` names a member** (issue 29): the URL must be one whose heartbeat authenticated
with the mesh token (``members``: :meth:`lchat.mesh.membership.Membership.known`), and ``https``
(``http`` only on a mesh whose own ``LCHAT_MESH_SELF`` is plain HTTP, which chose cleartext):
never an arbitrary address of the box's network, never a cleartext diversion of a space's
traffic. Writes run in a thread, serialised, and the router's route table is reloaded (the
``reload`` callback) before the answer goes out.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Coroutine
from io import BytesIO
from typing import Any, Required, TypedDict, Unpack

from prometheus_client import Counter
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from lchat import hosts
from lchat.config import BoxConfig
from lchat.mesh import tokens
from lchat.mesh.client import (
    DIGEST_PATH,
    HOLD_PATH,
    RELEASE_PATH,
    ROUTE_PATH,
    ROUTES_PATH,
    SENDER_HEADER,
    STATS_PATH,
    WAKE_PATH,
)
from lchat.mesh.fleet import SPACES_PATH
from lchat.mesh.placement import normalise_member_url
from lchat.mesh.route_payload import PayloadError, RoutePayload, decode_payload, in_scope
from lchat.mesh.route_store import Refused, Result, RouteStore
from lchat.mesh.space_calls import HostAnswer, SpaceCalls, SpaceHolds
from lchat.mesh.witness import BEAT_PATH, BeatMessage, BeatReply, MessageError
from lchat.registry import Conflict, Registry, Route
from lchat.threads import RunInThread
from lchat.webutil import QuietSite, answerable

MAX_BODY = 64 * 1024
# Called after every write with the reason (the router passes ``RouteSource.reload``); a Deferred
# it returns is waited for before the answer.
Reload = Callable[[str], object]


class Options(TypedDict, total=False):
    """What :func:`mesh_site` takes besides the registry, the config and ``reload``."""

    run_in_thread: Required[RunInThread]  # the registry and file work (the router's threads)
    # GET /api/mesh/spaces: the fleet view's snapshot (lchat.mesh.fleet.SpacesView.snapshot),
    # called on the reactor, finished in a worker thread.
    spaces: Callable[[], Callable[[], dict[str, Any]]] | None
    # POST /api/mesh/beat: a peer's beat, to this box's membership (Membership.receive_beat).
    beats: Callable[[BeatMessage], Coroutine[Any, Any, BeatReply]] | None
    # Is this URL a member's (Membership.known)? ``lives_at`` must be; None: no membership
    # here, so no ``lives_at`` is accepted.
    members: Callable[[str], bool] | None
    clock: Callable[[], float]  # the failed-authentication limiter's (time.monotonic)
    # GET /api/mesh/stats/<host>: this box's own answer (lchat.spacestats.SpaceStats.answer_here)
    stats: HostAnswer | None
    # POST /api/mesh/hold and /release: this box's activator (None: no hibernation here)
    holds: SpaceHolds | None
    # POST /api/mesh/wake/<host>: this box's own probe (lchat.readiness.Readiness.answer_here)
    probe: HostAnswer | None
    # The URL of a route's owner by the hash (MeshRouter.owner_url), called on the reactor: an
    # equal settings generation with other settings is taken only from it. None: from no one.
    owner: Callable[[Route], str] | None


_limited = Counter(
    "lchat_mesh_auth_limited_total",
    "Mesh API requests answered 429 because their client failed authentication too often",
)

_calls = Counter(
    "lchat_mesh_route_calls_total",
    "Route-replication API calls by operation and outcome",
    ["op", "outcome"],
)
_log = Logger(namespace="lchat.mesh.api")
_OPS = {  # path -> (operation, its one method); DELETE <ROUTE_PATH>/<host> besides
    ROUTE_PATH.encode(): ("upsert", b"POST"),
    ROUTES_PATH.encode(): ("list", b"GET"),
    SPACES_PATH.encode(): ("spaces", b"GET"),
    BEAT_PATH.encode(): ("beat", b"POST"),
    HOLD_PATH.encode(): ("hold", b"POST"),
    RELEASE_PATH.encode(): ("release", b"POST"),
    DIGEST_PATH.encode(): ("digest", b"GET"),
}
_INTERNAL = {"error": "internal error: see the router's log"}  # a 500's body (the log says why)


# --- the resource -------------------------------------------------------------------------------


class MeshAPI(Resource):
    """The mesh API (the module docstring), built by :func:`mesh_site`."""

    isLeaf = True

    def __init__(
        self, registry: Registry, cfg: BoxConfig, reload: Reload, **options: Unpack[Options]
    ) -> None:
        super().__init__()
        if cfg.mesh is None:
            raise ValueError("the mesh API needs LCHAT_MESH_SELF (and its domains and token)")
        self._registry = registry
        self._mesh = cfg.mesh
        self._store = RouteStore(registry, cfg.mesh, cfg.data_dir, cfg.run_dir, cfg.space_command)
        self._token = cfg.mesh.token.encode("utf-8")
        self._accept_token = cfg.mesh.accept_token.encode("utf-8")  # b"": none (lchat.mesh.tokens)
        self._reload = reload
        self._run = options["run_in_thread"]
        self._spaces = options.get("spaces")
        self._beats = options.get("beats")
        self._members = options.get("members")
        self._space_calls = SpaceCalls(
            normalise_member_url(cfg.mesh.self_url),
            registry,
            self._run,
            self._answer,
            self._finish,
            stats=options.get("stats"),
            probe=options.get("probe"),
            holds=options.get("holds"),
        )
        self._owner = options.get("owner")
        self._limiter = tokens.AuthLimiter(options.get("clock", time.monotonic))

    @property
    def write_lock(self) -> threading.Lock:
        """Held by every write of this API (the env file, then the row): the settings sweep
        (lchat.mesh.sync) holds it too, so that it never reads a peer's write half done."""
        return self._store.lock

    def render(self, request: Request) -> bytes | int:
        path = request.path or b""
        host_segment = b""
        if path in _OPS:
            op, allowed = _OPS[path]
        elif path.startswith(ROUTE_PATH.encode() + b"/") and path.count(b"/") == 4:
            op, allowed, host_segment = "delete", b"DELETE", path.rsplit(b"/", 1)[1]
        elif path.startswith(STATS_PATH.encode() + b"/") and path.count(b"/") == 4:
            op, allowed, host_segment = "stats", b"GET", path.rsplit(b"/", 1)[1]
        elif path.startswith(WAKE_PATH.encode() + b"/") and path.count(b"/") == 4:
            op, allowed, host_segment = "wake", b"POST", path.rsplit(b"/", 1)[1]
        else:
            return self._answer(request, "unknown", "not_found", 404, {"error": "not found"})
        if request.method != allowed:
            request.setHeader(b"allow", allowed)
            return self._answer(
                request, op, "bad_method", 405, {"error": f"use {allowed.decode()} here"}
            )
        client = tokens.client_of(request)
        retry = self._limiter.retry_after(client)
        if retry is not None:
            _limited.inc()
            if self._limiter.first_refusal(client):
                _log.warn(
                    "mesh API: {client} failed authentication {burst} times: answering it 429 "
                    "until it may try again (one more every {every:g}s)",
                    client=client,
                    burst=self._limiter.burst,
                    every=self._limiter.every,
                )
            request.setHeader(b"retry-after", str(retry).encode())
            error = f"too many failed authentications: try again in {retry}s"
            return self._answer(request, op, "limited", 429, {"error": error})
        if not self._authorised(request):
            self._limiter.failed(client)
            request.setHeader(b"www-authenticate", b'Bearer realm="lchat-mesh"')
            _log.warn(
                "mesh API: {op} refused: missing or wrong mesh token (from {client})",
                op=op,
                client=client,
            )
            return self._answer(
                request, op, "unauthorized", 401, {"error": "missing or wrong mesh token"}
            )
        if op == "upsert":
            try:
                payload = self._read_payload(request)
            except PayloadError as e:
                return self._answer(request, op, "invalid", 400, {"error": str(e)})
            from_owner = self._from_owner(request, payload)
            return self._start(
                request, op, lambda: self._store.upsert(payload, from_owner), payload.host
            )
        if op == "delete":
            try:
                host = hosts.normalise(host_segment.decode("ascii"))
            except (UnicodeDecodeError, hosts.InvalidHost) as e:
                return self._answer(request, op, "invalid", 400, {"error": f"host: {e}"})
            try:
                gen = _read_gen(request)
            except PayloadError as e:
                return self._answer(request, op, "invalid", 400, {"error": str(e)})
            return self._start(request, op, lambda: self._store.delete(host, gen), host)
        if op == "beat":
            return self._beat(request)
        if op == "stats":
            return self._space_calls.host_answer(request, op, host_segment)
        if op == "wake":
            return self._space_calls.host_answer(request, op, host_segment)
        if op in ("hold", "release"):
            return self._space_calls.hold_or_release(request, op)
        if op == "digest":
            with_tombstones = request.args.get(b"tombstones") == [b"1"]
            return self._start(request, op, lambda: self._store.digest(with_tombstones), "")
        if op == "list" and request.args.get(b"host"):
            try:
                one = hosts.normalise(request.args[b"host"][0].decode("ascii"))
            except (UnicodeDecodeError, hosts.InvalidHost) as e:
                return self._answer(request, op, "invalid", 400, {"error": f"host: {e}"})
            return self._start(request, op, lambda: self._store.listing(one), "")
        if op == "spaces":
            if self._spaces is None:
                return self._answer(request, op, "not_found", 404, {"error": "not served here"})
            try:
                finish = self._spaces()  # a snapshot, here on the reactor; the rest in a thread
            except Exception:
                _log.failure("mesh: the fleet view failed")
                return self._answer(request, op, "error", 500, _INTERNAL)
            return self._start(request, op, lambda: (200, finish(), "listed"), "")
        return self._start(request, op, self._store.listing, "")

    def _beat(self, request: Request) -> bytes | int:
        """``POST /api/mesh/beat``, on the reactor (see the module docstring)."""
        op = "beat"
        if self._beats is None:
            return self._answer(request, op, "not_found", 404, {"error": "not served here"})
        if getattr(request, "too_large", False):
            return self._answer(request, op, "invalid", 400, {"error": "the body is too large"})
        content = request.content.read() if request.content is not None else b""
        try:
            message = BeatMessage.parse(content)
            normalise_member_url(message.heartbeat.url)
        except (MessageError, ValueError) as e:
            return self._answer(request, op, "invalid", 400, {"error": f"not a beat: {e}"})
        still = answerable(request)
        d = Deferred.fromCoroutine(self._beats(message))

        def done(reply: BeatReply) -> None:
            if still():
                self._finish(request, still, op, "ok", 200, reply.to_json())

        def failed(failure: Failure) -> None:
            if failure.check(MessageError, ValueError):
                error = {"error": f"not a beat: {failure.getErrorMessage()}"}
                self._finish(request, still, op, "invalid", 400, error)
                return
            _log.failure("mesh: a peer's beat failed", failure)
            self._finish(request, still, op, "error", 500, _INTERNAL)

        d.addCallbacks(done, failed)
        return NOT_DONE_YET

    # --- checks, on the reactor (cheap) -------------------------------------------------------

    def _authorised(self, request: Request) -> bool:
        values = request.requestHeaders.getRawHeaders(b"authorization") or []
        if len(values) != 1:
            return False
        scheme, _, given = values[0].partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        which = tokens.match(given.strip(), self._token, self._accept_token)
        if which == "accept":
            tokens.note_accept_use("api")
        return which is not None

    def _read_payload(self, request: Request) -> RoutePayload:
        if getattr(request, "too_large", False):
            raise PayloadError(f"the body is larger than {MAX_BODY} bytes")
        content_type = (request.getHeader(b"content-type") or b"").decode("latin-1")
        media, _, params = content_type.partition(";")
        charset = params.strip().lower().replace(" ", "")
        if media.strip().lower() != "application/json" or charset not in ("", "charset=utf-8"):
            raise PayloadError("Content-Type must be application/json")
        body = request.content.read(MAX_BODY + 1) if request.content is not None else b""
        if len(body) > MAX_BODY:
            raise PayloadError(f"the body is larger than {MAX_BODY} bytes")
        payload = decode_payload(body)
        self.check_payload(payload)
        return payload

    def check_payload(self, payload: RoutePayload) -> None:
        """The checks of a peer's route beyond its shape (a push's, or one anti-entropy fetched):
        ``lives_at`` a member and not this box, the host in this box's scope. Raises
        :class:`PayloadError`."""
        if payload.lives_at and payload.lives_at == normalise_member_url(self._mesh.self_url):
            raise PayloadError(
                f"lives_at {payload.lives_at} is this box: a space that runs here always-on is "
                f"registered here, not replicated to it"
            )
        if payload.lives_at:
            self._check_member(payload.lives_at)
        if not in_scope(self._mesh, payload.host, payload.home_region):
            raise PayloadError(
                f"{payload.host} is not in this box's mesh scope (not under "
                f"{', '.join(self._mesh.domains)}, and its home region is not this box's)"
            )

    def _from_owner(self, request: Request, payload: RoutePayload) -> bool:
        """Is the sender (its :data:`~lchat.mesh.client.SENDER_HEADER`) the host's owner by the
        hash, as this box sees the membership? (lchat.mesh.settings.newer: the owner's word
        settles an equal generation.)"""
        sender = (request.getHeader(SENDER_HEADER) or "").strip()
        if not sender or self._owner is None:
            return False
        try:
            return normalise_member_url(sender) == self._owner(self._store.route(payload))
        except ValueError:
            return False

    def _check_member(self, url: str) -> None:
        """``lives_at`` must be a member's URL, over HTTPS (the module docstring)."""
        cleartext_mesh = self._mesh.self_url.lower().startswith("http://")
        if not url.startswith("https://") and not cleartext_mesh:
            _log.warn("mesh: refused lives_at {url}: not https", url=url)
            raise PayloadError(
                f"lives_at {url} must be https: a space's traffic is never forwarded in clear "
                "text on a mesh whose boxes speak HTTPS"
            )
        if self._members is None or not self._members(url):
            _log.warn("mesh: refused lives_at {url}: not a member of this mesh", url=url)
            raise PayloadError(
                f"lives_at {url} is not a member of this mesh (no heartbeat of it authenticated "
                "with the mesh token is known here): requests are forwarded only to members"
            )

    def apply(self, payload: RoutePayload, from_owner: bool) -> Deferred[str]:
        """Apply a peer's route that this box fetched itself (lchat.mesh.sync's anti-entropy)
        through the same upsert as ``POST /api/mesh/route``, then reload the route table; fires
        with the result (created, updated, stale). Fails as the upsert does
        (:class:`lchat.mesh.route_store.Refused` for a row this box cannot take,
        :class:`Conflict`), or as a push's checks (:class:`PayloadError`: :meth:`check_payload`)."""
        try:
            self.check_payload(payload)
        except PayloadError:
            return fail()
        return self._synced(payload.host, lambda: self._store.upsert(payload, from_owner))

    def apply_delete(self, host: str, gen: int) -> Deferred[str]:
        """Apply a peer's tombstone that this box read in its digest (lchat.mesh.sync) through
        the same path as ``DELETE /api/mesh/route/{host}?gen=`` (member data kept), then reload
        the route table; fires with the result (deleted, stale, absent)."""
        return self._synced(host, lambda: self._store.delete(host, gen))

    def _synced(self, host: str, write: Callable[[], Result]) -> Deferred[str]:
        """``write`` in a thread, then the route table reloaded whatever came of it; its outcome."""
        d: Deferred[Result] = self._run(write)

        def reload(result: Result) -> Deferred[Any]:
            reloaded = maybeDeferred(self._reload, f"mesh sync {result[2]}: {host}")
            return reloaded.addBoth(lambda _: result[2])

        return d.addCallback(reload)

    # --- answering ----------------------------------------------------------------------------

    def _start(
        self,
        request: Request,
        op: str,
        work: Callable[[], tuple[int, dict[str, Any], str]],
        host: str,
    ) -> int:
        still = answerable(request)
        d: Deferred[tuple[int, dict[str, Any], str]] = self._run(work)

        def reload_then(result: tuple[int, dict[str, Any], str]) -> Deferred[Any] | Any:
            if op in ("list", "spaces", "digest") or result[2] == "absent":
                return result
            reloaded = maybeDeferred(self._reload, f"mesh route {result[2]}: {host}")
            reloaded.addErrback(
                lambda f: _log.error(
                    "mesh: route table reload after {host} failed: {e}",
                    host=host,
                    e=f.getErrorMessage(),
                )
            )
            return reloaded.addCallback(lambda _: result)

        def done(result: tuple[int, dict[str, Any], str]) -> None:
            code, body, outcome = result
            self._finish(request, still, op, outcome, code, body)

        def failed(failure: Failure) -> None:
            if failure.check(Refused):
                refused: Refused = failure.value  # type: ignore[assignment]
                self._finish(
                    request, still, op, refused.outcome, refused.code, {"error": str(refused)}
                )
                return
            if failure.check(Conflict):  # a local write raced ours: the row is not replicable
                self._finish(
                    request, still, op, "conflict", 409, {"error": failure.getErrorMessage()}
                )
                return
            _log.failure("mesh: {op} {host} failed", failure, op=op, host=host or "-")
            self._finish(request, still, op, "error", 500, _INTERNAL)

        d.addCallback(reload_then)
        d.addCallbacks(done, failed)
        return NOT_DONE_YET

    def _answer(
        self, request: Request, op: str, outcome: str, code: int, body: dict[str, Any] | bytes
    ) -> bytes:
        """Counts the call, sets the status and headers; the body's bytes (JSON as given)."""
        _calls.labels(op, outcome).inc()
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"cache-control", b"no-store")
        if isinstance(body, bytes):
            return body
        return json.dumps(body, sort_keys=True).encode() + b"\n"

    def _finish(
        self,
        request: Request,
        still: Callable[[], bool],
        op: str,
        outcome: str,
        code: int,
        body: dict[str, Any] | bytes,
    ) -> None:
        data = self._answer(request, op, outcome, code, body)
        if not still():  # the caller went away
            return
        request.setHeader(b"content-length", str(len(data)).encode())
        request.write(data)
        request.finish()


def _read_gen(request: Request) -> int | None:
    """A DELETE's ``?gen=``: the sender's tombstone generation (absent: an older peer)."""
    values = request.args.get(b"gen")
    if not values:
        return None
    raw = values[0].decode("ascii", "replace")
    if not raw.isdigit() or not 0 < int(raw) < 2**53:
        raise PayloadError("gen must be a positive integer below 2**53")
    return int(raw)


class _CappedRequest(Request):
    """Keeps at most :data:`MAX_BODY` bytes of a body (the rest is read and dropped) and says so."""

    too_large = False
    _received = 0

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > MAX_BODY:
            self.too_large = True
        self.content = BytesIO()

    def handleContentChunk(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > MAX_BODY:
            self.too_large = True
        if not self.too_large and self.content is not None:
            self.content.write(data)


def mesh_site(
    registry: Registry, cfg: BoxConfig, reload: Reload, **options: Unpack[Options]
) -> Site:
    """The mesh API as a Site, for the router to serve on its internal socket."""
    site = QuietSite(MeshAPI(registry, cfg, reload, **options))
    site.requestFactory = _CappedRequest
    return site
