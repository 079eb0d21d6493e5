"""The build floor at a wake: a space never wakes on a build older than the newest it has run, on
any box (docs/operations.md, "The build floor").

The floor is ``<prefix>/<host>/build.json`` in the bucket (:class:`lchat.builds.BuildRecord`),
beside the space's lease and replica, so it travels with the space. Under the lease and before
the spawn, :meth:`BuildFloor.hold` reads it (one GET) and compares it with the build the host's
live link resolves to on this box (:func:`lchat.builds.compare_versions`):

- no record, or the link's build is newer: the record is written (a conditional PUT: created
  only if absent, else only over the version read) before the spawn, so a build that runs a
  migration is on record before it can run it;
- the link's build is older than the floor: the floor's own build runs instead when it is
  installed here (``versions/<floor>/``), else the wake fails ``503 build_behind``
  (Retry-After 30 s) with a log line naming the fix;
- the two have no known order (names such as hashes): the floor cannot be enforced; the wake goes
  on, the record is rewritten to the build run (the rollback guard still sees it), and a warning
  names why, once per host;
- a record that cannot be parsed is left as it is (never overwritten: it is evidence) and the
  wake goes on, with an error naming the key, once per host.

A build that lies in no version tree (``LCHAT_SPACE_COMMAND`` not under ``<opt>/live/``) has no
version: nothing is read or written. Only one writer is possible: the record is written only
under the space's lease. Every change of the record is counted in
``lchat_build_floor_writes_total{why}``, every wake lifted onto the floor's build in
``lchat_build_floor_lifts_total``; a refusal is ``lchat_wakes_total{outcome="build_behind"}``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from attrs import define, field, frozen
from prometheus_client import Counter
from twisted.logger import Logger

from lchat import builds
from lchat.builds import BadRecord, BuildLayout, BuildRecord
from lchat.hibernation.space import WakeFailed
from lchat.objstore import NotFound, ObjectStore, ObjectStoreError, PreconditionFailed
from lchat.release.feed import FeedError
from lchat.release.fetch import read_state
from lchat.threads import RunInThread

_log = Logger(namespace="lchat.activator")

BEHIND_RETRY = 30.0  # Retry-After of a build_behind refusal: an operator has to install a build
# How long a build_behind refusal is answered from memory before a wake looks again (the
# activator's; not its growing wake backoff: the space is not failing, this box is behind, and
# once the build is installed the next wake within this long takes it).
BEHIND_RECHECK = 5.0
WRITES = Counter(
    "lchat_build_floor_writes_total",
    "Build records written in the bucket (first: a space's first, raised: a newer build, "
    "unordered: a build with no known order against the record)",
    ["why"],
)
LIFTS = Counter(
    "lchat_build_floor_lifts_total",
    "Wakes that ran the space's floor build because the live link was older",
)


async def read(store: ObjectStore, prefix: str, host: str) -> BuildRecord | None:
    """``host``'s build record in the bucket, or None (none yet). Raises the store's errors and
    :class:`lchat.builds.BadRecord`."""
    try:
        got = await store.get(builds.record_key(prefix, host))
    except NotFound:
        return None
    return BuildRecord.parse(got.body)


def sidecar_argv(argv: list[str], lifted_to: str | None) -> list[str] | None:
    """The bot sidecar's ``argv`` for a wake whose space ran ``lifted_to`` (the floor's build
    directory) instead of its live link's: that build's sidecar, when ``argv`` runs a build of a
    version tree; None when that build has none (the link's older bot must not run beside it).
    ``argv`` as it is when the wake was not lifted, or its program lies in no version tree."""
    if lifted_to is None or not argv:
        return argv
    program = os.path.realpath(argv[0]) if os.path.isabs(argv[0]) else argv[0]
    if builds.version_in(program) is None:
        return argv
    bot = os.path.join(lifted_to, builds.SIDECAR_BINARY)
    return [bot, *argv[1:]] if _runnable(bot) else None


@frozen
class _Looked:
    """What the filesystem says about a wake's build (read in a thread)."""

    program: str  # argv[0] as the command gives it
    build: str  # its real path
    version: str | None  # versions/<v>/ it lies in
    layout: BuildLayout | None  # the tree holding it
    released: dict[str, str]  # the feed's order (empty: unknown, or unreadable)
    order_problem: str  # why the feed's order could not be read ("" when it could, or is absent)


def _look(program: str) -> _Looked:
    build = os.path.realpath(program) if os.path.isabs(program) else program
    layout = BuildLayout.holding(build)
    released: dict[str, str] = {}
    problem = ""
    if layout is not None:
        try:
            state = read_state(layout.release_state)
        except FeedError as e:
            problem = str(e)
        else:
            released = dict(state.released) if state is not None else {}
    return _Looked(program, build, builds.version_in(build), layout, released, problem)


def _runnable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


@define
class BuildFloor:
    """Holds every wake on this box to its space's floor. Collaborators are given here."""

    store: ObjectStore
    prefix: str  # LCHAT_HIBERNATE_PREFIX
    box: str  # LCHAT_BOX_ID: named in the records this box writes
    run_in_thread: RunInThread
    clock: Callable[[], float] = time.time
    _warned: set[tuple[str, str]] = field(factory=set)  # (host, what): said once per host

    async def hold(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` to run ``host`` on: as given, or with the floor's build as its program.
        Raises :class:`WakeFailed` (``build_behind``: below the floor with its build missing
        here; ``bucket``: the record could not be read or written)."""
        if not argv:
            return argv
        looked = await self.run_in_thread(_look, argv[0])
        if looked.version is None:
            return argv  # no version to compare: nothing to hold it to
        if looked.order_problem:
            self._warn_once(
                host,
                "order",
                "activator: {host}: the feed's order of builds is unknown ({problem}); "
                "comparing release numbers only",
                problem=looked.order_problem,
            )
        key = builds.record_key(self.prefix, host)
        for last in (False, True):
            try:
                return await self._hold(host, key, argv, looked)
            except PreconditionFailed as e:
                # Written since our read (a box before this lease's time, or a stray write):
                # read it again and decide afresh, once.
                if last:
                    raise WakeFailed(
                        host, "bucket", f"{key} keeps changing under the lease: {e}"
                    ) from e
            except ObjectStoreError as e:
                raise WakeFailed(host, "bucket", f"the build record {key}: {e}") from e
        raise AssertionError("unreachable")

    async def _hold(self, host: str, key: str, argv: list[str], looked: _Looked) -> list[str]:
        version = looked.version
        assert version is not None
        try:
            got = await self.store.get(key)
        except NotFound:
            await self._write(host, key, version, None, "first")
            return argv
        try:
            floor = BuildRecord.parse(got.body)
        except BadRecord as e:
            self._warn_once(
                host,
                "bad",
                "activator: {host}: {key} is not a build record ({error}): its build floor "
                "cannot be enforced; left as it is: delete it (the next wake writes a new one) "
                "or fix it",
                key=key,
                error=e,
                level="error",
            )
            return argv
        order = builds.compare_versions(version, floor.version, looked.released)
        if order is None:
            self._warn_once(
                host,
                "unordered",
                "activator: {host}: live link is {version}, it ran {floor}: these builds have "
                "no known order (not both in the feed, not both release numbers), so the build "
                "floor cannot be enforced; waking on {version} and recording it",
                version=version,
                floor=floor.version,
            )
            await self._write(host, key, version, got.info.etag, "unordered")
            return argv
        if order > 0:
            await self._write(host, key, version, got.info.etag, "raised", floor.version)
            return argv
        if order == 0:
            return argv
        return await self._lift(host, argv, looked, floor)

    async def _lift(
        self, host: str, argv: list[str], looked: _Looked, floor: BuildRecord
    ) -> list[str]:
        """The link's build is older than the floor: the floor's build, when installed here."""
        assert looked.layout is not None
        binary = os.path.join(
            looked.layout.build_dir(floor.version), os.path.basename(looked.build)
        )
        if await self.run_in_thread(_runnable, binary):
            LIFTS.inc()
            _log.warn(
                "activator: {host}: live link is {version}, but it ran {floor}: waking on {floor}",
                host=host,
                version=looked.version,
                floor=floor.version,
            )
            return [binary, *argv[1:]]
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(floor.at))
        _log.error(
            "activator: {host}: live link is {version}, but it ran {floor} (on {box} at {when}), "
            "which is not installed here ({binary} missing): not woken; fetch it: "
            "`lchat release fetch {floor}` (or deploy {floor} or newer to it)",
            host=host,
            version=looked.version,
            floor=floor.version,
            box=floor.box or "a box",
            when=when,
            binary=binary,
        )
        raise WakeFailed(
            host,
            "build_behind",
            f"{host} ran {floor.version}, newer than {looked.version} here, which is not installed",
            BEHIND_RETRY,
        )

    async def _write(
        self,
        host: str,
        key: str,
        version: str,
        etag: str | None,
        why: str,
        before: str | None = None,
    ) -> None:
        """The record of ``version``, created (``etag`` None) or replacing that version only."""
        record = BuildRecord(version=version, at=self.clock(), box=self.box)
        if etag is None:
            await self.store.put(key, record.to_bytes(), if_none_match=True)
        else:
            await self.store.put(key, record.to_bytes(), if_match=etag)
        WRITES.labels(why).inc()
        _log.info(
            "activator: {host}: build floor {before} -> {version}",
            host=host,
            before=before or "-",
            version=version,
        )

    def _warn_once(
        self, host: str, what: str, text: str, level: str = "warn", **kw: object
    ) -> None:
        if (host, what) in self._warned:
            return
        if len(self._warned) > 10_000:
            self._warned.clear()
        self._warned.add((host, what))
        (_log.error if level == "error" else _log.warn)(text, host=host, **kw)
