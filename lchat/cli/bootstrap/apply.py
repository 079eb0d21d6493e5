"""``lchat bootstrap``'s plan (:func:`plan`: reads the box, changes nothing) and applying it
(:func:`apply`: the steps still to do, in order, then what is left for the operator)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from attrs import frozen

from lchat import config, systemd_units
from lchat.builds import DEFAULT_OPT_DIR, BuildLayout
from lchat.cli.bootstrap.backup_units import backup_unit_steps
from lchat.cli.bootstrap.probe import probe_as
from lchat.cli.bootstrap.relayout import relayout_steps
from lchat.cli.bootstrap.request import (
    DATA_MODE,
    ISOLATED_DATA_MODE,
    ROUTER_UNIT,
    VENV_TWISTD,
    BootstrapError,
    Request,
    account_of,
)
from lchat.cli.bootstrap.steps import (
    HOME_BACKUP_UNIT,
    Step,
    data_dir_step,
    env_step,
    opt_steps,
    systemctl_steps,
    unit_steps,
    user_step,
)
from lchat.config import ConfigError


def plan(request: Request) -> list[Step]:
    """Every step, each saying whether it is already so. Reads the box; changes nothing."""
    account = account_of(request.user)
    group = account.group if account is not None else request.user  # useradd --user-group
    units = unit_steps(request, group)
    spaces, isolating = relayout_steps(request)
    return [
        user_step(request, account),
        data_dir_step(request, account, ISOLATED_DATA_MODE if isolating else DATA_MODE),
        env_step(request, account),
        *opt_steps(request),
        *units,
        *systemctl_steps(request, any(u.to_do for u in units)),
        *spaces,
        *backup_unit_steps(request),
    ]


@frozen
class Outcome:
    done: list[str]
    already: list[str]
    skipped: list[str]
    ok: list[str]  # settings checked and fine
    left: list[str]  # what the operator still has to do


def apply(request: Request, steps: Sequence[Step], probe: bool = True) -> Outcome:
    """Run the steps still to do, in order; then check what is left."""
    done, already, skipped = [], [], []
    for step in steps:
        if step.already is not None:
            already.append(step.already)
        elif step.skipped is not None:
            skipped.append(f"{step.what}: {step.skipped}")
        else:
            assert step.run is not None
            try:
                result = step.run()
            except systemd_units.UnitError as e:  # stopping and starting units, their drop-ins
                raise BootstrapError(str(e)) from e
            done.extend([result] if isinstance(result, str) else result)
    ok, left = [], []
    for step in steps:
        left.extend(step.left)
    if any(s.skipped and s.what.startswith("systemctl") for s in steps):
        where = "on the box" if request.root else "run them yourself"
        left.append(
            f"{where}: systemctl daemon-reload && systemctl enable {ROUTER_UNIT} {HOME_BACKUP_UNIT}"
        )
    twistd = request.path(VENV_TWISTD)
    if not os.access(twistd, os.X_OK):
        left.append(
            f"install lchat into {os.path.dirname(os.path.dirname(VENV_TWISTD))} (the units run "
            f"{VENV_TWISTD}): python3 -m venv /opt/lchat/venv && /opt/lchat/venv/bin/pip install "
            f"lchat-<version>-*.whl"
        )
    if not BuildLayout(request.path(DEFAULT_OPT_DIR)).installed():
        left.append(
            f"no space build in {os.path.join(DEFAULT_OPT_DIR, 'versions')} yet: fetch one "
            f"(lchat release fetch <version>) before adding always-on spaces"
        )
    env_path = request.path(request.env_file)
    missing = _mesh_checklist(env_path)
    left.extend(missing)
    if probe:
        found_ok, found_left = probe_as(request.user, env_path)
        ok.extend(found_ok)
        # config.load stops at the first missing mesh setting: the checklist already said it.
        left.extend(
            x
            for x in found_left
            if not (missing and ("LCHAT_MESH_SELF is set" in x or "LCHAT_MESH_SELF needs" in x))
        )
    left.append(f"then start the router (restart it if it runs): systemctl restart {ROUTER_UNIT}")
    return Outcome(done, already, skipped, ok, left)


def _mesh_checklist(env_path: str) -> list[str]:
    """What a mesh member's router.env still lacks (``config.load`` stops at the first)."""
    try:
        values = config.read_env_file(env_path)
    except ConfigError:
        return []  # the probe says what is wrong with the file
    if not values.get("LCHAT_MESH_SELF"):
        return []
    needed = {
        "LCHAT_MESH_DOMAINS": "the domains the mesh serves",
        "LCHAT_MESH_TOKEN": "the fleet's shared mesh token",
        "LCHAT_HIBERNATE_BUCKET": "the shared bucket, with its credentials",
    }
    return [
        f"set {name} in {env_path} ({why})" for name, why in needed.items() if not values.get(name)
    ]
