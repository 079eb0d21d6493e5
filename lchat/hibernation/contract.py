"""The space contract, as the activator speaks it (docs/design.md §8): what it asks a running space.

Readiness (``GET /api/version`` answering 200) is the child's (lchat.child, ``wait_ready``).
Here: ``GET /api/next-due`` with the space's admin token, asked at every graceful sleep so that a
scheduled delivery wakes the space again (docs/hibernation.md, "Scheduled deliveries").
"""

from __future__ import annotations

import json
from typing import Protocol

from attrs import frozen
from twisted.logger import Logger

from lchat import hosts, unixhttp
from lchat.config import read_env_file
from lchat.reactors import TimeReactor
from lchat.threads import RunInThread

_log = Logger(namespace="lchat.activator")


class Contract(Protocol):
    """What a stand-down asks a space (:class:`SpaceContract` over its socket)."""

    async def next_due(self, host: str, socket: str, timeout: float) -> int: ...  # noqa: ASYNC109


@frozen
class SpaceContract:
    """Asks a space what the activator needs to know. ``run_in_thread`` reads its env file."""

    reactor: TimeReactor
    run_in_thread: RunInThread
    data_dir: str

    async def next_due(self, host: str, socket: str, timeout: float) -> int:  # noqa: ASYNC109 (a Twisted timeout, not asyncio)
        """The space's earliest pending delivery (unix seconds, 0: none). Raises ValueError for
        an answer that is not one, and the transport's errors as they are."""
        env = await self.run_in_thread(lambda: read_env_file(hosts.env_path(self.data_dir, host)))
        token = env.get("LCHAT_ADMIN_TOKEN", "")
        resp = await unixhttp.request(
            self.reactor,
            socket,
            "GET",
            "/api/next-due",
            host=host,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=timeout,
        )
        if resp.status != 200:
            raise ValueError(f"GET /api/next-due answered {resp.status}")
        due = json.loads(resp.body).get("due")
        if not isinstance(due, int) or isinstance(due, bool) or due < 0:
            raise ValueError(f"GET /api/next-due: not a due time: {due!r}")
        _log.info("activator: {host} next due {due}", host=host, due=due or "none")
        return due
