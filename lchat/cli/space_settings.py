"""``lchat replication``, ``lchat env`` and ``lchat invite``: a space's own settings, changed on
this box, then a new settings generation and the push to every live mesh peer
(:func:`lchat.cli.mesh.publish_change`; docs/mesh.md, "What travels").

Invariants: a refusal changes nothing and is one ``lchat: error:`` line (:class:`SettingsError`);
env values are never printed (they hold the space's secrets), only key names; a lives-elsewhere
row (a space always-on on another box) is changed only on that box.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from attrs import frozen

from lchat import config, envfile, hosts
from lchat.cli import mesh as mesh_cli
from lchat.cli import provision
from lchat.config import BoxConfig, ConfigError
from lchat.handover.hibernate import hand_env_files_to_router
from lchat.handover.router import Say
from lchat.mesh.client import ENV_KEY, RESERVED_ENV
from lchat.mesh.route_payload import MAX_ENV_VALUE
from lchat.registry import REPLICATIONS, Registry, Route, Transaction

Handler = Callable[[argparse.Namespace], int]
Command = Callable[[str, str, Handler], Any]  # main's: a subcommand's parser, its handler set


class SettingsError(Exception):
    """A refusal of ``replication``, ``env`` or ``invite``; nothing was changed."""


@frozen
class Context:
    """What the commands take from ``lchat.cli.main``: the box's settings and registry as every
    command reads them, the running router's reload, and the CLI's output."""

    load_config: Callable[[argparse.Namespace], BoxConfig]
    open_registry: Callable[[BoxConfig], Registry]
    notify: Callable[[BoxConfig], None]  # ask the running router to reload its table
    say: Say  # out (stdout), note and warn (stderr)
    # The edit of an env file (``lchat env``): envfile.edit; a test's seam wraps it to land a
    # peer's copy between the edit and its generation.
    edit_env: Callable[[str, Mapping[str, str], Iterable[str]], None] = envfile.edit
    # Minting a setup invite into an env file (``lchat invite``): the same seam for the invite.
    mint_invite: Callable[[str], str] = provision.mint_invite
    now_ms: Callable[[], int] = lambda: int(time.time() * 1000)  # a new generation's clock


def add_commands(command: Command, ctx: Context) -> None:
    """Register the three commands with main's ``command(name, summary, handler)``."""
    sub = command(
        "replication",
        "print or set a space's replication class (stream, batched, daily)",
        lambda args: replication(args, ctx),
    )
    sub.add_argument("host", help="the space's hostname")
    sub.add_argument(
        "replication",
        nargs="?",
        type=_replication_class,
        metavar="CLASS",
        help="the new class: stream, batched or daily (omit to print the current one)",
    )

    sub = command(
        "env",
        "list a space's env key names, or set/unset values (every mesh peer takes the change)",
        lambda args: env(args, ctx),
    )
    sub.add_argument("host", help="the space's hostname")
    sub.add_argument(
        "action",
        nargs="?",
        choices=("set", "unset"),
        help="set NAME=VALUE ... or unset NAME ... (omit to list the names; values never shown)",
    )
    sub.add_argument(
        "items", nargs="*", metavar="ITEM", help="NAME=VALUE to set, NAME to unset (LCHAT_*)"
    )

    provision.add_invite_arguments(
        command("invite", provision.INVITE_SUMMARY, lambda args: invite(args, ctx))
    )


def instance_row(registry: Registry | Transaction, host: str, what: str) -> Route:
    """``host``'s row, which must be an instance's (``what`` it may do, for the refusal)."""
    route = registry.get(host)
    if route is None:
        raise SettingsError(f"{host} is not registered")
    if route.kind != "instance":
        raise SettingsError(
            f"{host} is a service (a server lchat does not run): only instances {what}"
        )
    return route


def replication(args: argparse.Namespace, ctx: Context) -> int:
    host = hosts.normalise(args.host)
    cfg = ctx.load_config(args)
    registry = ctx.open_registry(cfg)
    route = instance_row(registry, host, "have a replication class")
    if args.replication is None:
        ctx.say.out(route.replication)
        return 0
    old, new = route.replication, args.replication
    if old == new:
        ctx.say.out(f"{host}: replication is already {new}; nothing changed")
        return 0
    route = registry.update(host, replication=new)
    ctx.notify(cfg)
    ctx.say.out(f"{host}: replication {old} -> {new}")
    mesh_cli.publish_change(cfg, registry, route, ctx.say.note)
    if route.hibernate:
        # The activator reads the class at wake: an awake space keeps its cadence until it sleeps.
        ctx.say.note(
            f"{host} runs at the new cadence from its next wake; every sleep flushes in full"
        )
    else:
        ctx.say.note(
            f"{host} is not hibernating: the class applies once it is (lchat hibernate --on)"
        )
    return 0


