"""``lchat bootstrap``: make a fresh box ready to run the router, as root, idempotently.

What a box needs before ``systemctl start lchat-router`` (docs/operations.md, "Bootstrap a box"):

1. the service user (a system user, no login shell, no home) the units run as;
2. ``<data>`` (default ``/data``), mode 0750, owned by it;
3. ``<data>/router.env``, from the shipped example (:data:`lchat.ops.ENV_EXAMPLE`) with the given
   values filled in, mode 0600, owned by the service user: the router reads it, and env-file
   ownership follows the reader (a root-owned file the service user cannot read kills a wake);
4. ``/opt/lchat/versions`` and ``/opt/lchat/live`` (:class:`lchat.builds.BuildLayout`);
5. the systemd units shipped with the package (:data:`lchat.ops.UNITS_DIR`, the checkout's
   ``ops/systemd``) in ``/etc/systemd/system``, with the data directory and the user filled in;
   ``systemctl daemon-reload`` and ``systemctl enable lchat-router.service``;

then the router's own boot checks of the settings, run as the service user on the written file:
the configuration (``config.load``), the AWS credentials the buckets and Route53 need, and each
bucket's write probe (as the router's ``_BucketCheck``, ``lchat.buckets.probe_name``). What fails there is printed as
left to do, with everything else left (secrets to fill in, no build yet...).

Invariants: :func:`.apply.plan` changes nothing (it reads the box and says, step by step, what it
would do and what is already so); bad input is refused before anything changes; a second run
changes nothing; an operator's existing ``router.env`` keeps every line except the values given
(each change is named; a secret's value is never printed); ``--root DIR`` prefixes every path
(tests, or preparing an image) and then never creates users nor runs ``systemctl``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable

from lchat.cli.bootstrap.apply import apply, plan
from lchat.cli.bootstrap.request import DEFAULT_USER, BootstrapError, request_from_args

SUMMARY = (
    "prepare this box for the router: service user, data directory, router.env, /opt/lchat, "
    "systemd units (as root; idempotent; --dry-run shows the plan)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data-dir`` is the CLI's common option (LCHAT_DATA_DIR): here, where the box keeps its
    data and ``router.env`` (default /data)."""
    parser.add_argument(
        "--user",
        default=DEFAULT_USER,
        metavar="NAME",
        help=f"the service user the units run as (default {DEFAULT_USER}; created if missing)",
    )
    parser.add_argument(
        "--mesh-self",
        metavar="URL",
        help="this box's mesh URL (LCHAT_MESH_SELF), e.g. https://box-1.example.net",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        help="a router setting to put in router.env (repeatable; other lines are kept)",
    )
    parser.add_argument(
        "--root",
        metavar="DIR",
        help="prefix every path with DIR (tests, images): no user is created, no systemctl run",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    parser.add_argument(
        "--no-systemctl", action="store_true", help="install the units but run no systemctl"
    )


def run(args: argparse.Namespace, out: Callable[[str], None], fail: Callable[[str], int]) -> int:
    systemctl = shutil.which("systemctl")
    try:
        request = request_from_args(
            args,
            is_root=os.geteuid() == 0,
            systemctl=systemctl,
            systemd_running=os.path.isdir("/run/systemd/system"),
        )
        steps = plan(request)
        if request.dry_run:
            out("lchat bootstrap: the plan (--dry-run: nothing is changed)")
            for step in steps:
                if step.already is not None:
                    out(f"  already  {step.already}")
                elif step.skipped is not None:
                    out(f"  skip     {step.what}: {step.skipped}")
                else:
                    out(f"  to do    {step.what}")
                for line in step.detail:
                    out(f"             {line}")
            return 0
        outcome = apply(request, steps)
    except BootstrapError as e:
        return fail(str(e))
    out("lchat bootstrap:" + (" nothing to change" if not outcome.done else ""))
    for label, lines in (
        ("done", outcome.done),
        ("already", outcome.already),
        ("skipped", outcome.skipped),
        ("ok", outcome.ok),
        ("left", outcome.left),
    ):
        for line in lines:
            out(f"  {label:<8} {line}")
    return 0
