"""``lchat``: manage this box's registry of spaces and services.

Every command loads the box's settings exactly as the router does (``config.load``), so the CLI and
the router agree on paths. Commands that change the registry then ask the running router to reload over
its admin socket; when that fails, the router's 2 s registry poll picks the change up anyway.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import signal
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import lchat
from lchat import admin_client, config, envfile, hosts, systemd_units
from lchat.admin_client import SocketAdmin
from lchat.backup import litestream_yml
from lchat.buckets import open_bucket
from lchat.cli import backup as backup_cli
from lchat.cli import bootstrap as bootstrap_cli
from lchat.cli import certs, dev_cert, provision, runner, space_settings
from lchat.cli import fleet as fleet_cli
from lchat.cli import id_ledger as id_ledger_cli
from lchat.cli import instances as instances_cli
from lchat.cli import mesh as mesh_cli
from lchat.cli import release as release_cli
from lchat.cli import relocate as relocate_cli
from lchat.cli import replica as replica_cli
from lchat.cli import stats as stats_cli
from lchat.config import BoxConfig, ConfigError
from lchat.config.mesh import REGION_LABEL
from lchat.handover import HandoverError
from lchat.handover.hibernate import (
    POLL_INTERVAL,
    Hibernation,
    forget_clean_sleep,
    hand_env_files_to_router,
    one_line,
    refuse_if_backed_up,
)
from lchat.handover.router import Router, Say
from lchat.handover.seams import BoxUnits, FanOut, StoreBucket
from lchat.handover.start import Start, warn_if_born_dark
from lchat.ledger import LedgerError
from lchat.registry import REPLICATIONS, Registry, RegistryError, Route

PROG = "lchat"
# Options every subcommand accepts, before or after its name: option -> the variable it overrides.
COMMON_FLAGS = {
    "--registry": "LCHAT_REGISTRY",
    "--data-dir": "LCHAT_DATA_DIR",
    "--run-dir": "LCHAT_RUN_DIR",
}
COMMON_OPTIONS = ("--env-file", *COMMON_FLAGS)
DEFAULT_TIMEOUT = 30.0
HIBERNATE_TIMEOUT = 60.0
SERVICE_PROBE_TIMEOUT = 5.0


class CliError(Exception):
    """A refusal or failure; printed as one ``lchat: error:`` line, exit status 1."""


def run() -> None:
    try:
        code = main()
        sys.stdout.flush()  # here, not at exit: a reader gone by now is caught below
    except BrokenPipeError:
        code = _reader_gone()
    sys.exit(code)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError):
        return False


def _reader_gone() -> int:
    """stdout's reader went away (``lchat instances | head``, ``| grep -q``): stop quietly, as
    a command killed by SIGPIPE would (exit 141), with no error line. stdout now points at
    /dev/null so that nothing tries to flush into the closed pipe again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    space_argv = _space_argv(args_list)
    if space_argv is not None:
        # Imported lazily: the space server is a separate program that merely ships in this package.
        from lchat.space import main as space_main

        return space_main(space_argv)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # --help, or a usage error (argparse has printed it): 0 or 2
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (
        CliError,
        HandoverError,
        ConfigError,
        RegistryError,
        hosts.InvalidHost,
        systemd_units.UnitError,
        litestream_yml.BackupConfigError,
        mesh_cli.MeshCliError,
        provision.ProvisionError,
        space_settings.SettingsError,
        instances_cli.CapacityRefused,
        fleet_cli.FleetCliError,
        replica_cli.ReplicaCliError,
        certs.CertsError,
        dev_cert.DevCertError,
        LedgerError,
    ) as e:
        return _fail(str(e))
    except BrokenPipeError as e:
        if _stdout_closed():
            return _reader_gone()
        return _fail(str(e))  # another pipe or socket (the router's, say): a real error
    except OSError as e:
        return _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except KeyboardInterrupt:
        # Whatever was written stays consistent: rows and env files are each written atomically.
        _fail("interrupted")
        return 130


