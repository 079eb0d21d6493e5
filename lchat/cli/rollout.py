"""``lchat deploy <v> --fleet`` (start, watch, resume or abort a fleet rollout) and ``lchat release
agent`` (a box's part in it), over the rollout's objects in the mesh bucket
(lchat.release.rollout; docs/operations.md, "Deploys on a mesh").

The agent runs as root (``lchat-release.service``: it writes ``/opt/lchat``), every minute. One
round: with ``LCHAT_RELEASE_CHANNEL`` set, read the feed and start or join the rollout of the
channel's newer build inside ``LCHAT_RELEASE_WINDOW`` (:func:`follow_channel`); advance the rollout
if its reports say so; then do this box's duty, if any:

- *deploy*: fetch the build when it is not installed, deploy it to every space of the box
  (:meth:`lchat.release.deploy.Deployer.deploy`, health-gated per always-on host), then set the
  box's default build; report ``done``. When a host fails, the deployer has put it back; the
  hosts moved before it are rolled back here, the default is left alone; report ``failed``.
- *revert* (the rollout rolls back, and this box had finished): the default build returns to
  the one before, the hosts to the version they had; a hibernating space that already woke on
  the new build is refused by the rollback guard and stays on it (its build floor would lift it
  anyway). Report ``rolled_back``, or ``rollback_failed`` when an always-on host did not come
  back.

Bucket work runs on a reactor of its own per call (:func:`lchat.cli.runner.run`); the deploy
itself is the synchronous deployer's, between those calls.
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from lchat.buckets import open_mesh_bucket
from lchat.builds import DEFAULT_LINK, check_version
from lchat.cli import runner
from lchat.cli.mesh import read_mesh_members
from lchat.cli.release import (
    ERRORS,
    OpenRegistry,
    Out,
    feed_fetcher,
    fetch_build,
    make_deployer,
    need_router,
)
from lchat.config import BoxConfig, mesh_bucket
from lchat.mesh.placement import normalise_member_url
from lchat.objstore import ObjectStoreError
from lchat.reactors import Reactor
from lchat.release import deploy as deploy_mod
from lchat.release import feed as feedlib
from lchat.release import rollout as rollout_mod
from lchat.release import settings as settings_mod
from lchat.release.deploy import Deployer
from lchat.release.rollout import Board, Presence, Report, Rollout, RolloutError
from lchat.release.settings import ReleaseSettings

BUCKET_BUDGET = 60.0  # seconds for one round of bucket work (a few GETs and a PUT)
CLOCK_SKEW = (
    60.0  # boxes' clocks agree closer than this: a host's deploy record vs a rollout's start
)

_T = TypeVar("_T")


def _need_mesh(cfg: BoxConfig) -> None:
    if cfg.mesh is None:
        raise RolloutError(
            "this box is not on a mesh (LCHAT_MESH_SELF is not set): a fleet rollout goes "
            "through the mesh bucket; on a single box use `lchat deploy <v> --all`"
        )


def _on_board(cfg: BoxConfig, work: Callable[[Board], Coroutine[Any, Any, _T]]) -> _T:
    """``work(board)`` on the mesh bucket, on a reactor of its own."""
    _need_mesh(cfg)

    async def main(reactor: Reactor) -> _T:
        store = await open_mesh_bucket(reactor, cfg)
        try:
            return await work(Board(store, mesh_bucket(cfg).prefix, time.time))
        finally:
            await store.close()

    return runner.run(main, BUCKET_BUDGET)


# --- lchat deploy --fleet ------------------------------------------------------------------------


def run_fleet(args: argparse.Namespace, cfg: BoxConfig, out: Out) -> int:
    """Start (or ``--resume``/``--abort``) the fleet rollout and watch it to its end: 0 when every
    box is on the version, 1 when it failed (every box's outcome printed)."""
    _need_mesh(cfg)
    if not 0 < args.poll <= 3600 or not 0 < args.batch_timeout <= 86400:
        raise RolloutError("--poll must be in (0, 3600] and --batch-timeout in (0, 86400] seconds")
    if args.abort:
        rollout = _on_board(cfg, lambda b: b.abort(f"aborted by {cfg.box_id}"))
        out(f"rollout {rollout.id} of {rollout.version}: rolling back (aborted)")
    elif args.resume:
        found, _ = _on_board(cfg, lambda b: b.read())
        if found is None:
            raise RolloutError("no rollout to resume")
        rollout = found
    else:
        if not args.version:
            raise RolloutError("which version? `lchat deploy <version> --fleet`")
        version = check_version(args.version)
        members = runner.run(lambda r: read_mesh_members(r, cfg), BUCKET_BUDGET)
        boxes = sorted(normalise_member_url(m.url) for m in members)  # as each agent's box_id
        if not boxes:
            raise RolloutError("no live member in the mesh bucket: nothing to deploy to")
        batches = rollout_mod.batches_of(boxes, args.batch_boxes)
        rollout = _on_board(
            cfg, lambda b: b.start(version, batches, cfg.box_id, args.batch_timeout)
        )
        out(
            f"rollout {rollout.id} of {version} started: "
            + " then ".join(f"[{', '.join(b)}]" for b in rollout.batches)
        )
    return watch(cfg, rollout, out, args.poll)


def watch(cfg: BoxConfig, rollout: Rollout, out: Out, poll: float) -> int:
    """Advance and print the rollout until it is done (0) or failed (1)."""
    seen = (rollout.state, rollout.due)
    while True:
        try:
            current, reports = _on_board(cfg, lambda b: b.step())
        except (ObjectStoreError, TimeoutError) as e:
            # The rollout goes on without its watcher (the agents advance it): a bucket that
            # does not answer for a moment must not end the watch.
            out(f"the bucket did not answer ({e}); trying again in {poll:g}s")
            time.sleep(poll)  # a synchronous CLI: no reactor runs between two reads
            continue
        if current is None or current.id != rollout.id:
            raise RolloutError(f"rollout {rollout.id} is gone from the bucket (replaced?)")
        if (current.state, current.due) != seen:
            seen = (current.state, current.due)
            if current.state == "running":
                out(
                    f"batch {current.due + 1} of {len(current.batches)} due: "
                    + ", ".join(current.batches[current.due])
                )
            else:
                out(
                    f"rollout {current.id}: {current.state}"
                    + (f": {current.reason}" if current.reason else "")
                )
        if current.state in rollout_mod.FINAL:
            for line in rollout_mod.describe(current, reports):
                out(line)
            return 0 if current.state == "done" else 1
        time.sleep(poll)  # a synchronous CLI: each read runs a reactor of its own (runner.run)


# --- lchat release agent --------------------------------------------------------------------------


def run_agent(
    args: argparse.Namespace, cfg: BoxConfig, open_registry: OpenRegistry, out: Out
) -> int:
    """One round (``--once``), or rounds every ``--interval`` seconds until stopped."""
    _need_mesh(cfg)
    if not 0 < args.interval <= 86400:
        raise RolloutError("--interval must be between 0 and 86400 seconds")
    while True:
        code = agent_round(args, cfg, open_registry, out)
        if args.once:
            return code
        time.sleep(args.interval)  # a synchronous CLI between rounds (the timer runs --once)


def agent_round(
    args: argparse.Namespace, cfg: BoxConfig, open_registry: OpenRegistry, out: Out
) -> int:
    box = cfg.box_id
    settings = settings_mod.read(cfg.file_env)
    if settings.channel:
        try:
            follow_channel(cfg, settings, box, out)
        except (ObjectStoreError, TimeoutError, RolloutError) as e:
            # Following the channel waits for the next round; this box's part in a running
            # rollout does not.
            out(f"release agent: channel {settings.channel}: {e}; next round")

    async def look(board: Board) -> tuple[Rollout | None, Report | None]:
        rollout, _ = await board.step()
        return rollout, await board.report_of(box)

    rollout, own = _on_board(cfg, look)
    todo = rollout_mod.duty(rollout, box, own)
    if todo is None or rollout is None:
        out(
            "release agent: nothing to do"
            + (f" (rollout {rollout.id} of {rollout.version}: {rollout.state})" if rollout else "")
        )
        return 0
    out(f"release agent: rollout {rollout.id}: {todo} {rollout.version} on {box}")
    if todo == "deploy":
        report = _deploy_box(args, cfg, open_registry, out, rollout, box)
    else:
        assert own is not None
        report = _revert_box(args, cfg, open_registry, out, rollout, own)

    async def tell(board: Board) -> None:
        await board.report(report)
        await board.step()

    _on_board(cfg, tell)
    out(f"release agent: reported {report.outcome}")
    return 0 if report.outcome in ("done", "rolled_back") else 1


def follow_channel(cfg: BoxConfig, settings: ReleaseSettings, box: str, out: Out) -> None:
    """Read the feed (verified, never older than the newest this box accepted), say which
    channel this box follows, and start or join the rollout of the channel's version when it is
    newer than the box's default build and the window is open. A feed that cannot be read is
    said and skipped: a rollout already running still goes on."""
    channel = settings.channel
    default = settings.layout.version_of(DEFAULT_LINK)

    async def read_feed(reactor: Reactor) -> feedlib.Feed:
        async with feed_fetcher(reactor, cfg, settings) as fetcher:
            feed, _, _ = await fetcher.feed()
        return feed

    try:
        feed = runner.run(read_feed, BUCKET_BUDGET)
    except (*ERRORS, TimeoutError) as e:
        out(f"release agent: channel {channel}: the feed could not be read: {e}")
        return
    released = {v: r.released_at for v, r in feed.versions.items()}
    target = rollout_mod.channel_target(channel, feed.channels, default, released)
    presence = Presence(box, channel, default, time.time())
    if target is None:
        _on_board(cfg, lambda b: b.announce(presence))
        out(
            f"release agent: channel {channel} names {feed.channels.get(channel) or 'nothing'}; "
            f"this box's default build is {default or '-'}: nothing to roll out"
        )
        return
    now = datetime.datetime.now(datetime.UTC)
    if not settings.in_window(now):
        _on_board(cfg, lambda b: b.announce(presence))
        out(
            f"release agent: channel {channel} names {target}, newer than {default or '-'}: "
            f"waiting for LCHAT_RELEASE_WINDOW={settings.window} (UTC)"
        )
        return

    async def follow(board: Board) -> str:
        await board.announce(presence)
        return await board.follow(box, channel, target, feed.channels)

    out(f"release agent: channel {channel}: {_on_board(cfg, follow)}")


def _deploy_box(
    args: argparse.Namespace,
    cfg: BoxConfig,
    open_registry: OpenRegistry,
    out: Out,
    rollout: Rollout,
    box: str,
) -> Report:
    version = rollout.version
    settings = settings_mod.read(cfg.file_env)
    previous = settings.layout.version_of(DEFAULT_LINK)

    def report(outcome: rollout_mod.Outcome, failed: list[str], detail: str = "") -> Report:
        return Report(
            rollout.id, version, box, outcome, tuple(failed), previous, time.time(), detail
        )

    try:
        if version not in settings.layout.installed():
            fetch_build(version, cfg, settings, out)
        deployer, hosts = make_deployer(args, cfg, open_registry(cfg), out)
    except ERRORS as e:
        out(f"release agent: {e}")
        return report("failed", [], str(e))
    try:
        if hosts:
            need_router(cfg, deployer, hosts)
            code = deployer.deploy(version, hosts, canary=False, batch=1)
        else:
            code = 0
        if code == 0:
            deployer.set_default(version)
            return report("done", [])
    except ERRORS as e:
        out(f"release agent: {e}")
        failed, detail = list(deployer.failed_hosts), str(e)
    else:
        failed, detail = list(deployer.failed_hosts), ""
    try:
        _undo(deployer, hosts, rollout, out)  # the hosts it moved before the failure go back
    except ERRORS as e:
        out(f"release agent: {e}")
        detail = f"{detail}; putting the moved hosts back: {e}".lstrip("; ")
    return report("failed", failed, detail)


def _revert_box(
    args: argparse.Namespace,
    cfg: BoxConfig,
    open_registry: OpenRegistry,
    out: Out,
    rollout: Rollout,
    own: Report,
) -> Report:
    try:
        deployer, hosts = make_deployer(args, cfg, open_registry(cfg), out)
        if own.previous is not None:
            deployer.set_default(own.previous)
        failed = _undo(deployer, hosts, rollout, out)
    except ERRORS as e:
        out(f"release agent: {e}")
        return _again(own, "rollback_failed", [], str(e))
    return _again(own, "rollback_failed" if failed else "rolled_back", failed)


def _again(
    own: Report, outcome: rollout_mod.Outcome, failed: list[str], detail: str = ""
) -> Report:
    return Report(
        own.id, own.version, own.box, outcome, tuple(failed), own.previous, time.time(), detail
    )


def _undo(deployer: Deployer, hosts: list[str], rollout: Rollout, out: Out) -> list[str]:
    """Roll back the hosts this rollout moved here; the always-on ones that did not come back.
    A hibernating space that already woke on the new build is refused by the rollback guard and
    stays on it: not a failure (its build floor refuses an older build; migrations are
    additive)."""
    states = deploy_mod.read_states(deployer.layout)
    moved = [
        h
        for h in hosts
        if (s := states.get(h)) is not None
        and s.version == rollout.version
        and s.previous is not None
        and s.at >= rollout.started_at - CLOCK_SKEW
    ]
    failed = []
    for host in moved:
        if deployer.rollback([host]) != 0 and not deployer.route(host).hibernate:
            failed.append(host)
    if moved:
        need = "" if not failed else f"; still not back: {', '.join(failed)}"
        out(f"release agent: rolled back {', '.join(moved)}{need}")
    return failed
