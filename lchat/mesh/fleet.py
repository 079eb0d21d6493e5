"""Fleet status (docs/operations.md, "Fleet status"): every mesh box's spaces, each counted once.

Every router serves ``GET /api/mesh/spaces`` (:data:`SPACES_PATH`) on its mesh API (bearer
``LCHAT_MESH_TOKEN``, :mod:`lchat.mesh.api`): the spaces *this box reports*, and ``lchat fleet``
(:mod:`lchat.cli.fleet`) asks every live member for its list and prints the union.

The ownership rule (:func:`reporter`), the same on every box, so that the union over the boxes
counts every space exactly once while they agree on the membership view:

- an always-on instance (``hibernate`` off, not a "lives elsewhere" row) is reported by the box
  that runs it, the only one with that row (its peers hold a lives-elsewhere row naming it,
  which they never report);
- a hibernating instance in the mesh's placement scope (under ``LCHAT_MESH_DOMAINS``, or with a
  ``home_region``) is reported by its owner by rendezvous hashing over the live members
  (:func:`lchat.mesh.placement.owner`, the rule of due wakes and of ``lchat mesh``), whatever box
  it happens to be awake on; with no live member at all, by the box itself;
- any other hibernating instance lives on this box alone and is reported here;
- services are not spaces, and are never reported.

A space awake on a box that does not own it (it stays where it woke until it sleeps, after a
membership change) would look asleep in its owner's list: its holder lists it under
``visiting`` (host, state, times, lag, owner), which the aggregation (:func:`aggregate`) lays over
the owner's row. Visiting entries are never counted by themselves, so the count stays exact.

Answer of ``GET /api/mesh/spaces`` (200, JSON)::

    {"box": "https://box-1.example.net", "region": "ie", "lchat": "0.1.0",
     "generated_at": 1789000000.0, "members": ["https://box-1.example.net", ...],
     "default_version": "1.4.0",
     "spaces": [{"host": "a.chat.example.com", "state": "awake", "version": "1.4.0",
                 "awake_since": 1788990000, "next_due": null, "lag": 0.2, "process": null,
                 "home_region": "", "floor": "1.4.0"}, ...],
     "visiting": [{... the same fields ..., "owner": "https://box-2.example.net"}, ...]}

``settings`` (issue 32; absent from an older box's answer): for *every* in-scope space this box
holds a row of (not only those it reports), ``{host: {"gen", "hash", "replication",
"home_region", "env_keys"}}``: its settings generation and the first 8 hex digits of its hash
(:mod:`lchat.mesh.settings`), and the *names* of the replicable env values (never a value).
``lchat fleet`` compares the boxes' entries: a box whose generation or hash differs from the
newest is *diverged* (:attr:`Fleet.divergence`).

``state`` is the activator's (``asleep``, ``waking``, ``awake``, ``stopping``) for a hibernating
space and ``always-on`` for the others (``process``: their supervisor's state when the router
runs them itself, ``ready``, ``starting``, ``backoff``, ``failed``...; null under systemd).
``version``: the build ``<LCHAT_OPT_DIR>/live/<host>`` points into
(:meth:`lchat.builds.BuildLayout.version_of`), null when it has none; ``default_version``, the
box's own ``live/_default`` (what a fleet rollout sets), the same. ``awake_since``:
unix seconds, null unless awake (always-on: ready). ``next_due``: unix seconds, null when none.
``floor``: the space's build floor as this box last held it to at a wake (the version of its
``<data>/woke/<host>.json``, :func:`lchat.builds.read_wake`: a wake runs the floor's build or
raises the floor to its own, so the two agree after every wake here), null when it never woke here
on a versioned build, or for an always-on space. Never a GET of the bucket's ``build.json``: one
per space is too many for a fleet of thousands; a visiting entry carries its holder's, the fresher.
``lag``: seconds since the oldest commit not yet in the bucket (the hibernation replica of an
awake space, the fleet backup's of an always-on one), null when nothing replicates it here (an
asleep space was flushed when it slept). ``members``: the live view the ownership was computed
from, so that the caller can tell when boxes disagree.
"""

from __future__ import annotations

