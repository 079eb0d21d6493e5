"""``lchat release fetch|list|publish|refresh|keygen``, ``lchat deploy`` and ``lchat rollback``: space
builds from the signed feed, and switching this box's spaces between them
(lchat.release; docs/operations.md, "Releases" and "Deploys and rollbacks")."""

from __future__ import annotations

import argparse
import datetime
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lchat import hosts as hostnames
from lchat.admin_client import SocketAdmin
from lchat.buckets import open_bucket
from lchat.builds import BadRecord, BadVersion, BuildRecord, check_version
from lchat.cli import runner
from lchat.config import BoxConfig
from lchat.handover.hibernate import ACTIVATOR_BUSY
from lchat.handover.router import Router, Say
from lchat.hibernation import floor as floor_mod
from lchat.objstore import ObjectStore, ObjectStoreError
from lchat.reactors import Reactor
from lchat.registry import Registry
from lchat.release import deploy as deploy_mod
from lchat.release import feed as feedlib
from lchat.release import settings as settings_mod
from lchat.release.deploy import (
    Deployer,
    DeployError,
    Restarter,
    RouterRestarter,
    SystemdRestarter,
)
from lchat.release.feed import FeedError
from lchat.release.fetch import BucketSource, FeedSource, Fetcher, HttpSource, http_client
from lchat.release.publish import BucketTarget, DirectoryTarget, PublishTarget, publish, refresh
from lchat.release.rollout import RolloutError
from lchat.release.settings import ReleaseSettings, SettingsError

RELEASE_SUMMARY = "fetch, list and publish space builds from the signed release feed"
DEPLOY_SUMMARY = (
    "switch spaces to a build: one space (canary), this box (all), or every mesh box (fleet)"
)
ROLLBACK_SUMMARY = "return spaces to the build they ran before their last deploy"
DEFAULT_TIMEOUT = 30.0

Out = Callable[[str], None]
Fail = Callable[[str], int]
LoadConfig = Callable[[argparse.Namespace], BoxConfig]
OpenRegistry = Callable[[BoxConfig], Registry]

FLOOR_READ_BUDGET = 30.0  # seconds for one read of a space's build floor in the bucket
ERRORS = (FeedError, DeployError, SettingsError, ObjectStoreError, BadVersion, RolloutError)
Run = Callable[[argparse.Namespace, LoadConfig, OpenRegistry, Out], int]


def handler(
    run: Run, load_config: LoadConfig, open_registry: OpenRegistry, out: Out, fail: Fail
) -> Callable[[argparse.Namespace], int]:
    """``run`` as a command handler: this module's refusals become one ``lchat: error:`` line."""

    def handle(args: argparse.Namespace) -> int:
        try:
            return run(args, load_config, open_registry, out)
        except ERRORS as e:
            return fail(str(e))

    return handle


# --- arguments -------------------------------------------------------------------------------------


def add_release_arguments(
    parser: argparse.ArgumentParser, add_common: Callable[[argparse.ArgumentParser], None]
) -> None:
    actions = parser.add_subparsers(dest="release_action", metavar="<action>", required=True)
    sub = actions.add_parser("fetch", help="download, verify and install a build")
    add_common(sub)
    sub.add_argument("version", help="the version to install into <opt>/versions/")
    sub = actions.add_parser("list", help="installed builds, the hosts on each, and the feed's")
    add_common(sub)
    sub.add_argument("--offline", action="store_true", help="do not read the feed")
    sub = actions.add_parser("publish", help="(release host) add a build to the feed and sign it")
    add_common(sub)
    sub.add_argument("version", help="the new version's name")
    sub.add_argument("directory", help="the build: a directory with 'space' (and 'space-bot')")
    sub.add_argument(
        "--channel",
        choices=feedlib.CHANNELS,
        help="this release channel now names the new version: boxes following it "
        "(LCHAT_RELEASE_CHANNEL) roll it out inside their LCHAT_RELEASE_WINDOW",
    )
    _publish_targets(sub)
    sub = actions.add_parser(
        "refresh",
        help="(release host) re-sign the feed with a new expiry (LCHAT_RELEASE_FEED_VALIDITY), "
        "same builds: run it daily",
    )
    add_common(sub)
    _publish_targets(sub)
    sub = actions.add_parser(
        "agent",
        help="(root, lchat-release.timer) do this box's part of a fleet rollout "
        "(`lchat deploy --fleet`), and follow LCHAT_RELEASE_CHANNEL inside its window",
    )
    add_common(sub)
    sub.add_argument("--once", action="store_true", help="one round, then exit (the timer's way)")
    sub.add_argument(
        "--interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="without --once: the pause between rounds (default 60)",
    )
    _timeout(sub)
    sub = actions.add_parser("keygen", help="(release host) make a signing key pair")
    add_common(sub)
    sub.add_argument("--out", required=True, metavar="FILE", help="where to write the private key")


