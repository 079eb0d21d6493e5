"""``lchat bootstrap`` on an older box: every space's files moved into a directory of its own
(:mod:`lchat.relayout`), its units stopped and started again around the move, and the per-space
systemd drop-ins written."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from lchat import config
from lchat.cli.bootstrap.request import ROUTER_UNIT, Request
from lchat.cli.bootstrap.steps import Step
from lchat.config import BoxConfig, ConfigError

RELAYOUT = "move every space's files into a directory of its own (lchat/relayout.py)"
SPACES_TARGET = "lchat-spaces.target"
SPACE_UNITS = ("lchat@*", "lchat-bot@*")


def relayout_steps(request: Request) -> tuple[list[Step], bool]:
    """A box with spaces whose router.env leaves isolation on (``LCHAT_ISOLATION`` not ``off``):
    their flat files moved into their own directories and their rows rewritten
    (:mod:`lchat.relayout`); under systemd, with the router and every space stopped meanwhile
    and started again after (those that ran), and each always-on space's unit drop-in written
    (its own user: :func:`lchat.systemd_units.install_space`). Returns the steps and whether the
    box isolates its spaces once they are done. Reads the box; changes nothing."""
    from lchat import hosts, relayout, systemd_units
    from lchat.registry import Registry, RegistryError

    env_path = request.path(request.env_file)
    data_dir = request.path(request.data_dir)
    isolated = hosts.isolated(data_dir)
    has_rows = os.path.exists(os.path.join(data_dir, "registry.db"))
    if request.root:
        # The rows name box paths (/data/<host>.db), not paths under --root.
        skip = f"--root {request.root} given: run bootstrap on the box itself"
        return ([Step(RELAYOUT, skipped=skip)] if has_rows else []), isolated
    if not os.path.isfile(env_path):
        return [], isolated
    try:
        cfg = config.load(
            env_file=env_path,
            # The values this run writes into router.env win (--set LCHAT_ISOLATION=off).
            environ={k: v for k, v in request.values.items() if k.startswith("LCHAT_")},
            systemd_present=request.no_systemctl is None,
        )
    except ConfigError as e:
        skip = f"{env_path} does not load ({e}): fix it, run again"
        return ([Step(RELAYOUT, skipped=skip)] if has_rows else []), isolated
    isolated = hosts.isolated(cfg.data_dir)
    if not os.path.exists(cfg.registry):
        return [], isolated  # no spaces yet: the router lays the box out at its start
    registry = Registry(cfg.registry, time.time)
    try:
        rows = [r for r in registry.load() if r.kind == "instance"]
    except RegistryError as e:
        return [Step(RELAYOUT, skipped=f"cannot read the spaces' rows: {e}")], isolated
    if not rows:
        return [], isolated
    if cfg.isolation == "off":
        why = f"LCHAT_ISOLATION=off in {env_path}: every space runs as the router's user"
        if isolated:
            why += (
                f" (but {os.path.join(cfg.data_dir, hosts.SPACES)} exists: the router refuses that)"
            )
        return [Step(RELAYOUT, skipped=why)], isolated
    systemctl = request.no_systemctl is None
    steps = relayout.plan(
        cfg.data_dir, cfg.run_dir, registry, uids=cfg.space_uids, probe_running=not systemctl
    )
    to_do = any(s.to_do for s in steps)
    said = tuple(s.line for s in steps if s.action != "nothing")
    refused = [s.line for s in steps if s.action == "refuse"]
    out: list[Step] = []
    if not to_do:
        out.append(
            Step(
                RELAYOUT,
                already="every space's files are in a directory of its own",
                detail=said,
                left=refused,
            )
        )
    elif not systemctl and relayout.listening(cfg.admin_socket):
        out.append(
            Step(
                RELAYOUT,
                skipped=f"the router runs ({cfg.admin_socket} answers) and bootstrap cannot stop"
                f" it ({request.no_systemctl}): stop it and its spaces, then run bootstrap again",
                detail=said,
            )
        )
    else:
        was_active: list[str] = []
        if systemctl:

            def stop() -> str:
                was_active[:] = systemd_units.active_units(ROUTER_UNIT, *SPACE_UNITS)
                # Each running space named too: `systemctl stop` waits only for the jobs it was
                # asked for, and the target's stop reaches a space through PartOf= as a job of
                # its own (one started by hand, its target inactive, may still run when the
                # target's job is done; a space's stop waits for its lchat-backup@ final sync).
                systemd_units.stop_units(ROUTER_UNIT, SPACES_TARGET, *was_active)
                return f"stopped {ROUTER_UNIT} and {SPACES_TARGET} ({len(was_active)} units ran)"

            out.append(
                Step(
                    f"stop {ROUTER_UNIT} and {SPACES_TARGET}: no space runs while its files move",
                    run=stop,
                )
            )
        left: list[str] = []

        def move() -> list[str]:
            # Planned again: under systemd, only now that nothing runs is a running space a refusal.
            fresh = relayout.plan(cfg.data_dir, cfg.run_dir, registry, uids=cfg.space_uids)
            report = relayout.apply(cfg.data_dir, cfg.run_dir, cfg.space_uids, registry, fresh)
            left.extend(report.refused)
            return report.done

        out.append(Step(RELAYOUT, run=move, detail=said, left=left))
        isolated = True
    if isolated and systemctl and cfg.units == "systemd":
        out.extend(_dropin_steps(cfg, registry, rows))
    if to_do and systemctl:

        def start() -> str:
            if not was_active:
                return "nothing to start again (no unit ran before)"
            systemd_units.start_units(*was_active)
            return f"started again: {' '.join(was_active)}"

        out.append(Step("start again the units that ran", run=start))
    return out, isolated


def _dropin_steps(cfg: BoxConfig, registry: Any, rows: Sequence[Any]) -> list[Step]:
    """Each always-on space's units run as its own user only with their drop-ins (the template
    refuses an isolated box without one): written where missing."""
    from lchat import hosts, isolation, systemd_units

    missing = [
        r.host
        for r in rows
        if not r.hibernate
        and not r.elsewhere
        and not os.path.exists(systemd_units.dropin_path(r.host))
    ]
    if not missing:
        return []

    def write() -> list[str]:
        done = []
        for host in missing:
            route = registry.get(host)
            if route is None or route.hibernate or route.elsewhere:
                continue
            socket = hosts.socket_path(cfg.run_dir, host, isolated=True)
            db = hosts.db_path(cfg.data_dir, host)
            if route.socket != socket or route.db_path not in ("", db):
                # Its files did not move (a refusal above): a unit started on the isolated
                # paths would serve an empty database beside the real one.
                done.append(f"{host}: no drop-in: its row still names {route.socket}")
                continue
            user = systemd_units.install_space(cfg, host, socket)
            uid = f"uid {user.uid}" if user is not None else "no user of its own"
            done.append(f"{host}: its units run as {isolation.user_name(host)} ({uid})")
        return done

    return [
        Step(
            "write each always-on space's unit drop-ins (its own user, its own directories)",
            run=write,
            detail=tuple(systemd_units.dropin_path(h) for h in missing),
        )
    ]