import collections
import datetime
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs
from attrs import frozen

import lchat
from lchat import hosts
from lchat.builds import DEFAULT_LINK, DEFAULT_OPT_DIR, BuildLayout, read_wake
from lchat.config import BoxConfig, ConfigError
from lchat.mesh import placement
from lchat.mesh.client import ENV_KEY, read_route_env
from lchat.mesh.route_payload import MAX_ENV_KEYS
from lchat.registry import Route

SPACES_PATH = "/api/mesh/spaces"
SCHEMA = 1  # of the published document (publishable)
ALWAYS_ON = "always-on"
MAX_STATE = 32  # a peer's state or process label longer than this is not one
MAX_VERSION = 64  # BuildLayout's version names are at most 64 characters
REGION_UNSET = "default"  # the published key of members without LCHAT_MESH_REGION
SETTINGS_HASH = 8  # hex digits of a settings hash an answer carries (lchat.mesh.settings.SHORT)
_HEX = re.compile(r"[0-9a-f]{0,8}")

Outcome = Literal["ok", "unreachable", "error"]


def opt_dir(file_env: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str:
    """``LCHAT_OPT_DIR`` (the process environment wins over the env file, as for every setting),
    else ``/opt/lchat``."""
    environ = os.environ if environ is None else environ
    value = (environ.get("LCHAT_OPT_DIR") or file_env.get("LCHAT_OPT_DIR") or "").strip()
    return value or DEFAULT_OPT_DIR


# --- the ownership rule (pure) ------------------------------------------------------------------


def reporter(
    route: Route, me: str, live: Sequence[placement.Candidate], domains: Sequence[str]
) -> str | None:
    """The normalised URL of the box that reports ``route`` under the rule in the module
    docstring, as ``me`` (this box's normalised URL) sees it with the live members ``live``;
    None when the row is no space to report (a service, or a peer's always-on space)."""
    if route.kind != "instance" or route.elsewhere:
        return None
    if not route.hibernate or not (route.home_region or placement.in_scope(route.host, domains)):
        return me
    chosen = placement.owner(route.host, live, route.home_region)
    return placement.normalise_member_url(chosen.url) if chosen is not None else me


# --- the serving side ---------------------------------------------------------------------------


@frozen
class _Held:
    """What the activator says of a hibernating space it holds (waking, awake or stopping)."""

    state: str
    since: float  # unix seconds it entered ``state``
    lag: float | None
    lost: bool  # standing down: its lease went to another box


class SpacesView:
    """The answer of ``GET /api/mesh/spaces`` on one router (see the module docstring).

    :meth:`snapshot` runs on the reactor and copies what the activator, the membership, the
    supervisor and the backup know (none of them is thread-safe); the function it returns runs in
    a worker thread and adds what needs the disk (each space's live link). Reads only."""

    def __init__(
        self,
        clock: Callable[[], float],  # unix seconds: the reactor's
        cfg: BoxConfig,
        table: Callable[[], Iterable[Route]],  # the router's current route table
        activator: Any,  # lchat.hibernation.activator.Activator: status(), lease_lost(host)
        live: Callable[[], Sequence[placement.Candidate]],  # Membership.live
        *,
        children: Callable[[], Mapping[str, Any]] | None = None,  # Supervisor.status (builtin)
        backup: Callable[[], Mapping[str, Any]] | None = None,  # Backup.status (fleet backup)
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if cfg.mesh is None:
            raise ValueError("fleet status needs the mesh (LCHAT_MESH_SELF)")
        self._clock = clock
        self._me = placement.normalise_member_url(cfg.mesh.self_url)
        self._region = cfg.mesh.region
        self._domains = cfg.mesh.domains
        self._table = table
        self._activator = activator
        self._live = live
        self._children = children
        self._backup = backup
        self._layout = BuildLayout(opt_dir(cfg.file_env, environ))
        self._data_dir = cfg.data_dir

    def snapshot(self) -> Callable[[], dict[str, Any]]:
        """On the reactor: copy the state; returns the (blocking) rest, for a worker thread."""
        now = self._clock()
        routes = list(self._table())
        live = list(self._live())
        held: dict[str, _Held] = {}
        for host, entry in self._activator.status().items():
            since = now - (_optional_number(entry.get("for")) or 0.0)
            held[host] = _Held(
                state=str(entry.get("state") or "awake"),
                since=since,
                lag=_optional_number(entry.get("lag")),
                lost=bool(self._activator.lease_lost(host)),
            )
        children = self._children() if self._children is not None else {}
        # host -> its always-on process's state, and since when (reactor seconds)
        running = {host: (str(c.state), float(c.since)) for host, c in children.items()}
        backup_lag = _backup_lags(self._backup() if self._backup is not None else {})

        def finish() -> dict[str, Any]:
            spaces: list[dict[str, Any]] = []
            visiting: list[dict[str, Any]] = []
            for route in sorted(routes, key=lambda r: r.host):
                owner = reporter(route, self._me, live, self._domains)
                if owner is None:
                    continue
                here = held.get(route.host)
                if owner == self._me:
                    spaces.append(self._entry(route, now, here, running, backup_lag))
                elif route.hibernate and here is not None and not here.lost:
                    visiting.append(
                        self._entry(route, now, here, running, backup_lag) | {"owner": owner}
                    )
            return {
                "box": self._me,
                "region": self._region,
                "lchat": lchat.__version__,
                "generated_at": round(now, 3),
                "members": sorted(placement.normalise_member_url(m.url) for m in live),
                "default_version": self._layout.version_of(DEFAULT_LINK),
                "spaces": spaces,
                "visiting": visiting,
                "settings": self._settings(routes),
            }

        return finish

    def _settings(self, routes: Iterable[Route]) -> dict[str, dict[str, Any]]:
        """The ``settings`` map of the module docstring, in the worker thread (env files)."""
        held: dict[str, dict[str, Any]] = {}
        for route in sorted(routes, key=lambda r: r.host):
            if route.kind != "instance" or not (
                route.home_region or placement.in_scope(route.host, self._domains)
            ):
                continue
            keys: list[str] = []
            if route.hibernate and not route.elsewhere:
                try:
                    keys = sorted(read_route_env(self._data_dir, route.host))
                except (ConfigError, hosts.InvalidHost):
                    keys = []  # unreadable here: its hash still tells whether it diverged
            held[route.host] = {
                "gen": route.settings_gen,
                "hash": route.settings_hash[:SETTINGS_HASH],
                "replication": route.replication,
                "home_region": route.home_region,
                "env_keys": keys,
            }
        return held

    def _entry(
        self,
        route: Route,
        now: float,
        here: _Held | None,
        running: Mapping[str, tuple[str, float]],
        backup_lag: Mapping[str, float],
    ) -> dict[str, Any]:
        process: str | None = None
        awake_since: float | None = None
        lag: float | None = None
        if route.hibernate:
            state = here.state if here is not None else "asleep"
            if here is not None:
                lag = here.lag
                if state == "awake":
                    awake_since = here.since
        else:
            state = ALWAYS_ON
            if route.host in running:
                process, since = running[route.host]
                if process == "ready":
                    awake_since = since
            lag = backup_lag.get(route.host)
        return {
            "host": route.host,
            "state": state,
            "version": self._layout.version_of(route.host),
            "awake_since": int(awake_since) if awake_since is not None else None,
            "next_due": route.next_due if route.hibernate and route.next_due > 0 else None,
            "lag": round(lag, 3) if lag is not None else None,
            "process": process,
            "home_region": route.home_region,
            "floor": self._floor(route),
        }

    def _floor(self, route: Route) -> str | None:
        """The ``floor`` of the module docstring (a small local file, in the worker thread)."""
        if not route.hibernate:
            return None
        wake = read_wake(self._data_dir, route.host)
        return wake.version if wake is not None else None


def _backup_lags(status: Mapping[str, Any]) -> dict[str, float]:
    """host -> the largest lag of its databases in the fleet backup's ``status()``."""
    lags: dict[str, float] = {}
    databases = status.get("databases")
    if not isinstance(databases, Mapping):
        return lags
    for entry in databases.values():
        if not isinstance(entry, Mapping):
            continue
        host, lag = entry.get("host"), _optional_number(entry.get("lag"))
        if isinstance(host, str) and lag is not None:
            lags[host] = max(lag, lags.get(host, 0.0))
    return lags


def _optional_number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


# --- the calling side: parsing a peer's answer --------------------------------------------------


class BadAnswer(ValueError):
    """A peer's ``GET /api/mesh/spaces`` answer that is not one; the message says what is off."""


@frozen
class Space:
    """One space as one box reported it (``owner``: set on a visiting entry only)."""

    host: str
    state: str
    version: str | None = None
    awake_since: int | None = None
    next_due: int | None = None
    lag: float | None = None
    process: str | None = None
    home_region: str = ""
    owner: str = ""
    floor: str | None = None  # its build floor as the reporting box last woke it (absent: older)


@frozen
class HeldSettings:
    """A space's settings as one box holds them (the ``settings`` map of the answer)."""

    gen: int
    hash: str  # the first SETTINGS_HASH hex digits ('' when the row has none yet)
    replication: str = ""
    home_region: str = ""
    env_keys: tuple[str, ...] = ()  # names only, never values


@frozen
class BoxAnswer:
    """A member's answer, checked."""

    box: str
    region: str
    members: tuple[str, ...]
    spaces: tuple[Space, ...]
    visiting: tuple[Space, ...]
    default_version: str | None = None  # its live/_default build (absent from an older lchat)
    settings: Mapping[str, HeldSettings] = attrs.field(factory=dict)


def parse_answer(body: object) -> BoxAnswer:
    """Check a decoded answer field by field (hostile peers included); :class:`BadAnswer`."""
    if not isinstance(body, dict):
        raise BadAnswer("the answer is not a JSON object")
    box = _member(body.get("box"), "box")
    region = body.get("region", "")
    if not isinstance(region, str) or len(region) > 64:
        raise BadAnswer("region is not a short string")
    members = body.get("members")
    if not isinstance(members, list):
        raise BadAnswer("members is not a list")
    spaces = body.get("spaces")
    visiting = body.get("visiting", [])
    if not isinstance(spaces, list) or not isinstance(visiting, list):
        raise BadAnswer("spaces and visiting must be lists")
    return BoxAnswer(
        box=box,
        region=region,
        members=tuple(_member(m, "members") for m in members),
        spaces=tuple(_space(s, visiting=False) for s in spaces),
        visiting=tuple(_space(s, visiting=True) for s in visiting),
        default_version=_label(body.get("default_version"), "default_version", MAX_VERSION),
        settings=_held_settings(body.get("settings", {})),
    )


def _held_settings(value: object) -> dict[str, HeldSettings]:
    """The answer's ``settings`` map, checked (an older box sends none)."""
    if not isinstance(value, dict):
        raise BadAnswer("settings is not an object")
    held: dict[str, HeldSettings] = {}
    for host, entry in value.items():
        try:
            host = hosts.normalise(host)
        except hosts.InvalidHost as e:
            raise BadAnswer(f"settings host: {e}"[:200]) from None
        if not isinstance(entry, dict):
            raise BadAnswer(f"{host}: settings is not an object")
        gen, digest = entry.get("gen"), entry.get("hash", "")
        if isinstance(gen, bool) or not isinstance(gen, int) or not 0 <= gen < 2**63:
            raise BadAnswer(f"{host}: settings gen is not a generation")
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise BadAnswer(f"{host}: settings hash is not a short hex digest")
        keys = entry.get("env_keys", [])
        if (
            not isinstance(keys, list)
            or len(keys) > MAX_ENV_KEYS
            or not all(isinstance(k, str) and ENV_KEY.fullmatch(k) for k in keys)
        ):
            raise BadAnswer(f"{host}: env_keys is not a list of LCHAT_* names")
        replication = _label(entry.get("replication") or None, f"{host}: replication", MAX_STATE)
        region = entry.get("home_region", "")
        if not isinstance(region, str) or len(region) > 64:
            raise BadAnswer(f"{host}: home_region is not a short string")
        held[host] = HeldSettings(gen, digest, replication or "", region, tuple(keys))
    return held


def _member(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise BadAnswer(f"{field}: not a member URL")
    try:
        return placement.normalise_member_url(value)
    except ValueError as e:
        raise BadAnswer(f"{field}: {e}"[:200]) from None


def _space(value: object, *, visiting: bool) -> Space:
    if not isinstance(value, dict):
        raise BadAnswer("a space is not a JSON object")
    host = value.get("host")
    if not isinstance(host, str):
        raise BadAnswer("a space has no host")
    try:
        host = hosts.normalise(host)
    except hosts.InvalidHost as e:
        raise BadAnswer(f"space host: {e}"[:200]) from None
    state = _label(value.get("state"), f"{host}: state", MAX_STATE)
    if state is None:
        raise BadAnswer(f"{host}: no state")
    home_region = value.get("home_region", "")
    if not isinstance(home_region, str) or len(home_region) > 64:
        raise BadAnswer(f"{host}: home_region is not a short string")
    return Space(
        host=host,
        state=state,
        version=_label(value.get("version"), f"{host}: version", MAX_VERSION),
        awake_since=_seconds(value.get("awake_since"), f"{host}: awake_since"),
        next_due=_seconds(value.get("next_due"), f"{host}: next_due"),
        lag=_lag(value.get("lag"), host),
        process=_label(value.get("process"), f"{host}: process", MAX_STATE),
        home_region=home_region,
        owner=_member(value.get("owner"), f"{host}: owner") if visiting else "",
        floor=_label(value.get("floor"), f"{host}: floor", MAX_VERSION),
    )


def _label(value: object, what: str, limit: int) -> str | None:
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value
        or len(value) > limit
        or not value.isprintable()
        or value != value.strip()
    ):
        raise BadAnswer(f"{what} is not a short printable label")
    return value


def _seconds(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise BadAnswer(f"{what} is not unix seconds")
    return value


def _lag(value: object, host: str) -> float | None:
    if value is None:
        return None
    lag = _optional_number(value)
    if lag is None or lag < 0:
        raise BadAnswer(f"{host}: lag is not a number of seconds")
    return lag


# --- the calling side: the fleet ----------------------------------------------------------------


@frozen
class BoxReport:
    """One live member as ``lchat fleet`` saw it: its answer, or why there is none."""

    url: str  # normalised
    region: str  # from its heartbeat
    outcome: Outcome
    error: str = ""
    answer: BoxAnswer | None = None
    is_self: bool = False


@frozen
class Row:
    """One space in the fleet table: ``box`` reports it; ``running_on`` is the box it is awake on
    when that is another (a visiting entry laid over the owner's row)."""

    box: str
    space: Space
    running_on: str = ""


@frozen
class BoxTotal:
    """One live member's line under the table: its outcome and what it reports, by state."""

    url: str
    region: str
    outcome: Outcome
    error: str
    is_self: bool
    spaces: int
    by_state: Mapping[str, int]
    unreported: int | None = None  # unanswered: what this box's registry says it owns
    default_version: str | None = None  # the build a space without a link of its own runs there


@frozen
class Fleet:
    generated_at: float  # unix seconds
    rows: tuple[Row, ...]
    boxes: tuple[BoxTotal, ...]
    conflicts: Mapping[str, tuple[str, ...]]  # host -> every box that reported it
    warnings: tuple[str, ...]
    # host -> box -> its settings, for every host some answering box holds (issue 32)
    settings: Mapping[str, Mapping[str, HeldSettings]] = attrs.field(factory=dict)
    # host -> the boxes whose settings differ from the newest (the highest generation; at equal
    # generations the highest hash): they have not taken the newest change yet
    divergence: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)

    def diverged_since(self, host: str) -> float | None:
        """Unix seconds of the newest settings of a diverged ``host`` (its generation is the
        unix milliseconds of the change, or a little after on a box whose clock was behind);
        None when the host has not diverged."""
        if host not in self.divergence:
            return None
        return max(s.gen for s in self.settings[host].values()) / 1000.0

    @property
    def complete(self) -> bool:
        """Every live member answered."""
        return all(b.outcome == "ok" for b in self.boxes)


def aggregate(
    reports: Sequence[BoxReport],
    now: float,
    unreported: Mapping[str, int] | None = None,
) -> Fleet:
    """The union of the members' answers, each space once.

    A host reported by two boxes (their membership views differ for a moment) is kept once, from
    the box whose row is not asleep, else the lower URL, and named in ``conflicts``. A visiting
    entry updates its owner's row (state, times, lag: the space is awake elsewhere) or, when the
    owner did not answer, stands in for it under the owner's URL. ``unreported``: for members that
    did not answer, how many spaces this box's registry says they own (:func:`registry_counts`).
    """
    warnings: list[str] = []
    claims: dict[str, list[Row]] = {}
    answered = [
        (r.url, r.answer) for r in sorted(reports, key=lambda r: r.url) if r.answer is not None
    ]
    for url, answer in answered:
        if answer.box != url:
            warnings.append(
                f"{url} answered as {answer.box}: its LCHAT_MESH_SELF differs from its "
                "heartbeat's URL"
            )
        for space in answer.spaces:
            claims.setdefault(space.host, []).append(Row(url, space))
    rows: dict[str, Row] = {}
    conflicts: dict[str, tuple[str, ...]] = {}
    for host, claimed in claims.items():
        if len(claimed) > 1:
            conflicts[host] = tuple(r.box for r in claimed)
            claimed = sorted(claimed, key=lambda r: (r.space.state == "asleep", r.box))
        rows[host] = claimed[0]
    for url, answer in answered:
        for visit in answer.visiting:
            row = rows.get(visit.host)
            space = attrs.evolve(visit, owner="")
            if row is None:
                rows[visit.host] = Row(visit.owner, space, running_on=url)
            elif row.box != url:
                rows[visit.host] = Row(row.box, space, running_on=url)
    expected = sorted(r.url for r in reports)
    for url, view in {url: answer.members for url, answer in answered}.items():
        if sorted(view) != expected:
            warnings.append(
                f"{url} sees the live members {', '.join(view) or 'none'}, this box sees "
                f"{', '.join(expected)}: until the views agree, a space may show twice or not at "
                "all (heartbeats settle within LCHAT_MESH_DEAD_AFTER)"
            )
    if conflicts:
        warnings.append(
            f"{len(conflicts)} space(s) reported by more than one box (shown once): "
            f"{', '.join(sorted(conflicts)[:10])}"
        )
    totals = []
    for report in sorted(reports, key=lambda r: r.url):
        mine = [row for row in rows.values() if row.box == report.url]
        totals.append(
            BoxTotal(
                url=report.url,
                region=report.region,
                outcome=report.outcome,
                error=report.error,
                is_self=report.is_self,
                spaces=len(mine),
                by_state=_count(row.space.state for row in mine),
                unreported=(unreported or {}).get(report.url) if report.outcome != "ok" else None,
                default_version=report.answer.default_version if report.answer else None,
            )
        )
    ordered = tuple(sorted(rows.values(), key=lambda r: (r.box, r.space.host)))
    held, divergence = _divergence(answered)
    if divergence:
        warnings.append(
            f"{len(divergence)} space(s) with settings that differ between boxes (the boxes "
            f"named have not taken the newest yet; anti-entropy catches them up within "
            f"LCHAT_MESH_SYNC): {', '.join(sorted(divergence)[:10])}"
        )
    return Fleet(now, ordered, tuple(totals), conflicts, tuple(warnings), held, divergence)


def _divergence(
    answered: Sequence[tuple[str, BoxAnswer]],
) -> tuple[dict[str, dict[str, HeldSettings]], dict[str, tuple[str, ...]]]:
    """Every host's settings by box, and the boxes diverged from the newest (:class:`Fleet`)."""
    held: dict[str, dict[str, HeldSettings]] = {}
    for url, answer in answered:
        for host, settings in answer.settings.items():
            held.setdefault(host, {})[url] = settings
    divergence: dict[str, tuple[str, ...]] = {}
    for host, by_box in sorted(held.items()):
        newest = max((s.gen, s.hash) for s in by_box.values())
        behind = tuple(sorted(url for url, s in by_box.items() if (s.gen, s.hash) != newest))
        if behind:
            divergence[host] = behind
    return dict(sorted(held.items())), divergence


def registry_counts(
    routes: Iterable[Route],
    me: str,
    live: Sequence[placement.Candidate],
    domains: Sequence[str],
    members: Iterable[str],
) -> dict[str, int]:
    """For each of ``members`` (normalised URLs), how many spaces this box's registry says it
    reports: the hibernating rows it owns by the rule, and the lives-elsewhere rows naming it
    (its always-on spaces our peers forward to). An estimate for a member that did not answer."""
    counts = dict.fromkeys(members, 0)
    for route in routes:
        if route.kind != "instance":
            continue
        if route.elsewhere:
            url = route.lives_at
        else:
            url = reporter(route, me, live, domains) or ""
            if not route.hibernate:
                continue  # ours: we answered, or we would not be asking
        if url in counts:
            counts[url] += 1
    return counts


def _count(states: Iterable[str]) -> dict[str, int]:
    return dict(sorted(collections.Counter(states).items()))


def elected(members: Sequence[placement.Candidate], me: str) -> bool:
    """Is ``me`` the publisher: the live member with the lowest URL (the heartbeat janitor's
    rule, :meth:`lchat.mesh.members.Janitor.sweep`)? Never when ``me`` is not live."""
    urls = sorted(placement.normalise_member_url(m.url) for m in members)
    return bool(urls) and urls[0] == placement.normalise_member_url(me)


# --- output -------------------------------------------------------------------------------------


def utc(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    try:
        moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def as_json(fleet: Fleet) -> dict[str, Any]:
    """``lchat fleet --json``: the table, the per-box totals, conflicts and warnings."""
    return {
        "generated_at": utc(fleet.generated_at),
        "complete": fleet.complete,
        "boxes": [
            {
                "url": b.url,
                "region": b.region,
                "self": b.is_self,
                "outcome": b.outcome,
                "error": b.error or None,
                "spaces": b.spaces,
                "by_state": dict(b.by_state),
                "unreported": b.unreported,
                "default_version": b.default_version,
            }
            for b in fleet.boxes
        ],
        "spaces": [
            {"box": row.box}
            | attrs.asdict(row.space, filter=lambda a, _: a.name not in ("home_region", "owner"))
            | {"running_on": row.running_on or None}
            for row in fleet.rows
        ],
        "conflicts": {host: list(boxes) for host, boxes in sorted(fleet.conflicts.items())},
        "settings": {
            host: {url: attrs.asdict(s) for url, s in sorted(by_box.items())}
            for host, by_box in fleet.settings.items()
        },
        "divergence": {host: list(boxes) for host, boxes in sorted(fleet.divergence.items())},
        "warnings": list(fleet.warnings),
    }


def publishable(fleet: Fleet) -> dict[str, Any]:
    """The public document (``status/fleet.json``): counts only, never a space's or a box's
    name. Schema :data:`SCHEMA`; see docs/operations.md, "Fleet status"."""
    regions: dict[str, dict[str, Any]] = {}
    for box in fleet.boxes:
        region = regions.setdefault(
            box.region or REGION_UNSET,
            {"boxes": 0, "answered": 0, "spaces": 0, "by_state": collections.Counter()},
        )
        region["boxes"] += 1
        region["answered"] += box.outcome == "ok"
        region["spaces"] += box.spaces
        region["by_state"].update(box.by_state)
    for region in regions.values():
        region["by_state"] = dict(sorted(region["by_state"].items()))
    return {
        "schema": SCHEMA,
        "generated_at": utc(fleet.generated_at),
        "complete": fleet.complete,
        "boxes": {
            "live": len(fleet.boxes),
            "answered": sum(1 for b in fleet.boxes if b.outcome == "ok"),
            "unreachable": sum(1 for b in fleet.boxes if b.outcome == "unreachable"),
            "error": sum(1 for b in fleet.boxes if b.outcome == "error"),
        },
        "spaces": {
            "total": len(fleet.rows),
            "by_state": _count(row.space.state for row in fleet.rows),
        },
        "regions": dict(sorted(regions.items())),
        "versions": _count(row.space.version or "unknown" for row in fleet.rows),
    }
