"""Route replication, the calling side: push, tombstone and list routes on a mesh peer.

A peer's route-replication API (:mod:`lchat.mesh.api`) sits behind its ``LCHAT_MESH_SELF`` URL and
the shared bearer ``LCHAT_MESH_TOKEN``. Every call here is bounded by ``timeout`` (connect, request
and body together) and verifies HTTPS the way a browser does — the system's trust store, plus
``ca_file`` (``LCHAT_MESH_CA_FILE``) when given; there is no way to turn verification off.

:func:`route_payload` and :func:`elsewhere_payload` build the narrow payload that crosses the
wire (never a socket or database path: each box derives those locally), for the CLI's fan-out
and ``mesh-seed`` as for the API's own listing and the router's due pushes
(:mod:`lchat.mesh.due`); :func:`fan_out_targets` says which live peers must hold a route.
Each call takes the HTTP client to send with (``http``: treq's ``HTTPClient``, or
``treq.testing.StubTreq`` over a peer's real :class:`lchat.mesh.api.MeshAPI` in tests); by
default one of its own, verified as above.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Required, TypedDict, Unpack
from urllib.parse import urlsplit

import treq
from attrs import evolve
from treq.client import HTTPClient
from twisted.internet import error
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS
from twisted.web.iweb import IAgentEndpointFactory, IResponse
from zope.interface import implementer

from lchat import config, hosts
from lchat.mesh.members import Member
from lchat.mesh.placement import normalise_member_url
from lchat.mesh.witness import BEAT_PATH, MAX_MESSAGE, PeerCallError
from lchat.reactors import TCPReactor
from lchat.registry import Route
from lchat.twisted_internals import platform_trust_plus, quiet_pool, treq_reactor
from lchat.webutil import BytesProducer

ROUTE_PATH = "/api/mesh/route"
ROUTES_PATH = "/api/mesh/routes"
STATS_PATH = "/api/mesh/stats"  # GET <STATS_PATH>/<host>: a space's wake-free stats, local only
# lchat relocate run on another box: sleep a space here and hold it asleep, then lift the hold
HOLD_PATH = "/api/mesh/hold"
RELEASE_PATH = "/api/mesh/release"
WAKE_PATH = "/api/mesh/wake"  # POST <WAKE_PATH>/<host>: the readiness probe on that box
DIGEST_PATH = "/api/mesh/digest"  # {host: [settings gen, settings hash]} (lchat.mesh.sync)
REQUIRED_FIELDS = ("host", "kind", "version", "hibernate", "replication", "home_region", "env")
# Absent in the payloads of older peers, an optional field means "keep this box's value"
# (lchat.mesh.api). lives_at: present (non-empty) exactly on the "lives elsewhere" shape, with
# hibernate false: the space was flipped to always-on on the box at that URL, and peers forward
# to it.
# gen: the sender's settings generation (lchat.mesh.settings): absent from an older peer's
# payloads, and from a row that has none.
# bot_env: the replicable values of the space's ``<host>-bot.env`` (its bot sidecar's), present
# only when it has one: a payload without it means "no bot sidecar", so a peer removes its copy;
# an older peer refuses the field, and so a push of a space with a bot (never of one without).
# region_gen: the generation of the row's last home_region change (lchat.mesh.settings.region_newer),
# sent with gen (0: none since generations); absent from an older peer's payloads, whose home
# region then follows the whole row's order, as before.
OPTIONAL_FIELDS = ("next_due", "lives_at", "gen", "bot_env", "region_gen")
PAYLOAD_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS  # every field a payload may carry
MAX_NEXT_DUE = 2**53  # exclusive: unix seconds a JSON number carries exactly everywhere
MAX_GEN = 2**53  # exclusive: a settings generation (unix ms, Lamport-raised) a JSON number carries
# Who pushes (its LCHAT_MESH_SELF): the receiver takes an equal generation with other settings only
# from the host's owner by the hash (lchat.mesh.settings.newer). Authenticated by the bearer token.
SENDER_HEADER = "X-Lchat-Mesh-Sender"
# The env values a space needs to boot; the contract's own three are set by whichever box runs it.
ENV_KEY = re.compile(r"LCHAT_[A-Z0-9_]{1,64}")
RESERVED_ENV = frozenset({"LCHAT_HOST", "LCHAT_SOCKET", "LCHAT_DB"})
DEFAULT_TIMEOUT = 5.0
MAX_RESPONSE = 64 << 20  # a listing of many thousands of routes; anything bigger is not a peer


_log = Logger(namespace="lchat.mesh.client")


class MeshCallError(PeerCallError):
    """A call to a peer failed: unreachable, timed out, refused, or answered nonsense."""


def replicable_env(values: Mapping[str, str]) -> dict[str, str]:
    """The entries of a space's env file that replicate: ``LCHAT_*`` names but the contract's
    ``LCHAT_HOST``/``LCHAT_SOCKET``/``LCHAT_DB`` (an operator's other lines stay on the box)."""
    return {
        k: v for k, v in sorted(values.items()) if ENV_KEY.fullmatch(k) and k not in RESERVED_ENV
    }


def read_route_env(data_dir: str, host: str) -> dict[str, str]:
    """The replicable values of ``<data>/<host>.env``; ``{}`` when the file is missing.

    Raises :class:`lchat.config.ConfigError` when it exists but cannot be read or parsed."""
    return replicable_env(config.read_env_file(hosts.env_path(data_dir, host)))


def read_bot_env(data_dir: str, host: str) -> dict[str, str]:
    """The replicable values of ``<data>/<host>-bot.env`` (a staged bot sidecar's); ``{}`` when
    the space has none. Raises :class:`lchat.config.ConfigError` as :func:`read_route_env`."""
    return replicable_env(config.read_env_file(hosts.bot_env_path(data_dir, host)))


def route_payload(
    route: Route,
    env: Mapping[str, str],
    *,
    next_due: int | None = None,
    bot_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The narrow payload of ``POST /api/mesh/route`` for ``route`` with its env values (and
    ``bot_env``, its bot sidecar's, carried only when not empty: never on a lives-elsewhere row).

    ``next_due`` (unix seconds, 0: none) is carried when given — the router's due pushes give it,
    0 included, to clear a due time a wake honoured — and otherwise only when the row has one: a
    payload without it leaves the peer's value alone, so a create, ``mesh-seed`` or a listing can
    add a due time a peer missed but never erase one (a wake too many, never a reminder lost), and
    a peer running an older lchat (which refuses unknown fields) still takes the rows with none.
    """
    payload: dict[str, Any] = {
        "host": route.host,
        "kind": route.kind,
        "version": route.version,
        "hibernate": route.hibernate,
        "replication": route.replication,
        "home_region": route.home_region,
        "env": replicable_env(env),
    }
    if route.elsewhere:
        payload["lives_at"] = route.lives_at  # a peer's listing of its lives-elsewhere rows
    else:
        due = route.next_due if next_due is None else next_due
        if next_due is not None or due > 0:
            payload["next_due"] = due
        if bot_env:
            payload["bot_env"] = replicable_env(bot_env)
    if route.settings_gen > 0:  # a row from before settings generations has none to send
        payload["gen"] = route.settings_gen
        payload["region_gen"] = route.region_gen
    return payload


def elsewhere_payload(route: Route, self_url: str) -> dict[str, Any]:
    """The "lives elsewhere" shape of ``route``, an always-on instance on the box ``self_url``
    (its ``LCHAT_MESH_SELF``): ``hibernate`` false, ``lives_at`` the normalised URL, no env
    values (a peer never runs it) and no ``next_due``. A peer holding it forwards every request
    for the host to that box and never wakes it (docs/mesh.md, Hibernate flips)."""
    if route.kind != "instance" or route.hibernate or route.elsewhere:
        raise ValueError(f"{route.host}: only an always-on instance of this box lives elsewhere")
    return route_payload(evolve(route, lives_at=normalise_member_url(self_url)), {})


def fan_out_targets(
    mesh: config.MeshConfig, host: str, home_region: str, members: Sequence[Member]
) -> list[Member]:
    """The live peers that must hold ``host``'s route: every one when the host is under the mesh
    domains (the boxes share them), plus those whose region is the route's ``home_region``.
    Sorted by URL; never this box. Pure: the CLI's fan-out and the router's due pushes share it."""
    me = normalise_member_url(mesh.self_url)
    covered = any(hosts.covers(domain, host) for domain in mesh.domains)
    targets: dict[str, Member] = {}
    for member in members:
        if member.self or member.url == me:
            continue
        if covered or (home_region and member.region == home_region):
            targets.setdefault(member.url, member)
    return [targets[url] for url in sorted(targets)]


def check_peer_url(peer_url: str) -> str:
    """``http(s)://host[:port]`` with no path: a peer's ``LCHAT_MESH_SELF``. ValueError if not."""
    parts = urlsplit(peer_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{peer_url!r} is not an http(s) URL with a host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{peer_url!r} must be a base URL (no path, query or credentials)")
    try:
        parts.port  # noqa: B018 -- raises on a malformed port
    except ValueError as e:
        raise ValueError(f"{peer_url!r}: {e}") from e
    return peer_url.rstrip("/")


class CallOptions(TypedDict, total=False):
    """The keyword arguments of every call to a peer's route-replication API."""

    ca_file: str  # LCHAT_MESH_CA_FILE, trusted besides the system's store ("": none)
    timeout: float  # seconds for connect, request and body together (DEFAULT_TIMEOUT)
    reactor: Required[TCPReactor]  # the caller's: the router's, or the CLI's own
    http: HTTPClient | None  # the client to send with (tests: treq.testing.StubTreq)


async def push_route(
    peer_url: str,
    token: str,
    payload: Mapping[str, Any],
    *,
    sender: str = "",
    **options: Unpack[CallOptions],
) -> dict[str, Any]:
    """``POST /api/mesh/route``: create or update the route on the peer. Returns its answer
    (``{"host": ..., "result": "created" | "updated" | "stale"}``: stale, with the peer's
    ``gen``, when the peer holds newer settings and wrote nothing); raises
    :class:`MeshCallError`. ``sender``: this box's ``LCHAT_MESH_SELF`` (:data:`SENDER_HEADER`).

    A peer running an older lchat refuses the optional fields it does not know (400 ``unknown
    fields: gen, bot_env``: from before settings generations, or before the bot's env
    travelled): the push is retried once without those it names, and logged; any other field
    it refuses is an error."""
    body = json.dumps(dict(payload), sort_keys=True).encode()
    extra = {SENDER_HEADER: sender} if sender else {}
    try:
        _, answer = await _call("POST", peer_url, ROUTE_PATH, token, options, body, extra)
    except MeshCallError as e:
        unknown = _refused_optional_fields(e, payload)
        if not unknown:
            raise
        _log.warn(
            "mesh: {peer} does not know {fields} (an older lchat): pushing {host} to it "
            "without {them} (upgrade it: until then it may keep older settings)",
            peer=peer_url,
            fields=", ".join(unknown),
            them="them" if len(unknown) > 1 else "it",
            host=payload.get("host", "-"),
        )
        older = {k: v for k, v in payload.items() if k not in unknown}
        body = json.dumps(older, sort_keys=True).encode()
        _, answer = await _call("POST", peer_url, ROUTE_PATH, token, options, body, extra)
    return answer


def _refused_optional_fields(error: MeshCallError, payload: Mapping[str, Any]) -> list[str]:
    """The optional fields of ``payload`` a peer's 400 ``unknown fields: a, b`` names (an older
    lchat's parse: lchat.mesh.route_payload); [] when it names anything else, or is no such
    refusal (then there is nothing to retry without)."""
    said = str(error)
    if error.status != 400 or "unknown fields: " not in said:
        return []
    named = said.split("unknown fields: ", 1)[1].split(")", 1)[0]
    names = [n.strip().strip("'\"") for n in named.split(",")]
    if not names or any(n not in OPTIONAL_FIELDS or n not in payload for n in names):
        return []
    return names


async def delete_route(
    peer_url: str, token: str, host: str, gen: int | None = None, **options: Unpack[CallOptions]
) -> bool:
    """``DELETE /api/mesh/route/{host}``: tombstone the route on the peer (``gen``: the
    tombstone's generation, which the peer keeps). True when the peer had a row to delete, False
    when it had none (or a newer one); raises :class:`MeshCallError`."""
    path = f"{ROUTE_PATH}/{hosts.normalise(host)}" + ("" if gen is None else f"?gen={gen}")
    status, answer = await _call("DELETE", peer_url, path, token, options)
    deleted = answer.get("deleted")
    if not isinstance(deleted, bool):
        raise MeshCallError(peer_url, "the answer to DELETE has no 'deleted' flag", status)
    return deleted


async def list_routes(
    peer_url: str, token: str, **options: Unpack[CallOptions]
) -> list[dict[str, Any]]:
    """``GET /api/mesh/routes``: the peer's in-scope hibernating routes, as payloads."""
    status, answer = await _call("GET", peer_url, ROUTES_PATH, token, options)
    routes = answer.get("routes")
    if not isinstance(routes, list) or not all(
        isinstance(r, dict) and isinstance(r.get("host"), str) for r in routes
    ):
        raise MeshCallError(peer_url, "the listing is not a list of routes", status)
    return routes


async def get_json(
    peer_url: str, token: str, path: str, **options: Unpack[CallOptions]
) -> dict[str, Any]:
    """``GET path`` on the peer's mesh API (``lchat fleet``'s ``/api/mesh/spaces``): its answer,
    a JSON object; raises :class:`MeshCallError` (no answer in time, not 2xx, not an object).
    ``MeshCallError.status`` is None exactly when no HTTP answer came at all."""
    _, answer = await _call("GET", peer_url, path, token, options)
    return answer


async def ask_stats(
    peer_url: str, token: str, host: str, **options: Unpack[CallOptions]
) -> tuple[int, dict[str, Any]]:
    """``GET /api/mesh/stats/{host}``: the peer's own wake-free stats of ``host``
    (lchat.spacestats), whatever its status: (status, its JSON object; ``{}`` when the answer
    was not one). A 404 without a ``reason`` is a peer that has no such endpoint (an older
    lchat). Raises :class:`MeshCallError` only when no HTTP answer came in time."""
    return await _ask_host("GET", STATS_PATH, peer_url, token, host, **options)


async def ask_wake(
    peer_url: str, token: str, host: str, **options: Unpack[CallOptions]
) -> tuple[int, dict[str, Any]]:
    """``POST /api/mesh/wake/{host}``: the peer's own readiness probe of ``host``
    (lchat.readiness), as :func:`ask_stats` answers (a 404 without ``reason``: an older lchat).
    The timeout must cover a cold wake."""
    return await _ask_host("POST", WAKE_PATH, peer_url, token, host, **options)


async def _ask_host(
    method: str, base: str, peer_url: str, token: str, host: str, **options: Unpack[CallOptions]
) -> tuple[int, dict[str, Any]]:
    body = b"" if method == "POST" else None
    return await _ask(method, peer_url, f"{base}/{hosts.normalise(host)}", token, body, options)


async def hold_space(
    peer_url: str, token: str, host: str, seconds: float, **options: Unpack[CallOptions]
) -> tuple[int, dict[str, Any]]:
    """``POST /api/mesh/hold`` ``{"host", "seconds"}``: the peer sleeps ``host`` (its final
    replica flushed, its lease released) and keeps it from waking there for ``seconds`` or until
    :func:`release_space`. Answered once it is asleep, so ``timeout`` must outlast a sleep.
    (status, its JSON object; ``{}`` when the answer was not one), whatever the status: a 404
    without a ``reason`` is a peer without the call (an older lchat). Raises
    :class:`MeshCallError` only when no HTTP answer came in time (the hold may still have been
    placed: it ends by itself)."""
    body = json.dumps({"host": hosts.normalise(host), "seconds": seconds}).encode()
    return await _ask("POST", peer_url, HOLD_PATH, token, body, options)


async def release_space(
    peer_url: str, token: str, host: str, **options: Unpack[CallOptions]
) -> tuple[int, dict[str, Any]]:
    """``POST /api/mesh/release`` ``{"host"}``: lift the hold :func:`hold_space` put on the
    peer (200 ``{"host", "released": bool}``); as :func:`hold_space` for the rest."""
    body = json.dumps({"host": hosts.normalise(host)}).encode()
    return await _ask("POST", peer_url, RELEASE_PATH, token, body, options)


async def _ask(
    method: str, peer_url: str, path: str, token: str, body: bytes | None, options: CallOptions
) -> tuple[int, dict[str, Any]]:
    """One call whose every status is an answer: (status, the answer's JSON object or ``{}``);
    :class:`MeshCallError` only when no answer came in time."""
    code, parsed = await _request(method, peer_url, path, token, options, body, None, MAX_MESSAGE)
    return code, parsed if isinstance(parsed, dict) else {}


async def settings_digest(
    peer_url: str, token: str, **options: Unpack[CallOptions]
) -> dict[str, tuple[int, str]]:
    """``GET /api/mesh/digest``: the peer's ``{host: (settings gen, settings hash)}``; raises
    :class:`MeshCallError` (an answer of any other shape too)."""
    status, answer = await _call("GET", peer_url, DIGEST_PATH, token, options)
    return _digest_rows(peer_url, status, answer)


async def settings_digest_and_tombstones(
    peer_url: str, token: str, **options: Unpack[CallOptions]
) -> tuple[dict[str, tuple[int, str]], dict[str, int], dict[str, int]]:
    """``GET /api/mesh/digest?tombstones=1``: the peer's rows (as :func:`settings_digest`), its
    tombstones ``{host: gen}`` and its rows' home-region generations ``{host: region_gen}`` (the
    rows whose region changed since generations; lchat.mesh.settings.region_newer); an older
    peer, which ignores the query and answers the rows alone, has neither (one from before
    home-region generations: no regions). Raises :class:`MeshCallError` (an answer of any other
    shape too)."""
    status, answer = await _call("GET", peer_url, DIGEST_PATH + "?tombstones=1", token, options)
    rows, buried = answer.get("rows"), answer.get("tombstones")
    if not isinstance(rows, dict) or not isinstance(buried, dict):
        return _digest_rows(peer_url, status, answer), {}, {}  # an older peer: no host is "rows"
    tombstones = _digest_gens(peer_url, status, buried, "tombstone", 1)
    regions = _digest_gens(peer_url, status, answer.get("regions", {}), "region generation", 0)
    return _digest_rows(peer_url, status, rows), tombstones, regions


def _digest_gens(
    peer_url: str, status: int, found: object, what: str, least: int
) -> dict[str, int]:
    """A digest's ``{host: generation}`` map (each at least ``least``)."""
    if not isinstance(found, dict):
        raise MeshCallError(peer_url, f"the digest's {what}s are malformed", status)
    gens: dict[str, int] = {}
    for host, gen in found.items():
        if not isinstance(gen, int) or isinstance(gen, bool) or not least <= gen < 2**63:
            raise MeshCallError(
                peer_url, f"the digest's {what} of {host[:80]!r} is malformed", status
            )
        gens[host] = gen
    return gens


def _digest_rows(peer_url: str, status: int, answer: dict[str, Any]) -> dict[str, tuple[int, str]]:
    digest: dict[str, tuple[int, str]] = {}
    for host, value in answer.items():
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[0], int)
            or isinstance(value[0], bool)
            or not isinstance(value[1], str)
        ):
            raise MeshCallError(
                peer_url, f"the digest's entry for {host[:80]!r} is malformed", status
            )
        digest[host] = (value[0], value[1])
    return digest


async def fetch_route(
    peer_url: str, token: str, host: str, **options: Unpack[CallOptions]
) -> dict[str, Any] | None:
    """``GET /api/mesh/routes?host=``: the peer's row of ``host`` as a payload, or None when it
    holds none; raises :class:`MeshCallError`."""
    path = f"{ROUTES_PATH}?host={hosts.normalise(host)}"
    status, answer = await _call("GET", peer_url, path, token, options)
    routes = answer.get("routes")
    if not isinstance(routes, list) or not all(isinstance(r, dict) for r in routes):
        raise MeshCallError(peer_url, "the listing is not a list of routes", status)
    found = [r for r in routes if r.get("host") == host]
    return found[0] if found else None


class PeerBeats:
    """The witness's channel (lchat.mesh.witness.PeerChannel): ``POST /api/mesh/beat`` on a
    peer, with the mesh token, verified HTTPS as every mesh call, over kept-alive connections (a
    box beats each peer every heartbeat, and several times a second while a write waits for the
    peers to know of a backlog)."""

    def __init__(self, reactor: TCPReactor, token: str, ca_file: str = "") -> None:
        self._reactor = reactor
        self._token = token
        self._ca_file = ca_file
        self._agents: dict[float, Agent] = {}
        self._pools: list[Any] = []

    def _agent(self, timeout: float) -> Agent:
        agent = self._agents.get(timeout)
        if agent is None:
            pool = quiet_pool(IReactorTime(self._reactor), persistent=True)
            self._pools.append(pool)
            agent = self._agents[timeout] = _agent(self._reactor, self._ca_file, timeout, pool)
        return agent

    def close(self) -> Deferred[Any]:
        """Close the kept-alive connections (the router's stop)."""
        pools, self._pools, self._agents = self._pools, [], {}
        return DeferredList([p.closeCachedConnections() for p in pools], consumeErrors=True)

    async def call(
        self,
        url: str,
        body: bytes,
        timeout: float,  # noqa: ASYNC109 -- Twisted: enforced with addTimeout
    ) -> bytes:
        try:
            target = check_peer_url(url) + BEAT_PATH
        except ValueError as e:
            raise PeerCallError(url, str(e)) from e
        client = HTTPClient(self._agent(timeout), data_to_body_producer=BytesProducer)
        headers: dict[bytes | str, bytes | str] = {
            "Authorization": f"Bearer {self._token}",
            "Content-Type": "application/json",
        }
        try:
            code, data = await _exchange(
                client,
                "POST",
                target,
                headers,
                body,
                reactor=self._reactor,
                timeout=timeout,
                limit=MAX_MESSAGE,
                fail=lambda what: PeerCallError(url, what),
            )
        except PeerCallError as e:
            e.refused = isinstance(e.__cause__, error.ConnectionRefusedError)
            raise
        if not 200 <= code < 300:
            raise PeerCallError(url, f"answered {code}", code)
        return data


# --- HTTP ---------------------------------------------------------------------------------------


@implementer(IStreamClientEndpoint)
class _TLSEndpoint:
    """``wrapClientTLS`` with the TLS layer's timers on *our* reactor: by default they use the
    global one, which the CLI's own reactor never runs (the handshake would never be written)."""

    def __init__(self, clock: IReactorTime, creator: Any, tcp: IStreamClientEndpoint) -> None:
        self._clock = clock
        self._creator = creator
        self._tcp = tcp

    def connect(self, factory: Any) -> Deferred[Any]:
        tls = TLSMemoryBIOFactory(self._creator, True, factory, clock=self._clock)
        d: Deferred[Any] = self._tcp.connect(tls)
        return d.addCallback(lambda protocol: protocol.wrappedProtocol)


@implementer(IAgentEndpointFactory)
class _Endpoints:
    def __init__(
        self, reactor: TCPReactor, policy: BrowserLikePolicyForHTTPS, timeout: float
    ) -> None:
        self._reactor = reactor
        self._policy = policy
        self._timeout = timeout

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        host = uri.host.decode("ascii")
        tcp = HostnameEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        if uri.scheme != b"https":
            return tcp
        creator = self._policy.creatorForNetloc(uri.host, uri.port)
        return _TLSEndpoint(IReactorTime(self._reactor), creator, tcp)


def _agent(reactor: TCPReactor, ca_file: str, timeout: float, pool: Any = None) -> Agent:
    """Verified HTTPS (the system's trust store, plus ``ca_file``), connecting within
    ``timeout``; a connection per call unless given a ``pool``."""
    trust = platform_trust_plus(ca_file) if ca_file else None
    return Agent.usingEndpointFactory(
        reactor,
        _Endpoints(reactor, BrowserLikePolicyForHTTPS(trustRoot=trust), timeout),
        pool=pool if pool is not None else quiet_pool(IReactorTime(reactor), persistent=False),
    )


async def _call(
    method: str,
    peer_url: str,
    path: str,
    token: str,
    options: CallOptions,
    body: bytes | None = None,
    extra: Mapping[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One call to a peer's mesh API: its status and its answer, a JSON object (anything else,
    and any status but 2xx, is :class:`MeshCallError`)."""
    code, parsed = await _request(method, peer_url, path, token, options, body, extra, MAX_RESPONSE)
    answer = parsed if isinstance(parsed, dict) else {}
    if not 200 <= code < 300:
        error = answer.get("error") if isinstance(answer.get("error"), str) else ""
        raise MeshCallError(peer_url, f"answered {code}{': ' + error if error else ''}", code)
    if not isinstance(parsed, dict):
        raise MeshCallError(peer_url, "the answer is not a JSON object", code)
    return code, answer


async def _request(
    method: str,
    peer_url: str,
    path: str,
    token: str,
    options: CallOptions,
    body: bytes | None,
    extra: Mapping[str, str] | None,
    limit: int,
) -> tuple[int, object]:
    """One request with the mesh token: its status and its decoded JSON (None when the answer
    was not JSON); :class:`MeshCallError` when no answer came in time. A non-empty ``body`` is
    JSON."""
    reactor = options["reactor"]
    timeout = options.get("timeout", DEFAULT_TIMEOUT)
    try:
        url = check_peer_url(peer_url) + path
    except ValueError as e:
        raise MeshCallError(peer_url, str(e)) from e
    headers: dict[bytes | str, bytes | str] = {
        "Authorization": f"Bearer {token}",
        "Accept": "application/json",
    }
    if body:
        headers["Content-Type"] = "application/json"
    headers.update(extra or {})
    # Bodies are written at once, not through treq's default producer: that one is paced by the
    # global cooperator, which the CLI's own reactor never runs.
    client = options.get("http") or HTTPClient(
        _agent(reactor, options.get("ca_file", ""), timeout), data_to_body_producer=BytesProducer
    )
    code, raw = await _exchange(
        client,
        method,
        url,
        headers,
        body,
        reactor=reactor,
        timeout=timeout,
        limit=limit,
        fail=lambda what: MeshCallError(peer_url, f"{method} {path}: {what}"),
    )
    try:
        return code, json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        return code, None


async def _exchange(
    client: HTTPClient,
    method: str,
    url: str,
    headers: dict[bytes | str, bytes | str],
    body: bytes | None,
    *,
    reactor: TCPReactor,
    timeout: float,  # noqa: ASYNC109 -- Twisted: enforced with addTimeout
    limit: int,
    fail: Callable[[str], Exception],
) -> tuple[int, bytes]:
    """One request and its whole answer (status, body): no redirect followed (it would carry
    the bearer token elsewhere), at most ``limit`` bytes, within ``timeout``; any failure is
    ``fail(what happened)``."""
    clock = IReactorTime(reactor)

    async def exchange() -> tuple[int, bytes]:
        response: IResponse = await client.request(
            method,
            url,
            headers=headers,
            data=body,
            allow_redirects=False,
            reactor=treq_reactor(clock),
        )
        chunks: list[bytes] = []
        size = 0

        def collect(data: bytes) -> None:
            nonlocal size
            size += len(data)
            if size > limit:
                raise fail(f"the answer is larger than {limit} bytes")
            chunks.append(data)

        await treq.collect(response, collect)
        return response.code, b"".join(chunks)

    d: Deferred[tuple[int, bytes]] = Deferred.fromCoroutine(exchange())

    def timed_out(result: object, seconds: float) -> tuple[int, bytes]:
        # Whatever the cancellation turned into on its way out (ResponseNeverReceived, ...).
        raise fail(f"no answer within {seconds:g}s")

    d.addTimeout(timeout, clock, onTimeoutCancel=timed_out)
    try:
        return await d
    except PeerCallError:  # MeshCallError too
        raise
    except Exception as e:
        raise fail(_describe(e)) from e


def _describe(e: BaseException) -> str:
    reasons = getattr(e, "reasons", None)  # ResponseNeverReceived, RequestTransmissionFailed
    if reasons:
        return "; ".join(f.getErrorMessage() for f in reasons)
    return str(e) or type(e).__name__
