"""``lchat``: manage this box's registry of spaces and services.

Every command loads the box's settings exactly as the router does (``config.load``), so the CLI and
the router agree on paths. Commands that change the registry then ask the running router to reload over
its admin socket; when that fails, the router's 2 s registry poll picks the change up anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

import lchat
from lchat import config, hosts
from lchat.cli import admin_client, dev_cert, envfile, units
from lchat.cli import replica as replica_cli
from lchat.config import BoxConfig, ConfigError
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
POLL_INTERVAL = 0.2
SERVICE_PROBE_TIMEOUT = 5.0
TABLE_COLUMNS = ("HOST", "KIND", "STATUS", "VERSION", "HIBERNATE", "REPLICATION", "SOCKET")


class CliError(Exception):
    """A refusal or failure; printed as one ``lchat: error:`` line, exit status 1."""


def run() -> None:
    sys.exit(main())


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    space_argv = _space_argv(args_list)
    if space_argv is not None:
        return _run_space(space_argv)
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
    except (CliError, ConfigError, RegistryError, hosts.InvalidHost, units.UnitError) as e:
        return _fail(str(e))
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
    sub.add_argument("host", help="the space's hostname, e.g. chat-a.example.com")
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
    sub.add_argument("--home-region", metavar="R", default="", help="the space's home region")
    sub.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long to wait for it to answer (default {DEFAULT_TIMEOUT:g})",
    )
    sub.add_argument("--no-wait", action="store_true", help="start it but do not health-check it")

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

    command("version", "print lchat's version", cmd_version)
    dev_cert.add_arguments(command("dev-cert", dev_cert.SUMMARY, cmd_dev_cert))
    replica_cli.add_arguments(
        command("replica", replica_cli.SUMMARY, lambda a: replica_cli.run(a, load_config(a), _out)),
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


def _run_space(argv: list[str]) -> int:
    # Imported lazily: the space server is a separate program that merely ships in this package.
    from lchat.space import main as space_main

    return space_main(argv)


# --- commands -----------------------------------------------------------------------------------


def cmd_version(args: argparse.Namespace) -> int:
    # No config needed: `lchat version` must work on a box whose router.env is broken.
    _out(f"{PROG} {lchat.__version__}")
    return 0


def cmd_dev_cert(args: argparse.Namespace) -> int:
    # With --out no settings are needed: it must work on a box whose router.env is broken.
    cfg = None if args.out else load_config(args)
    try:
        return dev_cert.run(args, cfg, _out)
    except dev_cert.DevCertError as e:
        raise CliError(str(e)) from e


def cmd_instances(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    routes = sorted(open_registry(cfg).load(), key=lambda r: r.host)
    if args.json:
        _out(json.dumps([attrs.asdict(r) for r in routes], indent=2))
        return 0
    rows = [TABLE_COLUMNS, *(_table_row(r) for r in routes)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    for row, route in zip(rows, [None, *routes], strict=True):
        _out("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if route is not None and route.status == "failed":
            _out(f"  last error: {_one_line(route.last_error) or '(none recorded)'}")
    return 0


def cmd_add_instance(args: argparse.Namespace) -> int:
    host = hosts.normalise(args.host)
    token = _check_token(args.admin_token) if args.admin_token is not None else None
    home_region = _check_region(args.home_region)
    cfg = load_config(args)
    if args.hibernate and cfg.hibernate is None:
        raise CliError("--hibernate needs a hibernation bucket: set LCHAT_HIBERNATE_BUCKET")
    _require_dir(cfg.data_dir, "LCHAT_DATA_DIR / --data-dir")
    registry = open_registry(cfg)
    if registry.get(host) is not None:
        raise CliError(f"{host} is already registered")
    socket = hosts.socket_path(cfg.run_dir, host)
    if cfg.units == "systemd" and not args.hibernate and not socket.endswith(f"/{host}.sock"):
        # lchat@.service spells its socket <run>/%i.sock; a hashed name would not match it.
        raise CliError(
            f"{host}: the socket path {cfg.run_dir}/{host}.sock is too long for a unix socket; "
            f"systemd units cannot run it (use LCHAT_UNITS=builtin, or a shorter LCHAT_RUN_DIR)"
        )
    token = _stage_env_file(hosts.env_path(cfg.data_dir, host), token)
    registry.insert(
        Route(
            host=host,
            kind="instance",
            socket=socket,
            db_path=hosts.db_path(cfg.data_dir, host),
            # A hibernating space has nothing to start: the activator wakes it on its first request.
            status="ready" if args.hibernate else "creating",
            hibernate=args.hibernate,
            replication=args.replication,
            home_region=home_region,
        )
    )
    _out(f"admin token: {token}")
    if args.hibernate:
        notify_router(cfg)
        _out(f"{host} is registered, hibernating: it wakes on its first request")
        return 0
    if cfg.units == "systemd":
        return _start_with_systemd(cfg, registry, host, socket, args)
    return _start_with_router(cfg, registry, host, args)


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
    notify_router(cfg)
    _out(f"{host} -> {path} (service, ready)")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    host = hosts.normalise(args.host)
    cfg = load_config(args)
    registry = open_registry(cfg)
    route = registry.get(host)
    if route is None or not registry.delete(host):
        raise CliError(f"{host} is not registered")
    # Stop routing first, then stop the process: no request is sent to a socket going away.
    notify_router(cfg)
    _out(f"removed {host}; no files were deleted")
    if not args.stop:
        return 0
    if route.kind == "service":
        _note(f"{host} is a service, not a process lchat runs: nothing to stop")
    elif cfg.units == "systemd":
        try:
            units.disable_now(host)
        except units.UnitError as e:
            raise CliError(f"{host} was removed, but {e}") from e
        _out(f"stopped and disabled {units.unit_name(host)}")
    else:
        _note(f"the router stops {host}'s process now that its row is gone")
    return 0


# --- starting an instance -----------------------------------------------------------------------


def _start_with_systemd(
    cfg: BoxConfig, registry: Registry, host: str, socket: str, args: argparse.Namespace
) -> int:
    try:
        units.enable_now(host)
    except units.UnitError as e:
        registry.set_status(host, "failed", str(e))
        notify_router(cfg)
        raise CliError(f"{host} failed: {e}") from e
    if args.no_wait:
        notify_router(cfg)
        _out(f"{host}: started {units.unit_name(host)}; not health-checked (row stays 'creating')")
        return 0
    if not admin_client.wait_for_version(socket, host, args.timeout, POLL_INTERVAL):
        error = f"not answering on {socket} after {args.timeout:g}s"
        registry.set_status(host, "failed", error)
        notify_router(cfg)
        raise CliError(f"{host} failed: {error}")
    registry.set_status(host, "ready")
    notify_router(cfg)
    _out(f"{host} is ready")
    return 0


def _start_with_router(
    cfg: BoxConfig, registry: Registry, host: str, args: argparse.Namespace
) -> int:
    """Builtin units: the router's supervisor runs the child and records its health in the row."""
    try:
        _reload(cfg)
    except admin_client.Unreachable as e:
        if _router_absent(e):
            _warn(f"router is not running ({cfg.admin_socket}): {host} will start when it does")
            return 0
        _note(f"cannot reach the router ({e}); its registry poll will start {host}")
    if args.no_wait:
        _out(f"{host} is registered; the router is starting it")
        return 0
    route = _wait_for_verdict(registry, host, args.timeout)
    if route.status == "ready":
        _out(f"{host} is ready")
        return 0
    if route.status == "failed":
        raise CliError(f"{host} failed: {_one_line(route.last_error) or 'no error recorded'}")
    raise CliError(f"{host} is still {route.status} after {args.timeout:g}s")


