"""LCHAT_MAX_REGISTERED on a mesh counts per owner (docs/mesh.md "Capacity"): real routers, the
real ``lchat add-instance`` and its fan-out, on moto and on SeaweedFS.

Every box holds every mesh row, so a box-wide count stopped a whole mesh at one box's ceiling.
The ceiling is each owner's: a create is refused only when the new host's owner (HRW among the
live boxes) already holds the ceiling, and the refusal names it.
"""

from __future__ import annotations

from typing import Any, Literal

from attrs import frozen
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread

from lchat.mesh.placement import normalise_member_url, owner
from tests import s3servers
from tests.test_mesh import DOMAIN, MeshTestCase, _lchat

CEILING = 2


@frozen
class _Member:
    url: str
    region: str = ""


class MeshCapacityTests(MeshTestCase):
    kind: Literal["moto", "seaweedfs"] = "moto"

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server(self.kind)
        self.bucket = await self.server.new_bucket()

    @inlineCallbacks
    def test_max_registered_counts_the_rows_each_owner_holds(self) -> Any:
        boxes = self.boxes(2, LCHAT_MAX_REGISTERED=str(CEILING))
        yield self.start(*boxes)
        members = [_Member(b.url) for b in boxes]
        held: dict[str, list[str]] = {normalise_member_url(b.url): [] for b in boxes}
        refused: list[tuple[str, str, str]] = []  # (host, its owner, the error)
        # Creates on box0 until both owners hold the ceiling, and one more. Which box owns a
        # name depends on the boxes' ports (drawn afresh each run): names are taken from a long
        # list, skipping those whose owner has shown all it must (its ceiling and a refusal), so
        # an unlucky draw (few of the first names owned by one box) takes more names, not more
        # creates (it took 12 names at most, and failed ~1 run in 50).
        for i in range(500):
            host = f"c{i}.{DOMAIN}"
            taker = owner(host, members)
            assert taker is not None
            url = normalise_member_url(taker.url)
            if len(held[url]) >= CEILING and any(r[1] == url for r in refused):
                continue
            ran = yield deferToThread(
                _lchat, "add-instance", host, "--hibernate", "--env-file", boxes[0].env_file
            )
            if ran.returncode == 0:
                held[url].append(host)
            else:
                refused.append((host, url, ran.stderr))
                self.assertIsNone(boxes[0].registry().get(host))
            if all(len(hosts) >= CEILING for hosts in held.values()) and refused:
                break
        # More than one box's ceiling in all (a box-wide count stops at CEILING), and no owner
        # beyond it.
        self.assertEqual(
            {url: len(hosts) for url, hosts in held.items()},
            {url: CEILING for url in held},
            refused,
        )
        for host, url, error in refused:
            self.assertIn(f"{CEILING} instances are registered to {url}, which owns {host}", error)
            self.assertIn(f"LCHAT_MAX_REGISTERED={CEILING}", error)
        # Every box counts the same rows per owner.
        expected = {url: len(hosts) for url, hosts in held.items()}
        for box in boxes:
            yield self.wait_for(
                lambda box=box: box.status()["capacity"].get("registered_owned") == expected,
                timeout=10,
            )


class MeshCapacitySeaweedFSTests(MeshCapacityTests):
    kind = "seaweedfs"