# --- argument parsing ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Manage the spaces and services routed by this box's lchat router.",
        epilog="Every command also takes the common options shown here, before or after its name.",
    )
    _add_common(parser, None)
    commands = parser.add_subparsers(dest="command", metavar="<command>", title="commands")

    def command(name: str, summary: str, handler: Callable[[argparse.Namespace], int]) -> Any:
        sub = commands.add_parser(name, help=summary, description=summary)
        _add_common(sub, argparse.SUPPRESS)
        sub.set_defaults(handler=handler)
        return sub

    sub = command("instances", "list every registered host and its state", cmd_instances)
    sub.add_argument("--json", action="store_true", help="print a JSON list with every field")

    sub = command(
        "add-instance", "register a new space, write its env file and start it", cmd_add_instance
    )
    named = sub.add_mutually_exclusive_group(required=True)  # a usage error (2) otherwise
    named.add_argument(
        "host", nargs="?", help="the space's hostname, e.g. chat-a.example.com (or --mint)"
    )
    named.add_argument(
        "--mint",
        metavar="DOMAIN",
        help="name it <id>.DOMAIN with the next id from the id ledger (LCHAT_CLOUD_ID_LEDGER; "
        "unset: this box's own count) instead of giving HOST",
    )
    sub.add_argument(
        "--admin-token",
        metavar="T",
        help="use this admin token instead of minting one (16-256 printable characters)",
    )
    sub.add_argument(
        "--hibernate",
        action="store_true",
        help="let the router's activator run it on demand (needs LCHAT_HIBERNATE_BUCKET)",
    )
    sub.add_argument(
        "--replication",
        choices=REPLICATIONS,
        default="stream",
        metavar="CLASS",
        help="replication class: stream (default), batched or daily",
    )
    sub.add_argument(
        "--home-region",
        metavar="R",
        default=None,
        help="the space's home region (default: LCHAT_CLOUD_REGION, else none)",
    )
    sub.add_argument(
        "--probe",
        nargs="?",
        const=provision.DEFAULT_PROBE_TIMEOUT,
        default=None,
        type=_positive_seconds,
        metavar="TIMEOUT",
        help="with --hibernate: then wake it where it would run, read its version and sleep it "
        f"again (lchat probe), within TIMEOUT seconds (--probe=TIMEOUT; default "
        f"{provision.DEFAULT_PROBE_TIMEOUT:g}); exit 1 naming why it did not boot (the row stays)",
    )
    sub.add_argument(
        "--invite",
        action="store_true",
        help="mint a setup invite: print https://HOST/setup#INVITE, keep only its hash in the "
        "space's env file (lchat invite)",
    )
    _add_timeout(sub, DEFAULT_TIMEOUT, "how long to wait for it to answer")
    sub.add_argument("--no-wait", action="store_true", help="start it but do not health-check it")

    sub = command(
        "hibernate",
        "hand a space to the activator (--on) or back to its unit (--off)",
        cmd_hibernate,
    )
    sub.add_argument("host", help="the space's hostname")
    which = sub.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--on",
        dest="on",
        action="store_true",
        help="stop its unit; the activator sleeps it when idle and wakes it on demand",
    )
    which.add_argument(
        "--off",
        dest="on",
        action="store_false",
        help="put it to sleep, then run it as an ordinary unit again",
    )
    _add_timeout(
        sub, HIBERNATE_TIMEOUT, "bound of each wait: socket release, health check, warm wake"
    )

    sub = command(
        "add-service",
        "route a host to a server already listening on a unix socket",
        cmd_add_service,
    )
    sub.add_argument("host", help="the hostname to route")
    sub.add_argument(
        "--socket", metavar="P", required=True, help="absolute path of its unix socket"
    )

    sub = command("remove", "remove a host's row (its files are never deleted)", cmd_remove)
    sub.add_argument("host", help="the hostname to remove")
    sub.add_argument("--stop", action="store_true", help="also stop and disable its unit")

    sub = command(
        "mesh-seed",
        "push this box's in-scope hibernating routes to a mesh peer (a new box's catch-up)",
        cmd_mesh_seed,
    )
    sub.add_argument("peer", metavar="PEER-URL", help="the peer's LCHAT_MESH_SELF URL")
    sub.add_argument(
        "--region",
        metavar="R",
        default="",
        help="also push the routes whose home region is R (the peer's LCHAT_MESH_REGION)",
    )
    sub.add_argument(
        "--prune",
        action="store_true",
        help="also tombstone the peer's in-scope rows that this registry no longer has",
    )

    id_ledger_cli.add_arguments(
        command(
            "id-ledger",
            id_ledger_cli.SUMMARY,
            lambda a: id_ledger_cli.run(a, load_config(a), _out),
        ),
        lambda p: _add_common(p, argparse.SUPPRESS),
    )

    provision.add_probe_arguments(command("probe", provision.PROBE_SUMMARY, cmd_probe))
    space_settings.add_commands(
        command,
        space_settings.Context(load_config, open_registry, lambda cfg: _router(cfg).notify(), SAY),
    )

    command(
        "mesh",
        "list the mesh's members: region, heartbeat age, version, spaces each owns",
        cmd_mesh,
    )

    stats_cli.add_arguments(
        command(
            "stats",
            stats_cli.SUMMARY,
            lambda a: stats_cli.run(a, load_config(a), _out, open_registry),
        )
    )
    relocate_cli.add_arguments(
        command(
            "relocate",
            relocate_cli.SUMMARY,
            lambda a: relocate_cli.run(a, load_config(a), open_registry, _out, _note),
        )
    )
    fleet_cli.add_arguments(
        command(
            "fleet",
            fleet_cli.SUMMARY,
            lambda a: fleet_cli.run(a, load_config(a), open_registry, _out, _note),
        )
    )

    def _release_handler(run: release_cli.Run) -> Callable[[argparse.Namespace], int]:
        return release_cli.handler(run, load_config, open_registry, _out, _fail)

    release_cli.add_release_arguments(
        command("release", release_cli.RELEASE_SUMMARY, _release_handler(release_cli.run_release)),
        lambda p: _add_common(p, argparse.SUPPRESS),
    )
    release_cli.add_deploy_arguments(
        command("deploy", release_cli.DEPLOY_SUMMARY, _release_handler(release_cli.run_deploy))
    )
    release_cli.add_rollback_arguments(
        command(
            "rollback", release_cli.ROLLBACK_SUMMARY, _release_handler(release_cli.run_rollback)
        )
    )
    bootstrap_cli.add_arguments(
        command("bootstrap", bootstrap_cli.SUMMARY, lambda a: bootstrap_cli.run(a, _out, _fail))
    )
    command("version", "print lchat's version", cmd_version)
    dev_cert.add_arguments(command("dev-cert", dev_cert.SUMMARY, cmd_dev_cert))
    certs.add_arguments(
        command("certs", certs.SUMMARY, lambda a: certs.run(a, load_config(a), _out))
    )
    replica_cli.add_arguments(
        command("replica", replica_cli.SUMMARY, lambda a: replica_cli.run(a, load_config(a), _out)),
        lambda p: _add_common(p, argparse.SUPPRESS),
    )
    backup_cli.add_arguments(
        command("backup", backup_cli.SUMMARY, lambda a: backup_cli.run(a, load_config(a), _out)),
        lambda p: _add_common(p, argparse.SUPPRESS),
    )
    # Listed for --help only: main() hands `space ...` over before argparse sees it.
    commands.add_parser(
        "space", help="run the reference space server (arguments go to it)", add_help=False
    )
    return parser