def _publish_targets(sub: argparse.ArgumentParser) -> None:
    """The signing key, and where the feed goes."""
    sub.add_argument("--key", required=True, metavar="FILE", help="the Ed25519 private key (PEM)")
    sub.add_argument("--to", metavar="DIR", help="write into DIR (served as LCHAT_RELEASE_URL)")
    sub.add_argument(
        "--mirror",
        action="store_true",
        help="upload to the S3 mirror (LCHAT_RELEASE_MIRROR_URL)",
    )


def add_deploy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "version",
        nargs="?",
        help="an installed version (lchat release fetch); with --fleet, one in the feed",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--canary", metavar="HOST", help="deploy to this one space first")
    which.add_argument(
        "--all",
        action="store_true",
        help="every space registered on this box, then the box's default build (live/_default)",
    )
    which.add_argument(
        "--fleet",
        action="store_true",
        help="every box of the mesh, --batch-boxes at a time, through the bucket: each box's "
        'release agent deploys it to all its spaces (docs/operations.md, "Deploys on a mesh")',
    )
    parser.add_argument(
        "--batch-boxes",
        type=_positive_int,
        default=1,
        metavar="K",
        help="with --fleet: boxes deploying together (default 1); a failed box rolls the rollout "
        "back",
    )
    parser.add_argument(
        "--batch-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="with --fleet: how long a batch of boxes has to report before the rollout rolls "
        "back (default 1800; agents run every minute)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="with --fleet: how often the rollout is read while watching it (default 5)",
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="with --fleet: watch the running rollout again (its orchestrator died)",
    )
    resume.add_argument(
        "--abort",
        action="store_true",
        help="with --fleet: roll the running rollout back (finished boxes return), and watch it",
    )
    parser.add_argument(
        "--batch",
        type=_positive_int,
        default=1,
        metavar="N",
        help="spaces switched together with --all (default 1); a failed batch stops the rollout",
    )
    _timeout(parser)


def add_rollback_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("host", nargs="?", help="the space to roll back")
    which.add_argument("--all", action="store_true", help="every space with a previous version")
    _timeout(parser)


