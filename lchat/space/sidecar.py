"""The reference bot sidecar (docs/design.md §7, §8): `python -m lchat.space.sidecar`.

A small second process beside a space. On a hibernating host the activator co-spawns it once the
space is healthy and stops it first at sleep, so it lives exactly while its space is awake. It

- keeps a *charter*: a run every ``LCHAT_BOT_EVERY`` seconds on a fixed grid; a run posts one
  message to ``LCHAT_BOT_ROOM`` (if set). The next run time is persisted atomically beside the
  database (``$LCHAT_DB-bot.json``) so that being stopped at every sleep does not reset the
  schedule; a run whose time passed while stopped runs once on start (never once per missed
  period), then the grid continues;
- reports its next run on start and after each run (``POST /api/charter-next-due``, bot token),
  so a sleeping space is woken for it (the space folds it into ``GET /api/next-due``);
- optionally (``LCHAT_BOT_LISTEN=1``) keeps a WebSocket open to the room and logs what it hears;
- marks every request it makes, WebSocket upgrades included, with ``X-Lchat-Sidecar: 1``: the
  activator keeps that traffic activity-invisible (no idle credit, never a wake);
- retries every failure (nothing listening, 5xx, 503 + Retry-After) with capped backoff: it never
  exits because its space misbehaves, so it can never crash-loop;
- stops cleanly and quickly on SIGTERM (exit 0), giving an in-flight run and the report of the next
  run at most ``STOP_GRACE`` seconds.

How it reaches its space (its socket, or a base URL such as the router's):
lchat.space.sidecar_client.

Delivery is at least once: the schedule advances only after a run finished, so a run interrupted
by SIGTERM is repeated on the next start (rarely posting twice if the post had already landed).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from attrs import define, field, frozen
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.backoff import Backoff
from lchat.files import write_atomic
from lchat.reactors import Reactor, installed
from lchat.space.sidecar_client import (
    Client,
    Connector,
    RequestFailed,
    WSHandle,
    client_for,
    ws_connect,
)
from lchat.space.sidecar_config import ENV_HELP, ConfigError, SidecarConfig
from lchat.unixhttp import Response

log = Logger(namespace="lchat.space.sidecar")
MAX_TIME = 2**53  # as lchat.space.api: larger "unix seconds" are nonsense
BACKOFF = Backoff(1.0, 60.0)  # every retry: 1 s doubling to 60 s, also the cap on a Retry-After
STOP_GRACE = 3.0  # on SIGTERM: an in-flight run and the final report get this long together


class _Stopping(Exception):
    """A retry loop noticed the sidecar is stopping."""


# -- schedule logic (pure) ---------------------------------------------------------------------


def initial_due(saved: int | None, every: int, now: float) -> int:
    """The next run on start: the saved one, a fresh one (none saved), or a clamped one.

    A saved time in the past is returned as is: it is overdue and runs once, right away. A saved
    time more than one period ahead (the period was shortened, or the clock went back) is pulled
    in to one period from now.
    """
    fresh = math.ceil(now) + every
    if saved is None or saved > fresh:
        return fresh
    return saved


def next_slot(due: int, every: int, now: float) -> int:
    """The first time on the grid ``due + k * every`` that is after ``now`` (``due`` if ahead).

    However many periods were missed, this skips them all: one catch-up run, then the grid.
    """
    if now < due:
        return due
    return due + (int((now - due) // every) + 1) * every


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds asked for by a Retry-After header (delta-seconds or HTTP-date), or None."""
    if not value:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]{1,10}", value):
        return float(int(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def retryable(status: int) -> bool:
    """Worth asking again later: the space is busy, starting, stopping or broken for now."""
    return status in (408, 425, 429) or 500 <= status <= 599


def when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- the persisted schedule --------------------------------------------------------------------


@frozen
class StateFile:
    """``{"next_run": <unix seconds>}`` in one small file, replaced atomically.

    Written once per run (and on a fresh start); small enough to write on the reactor thread of
    this single-purpose process.
    """

    path: str

    def load(self) -> int | None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(4096)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warn(
                "cannot read schedule {path}: {error}; starting afresh", path=self.path, error=e
            )
            return None
        try:
            due = json.loads(raw)["next_run"]
        except (ValueError, TypeError, KeyError):
            due = None
        if type(due) is not int or not 0 <= due < MAX_TIME:
            log.warn("schedule {path} is unreadable; starting afresh", path=self.path)
            return None
        return due

    def save(self, due: int) -> None:
        write_atomic(self.path, json.dumps({"next_run": due}).encode(), 0o600)


# -- the sidecar -------------------------------------------------------------------------------


@define(eq=False)
class Sidecar:
    """The charter, the reports and the optional listener, on an injected clock."""

    clock: IReactorTime  # a task.Clock in tests
    config: SidecarConfig
    client: Client
    state: StateFile
    connect_ws: Connector | None = None
    next_run: int = 0  # the next run, as persisted (unix seconds)
    reported: int | None = None  # the last next_run the space acknowledged (or rejected)
    runs: int = 0
    stopping: bool = False
    _timer: IDelayedCall | None = None
    _running: Deferred[None] | None = None
    _reporting: Deferred[None] | None = None
    _listening: Deferred[None] | None = None
    _ws: WSHandle | None = None
    _sleeps: set[Deferred[None]] = field(factory=set)

    @property
    def host(self) -> str:
        return self.config.host

    def now(self) -> float:
        return float(self.clock.seconds())

    # lifecycle

    def start(self) -> None:
        saved = self.state.load()
        now = self.now()
        self.next_run = initial_due(saved, self.config.every, now)
        if saved != self.next_run:
            self._save()
        overdue = self.next_run <= now
        log.info(
            "sidecar {host} started: every {every}s, room {room}, next run {next}{overdue}",
            host=self.host,
            every=self.config.every,
            room=self.config.room or "(none)",
            next=when(self.next_run),
            overdue=" (overdue: running now)" if overdue else "",
        )
        if overdue:
            self._fire()
        else:
            self._schedule()
            self._want_report()
        if self.config.listen:
            self._listening = Deferred.fromCoroutine(self._listen_loop())
            self._listening.addErrback(self._quiet, "listener")

    async def stop(self) -> None:
        """Stop quickly: no new run, no more retries; a run in flight and the report of the
        next run get at most STOP_GRACE seconds (together)."""
        if self.stopping:
            return
        self.stopping = True
        deadline = self.now() + STOP_GRACE
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        for d in list(self._sleeps):
            d.cancel()
        if self._ws is not None:
            self._ws.close()
        if self._listening is not None:
            self._listening.cancel()
        await self._bounded(self._running, deadline)
        if self.reported != self.next_run:
            self._want_report()  # one last attempt, no retries
        await self._bounded(self._reporting, deadline)
        log.info("sidecar {host} stopped", host=self.host)

    # the charter

    def _schedule(self) -> None:
        if self.stopping:
            return
        delay = max(0.0, self.next_run - self.now())
        self._timer = self.clock.callLater(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.stopping:
            return
        if self.now() < self.next_run:  # woke early (clock adjusted): wait on
            self._schedule()
            return
        self._running = Deferred.fromCoroutine(self._run(self.next_run))
        self._running.addErrback(self._quiet, "run")

    async def _run(self, due: int) -> None:
        deadline = next_slot(due, self.config.every, self.now())  # do not run into the next slot
        outcome = "nothing to post (no LCHAT_BOT_ROOM)"
        if self.config.room is not None:
            try:
                outcome = await self._post(self.config.room, due, deadline)
            except (CancelledError, _Stopping):
                raise  # interrupted by stop: not advanced, so it runs again on the next start
            except Exception:
                log.failure("sidecar {host}: run for {due} failed", host=self.host, due=when(due))
                outcome = "failed"
        self.runs += 1
        self.next_run = next_slot(due, self.config.every, self.now())
        self._save()
        log.info(
            "sidecar {host}: run for {due}: {outcome}; next run {next}",
            host=self.host,
            due=when(due),
            outcome=outcome,
            next=when(self.next_run),
        )
        self._schedule()
        self._want_report()

    async def _post(self, room: str, due: int, deadline: int) -> str:
        text = self.config.message or f"scheduled run {when(due)}"
        body = json.dumps({"body": text}).encode()
        backoff = BACKOFF.delays()
        while True:
            headers = {"Content-Type": "application/json"}
            resp, problem, wait = await self._ask(f"/api/rooms/{room}/messages", headers, body)
            if resp is not None and resp.status == 201:
                return f"posted message {_field(resp.body, 'id')} to {room}"
            if resp is not None:
                log.error(
                    "sidecar {host}: posting to {room} refused: HTTP {status} {detail}",
                    host=self.host,
                    room=room,
                    status=resp.status,
                    detail=_field(resp.body, "error"),
                )
                return f"post refused (HTTP {resp.status})"
            if self.stopping:
                raise _Stopping()
            delay = backoff.next(wait)
            if self.now() + delay >= deadline:
                return f"gave up posting ({problem}) at the next slot"
            log.warn(
                "sidecar {host}: posting to {room} failed ({problem}); retrying in {delay:g}s",
                host=self.host,
                room=room,
                problem=problem,
                delay=delay,
            )
            await self._sleep(delay)

    def _save(self) -> None:
        try:
            self.state.save(self.next_run)
        except OSError as e:
            log.error(
                "sidecar {host}: cannot save the schedule to {path}: {error}",
                host=self.host,
                path=self.state.path,
                error=e,
            )

    # reporting the next run

    def _want_report(self) -> None:
        if self._reporting is None or self._reporting.called:
            self._reporting = Deferred.fromCoroutine(self._report_loop())
            self._reporting.addErrback(self._quiet, "report")

    async def _report_loop(self) -> None:
        """Until the space knows our latest next run (a run meanwhile just changes the value)."""
        backoff = BACKOFF.delays()
        while self.reported != self.next_run:
            due = self.next_run
            headers = {
                "Authorization": f"Bearer {self.config.token}",
                "Content-Type": "application/json",
            }
            body = json.dumps({"due": due}).encode()
            resp, problem, wait = await self._ask("/api/charter-next-due", headers, body)
            if resp is not None and 200 <= resp.status < 300:
                self.reported = due
                backoff.reset()
                log.info(
                    "sidecar {host}: reported next run {due} ({at})",
                    host=self.host,
                    due=due,
                    at=when(due),
                )
                continue
            if resp is not None:
                self.reported = due  # asking again will not help; a later run tries anew
                log.error(
                    "sidecar {host}: report of next run {due} refused: HTTP {status} {detail}"
                    "{hint}",
                    host=self.host,
                    due=due,
                    status=resp.status,
                    detail=_field(resp.body, "error"),
                    hint=" (check LCHAT_BOT_TOKEN)" if resp.status in (401, 403) else "",
                )
                continue
            if self.stopping:
                log.warn(
                    "sidecar {host}: could not report next run {due} before stopping ({problem})",
                    host=self.host,
                    due=due,
                    problem=problem,
                )
                return
            delay = backoff.next(wait)
            log.warn(
                "sidecar {host}: reporting next run failed ({problem}); retrying in {delay:g}s",
                host=self.host,
                problem=problem,
                delay=delay,
            )
            await self._sleep(delay)

    # listening

    async def _listen_loop(self) -> None:
        assert self.config.room is not None
        connect = self.connect_ws
        if connect is None:
            return
        path = f"/api/rooms/{self.config.room}/ws"
        backoff = BACKOFF.delays()
        while not self.stopping:
            try:
                handle = await connect(path, self._heard)
            except RequestFailed as e:
                problem = e.reason
            else:
                self._ws = handle
                backoff.reset()
                log.info(
                    "sidecar {host}: listening to room {room}",
                    host=self.host,
                    room=self.config.room,
                )
                try:
                    await handle.closed
                finally:
                    self._ws = None
                problem = "connection closed"
            if self.stopping:
                return
            delay = backoff.next()
            log.warn(
                "sidecar {host}: websocket: {problem}; reconnecting in {delay:g}s",
                host=self.host,
                problem=problem,
                delay=delay,
            )
            await self._sleep(delay)

    def _heard(self, text: str) -> None:
        try:
            frame = json.loads(text)
        except ValueError:
            return
        if isinstance(frame, dict) and "id" in frame:
            log.info(
                "sidecar {host}: heard message {id} in {room}",
                host=self.host,
                id=frame.get("id"),
                room=frame.get("room"),
            )

    # helpers

    async def _ask(
        self, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[Response | None, str, float | None]:
        """POST once: the response when it is final (2xx, or a refusal that asking again will
        not change); else None, the problem and the Retry-After asked for."""
        try:
            resp = await self.client.request("POST", path, headers=headers, body=body)
        except RequestFailed as e:
            return None, e.reason, None
        if 200 <= resp.status < 300 or not retryable(resp.status):
            return resp, "", None
        return None, f"HTTP {resp.status}", retry_after(resp.headers.get("retry-after"), self.now())

    async def _sleep(self, delay: float) -> None:
        if self.stopping:
            raise _Stopping()
        d: Deferred[None] = deferLater(self.clock, delay)
        self._sleeps.add(d)
        try:
            await d
        finally:
            self._sleeps.discard(d)

    async def _bounded(self, task: Deferred[None] | None, deadline: float) -> None:
        if task is None or task.called:
            return
        remaining = max(0.0, deadline - self.now())
        try:
            await task.addTimeout(remaining, self.clock)
        except (defer.TimeoutError, CancelledError, _Stopping):
            pass

    def _quiet(self, failure: Failure, what: str) -> None:
        """Ends of background tasks: stopping is expected, anything else is a bug worth a log."""
        if failure.check(CancelledError, _Stopping):
            return None
        log.failure("sidecar {host}: {what} failed", failure, host=self.host, what=what)
        return None


def _field(body: bytes, name: str) -> str:
    try:
        value = json.loads(body).get(name)
    except (ValueError, AttributeError):
        return ""
    return "" if value is None else str(value)


# -- the process -------------------------------------------------------------------------------


def run(reactor: Reactor, config: SidecarConfig) -> int:
    """Run the sidecar on ``reactor`` until SIGTERM/SIGINT; return the exit code."""
    client = client_for(reactor, config)

    def connect(path: str, on_text: Callable[[str], None]) -> Awaitable[WSHandle]:
        return ws_connect(reactor, client, path, on_text)

    sidecar = Sidecar(reactor, config, client, StateFile(config.state_path), connect)
    reactor.addSystemEventTrigger(
        "before", "shutdown", lambda: Deferred.fromCoroutine(sidecar.stop())
    )
    reactor.callWhenRunning(sidecar.start)
    reactor.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    from lchat.space.server import parse_no_options

    stop = parse_no_options(
        argv,
        "python -m lchat.space.sidecar",
        "Run the reference lchat bot sidecar next to a space (configured by environment).",
        ENV_HELP,
    )
    if stop is not None:
        return stop
    try:
        config = SidecarConfig.from_env(os.environ)
    except ConfigError as e:
        print(f"lchat sidecar: {e}", file=sys.stderr)
        return 2
    from lchat.space.server import start_logging

    start_logging()
    return run(installed(), config)


if __name__ == "__main__":
    sys.exit(main())
