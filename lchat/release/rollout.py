"""A fleet rollout: one build to every box of a mesh, a batch of boxes at a time, coordinated
through the mesh bucket (docs/operations.md, "Deploys on a mesh").

The router cannot write the build tree (``lchat-router.service``: ``ReadWritePaths=/data
/run/lchat``), so each box's *release agent* (``lchat release agent``, root, run every minute by
``lchat-release.timer``) does its own box's deploy. They meet in the bucket::

    <prefix>/release/rollout.json                 the rollout (:class:`Rollout`): one at a time
    <prefix>/release/boxes/<base64url(box)>.json  each box's report on it (:class:`Report`)
    <prefix>/release/agents/<base64url(box)>.json the channel each agent follows (:class:`Presence`)

``<prefix>`` is the mesh bucket's (``LCHAT_MESH_BUCKET``, else the hibernation bucket's); a box is
its normalised ``LCHAT_MESH_SELF``.

The state machine (:func:`advance`, a pure function of the rollout, the reports and the time):

- ``running``: the boxes of ``batches[due]`` deploy. When all of them report ``done``, the next
  batch is due (the last one done: state ``done``). A box that reports ``failed`` (a host did not
  come back healthy: the deploy put it back and reverted the hosts it had moved on that box), or a
  batch that has not all reported within ``batch_timeout`` of becoming due, turns the rollout to
  ``rollback``.
- ``rollback``: every box that reported ``done`` returns to its previous default build and its
  always-on hosts to their previous version, and reports ``rolled_back`` (or
  ``rollback_failed``). Hibernating spaces that already woke on the new build stay on it: their
  build floor (lchat.hibernation.floor) refuses an older one, and migrations are additive. When
  every such box has reported, or ``batch_timeout`` has passed, the state is ``failed``.
- ``done`` and ``failed`` are final: a new rollout may then replace the record.

Invariants: only one rollout at a time (it is created with ``If-None-Match``, or ``If-Match`` over
a finished one); every change of the record is a conditional PUT over the version read, so any
number of agents and watchers may advance it at once and only one change of each step lands; a
box acts only on its own report's absence (deploy) or on its own ``done`` (revert), so a repeated
agent run does nothing twice. A crashed ``lchat deploy --fleet`` does not stall the rollout: the
agents advance it; ``--resume`` watches it again, ``--abort`` turns it to ``rollback``.

Release channels (``LCHAT_RELEASE_CHANNEL``, the feed's signed ``channels``): an agent whose
channel names a version newer than its box's default build (:func:`channel_target`), inside its
``LCHAT_RELEASE_WINDOW``, starts a rollout of it over the boxes following a channel that names it,
canary-channel boxes first, or joins the one running (:meth:`Board.follow`), as a last batch. A
channel never retries a version whose last rollout failed.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from attrs import evolve, frozen
from prometheus_client import Counter
from twisted.logger import Logger

from lchat.builds import BadVersion, check_version, compare_versions
from lchat.objstore import NotFound, ObjectStore, PreconditionFailed

_log = Logger(namespace="lchat.release")

State = Literal["running", "rollback", "done", "failed"]
Outcome = Literal["done", "failed", "rolled_back", "rollback_failed"]
STATES: tuple[State, ...] = ("running", "rollback", "done", "failed")
FINAL: tuple[State, ...] = ("done", "failed")
OUTCOMES: tuple[Outcome, ...] = ("done", "failed", "rolled_back", "rollback_failed")
DEFAULT_BATCH_TIMEOUT = 1800.0  # an agent runs every minute; a box's deploy restarts its spaces
PRESENCE_FRESH = 600.0  # an agent silent longer than this is not counted into a channel rollout

TRANSITIONS = Counter(
    "lchat_release_rollout_transitions_total",
    "Fleet rollout records written, by the state they enter (running: created or its next batch "
    "due; rollback; done; failed)",
    ["state"],
)
REPORTS = Counter(
    "lchat_release_agent_reports_total",
    "Reports a release agent wrote for its box, by outcome",
    ["outcome"],
)
for _state in STATES:
    TRANSITIONS.labels(_state)
for _outcome in OUTCOMES:
    REPORTS.labels(_outcome)


class RolloutError(Exception):
    """A refusal or failure of a fleet rollout; one line."""


class BadRollout(RolloutError):
    """A rollout record or report that is not one (named by its key)."""


class RolloutRunning(RolloutError):
    """Another rollout runs: this one is refused."""


def rollout_key(prefix: str) -> str:
    return _join(prefix, "release", "rollout.json")


def report_key(prefix: str, box: str) -> str:
    return _join(prefix, "release", "boxes", f"{_box_name(box)}.json")


def _box_name(box: str) -> str:
    """A box (its mesh URL) as a key segment: base64url, unpadded, as the heartbeats' keys."""
    return base64.urlsafe_b64encode(box.encode("utf-8")).rstrip(b"=").decode("ascii")