def _timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long an always-on space has to answer after its restart (default "
        f"{DEFAULT_TIMEOUT:g})",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


# --- release -------------------------------------------------------------------------------------


def run_release(
    args: argparse.Namespace, load_config: LoadConfig, open_registry: OpenRegistry, out: Out
) -> int:
    if args.release_action == "keygen":
        return _keygen(args.out, out)
    cfg = load_config(args)
    settings = settings_mod.read(cfg.file_env)
    if args.release_action in ("publish", "refresh"):
        return _publish(args, cfg, settings, out)
    if args.release_action == "list":
        return _list(args, cfg, settings, open_registry, out)
    if args.release_action == "agent":
        from lchat.cli import rollout as rollout_cli  # it builds on this module's deployer

        return rollout_cli.run_agent(args, cfg, open_registry, out)
    return fetch_build(args.version, cfg, settings, out)


def _keygen(path: str, out: Out) -> int:
    key = Ed25519PrivateKey.generate()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise FeedError(f"{path} exists: refusing to overwrite a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(feedlib.private_key_pem(key))
        os.fsync(f.fileno())
    out(f"private key written to {path} (mode 0600): keep it on the release host only")
    out(f"LCHAT_RELEASE_PUBKEY={feedlib.public_key_text(key.public_key())}")
    return 0


def _pubkey(cfg: BoxConfig, settings: ReleaseSettings) -> Any:
    if not settings.pubkey:
        raise SettingsError(
            f"LCHAT_RELEASE_PUBKEY is not set (in {cfg.env_file}): without it no feed can be "
            "verified"
        )
    return feedlib.public_key_from_text(settings.pubkey)


async def _mirror_store(reactor: Reactor, cfg: BoxConfig, settings: ReleaseSettings) -> ObjectStore:
    assert settings.mirror is not None
    what = "LCHAT_RELEASE_MIRROR_URL"
    return await open_bucket(reactor, cfg, settings.mirror, what=what, make_dir=True)


@asynccontextmanager
async def feed_fetcher(
    reactor: Reactor, cfg: BoxConfig, settings: ReleaseSettings
) -> AsyncIterator[Fetcher]:
    """The feed's fetcher; the mirror's store is closed on leaving."""
    pubkey = _pubkey(cfg, settings)
    primary: FeedSource | None = (
        HttpSource(settings.url, http_client(reactor), reactor) if settings.url else None
    )
    mirror: FeedSource | None = None
    store = None
    if settings.mirror is not None:
        store = await _mirror_store(reactor, cfg, settings)
        mirror = BucketSource(store, settings.mirror.prefix, settings.mirror_url)
    try:
        yield Fetcher(
            layout=settings.layout,
            pubkey=pubkey,
            state_file=settings.state_file,
            primary=primary,
            mirror=mirror,
        )
    finally:
        if store is not None:
            await store.close()


def fetch_build(version: str, cfg: BoxConfig, settings: ReleaseSettings, out: Out) -> int:
    check_version(version)
    _pubkey(cfg, settings)  # refuse before any network

    async def main(reactor: Reactor) -> tuple[str, str, str]:
        async with feed_fetcher(reactor, cfg, settings) as fetcher:
            what, release, source = await fetcher.fetch(version)
        return what, source, settings.layout.build_dir(release.version)

    what, source, where = runner.run(main)
    out(f"{version}: {what} in {where} (feed from the {source})")
    return 0


def _list(
    args: argparse.Namespace,
    cfg: BoxConfig,
    settings: ReleaseSettings,
    open_registry: OpenRegistry,
    out: Out,
) -> int:
    layout = settings.layout
    feed_versions: dict[str, str] = {}
    feed_line = "feed: not read (--offline)"
    if not args.offline:

        async def main(reactor: Reactor) -> tuple[feedlib.Feed, str]:
            async with feed_fetcher(reactor, cfg, settings) as fetcher:
                feed, source, _ = await fetcher.feed()
            return feed, source

        feed, source = runner.run(main)
        feed_versions = {v: r.released_at for v, r in feed.versions.items()}
        feed_line = (
            f"feed: feed_version {feed.feed_version} from the {source}, expires {feed.expires_at}"
        )
    routes = [r for r in open_registry(cfg).load() if r.kind == "instance" and not r.elsewhere]
    on = Counter(v for r in routes if (v := layout.version_of(r.host)) is not None)  # hosts on each
    installed = set(layout.installed())
    rows = [("VERSION", "INSTALLED", "HOSTS", "IN-FEED", "RELEASED")]
    for version in sorted(installed | set(feed_versions) | set(on)):
        rows.append(
            (
                version,
                "yes" if version in installed else "no",
                str(on[version]),
                "yes" if version in feed_versions else ("?" if args.offline else "no"),
                feed_versions.get(version) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    out(feed_line)
    return 0


def _publish(args: argparse.Namespace, cfg: BoxConfig, settings: ReleaseSettings, out: Out) -> int:
    if not args.to and not args.mirror:
        raise FeedError("give --to DIR and/or --mirror: nowhere to publish to")
    if args.mirror and settings.mirror is None:
        raise SettingsError("--mirror: LCHAT_RELEASE_MIRROR_URL is not set")
    try:
        with open(args.key, "rb") as f:
            key = feedlib.load_private_key(f.read(), args.key)
    except OSError as e:
        raise FeedError(f"--key {args.key}: {e.strerror or e}") from None
    refreshing = args.release_action == "refresh"
    if not refreshing and not os.path.isdir(args.directory):
        raise FeedError(f"{args.directory} is not a directory")
    to = os.path.abspath(args.to) if args.to else None

    async def main(reactor: Reactor) -> feedlib.Feed:
        targets: list[PublishTarget] = [DirectoryTarget(to)] if to is not None else []
        store = await _mirror_store(reactor, cfg, settings) if args.mirror else None
        if store is not None:
            assert settings.mirror is not None
            targets.append(BucketTarget(store, settings.mirror.prefix, settings.mirror_url))
        now = datetime.datetime.now(datetime.UTC)
        try:
            if refreshing:
                return await refresh(key, targets, now, settings.feed_validity)
            return await publish(
                args.version,
                args.directory,
                key,
                targets,
                now,
                settings.feed_validity,
                channel=args.channel or "",
            )
        finally:
            if store is not None:
                await store.close()

    feed = runner.run(main)
    where = " and ".join(filter(None, [args.to, settings.mirror_url if args.mirror else ""]))
    what = "refreshed the feed" if refreshing else f"published {args.version}"
    if not refreshing and args.channel:
        what += f" on channel {args.channel}"
    out(
        f"{what} as feed_version {feed.feed_version} {'on' if refreshing else 'to'} {where} "
        f"({len(feed.versions)} versions listed), expires {feed.expires_at}"
    )
    return 0


# --- deploy and rollback -------------------------------------------------------------------------


def make_deployer(
    args: argparse.Namespace, cfg: BoxConfig, registry: Registry, out: Out
) -> tuple[Deployer, list[str]]:
    settings = settings_mod.read(cfg.file_env)
    runs = cfg.space_command[0] if cfg.space_command else ""
    expected = settings.layout.live_link("{host}")
    if os.path.normpath(runs) != expected:
        raise DeployError(
            f"LCHAT_SPACE_COMMAND runs {runs!r}, not {expected}: switching live links would "
            "change nothing this router runs (set LCHAT_SPACE_COMMAND, or LCHAT_OPT_DIR)"
        )
    routes = {r.host: r for r in registry.load() if r.kind == "instance" and not r.elsewhere}
    admin = SocketAdmin(cfg.admin_socket)
    restarter: Restarter = SystemdRestarter() if cfg.units == "systemd" else RouterRestarter(admin)
    router = Router(admin, Say(out, out, out))  # only its entry(): it says nothing
    if not 0 < args.timeout < 86400:
        raise DeployError("--timeout must be between 0 and 86400 seconds")
    deployer = Deployer(
        layout=settings.layout,
        data_dir=cfg.data_dir,
        routes=routes,
        restarter=restarter,
        out=out,
        timeout=args.timeout,
        awake=lambda host: (router.entry(host) or {}).get("state") in ACTIVATOR_BUSY,
        floor=_floor_reader(cfg),
    )
    return deployer, sorted(routes)


def _floor_reader(cfg: BoxConfig) -> Callable[[str], BuildRecord | None] | None:
    """A host's build floor read from the bucket (lchat.hibernation.floor), for the rollback
    guard; None on a box without hibernation (no bucket: the local wake record only)."""
    hib = cfg.hibernate
    if hib is None:
        return None

    def read(host: str) -> BuildRecord | None:
        async def main(reactor: Reactor) -> BuildRecord | None:
            store = await open_bucket(reactor, cfg, hib.where)
            try:
                return await floor_mod.read(store, hib.prefix, host)
            finally:
                await store.close()

        try:
            return runner.run(main, FLOOR_READ_BUDGET)
        except (ObjectStoreError, TimeoutError, BadRecord) as e:
            raise DeployError(
                f"its build floor in the bucket ({hib.where}) could not be read "
                f"({e}): a wake on another box would not be seen; try again once it can"
            ) from None

    return read


def need_router(cfg: BoxConfig, deployer: Deployer, hosts: list[str]) -> None:
    restarter = deployer.restarter
    always_on = any(not deployer.route(h).hibernate for h in hosts)
    if always_on and isinstance(restarter, RouterRestarter) and not restarter.reachable():
        raise DeployError(
            f"the router does not answer on {cfg.admin_socket}, and always-on spaces are "
            "restarted by it (LCHAT_UNITS=builtin): start it, then deploy; nothing changed"
        )


def run_deploy(
    args: argparse.Namespace, load_config: LoadConfig, open_registry: OpenRegistry, out: Out
) -> int:
    cfg = load_config(args)
    if args.fleet:
        from lchat.cli import rollout as rollout_cli  # it builds on this module's deployer

        return rollout_cli.run_fleet(args, cfg, out)
    fleet_only = [
        flag
        for flag, given in (
            ("--resume", args.resume),
            ("--abort", args.abort),
            ("--batch-boxes", args.batch_boxes != 1),
            ("--batch-timeout", args.batch_timeout != 1800.0),
            ("--poll", args.poll != 5.0),
        )
        if given
    ]
    if fleet_only:  # (a flag that would silently do nothing here is refused: nothing changed)
        raise DeployError(f"{', '.join(fleet_only)}: for a fleet rollout only: add --fleet")
    if not args.version:
        raise DeployError("which version? `lchat deploy <version> --canary HOST|--all|--fleet`")
    deployer, every = make_deployer(args, cfg, open_registry(cfg), out)
    hosts = [hostnames.normalise(args.canary)] if args.canary else every
    for host in hosts:
        deployer.route(host)
    deploy_mod.check_installed(deployer.layout, args.version)
    if not hosts:  # --all on a box with no space yet: only its default build
        out("no spaces are registered on this box yet")
        deployer.set_default(args.version)
        return 0
    need_router(cfg, deployer, hosts)
    code = deployer.deploy(
        args.version, hosts, canary=bool(args.canary), batch=1 if args.canary else args.batch
    )
    if code == 0 and args.all:
        deployer.set_default(args.version)  # after the rollout: a failed one leaves it alone
    return code


def run_rollback(
    args: argparse.Namespace, load_config: LoadConfig, open_registry: OpenRegistry, out: Out
) -> int:
    cfg = load_config(args)
    deployer, every = make_deployer(args, cfg, open_registry(cfg), out)
    if args.all:
        states = deploy_mod.read_states(deployer.layout)
        hosts = [h for h in every if h in states and states[h].previous is not None]
        if not hosts:
            raise DeployError("no space on this box has a previous version to return to")
    else:
        hosts = [hostnames.normalise(args.host)]
        deployer.route(hosts[0])
    need_router(cfg, deployer, hosts)
    return deployer.rollback(hosts)


# --- lchat instances ------------------------------------------------------------------------------


def live_versions(cfg: BoxConfig, hosts: list[str]) -> dict[str, tuple[str | None, bool]]:
    """Each host's build on this box (its ``live/<host>`` link) and whether a ``--canary``
    deploy put it there; empty when LCHAT_OPT_DIR is unusable (``instances`` must still work)."""
    try:
        layout = settings_mod.read(cfg.file_env).layout
    except SettingsError:
        return {}
    states = deploy_mod.read_states(layout)
    result = {}
    for host in hosts:
        version = layout.version_of(host)
        state = states.get(host)
        result[host] = (version, state is not None and state.canary and state.version == version)
    return result