def env(args: argparse.Namespace, ctx: Context) -> int:
    """``lchat env``: one atomic edit of ``<data>/<host>.env`` and its new settings generation,
    in one registry transaction, then the push."""
    host = hosts.normalise(args.host)
    cfg = ctx.load_config(args)
    registry = ctx.open_registry(cfg)
    route = instance_row(registry, host, "have an env file")
    if route.elsewhere:
        raise SettingsError(f"{host} runs always-on on {route.lives_at}: run `lchat env` there")
    path = hosts.env_path(cfg.data_dir, host)
    if args.action is None:
        if args.items:
            raise SettingsError("name an action: set NAME=VALUE ... or unset NAME ...")
        try:
            names = sorted(config.read_env_file(path, must_exist=True))
        except ConfigError as e:
            raise SettingsError(str(e)) from e
        for name in names:
            ctx.say.out(name)
        return 0
    values, unset = _edits(args.action, args.items)
    # The edit and its generation are one step: the router's route store writes a peer's copy
    # (env file, then row) in the same registry transaction, so an owner's older copy landing
    # between them can neither overwrite the edit nor leave it under the older generation. The
    # row is read again inside: what the edit versions is the row as it is now.
    with registry.transaction() as txn:
        route = instance_row(txn, host, "have an env file")
        if route.elsewhere:
            raise SettingsError(f"{host} runs always-on on {route.lives_at}: run `lchat env` there")
        try:
            ctx.edit_env(path, values, unset)
        except FileNotFoundError:
            raise SettingsError(f"{host} has no env file ({path}): nothing was changed") from None
        except ValueError as e:
            raise SettingsError(f"{e}; nothing was changed") from e
        bumped = mesh_cli.bump_change(cfg, txn, route, ctx.say.note, ctx.now_ms())
    changed = ", ".join([*values, *unset])
    verb = "set" if values else "unset"
    ctx.say.out(f"{host}: {verb} {changed} (the space takes it at its next wake)")
    if bumped is not None:
        mesh_cli.fan_out_upsert(cfg, bumped, ctx.say.note)
    return 0


def _edits(action: str, items: list[str]) -> tuple[dict[str, str], list[str]]:
    """``set NAME=VALUE ...`` as values, ``unset NAME ...`` as names; each checked."""
    if not items:
        raise SettingsError(f"{action}: name at least one variable")
    values: dict[str, str] = {}
    unset: list[str] = []
    for item in items:
        name, equals, value = item.partition("=")
        if (action == "set") != bool(equals):
            wanted = "NAME=VALUE" if action == "set" else "NAME (no value)"
            raise SettingsError(f"{action}: {item.split('=', 1)[0]!r} is not {wanted}")
        if not ENV_KEY.fullmatch(name) or name in RESERVED_ENV:
            raise SettingsError(
                f"{name!r} is not a space setting: LCHAT_[A-Z0-9_]{{1,64}}, not "
                f"{', '.join(sorted(RESERVED_ENV))} (set per box from the row)"
            )
        if equals:
            if len(value.encode("utf-8")) > MAX_ENV_VALUE:
                raise SettingsError(f"{name}: the value is longer than {MAX_ENV_VALUE} bytes")
            values[name] = value
        else:
            unset.append(name)
    return values, unset


def invite(args: argparse.Namespace, ctx: Context) -> int:
    """``lchat invite``: mint the space's setup invite (its hash in the env file), then the push."""
    host = hosts.normalise(args.host)
    cfg = ctx.load_config(args)
    registry = ctx.open_registry(cfg)
    route = instance_row(registry, host, "have a setup invite")
    if route.elsewhere:
        raise SettingsError(
            f"{host} runs always-on on {route.lives_at} (a lives-elsewhere row from that box): "
            f"run `lchat invite {host}` there"
        )
    path = hosts.env_path(cfg.data_dir, host)
    if not os.path.exists(path):
        raise SettingsError(f"{host} has no env file at {path}: nothing was changed")
    if provision.has_invite(path) and not args.rotate:
        raise SettingsError(
            f"{host} already has a setup invite, and only its hash is kept, so it cannot be "
            "shown again: --rotate mints a new one (the old one stops working); nothing was "
            "changed"
        )
    # The invite's hash and its generation are one step, as `lchat env`'s edit and its
    # generation are: an owner's older copy landing between them would put the old hash back.
    with registry.transaction() as txn:
        route = instance_row(txn, host, "have a setup invite")
        minted = ctx.mint_invite(path)
        bumped = (
            mesh_cli.bump_change(cfg, txn, route, ctx.say.note, ctx.now_ms())
            if route.hibernate
            else None
        )
    hand_env_files_to_router(cfg, host, ctx.say, quiet=True)
    ctx.say.out(f"setup invite: {provision.invite_url(host, minted)}")
    if route.hibernate:
        reach = None if bumped is None else mesh_cli.fan_out_upsert(cfg, bumped, ctx.say.note)
        if reach is not None:
            ctx.say.out(reach.describe())
        ctx.say.note(
            f"{host} takes the new invite at its next wake (a space already set up takes none)"
        )
    else:
        ctx.say.note(
            f"{host} takes the new invite when its unit restarts (a space already set up takes "
            "none)"
        )
    return 0


def _replication_class(text: str) -> str:
    if text not in REPLICATIONS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a replication class (choose from {', '.join(REPLICATIONS)})"
        )
    return text
