"""Deploying an installed build to this box's spaces, and rolling back (docs/operations.md,
"Deploys and rollbacks").

A deploy of ``<v>`` to a host repoints ``live/<host>`` (and ``live/<host>-bot`` when the build
has a sidecar) at ``versions/<v>/``, atomically (a new link under a temp name, renamed over the
old one: the router's next exec sees the old build or the new one, never no build). Then:

- an always-on space is restarted (builtin units: the router's ``POST /restart?host=H``;
  systemd: ``systemctl restart lchat@H``) and health-checked (``GET /api/version`` on its socket,
  as ``lchat add-instance`` does). If it does not answer within the timeout, or the router sees
  its new run exit, the link is put back, the space restarted onto the build it had, and the
  rollout stops: the hosts after it are not touched.
- a hibernating space is only repointed: its next wake runs the new build (an awake one keeps
  its build until it sleeps).

Per host, ``live/.state.json`` keeps the version deployed, the one before it (what ``lchat
rollback`` returns to), whether it was a canary (``--canary``; an ``--all`` deploy clears it) and
when. One deploy or rollback at a time per box (``live/.lock``).

A rollback of a hibernating space is refused when it ran the build being rolled back from, or
one newer than the build it would return to: that build may have run additive migrations on its
database which the older build does not know. What it ran is read from its build floor in the
bucket first (``floor``: ``<prefix>/<host>/build.json``, written by a wake on any box of the
mesh), then from its last wake on this box (``lchat.builds.read_wake``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from attrs import asdict, define, field, frozen

from lchat import admin_client, systemd_units
from lchat.builds import (
    DEFAULT_LINK,
    SIDECAR_BINARY,
    SPACE_BINARY,
    BuildLayout,
    BuildRecord,
    check_version,
    compare_versions,
    read_wake,
)
from lchat.files import fsync_directory, write_atomic
from lchat.registry import Route
from lchat.release.feed import FeedError
from lchat.release.fetch import read_state

POLL_INTERVAL = 0.2
RESTART_TIMEOUT = 60.0  # the router answers /restart once the old run has ended (SIGKILL at 20 s)
STATE_NAME = ".state.json"
LOCK_NAME = ".lock"


class DeployError(Exception):
    """A refusal or failure, one line."""


# --- links -------------------------------------------------------------------------------------


def point(layout: BuildLayout, host: str, version: str | None, *, sidecar: bool = False) -> None:
    """Make ``live/<host>`` (or ``-bot``) point at ``version``'s binary, atomically; ``None``
    removes the link. The link is relative (``../versions/<v>/space``)."""
    link = layout.live_link(host, sidecar=sidecar)
    os.makedirs(layout.live_dir, 0o755, exist_ok=True)
    if version is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        fsync_directory(layout.live_dir)
        return
    name = SIDECAR_BINARY if sidecar else SPACE_BINARY
    target = os.path.join(os.pardir, "versions", check_version(version), name)
    tmp = os.path.join(layout.live_dir, f".{os.path.basename(link)}.{secrets.token_hex(6)}.tmp")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_directory(layout.live_dir)


def check_installed(layout: BuildLayout, version: str) -> None:
    binary = layout.binary(version)
    if not os.path.isfile(binary):
        installed = ", ".join(layout.installed()) or "none"
        raise DeployError(
            f"version {version} is not installed ({binary} missing; installed: {installed}): "
            f"run `lchat release fetch {version}` first"
        )
    if not os.access(binary, os.X_OK):
        raise DeployError(f"{binary} is not executable")


# --- per-host state -------------------------------------------------------------------------------


@frozen
class HostState:
    version: str
    previous: str | None  # what `lchat rollback` returns to (None: nothing to return to)
    canary: bool
    at: float


def state_path(layout: BuildLayout) -> str:
    return os.path.join(layout.live_dir, STATE_NAME)


def read_states(layout: BuildLayout) -> dict[str, HostState]:
    """Every host's deploy record (empty when there is none yet, or it is unreadable)."""
    try:
        with open(state_path(layout), encoding="utf-8") as f:
            doc = json.load(f)
        return {
            host: HostState(
                version=str(entry["version"]),
                previous=entry.get("previous") if isinstance(entry.get("previous"), str) else None,
                canary=bool(entry.get("canary", False)),
                at=float(entry.get("at", 0.0)),
            )
            for host, entry in doc.get("hosts", {}).items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_states(layout: BuildLayout, states: dict[str, HostState]) -> None:
    doc = {"hosts": {h: asdict(s) for h, s in sorted(states.items())}}
    os.makedirs(layout.live_dir, 0o755, exist_ok=True)
    write_atomic(state_path(layout), json.dumps(doc, indent=2).encode() + b"\n", 0o644)


@contextmanager
def deploy_lock(layout: BuildLayout) -> Iterator[None]:
    """One deploy or rollback at a time on this box."""
    os.makedirs(layout.live_dir, 0o755, exist_ok=True)
    # live/ is root's (0755): no other user can plant a link here; O_NOFOLLOW all the same.
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(os.path.join(layout.live_dir, LOCK_NAME), flags, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DeployError(
                "another `lchat deploy` or `lchat rollback` is running on this box: "
                "wait for it to finish"
            ) from None
        yield
    finally:
        os.close(fd)


# --- restarting always-on spaces ----------------------------------------------------------------


class Restarter(Protocol):
    def restart(self, host: str) -> None:
        """Stop the space's current run and start it again (DeployError when that fails)."""
        ...

    def failed(self, host: str) -> str | None:
        """Why its new run is known to have failed already, or None (not known)."""
        ...


@frozen
class RouterRestarter:
    """Builtin units: the router runs always-on spaces itself; ask it over its admin API."""

    admin: admin_client.RouterAdmin
    _pids: dict[str, int | None] = field(factory=dict)  # host -> the pid its restart started

    def restart(self, host: str) -> None:
        try:
            response = self.admin.restart(host, RESTART_TIMEOUT)
        except (admin_client.Unreachable, admin_client.ProtocolError) as e:
            raise DeployError(f"{host}: could not ask the router to restart it: {e}") from e
        try:
            body = response.json()
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}
        if response.status != 200:
            raise DeployError(
                f"{host}: the router answered {response.status} to the restart: "
                f"{body.get('error', '')}"
            )
        pid = body.get("pid")
        self._pids[host] = pid if isinstance(pid, int) else None

    def failed(self, host: str) -> str | None:
        try:
            process = self.admin.status(3.0).json()["hosts"][host]["process"]
        except (admin_client.Unreachable, admin_client.ProtocolError, ValueError, KeyError):
            return None
        except TypeError:
            return None
        if not isinstance(process, dict) or process.get("state") not in ("backoff", "failed"):
            return None
        # A space that was failing before stays "failed" until a run is ready: only a state
        # without the run the restart started means that run has ended.
        started = self._pids.get(host)
        if started is not None and process.get("pid") == started:
            return None
        return str(process.get("last_error") or "its new run exited")

    def reachable(self) -> bool:
        try:
            return self.admin.status(3.0).status == 200
        except (admin_client.Unreachable, admin_client.ProtocolError):
            return False


@frozen
class SystemdRestarter:
    """``LCHAT_UNITS=systemd``: ``systemctl restart lchat@<host>`` (``restart_unit``: the units
    seam's, :meth:`lchat.handover.seams.Units.restart`)."""

    restart_unit: Callable[[str], None] = systemd_units.restart

    def restart(self, host: str) -> None:
        try:
            self.restart_unit(host)
        except systemd_units.UnitError as e:
            raise DeployError(f"{host}: {e}") from e

    def failed(self, host: str) -> str | None:
        return None


# --- the deployer ------------------------------------------------------------------------------


@define
class Deployer:
    """Switches hosts between installed builds. ``routes``: this box's instance rows by host."""

    layout: BuildLayout
    data_dir: str
    routes: dict[str, Route]
    restarter: Restarter
    out: Callable[[str], None]
    timeout: float = 30.0
    awake: Callable[[str], bool] = lambda host: False  # a hibernating space running right now
    # (socket, host, timeout) -> it answered GET /api/version within timeout (the health gate)
    answers: Callable[[str, str, float], bool] = lambda socket, host, timeout: (
        admin_client.wait_for_version(socket, host, timeout, POLL_INTERVAL)
    )
    # host -> its build floor in the bucket (None: no record); raises DeployError when it cannot
    # be read. None: no bucket (a box without hibernation): the local record only.
    floor: Callable[[str], BuildRecord | None] | None = None
    _clock: Callable[[], float] = time.time
    _monotonic: Callable[[], float] = time.monotonic
    # The hosts the last deploy() could not bring up on its version (each put back where it was).
    failed_hosts: list[str] = field(factory=list, init=False)

    def route(self, host: str) -> Route:
        route = self.routes.get(host)
        if route is None:
            raise DeployError(
                f"{host} is not a space registered on this box (see `lchat instances`)"
            )
        return route

    def deploy(self, version: str, hosts: Sequence[str], *, canary: bool, batch: int) -> int:
        """Deploy to ``hosts`` in batches of ``batch``; stops after the first batch with a
        failure. Returns 0 when every host is on ``version``, else 1."""
        check_installed(self.layout, version)
        routes = [self.route(h) for h in hosts]
        self.failed_hosts = []
        with deploy_lock(self.layout):
            states = read_states(self.layout)
            done = 0
            for start in range(0, len(routes), batch):
                chunk = routes[start : start + batch]
                failed = 0
                for route in chunk:
                    try:
                        ok = self._deploy_one(route, version, canary, states)
                        failed += not ok
                        if not ok:
                            self.failed_hosts.append(route.host)
                    finally:
                        write_states(self.layout, states)  # each host's record as it happens
                done += len(chunk)
                if failed:
                    left = [r.host for r in routes[done:]]
                    self.out(
                        f"rollout stopped: {failed} of {len(chunk)} in this batch failed; "
                        + (
                            f"{len(left)} host(s) not touched: {', '.join(left)}"
                            if left
                            else "no host left to deploy"
                        )
                    )
                    return 1
            return 0

    def _deploy_one(
        self, route: Route, version: str, canary: bool, states: dict[str, HostState]
    ) -> bool:
        """Whether ``route`` is on ``version`` now."""
        host = route.host
        current = self.layout.version_of(host)
        old = states.get(host)
        if current == version:
            # Already there: an --all deploy still settles the canary flag and the record.
            previous = old.previous if old is not None and old.version == version else None
            states[host] = HostState(version, previous, canary, old.at if old else self._clock())
            self.out(f"{host}: already on {version}{' (canary)' if canary else ''}")
            return True
        if route.hibernate:
            self._repoint(host, version)
            states[host] = HostState(version, current, canary, self._clock())
            line = f"{host}: {current or '-'} -> {version}: repointed (hibernating: its next wake runs {version})"
            if self.awake(host):
                line += f"; awake now, it runs {current or 'its build'} until it sleeps"
            self.out(line)
            return True
        problem, back = self._switch(route, version, current)
        if problem is None:
            states[host] = HostState(version, current, canary, self._clock())
            self.out(f"{host}: {current or '-'} -> {version}: restarted, healthy")
            return True
        verdict = (
            f"rolled back to {current or 'no build'}, healthy"
            if back is None
            else f"rolled back to {current or 'no build'}, which does not answer either: {back}"
        )
        self.out(f"{host}: {current or '-'} -> {version} FAILED ({problem}); {verdict}")
        return False

    def set_default(self, version: str) -> None:
        """Point ``live/_default`` (and ``-bot``) at ``version``: the build a host without a link
        of its own runs here (one created on a peer and replicated, or added since)."""
        check_installed(self.layout, version)
        with deploy_lock(self.layout):
            before = self.layout.version_of(DEFAULT_LINK)
            if before == version:
                self.out(f"default build: already {version}")
                return
            self._repoint(DEFAULT_LINK, version)
            self.out(
                f"default build: {before or '-'} -> {version} (what a space without a link of "
                f"its own runs here: one added since, or replicated from a peer)"
            )

    def _repoint(self, host: str, version: str | None) -> None:
        """``live/<host>`` at ``version``; its ``-bot`` link too when that build has a sidecar
        (else the link goes, when there was one)."""
        sidecar = version is not None and os.path.exists(self.layout.binary(version, sidecar=True))
        point(self.layout, host, version)
        if sidecar or os.path.lexists(self.layout.live_link(host, sidecar=True)):
            point(self.layout, host, version if sidecar else None, sidecar=True)

    def _switch(self, route: Route, to: str, back_to: str | None) -> tuple[str | None, str | None]:
        """Repoint an always-on space to ``to`` and restart it; when it does not answer, repoint
        it to ``back_to`` and restart it again. (Why ``to`` failed, why ``back_to`` does not
        answer either), each None when it did not."""
        self._repoint(route.host, to)
        problem = self._restart_and_check(route)
        if problem is None:
            return None, None
        self._repoint(route.host, back_to)
        return problem, self._restart_and_check(route)

    def _restart_and_check(self, route: Route) -> str | None:
        """Restart the space and wait for it to answer; None when healthy, else why not."""
        try:
            self.restarter.restart(route.host)
        except DeployError as e:
            return str(e)
        deadline = self._monotonic() + self.timeout
        while True:
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                return f"not answering on {route.socket} after {self.timeout:g}s"
            if self.answers(route.socket, route.host, min(1.0, remaining)):
                return None
            failed = self.restarter.failed(route.host)
            if failed is not None:
                return f"it exited: {' '.join(failed.split())}"

    def rollback(self, hosts: Sequence[str]) -> int:
        """Return each host to the version it had before its last deploy."""
        with deploy_lock(self.layout):
            states = read_states(self.layout)
            failures = 0
            for host in hosts:
                ok = self._rollback_one(host, states)
                write_states(self.layout, states)
                failures += not ok
            return 1 if failures else 0

    def _rollback_one(self, host: str, states: dict[str, HostState]) -> bool:
        route = self.route(host)
        state = states.get(host)
        current = self.layout.version_of(host)
        if state is None or state.previous is None:
            self.out(f"{host}: refused: no previous version recorded (no deploy to roll back)")
            return False
        if current != state.version:
            self.out(
                f"{host}: refused: it is on {current or 'no build'}, not {state.version} as the "
                f"last deploy left it (changed by hand?): deploy the version you want instead"
            )
            return False
        previous = state.previous
        try:
            check_installed(self.layout, previous)
        except DeployError as e:
            self.out(f"{host}: refused: {e}")
            return False
        if route.hibernate:
            try:
                woke = self._woke_on(host, state.version, previous)
            except DeployError as e:
                self.out(f"{host}: refused: {e}")
                return False
            if woke is not None:
                self.out(woke)
                return False
            self._repoint(host, previous)
            # A wake may have spawned between the check and the repoint: look again.
            try:
                woke = self._woke_on(host, state.version, previous)
            except DeployError as e:
                woke = f"{host}: refused: {e}"
            if woke is not None:
                self._repoint(host, state.version)
                self.out(woke)
                return False
            states[host] = HostState(previous, None, False, self._clock())
            self.out(f"{host}: {state.version} -> {previous}: repointed (hibernating)")
            return True
        problem, back = self._switch(route, previous, state.version)
        if problem is None:
            states[host] = HostState(previous, None, False, self._clock())
            self.out(f"{host}: {state.version} -> {previous}: restarted, healthy")
            return True
        self.out(
            f"{host}: rollback to {previous} FAILED ({problem}); back on {state.version}"
            + (", healthy" if back is None else f", which does not answer either: {back}")
        )
        return False

    def _woke_on(self, host: str, version: str, previous: str) -> str | None:
        """Why going back from ``version`` to ``previous`` is refused, or None: the space ran
        ``version``, or a build newer than ``previous``, on any box (its floor in the bucket) or
        on this one (its last wake here). Raises DeployError when the floor cannot be read."""
        floor = self.floor(host) if self.floor is not None else None
        if floor is not None:
            released = self._released()
            newer = compare_versions(floor.version, previous, released)
            if floor.version == version or (newer is not None and newer > 0):
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(floor.at))
                where = f" on {floor.box}" if floor.box else ""
                return (
                    f"{host}: refused: it ran {floor.version}{where} (first at {when}, its build "
                    f"floor in the bucket), so its database may carry {floor.version}'s "
                    f"(additive) migrations, which {previous} does not know; roll forward "
                    f"instead (deploy a fixed version)"
                )
        wake = read_wake(self.data_dir, host)
        if wake is None or wake.version != version:
            return None
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wake.at))
        return (
            f"{host}: refused: it woke on {version} at {when}, so its database may carry "
            f"{version}'s (additive) migrations, which the older build does not know; "
            f"roll forward instead (deploy a fixed version)"
        )

    def _released(self) -> dict[str, str]:
        """The feed's order of builds as this box last accepted it (empty when unknown)."""
        try:
            state = read_state(self.layout.release_state)
        except FeedError:
            return {}
        return dict(state.released) if state is not None else {}