def _add_common(parser: argparse.ArgumentParser, default: str | None) -> None:
    # Subcommands use SUPPRESS so an option given before the command name is not reset after it.
    group = parser.add_argument_group("common options")
    group.add_argument(
        "--env-file",
        metavar="PATH",
        default=default,
        help=f"the router's env file (default {config.DEFAULT_ENV_FILE}; must exist if given)",
    )
    for option, variable in COMMON_FLAGS.items():
        group.add_argument(option, metavar="PATH", default=default, help=f"overrides {variable}")


def _add_timeout(parser: argparse.ArgumentParser, default: float, meaning: str) -> None:
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=default,
        metavar="SECONDS",
        help=f"{meaning} (default {default:g})",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 86400 seconds")
    return value


def _space_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``space`` when that is the command, skipping common options before it."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in COMMON_OPTIONS:
            i += 2
        elif word.split("=", 1)[0] in COMMON_OPTIONS:
            i += 1
        else:
            return argv[i + 1 :] if word == "space" else None
    return None


# --- commands -----------------------------------------------------------------------------------


def cmd_version(args: argparse.Namespace) -> int:
    # No config needed: `lchat version` must work on a box whose router.env is broken.
    _out(f"{PROG} {lchat.__version__}")
    return 0


def cmd_dev_cert(args: argparse.Namespace) -> int:
    # With --out no settings are needed: it must work on a box whose router.env is broken.
    return dev_cert.run(args, None if args.out else load_config(args), _out)


