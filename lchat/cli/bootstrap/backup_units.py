"""``lchat bootstrap``: every always-on systemd space gets its ``lchat-backup@<host>`` unit.

``add-instance`` enables the unit for a space it adds while the fleet backup is on; a space added
earlier (before ``LCHAT_BACKUP_BUCKET`` was set, or by an lchat without the unit) has none, and
its writes would have no RPO while the router is down (docs/backup.md, "While the router is
down"). This step enables it for each such space, and starts it for each space that runs now:
never for a stopped one (the unit is bound to the space's unit, and starting it would start the
space too). Reads the box; changes nothing until run.
"""

from __future__ import annotations

import os
import time

from lchat import config, systemd_units
from lchat.cli.bootstrap.request import Request
from lchat.cli.bootstrap.steps import UNITS_TARGET, Step
from lchat.config import ConfigError

WHAT = "enable each always-on systemd space's lchat-backup@ unit (its writes ship while the router is down)"


def backup_unit_steps(request: Request) -> list[Step]:
    from lchat.registry import Registry, RegistryError

    env_path = request.path(request.env_file)
    if request.root or not os.path.isfile(env_path):
        return []  # --root: the rows name box paths, and systemctl never runs there
    try:
        cfg = config.load(
            env_file=env_path,
            environ={k: v for k, v in request.values.items() if k.startswith("LCHAT_")},
            systemd_present=request.no_systemctl is None,
        )
    except ConfigError:
        return []  # the relayout's step says why it does not load
    if cfg.units != "systemd" or cfg.backup is None or not os.path.exists(cfg.registry):
        return []
    try:
        rows = Registry(cfg.registry, time.time).load()
    except RegistryError as e:
        return [Step(WHAT, skipped=f"cannot read the spaces' rows: {e}")]
    hosts = sorted(
        r.host for r in rows if r.kind == "instance" and not r.hibernate and not r.elsewhere
    )
    missing = [h for h in hosts if not os.path.lexists(_wants_link(h))]
    if not missing:
        return (
            [Step(WHAT, already="every always-on systemd space has its lchat-backup@ unit")]
            if hosts
            else []
        )
    if request.no_systemctl is not None:
        return [Step(WHAT, skipped=request.no_systemctl)]

    def enable() -> list[str]:
        running = set(systemd_units.active_units(*(f"lchat@{h}.service" for h in missing)))
        done = []
        for host in missing:
            systemd_units.enable_backup(host)
            unit = systemd_units.backup_unit_name(host)
            if f"lchat@{host}.service" in running:
                systemd_units.start_units(unit)
                done.append(f"{unit}: enabled and started")
            else:
                done.append(f"{unit}: enabled (starts with lchat@{host})")
        return done

    return [
        Step(WHAT, run=enable, detail=tuple(systemd_units.backup_unit_name(h) for h in missing))
    ]


def _wants_link(host: str) -> str:
    """Where ``systemctl enable lchat-backup@<host>`` puts its link (``WantedBy=lchat@%i``)."""
    unit = systemd_units.backup_unit_name(host)
    return os.path.join(UNITS_TARGET, f"lchat@{host}.service.wants", f"{unit}.service")