def _join(prefix: str, *parts: str) -> str:
    return "/".join([prefix.strip("/"), *parts] if prefix.strip("/") else parts)


def batches_of(boxes: Sequence[str], size: int, first: Iterable[str] = ()) -> list[list[str]]:
    """``boxes`` in batches of ``size``; the boxes in ``first`` (canaries) lead, in their own
    batches, so a broken build stops on them."""
    if size < 1:
        raise ValueError("a batch has at least one box")
    leading = [b for b in boxes if b in set(first)]
    rest = [b for b in boxes if b not in set(first)]
    return [leading[i : i + size] for i in range(0, len(leading), size)] + [
        rest[i : i + size] for i in range(0, len(rest), size)
    ]


@frozen
class Rollout:
    """The record at ``release/rollout.json``."""

    id: str
    version: str
    batches: tuple[tuple[str, ...], ...]
    state: State
    due: int  # running: the batch due now; after: the last batch that was due
    started_at: float
    changed_at: float  # the state's or ``due``'s last change: timeouts count from it
    by: str  # who started it (a box, or "channel <name>")
    batch_timeout: float = DEFAULT_BATCH_TIMEOUT
    reason: str = ""  # why it is rolling back or failed

    @property
    def boxes(self) -> list[str]:
        return [b for batch in self.batches for b in batch]

    def reached(self) -> list[str]:
        """The boxes whose batch has been due."""
        return [b for batch in self.batches[: self.due + 1] for b in batch]

    def to_bytes(self) -> bytes:
        doc = {
            "id": self.id,
            "version": self.version,
            "batches": [list(b) for b in self.batches],
            "state": self.state,
            "due": self.due,
            "started_at": self.started_at,
            "changed_at": self.changed_at,
            "by": self.by,
            "batch_timeout": self.batch_timeout,
            "reason": self.reason,
        }
        return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def parse(cls, body: bytes, key: str) -> Rollout:
        try:
            doc = json.loads(body)
            batches = tuple(tuple(str(b) for b in batch) for batch in doc["batches"])
            state = doc["state"]
            if state not in STATES or not batches or not all(batches):
                raise ValueError(f"state {state!r}, batches {doc['batches']!r}")
            due = int(doc["due"])
            if not 0 <= due < len(batches):
                raise ValueError(f"due {due} outside its {len(batches)} batches")
            return cls(
                id=str(doc["id"]),
                version=check_version(str(doc["version"])),
                batches=batches,
                state=state,
                due=due,
                started_at=float(doc["started_at"]),
                changed_at=float(doc["changed_at"]),
                by=str(doc.get("by", "")),
                batch_timeout=float(doc.get("batch_timeout", DEFAULT_BATCH_TIMEOUT)),
                reason=str(doc.get("reason", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError, BadVersion) as e:
            raise BadRollout(f"{key} is not a rollout record ({e})") from None


@frozen
class Report:
    """A box's report on a rollout: ``release/boxes/<box>.json``."""

    id: str  # the rollout's
    version: str
    box: str
    outcome: Outcome
    failed: tuple[str, ...] = ()  # hosts that did not come back healthy (or back)
    previous: str | None = None  # the box's default build before the rollout
    at: float = 0.0
    detail: str = ""

    def to_bytes(self) -> bytes:
        doc = {
            "id": self.id,
            "version": self.version,
            "box": self.box,
            "outcome": self.outcome,
            "failed": list(self.failed),
            "previous": self.previous,
            "at": self.at,
            "detail": self.detail,
        }
        return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def parse(cls, body: bytes, key: str) -> Report:
        try:
            doc = json.loads(body)
            outcome = doc["outcome"]
            if outcome not in OUTCOMES:
                raise ValueError(f"outcome {outcome!r}")
            previous = doc.get("previous")
            return cls(
                id=str(doc["id"]),
                version=str(doc["version"]),
                box=str(doc["box"]),
                outcome=outcome,
                failed=tuple(str(h) for h in doc.get("failed", ())),
                previous=previous if isinstance(previous, str) else None,
                at=float(doc.get("at", 0.0)),
                detail=str(doc.get("detail", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadRollout(f"{key} is not a box's rollout report ({e})") from None


def advance(rollout: Rollout, reports: Mapping[str, Report], now: float) -> Rollout | None:
    """The rollout's next state given its boxes' reports (only those with its ``id`` count) at
    ``now``; None when nothing changes. Pure: any agent or watcher may call it."""
    mine = {b: r for b, r in reports.items() if r.id == rollout.id}
    if rollout.state == "running":
        failed = [b for b in rollout.reached() if b in mine and mine[b].outcome == "failed"]
        if failed:
            why = "; ".join(
                f"{b}: {', '.join(mine[b].failed) or mine[b].detail or 'failed'}" for b in failed
            )
            return evolve(rollout, state="rollback", changed_at=now, reason=f"failed on {why}")
        batch = rollout.batches[rollout.due]
        waiting = [b for b in batch if b not in mine]
        if not waiting:
            if rollout.due + 1 == len(rollout.batches):
                return evolve(rollout, state="done", changed_at=now)
            return evolve(rollout, due=rollout.due + 1, changed_at=now)
        if now - rollout.changed_at >= rollout.batch_timeout:
            return evolve(
                rollout,
                state="rollback",
                changed_at=now,
                reason=f"no report within {rollout.batch_timeout:g}s from {', '.join(waiting)}",
            )
        return None
    if rollout.state == "rollback":
        pending = reverting(rollout, mine)
        if not pending:
            return evolve(rollout, state="failed", changed_at=now)
        if now - rollout.changed_at >= rollout.batch_timeout:
            return evolve(
                rollout,
                state="failed",
                changed_at=now,
                reason=f"{rollout.reason}; not rolled back within "
                f"{rollout.batch_timeout:g}s: {', '.join(pending)}",
            )
    return None


def reverting(rollout: Rollout, reports: Mapping[str, Report]) -> list[str]:
    """The boxes that must still roll back: those that reported this rollout ``done``."""
    return [
        b
        for b in rollout.boxes
        if b in reports and reports[b].id == rollout.id and reports[b].outcome == "done"
    ]


Duty = Literal["deploy", "revert"]


def duty(rollout: Rollout | None, box: str, own: Report | None) -> Duty | None:
    """What ``box``'s agent has to do now: deploy (its batch is due and it has not reported on
    this rollout), revert (the rollout rolls back and it had finished), or nothing."""
    if rollout is None:
        return None
    mine = own is not None and own.id == rollout.id
    if rollout.state == "running" and box in rollout.reached() and not mine:
        return "deploy"
    if rollout.state == "rollback" and mine and own is not None and own.outcome == "done":
        return "revert"
    return None


def describe(rollout: Rollout, reports: Mapping[str, Report]) -> list[str]:
    """One line per box: its batch and its outcome, for the operator."""
    lines = []
    for number, batch in enumerate(rollout.batches):
        for box in batch:
            report = reports.get(box)
            if report is None or report.id != rollout.id:
                what = "not reached" if number > rollout.due else "no report"
            else:
                what = report.outcome
                if report.failed:
                    what += f" (failed: {', '.join(report.failed)})"
                if report.detail:
                    what += f": {report.detail}"
            lines.append(f"  batch {number + 1}: {box}: {what}")
    return lines


@frozen
class Board:
    """The rollout's objects in the mesh bucket. ``clock``: wall time (the record's dates; the
    boxes' clocks agree to seconds, the timeouts are minutes)."""

    store: ObjectStore
    prefix: str
    clock: Callable[[], float]

    async def read(self) -> tuple[Rollout | None, str | None]:
        """The rollout and its ETag, or (None, None) when there is none."""
        key = rollout_key(self.prefix)
        try:
            got = await self.store.get(key)
        except NotFound:
            return None, None
        return Rollout.parse(got.body, key), got.info.etag

    async def report_of(self, box: str) -> Report | None:
        key = report_key(self.prefix, box)
        try:
            got = await self.store.get(key)
        except NotFound:
            return None
        return Report.parse(got.body, key)

    async def reports(self, rollout: Rollout) -> dict[str, Report]:
        """Each box's report on ``rollout`` (boxes whose report is older, or unreadable, are
        left out: a damaged report counts as none, and is logged)."""
        found = {}
        for box in rollout.boxes:
            try:
                report = await self.report_of(box)
            except BadRollout as e:
                _log.error("release: {error}; counted as no report", error=e)
                continue
            if report is not None and report.id == rollout.id:
                found[box] = report
        return found

    async def start(
        self,
        version: str,
        batches: Sequence[Sequence[str]],
        by: str,
        batch_timeout: float = DEFAULT_BATCH_TIMEOUT,
    ) -> Rollout:
        """Create a rollout of ``version``; :class:`RolloutRunning` when one runs (or another
        creator won the race)."""
        check_version(version)
        current, etag = await self.read()
        if current is not None and current.state not in FINAL:
            raise RolloutRunning(running_line(current))
        now = self.clock()
        rollout = Rollout(
            id=f"{int(now)}-{secrets.token_hex(4)}",
            version=version,
            batches=tuple(tuple(b) for b in batches),
            state="running",
            due=0,
            started_at=now,
            changed_at=now,
            by=by,
            batch_timeout=batch_timeout,
        )
        if not rollout.batches or not all(rollout.batches):
            raise RolloutError("a rollout needs at least one box")
        try:
            if etag is None:
                await self.store.put(
                    rollout_key(self.prefix), rollout.to_bytes(), if_none_match=True
                )
            else:
                await self.store.put(rollout_key(self.prefix), rollout.to_bytes(), if_match=etag)
        except PreconditionFailed:
            again, _ = await self.read()
            raise RolloutRunning(
                running_line(again) if again is not None else "another rollout was just started"
            ) from None
        TRANSITIONS.labels("running").inc()
        _log.info(
            "release: rollout {id} of {version} started by {by}: {batches}",
            id=rollout.id,
            version=version,
            by=by,
            batches=" then ".join(",".join(b) for b in rollout.batches),
        )
        return rollout

    async def step(self) -> tuple[Rollout | None, dict[str, Report]]:
        """Advance the rollout once if its reports say so (a conditional PUT: a concurrent step
        that landed first wins, and this one is dropped); the rollout as it is then, and its
        reports."""
        rollout, etag = await self.read()
        if rollout is None:
            return None, {}
        reports = await self.reports(rollout)
        nxt = advance(rollout, reports, self.clock())
        if nxt is None or etag is None:
            return rollout, reports
        return await self._replace(rollout, nxt, etag), reports

    async def abort(self, why: str) -> Rollout:
        """Turn the running rollout to ``rollback`` (boxes that finished go back)."""
        rollout, etag = await self.read()
        if rollout is None or etag is None or rollout.state in FINAL:
            raise RolloutError("no rollout is running: nothing to abort")
        if rollout.state == "rollback":
            return rollout
        nxt = evolve(rollout, state="rollback", changed_at=self.clock(), reason=why)
        return await self._replace(rollout, nxt, etag)

    async def _replace(self, rollout: Rollout, nxt: Rollout, etag: str) -> Rollout:
        try:
            await self.store.put(rollout_key(self.prefix), nxt.to_bytes(), if_match=etag)
        except PreconditionFailed:
            again, _ = await self.read()  # someone else advanced it: theirs stands
            return again if again is not None else rollout
        TRANSITIONS.labels(nxt.state).inc()
        if nxt.state == "running":
            _log.info(
                "release: rollout {id} of {version}: batch {n} of {of} due: {boxes}",
                id=nxt.id,
                version=nxt.version,
                n=nxt.due + 1,
                of=len(nxt.batches),
                boxes=", ".join(nxt.batches[nxt.due]),
            )
        else:
            (_log.info if nxt.state == "done" else _log.error)(
                "release: rollout {id} of {version}: {state}{why}",
                id=nxt.id,
                version=nxt.version,
                state=nxt.state,
                why=f" ({nxt.reason})" if nxt.reason else "",
            )
        return nxt

    async def announce(self, presence: Presence) -> None:
        await self.store.put(agent_key(self.prefix, presence.box), presence.to_bytes())

    async def followers(self, fresh: float) -> list[Presence]:
        """The agents that said which channel they follow within ``fresh`` seconds."""
        prefix = _join(self.prefix, "release", "agents") + "/"
        now = self.clock()
        found = []
        for info in await self.store.list(prefix):
            try:
                got = await self.store.get(info.key)
                presence = Presence.parse(got.body, info.key)
            except NotFound:
                continue
            except BadRollout as e:
                _log.error("release: {error}; skipped", error=e)
                continue
            if now - presence.at <= fresh:
                found.append(presence)
        return found

    async def follow(
        self,
        box: str,
        channel: str,
        target: str,
        channels: Mapping[str, str],
        batch_timeout: float = DEFAULT_BATCH_TIMEOUT,
    ) -> str:
        """``box`` follows ``channel``, which names ``target``, newer than its default build, and
        its window is open: start a rollout of ``target`` over the boxes whose channel names it
        (canary-channel boxes first), or join the one running. What happened, for the log."""
        rollout, etag = await self.read()
        if rollout is not None and rollout.state not in FINAL:
            if rollout.version != target:
                return f"waiting: {running_line(rollout)}"
            if box in rollout.boxes or etag is None:
                return f"in rollout {rollout.id} of {target}"
            joined = evolve(rollout, batches=(*rollout.batches, (box,)))
            landed = await self._replace(rollout, joined, etag)
            if box in landed.boxes:
                return f"joined rollout {rollout.id} of {target} (its last batch)"
            return f"could not join rollout {rollout.id} yet (it changed): next round"
        if rollout is not None and rollout.state == "failed" and rollout.version == target:
            # Retried every minute, a broken build would restart the canaries' spaces forever:
            # a failed version waits for a person (or a newer version on the channel).
            return (
                f"rollout {rollout.id} of {target} failed ({rollout.reason}): not retried by the "
                f"channel; publish a fixed version, or `lchat deploy {target} --fleet` by hand"
            )
        present = await self.followers(fresh=PRESENCE_FRESH)
        on = {p.box: p.channel for p in present if channels.get(p.channel) == target}
        on[box] = channel
        canaries = [b for b, c in on.items() if c == "canary"]
        batches = batches_of(sorted(on), 1, first=sorted(canaries))
        try:
            started = await self.start(target, batches, f"channel {channel} ({box})", batch_timeout)
        except RolloutRunning as e:
            return f"waiting: {e}"
        return f"started rollout {started.id} of {target} on channel {channel}"

    async def report(self, report: Report) -> None:
        await self.store.put(report_key(self.prefix, report.box), report.to_bytes())
        REPORTS.labels(report.outcome).inc()
        (_log.info if report.outcome in ("done", "rolled_back") else _log.error)(
            "release: {box}: rollout {id} of {version}: {outcome}{failed}",
            box=report.box,
            id=report.id,
            version=report.version,
            outcome=report.outcome,
            failed=f" (failed: {', '.join(report.failed)})" if report.failed else "",
        )


# --- release channels ----------------------------------------------------------------------------


@frozen
class Presence:
    """A channel-following agent's last word: ``release/agents/<box>.json``, rewritten each
    round, so a box starting a channel's rollout knows who else follows which channel."""

    box: str
    channel: str
    default: str | None  # its default build then
    at: float

    def to_bytes(self) -> bytes:
        doc = {"box": self.box, "channel": self.channel, "default": self.default, "at": self.at}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"

    @classmethod
    def parse(cls, body: bytes, key: str) -> Presence:
        try:
            doc = json.loads(body)
            default = doc.get("default")
            return cls(
                str(doc["box"]),
                str(doc["channel"]),
                default if isinstance(default, str) else None,
                float(doc["at"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadRollout(f"{key} is not an agent's presence record ({e})") from None


def agent_key(prefix: str, box: str) -> str:
    return _join(prefix, "release", "agents", f"{_box_name(box)}.json")


def channel_target(
    channel: str, channels: Mapping[str, str], default: str | None, released: Mapping[str, str]
) -> str | None:
    """The version ``channel`` names when it is newer than the box's ``default`` build (or the box
    has none), else None: nothing to roll out. Never older (no channel downgrades a box: its
    spaces' build floors would refuse it), never a version without a known order."""
    target = channels.get(channel)
    if target is None or target == default:
        return None
    if default is None:
        return target
    order = compare_versions(target, default, released)
    return target if order is not None and order > 0 else None


def running_line(rollout: Rollout) -> str:
    return (
        f"rollout {rollout.id} of {rollout.version} is {rollout.state} (started by {rollout.by}, "
        f"batch {rollout.due + 1} of {len(rollout.batches)}): watch it with `lchat deploy "
        f"--fleet --resume`, or stop it with `lchat deploy --fleet --abort`"
    )