def cmd_instances(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    routes = sorted(open_registry(cfg).load(), key=lambda r: r.host)
    status = _router(cfg).status() if routes else {}
    return instances_cli.show(cfg, routes, status, args.json, _out, _note)


def cmd_add_instance(args: argparse.Namespace) -> int:
    if (args.host is None) == (args.mint is None):
        raise CliError("give the space's HOST, or --mint DOMAIN to name it <id>.DOMAIN (not both)")
    domain = hosts.normalise(args.mint) if args.mint is not None else ""
    host = hosts.normalise(args.host) if args.host is not None else ""
    token = _check_token(args.admin_token) if args.admin_token is not None else None
    cfg = load_config(args)
    # The flag wins; else the provisioner's region stamps the space at birth (LCHAT_CLOUD_REGION).
    home_region = _check_region(
        args.home_region if args.home_region is not None else cfg.cloud_region
    )
    if args.hibernate and cfg.hibernate is None:
        raise CliError("--hibernate needs a hibernation bucket: set LCHAT_HIBERNATE_BUCKET")
    if args.probe is not None and not args.hibernate:
        raise CliError(
            "--probe needs --hibernate (an always-on space is health-checked by its start); "
            "nothing was registered"
        )
    _require_dir(cfg.data_dir, "LCHAT_DATA_DIR / --data-dir")
    registry = open_registry(cfg)
    if host and registry.get(host) is not None:
        raise CliError(f"{host} is already registered")
    if not args.hibernate:
        instances_cli.refuse_beyond_always_on(cfg, registry, host)
    if host:
        instances_cli.refuse_beyond_registered(cfg, registry, _note, host, home_region)
    elif cfg.mesh is None:
        instances_cli.refuse_beyond_registered(cfg, registry, _note, "", home_region)
    if domain:
        # After every refusal that needs no id: a refused create wastes none.
        try:
            host = id_ledger_cli.mint(cfg, [r.host for r in registry.load()], domain, _note)
        except LedgerError as e:
            raise CliError(f"{e}; nothing was registered") from e
        if registry.get(host) is not None:
            raise CliError(f"{host} (just minted) is already registered: nothing was registered")
        if cfg.mesh is not None:
            # On a mesh the ceiling is the new host's owner's: known once the host is named (a
            # refusal here leaves the minted id unused).
            instances_cli.refuse_beyond_registered(cfg, registry, _note, host, home_region)
    socket = hosts.socket_path(cfg.run_dir, host, isolated=hosts.isolated(cfg.data_dir))
    if cfg.units == "systemd" and not args.hibernate and not socket.endswith(f"/{host}.sock"):
        # lchat@.service spells its socket <run>/%i.sock; a hashed name would not match it.
        raise CliError(
            f"{host}: the socket path {socket} is too long for a unix socket; "
            f"systemd units cannot run it (use LCHAT_UNITS=builtin, or a shorter LCHAT_RUN_DIR)"
        )
    db = hosts.db_path(cfg.data_dir, host)
    if args.hibernate:
        refuse_if_backed_up(_backup_listing(cfg, db), host, db, "nothing was registered")
    token = _stage_env_file(hosts.env_path(cfg.data_dir, host), token)
    # Before the row and the fan-out: the invite's hash travels with the env file.
    invite = provision.mint_invite(hosts.env_path(cfg.data_dir, host)) if args.invite else None
    # The activator and builtin units read it as the router's user (only systemd reads as root).
    hand_env_files_to_router(cfg, host, SAY, quiet=True)
    if args.hibernate:
        forget_clean_sleep(db)  # a database left by an earlier life is not vouched for
    route = registry.insert(
        Route(
            host=host,
            kind="instance",
            socket=socket,
            db_path=db,
            # A hibernating space has nothing to start: the activator wakes it on its first request.
            status="ready" if args.hibernate else "creating",
            hibernate=args.hibernate,
            replication=args.replication,
            home_region=home_region,
        )
    )
    _out(f"admin token: {token}")
    if invite is not None:
        _out(f"setup invite: {provision.invite_url(host, invite)}")
    if args.hibernate:
        # Nothing to start and nothing to wait for: no process and no database until its first
        # request (or `lchat hibernate --on`'s warm request) wakes it.
        _router(cfg).notify()
        warn_if_born_dark(cfg, SocketAdmin(cfg.admin_socket), host, SAY)
        # With the mesh on, every live peer covering the host learns the route (best-effort).
        _say_reach(mesh_cli.publish_change(cfg, registry, route, _note))
        _out(
            f"{host} is registered, asleep ({args.replication} replication): "
            f"it wakes on its first request"
        )
        if args.probe is not None:
            return provision.probe(cfg, host, args.probe, _out, created=True)
        return 0
    start = Start(cfg, registry, _router(cfg), BoxUnits(cfg, POLL_INTERVAL))
    return start(host, socket, args.timeout, wait=not args.no_wait)


def _say_reach(reach: mesh_cli.Reach | None) -> None:
    """``registered on 2/3 boxes (https://b: converges when it is back)``: how many boxes of the
    mesh hold the row now (None: not a mesh host, nothing to say)."""
    if reach is not None:
        _out(reach.describe())


def cmd_probe(args: argparse.Namespace) -> int:
    host = hosts.normalise(args.host)
    if not 0 < args.timeout < 86400:
        raise CliError("--timeout must be between 0 and 86400 seconds")
    cfg = load_config(args)
    return provision.probe(cfg, host, args.timeout, _out, as_json=args.json, created=False)


def cmd_add_service(args: argparse.Namespace) -> int:
    host = hosts.normalise(args.host)
    path = _check_socket_arg(args.socket)
    cfg = load_config(args)
    registry = open_registry(cfg)
    if registry.get(host) is not None:
        raise CliError(f"{host} is already registered")
    why = admin_client.answers_http(path, host, timeout=SERVICE_PROBE_TIMEOUT)
    if why is not None:
        raise CliError(f"--socket {path} does not answer HTTP: {why}")
    registry.insert(Route(host=host, kind="service", socket=path, status="ready"))
    _router(cfg).notify()
    _out(f"{host} -> {path} (service, ready)")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    host = hosts.normalise(args.host)
    cfg = load_config(args)
    registry = open_registry(cfg)
    route = registry.get(host)
    tomb_gen: int | None = None
    if route is not None and mesh_cli.tombstoned(cfg, route):
        # A mesh row: its tombstone stays here, so no peer's older copy brings it back.
        removed = registry.delete_with_tombstone(host, int(time.time() * 1000))
        route, tomb_gen = (removed[0], removed[1].gen) if removed else (None, None)
    elif route is not None and not registry.delete(host):
        route = None
    if route is None:
        raise CliError(f"{host} is not registered")
    # Stop routing first, then stop the process: no request is sent to a socket going away.
    _router(cfg).notify()
    _out(f"removed {host}; no files were deleted")
    # With the mesh on, peers holding a replicated row get a tombstone (best-effort; a peer
    # missed takes it from this box's digest: docs/mesh.md, "What travels").
    mesh_cli.fan_out_delete(cfg, route, _note, tomb_gen)
    if not args.stop:
        return 0
    if route.kind == "service":
        _note(f"{host} is a service, not a process lchat runs: nothing to stop")
    elif cfg.units == "systemd":
        try:
            systemd_units.disable_now(host)
        except systemd_units.UnitError as e:
            raise CliError(f"{host} was removed, but {e}") from e
        _out(f"stopped and disabled {systemd_units.unit_name(host)}")
    else:
        _note(f"the router stops {host}'s process now that its row is gone")
    return 0


def cmd_mesh_seed(args: argparse.Namespace) -> int:
    region = _check_region(args.region, "--region")
    cfg = load_config(args)
    return mesh_cli.mesh_seed(
        cfg, open_registry(cfg), args.peer, region=region, prune=args.prune, out=_out, note=_note
    )


def cmd_mesh(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    return mesh_cli.show_mesh(cfg, open_registry(cfg), _out)


def cmd_hibernate(args: argparse.Namespace) -> int:
    host = hosts.normalise(args.host)
    cfg = load_config(args)
    registry = open_registry(cfg)
    route = space_settings.instance_row(registry, host, "hibernate")
    if route.elsewhere:
        raise CliError(
            f"{host} runs always-on on {route.lives_at} (a lives-elsewhere row from that box): "
            f"run `lchat hibernate {host}` there"
        )
    if not args.on and route.hibernate:
        instances_cli.refuse_beyond_always_on(cfg, registry, host)
    hibernation = _hibernation(cfg, registry)
    return (hibernation.on if args.on else hibernation.off)(route, args.timeout)


# --- wiring the hand-over commands -------------------------------------------------------------


SAY = Say(out=lambda line: _out(line), note=lambda m: _note(m), warn=lambda m: _warn(m))


def _router(cfg: BoxConfig) -> Router:
    return Router(SocketAdmin(cfg.admin_socket), SAY)


def _hibernation(cfg: BoxConfig, registry: Registry) -> Hibernation:
    hib = cfg.hibernate
    bucket = None
    if hib is not None:
        bucket = StoreBucket(lambda reactor: open_bucket(reactor, cfg, hib.where), runner.run)
    peers = FanOut(
        active=cfg.mesh is not None,
        push=lambda route: mesh_cli.publish_change(cfg, registry, route, _note),
        replicates=lambda route: cfg.mesh is not None and mesh_cli.replicates(cfg.mesh, route),
    )
    return Hibernation(
        cfg,
        registry,
        SocketAdmin(cfg.admin_socket),
        BoxUnits(cfg, POLL_INTERVAL),
        peers,
        bucket,
        SAY,
        backed_up=lambda db: _backup_listing(cfg, db),
    )


def _backup_listing(cfg: BoxConfig, db: str) -> str | None:
    """The box-wide backup replicator's config when it lists ``db``."""
    config_file = litestream_yml.config_path(cfg)
    return config_file if litestream_yml.tracks(config_file, db) else None


def _stage_env_file(path: str, token: str | None) -> str:
    """Write (or reuse) ``<data>/<host>.env`` and return the admin token it holds."""
    existing = envfile.read_token(path)
    if token is None and existing is not None:
        # Left by an earlier `remove`, which never deletes data: keep the space's token.
        envfile.make_private(path)
        _note(f"reusing the admin token in {path}")
        return existing
    token = token or secrets.token_urlsafe(32)
    envfile.write_token(path, token)
    return token


# --- settings and validation --------------------------------------------------------------------


def load_config(args: argparse.Namespace) -> BoxConfig:
    flags = {
        variable: getattr(args, option[2:].replace("-", "_"), None)
        for option, variable in COMMON_FLAGS.items()
    }
    cfg = config.load(env_file=getattr(args, "env_file", None), flags=flags)
    for warning in cfg.warnings:
        _warn(warning)
    return cfg


def open_registry(cfg: BoxConfig) -> Registry:
    directory = os.path.dirname(cfg.registry)
    if directory == cfg.data_dir:
        _require_dir(directory, "LCHAT_DATA_DIR / --data-dir")
    else:
        _require_dir(directory, "LCHAT_REGISTRY / --registry")
    _create_registry_for_router(cfg.registry)
    registry = Registry(cfg.registry, time.time)
    registry.migrate()
    return registry


def _create_registry_for_router(path: str) -> None:
    """As root, a registry that does not exist yet is created empty (an empty file is an empty
    SQLite database) owned by its directory's owner, the router's user: created by SQLite it
    would be root's, the router could never write it ("attempt to write a readonly database"),
    and env files handed "to the router's user" would go to root. Its ``-wal`` and ``-shm``
    follow: SQLite run as root gives them the database file's owner."""
    if os.geteuid() != 0 or os.path.lexists(path):
        return
    st = os.stat(os.path.dirname(path) or ".")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
    except FileExistsError:
        return  # made a moment ago (by the router, or another command): SQLite opens it
    try:
        os.fchown(fd, st.st_uid, st.st_gid)
    finally:
        os.close(fd)


def _require_dir(path: str, setting: str) -> None:
    if not os.path.isdir(path):
        raise CliError(f"directory {path} does not exist (set {setting})")


def _check_token(token: str) -> str:
    # It lands unquoted in an env file: no whitespace, no quotes or backslashes to be reinterpreted.
    if not 16 <= len(token) <= 256:
        raise CliError("--admin-token must be 16 to 256 characters long")
    if any(not 0x21 <= ord(c) <= 0x7E or c in "\"'\\" for c in token):
        raise CliError(
            "--admin-token must be printable ASCII without spaces, quotes or backslashes"
        )
    return token


def _check_region(region: str, option: str = "--home-region") -> str:
    if region and not REGION_LABEL.fullmatch(region):
        raise CliError(f"{option} {region!r} must be letters, digits, '.', '_' or '-'")
    return region


def _check_socket_arg(path: str) -> str:
    if "\x00" in path or not os.path.isabs(path):
        raise CliError(f"--socket {path!r} must be an absolute path")
    path = os.path.normpath(path)
    if len(os.fsencode(path)) > hosts.MAX_SOCKET_PATH:
        raise CliError(f"--socket {path} is too long for a unix socket path")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CliError(f"--socket {path}: no such file") from None
    if not stat.S_ISSOCK(mode):
        raise CliError(f"--socket {path} is not a unix socket")
    return path


# --- output -------------------------------------------------------------------------------------


def _out(line: str) -> None:
    print(line, file=sys.stdout)


def _note(message: str) -> None:
    print(f"{PROG}: {one_line(message)}", file=sys.stderr)


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {one_line(message)}", file=sys.stderr)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr)
    return 1
