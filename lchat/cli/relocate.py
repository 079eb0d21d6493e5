"""``lchat relocate <host> --to <region>``: its arguments, and the real seams wired into
:class:`lchat.handover.relocate.Relocation` (the steps and their invariants are there)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from attrs import frozen
from twisted.internet.defer import Deferred

from lchat import hosts
from lchat.admin_client import SocketAdmin
from lchat.buckets import open_bucket
from lchat.cli import mesh as mesh_cli
from lchat.cli import move_dns as move_dns_cli
from lchat.cli import runner
from lchat.config import BoxConfig
from lchat.handover.relocate import Relocation
from lchat.handover.router import Say
from lchat.handover.seams import MeshFanOut, MeshHolds, RegionStores
from lchat.mesh.members import Member
from lchat.reactors import Reactor
from lchat.registry import Registry

SUMMARY = "move a hibernating space to another region (copy its replica, flip home_region)"
DEFAULT_TIMEOUT = 3600.0  # the whole relocation: a large replica's download + re-upload
MEMBERS_BUDGET = 30.0  # one read of the mesh's heartbeats (a LIST and a few GETs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("host", help="the space's hostname (a hibernating instance)")
    parser.add_argument(
        "--to",
        dest="to",
        required=True,
        metavar="REGION",
        help="the destination region (a LCHAT_MESH_REGION; its bucket from LCHAT_REGION_BUCKETS)",
    )
    parser.add_argument(
        "--from",
        dest="source",
        default="",
        metavar="REGION",
        help="the region whose bucket holds the space, for one with no home_region when the "
        "regions keep their replicas in different buckets (LCHAT_REGION_BUCKETS); otherwise its "
        "home_region is where it moves from",
    )
    parser.add_argument(
        "--move-dns",
        action="store_true",
        help="also point the host's own A/AAAA records at the destination region's live boxes "
        "(Route53 only: LCHAT_DNS_PROVIDER=route53; not needed for correctness)",
    )
    parser.add_argument("--json", action="store_true", help="print the steps as one JSON object")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"bound of the whole relocation (default {DEFAULT_TIMEOUT:g}); the copy must also "
        "finish within the lease TTL (LCHAT_LEASE_TTL), or it is refused before the flip",
    )


def run(
    args: argparse.Namespace,
    cfg: BoxConfig,
    open_registry: Callable[[BoxConfig], Registry],
    out: Callable[[str], None],
    note: Callable[[str], None],
) -> int:
    """``lchat relocate``: a refusal or failure raises :class:`HandoverError`."""

    def report(steps: dict[str, Any], lines: list[str]) -> None:
        for line in [json.dumps(steps, ensure_ascii=False, sort_keys=True)] if args.json else lines:
            out(line)

    registry = open_registry(cfg)
    peers = MeshFanOut(
        members=lambda: live_members(cfg),
        # A new home region is a setting: a new settings generation, then the fan-out.
        push_reporting=lambda route, said: mesh_cli.publish_change(cfg, registry, route, said),
    )
    host = hosts.normalise(args.host)
    relocation = Relocation(
        cfg,
        registry,
        SocketAdmin(cfg.admin_socket),
        peers,
        RegionStores(
            lambda reactor, where, what: open_bucket(reactor, cfg, where, what=what, make_dir=True),
            runner.run,
        ),
        Route53Records(cfg),
        Say(out=out, note=note, warn=note),
        report,
        peer_holds=MeshHolds(cfg),
    )
    return relocation(
        host, args.to, move_dns=args.move_dns, timeout=args.timeout, source=args.source
    )


def live_members(cfg: BoxConfig) -> list[Member]:
    """The mesh's live members by their heartbeats, within :data:`MEMBERS_BUDGET`."""

    async def main(reactor: Reactor) -> list[Member]:
        d = Deferred.fromCoroutine(mesh_cli.read_mesh_members(reactor, cfg))
        d.addTimeout(MEMBERS_BUDGET, reactor)
        members: list[Member] = await d
        return members

    return runner.run(main, MEMBERS_BUDGET + 5)


@frozen
class Route53Records:
    """:class:`lchat.handover.seams.AddressRecords` through the box's Route53 DNS-01 provider
    (:mod:`lchat.cli.move_dns`, whose MoveDNSError is a HandoverError)."""

    cfg: BoxConfig

    def check(self, host: str) -> None:
        move_dns_cli.require_route53(self.cfg, host)

    def point(self, host: str, member_urls: list[str]) -> tuple[str, dict[str, Any]]:
        addresses = move_dns_cli.destination_addresses(member_urls)
        moved = move_dns_cli.move_dns(self.cfg, host, addresses)
        return moved.line, moved.as_json()