def _wait_for_verdict(registry: Registry, host: str, timeout: float) -> Route:
    deadline = time.monotonic() + timeout
    while True:
        route = registry.get(host)
        if route is None:
            raise CliError(f"{host} was removed while it was starting")
        if route.status != "creating" or time.monotonic() >= deadline:
            return route
        time.sleep(POLL_INTERVAL)  # the CLI is synchronous: no reactor here to block


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


# --- the router ---------------------------------------------------------------------------------


def notify_router(cfg: BoxConfig) -> None:
    """Ask the running router to reload now; its 2 s poll is the fallback, so never an error."""
    try:
        _reload(cfg)
    except admin_client.Unreachable as e:
        if _router_absent(e):
            _note("router not running; it will pick this up when it starts")
        else:
            _note(f"cannot reach the router ({e}); it will pick this up within seconds")


def _reload(cfg: BoxConfig) -> None:
    """POST /reload; raises Unreachable when nothing listens. A bad answer is only a note."""
    try:
        response = admin_client.reload(cfg.admin_socket)
    except admin_client.ProtocolError as e:
        _note(f"the router did not answer the reload ({e}); it will pick this up within seconds")
        return
    if response.status != 200:
        _note(f"the router answered {response.status} to the reload; it polls the registry anyway")


def _router_absent(e: admin_client.Unreachable) -> bool:
    return isinstance(e.__cause__, FileNotFoundError | ConnectionRefusedError)


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
    registry = Registry(cfg.registry)
    registry.migrate()
    return registry


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


def _check_region(region: str) -> str:
    if region and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", region):
        raise CliError(f"--home-region {region!r} must be letters, digits, '.', '_' or '-'")
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


def _table_row(route: Route) -> tuple[str, ...]:
    return (
        route.host,
        route.kind,
        route.status,
        route.version or "-",
        "on" if route.hibernate else "off",
        route.replication,
        route.socket,
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _out(line: str) -> None:
    print(line, file=sys.stdout)


def _note(message: str) -> None:
    print(f"{PROG}: {_one_line(message)}", file=sys.stderr)


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {_one_line(message)}", file=sys.stderr)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 1
