"""The body of a mesh box's heartbeat object (lchat.mesh.membership) and of its beats to its peers
(lchat.mesh.witness)."""

from __future__ import annotations

import json
import math
from typing import Any

from attrs import frozen


@frozen
class Heartbeat:
    """The body of a heartbeat object."""

    url: str  # normalised LCHAT_MESH_SELF
    region: str  # LCHAT_MESH_REGION ("" = region-agnostic)
    version: str  # lchat.__version__ of the beating process
    started_at: float  # unix seconds (the box's clock, informational) of that process's start
    # Random per liveness period of a router process: the leases it takes name it (docs/lease.md),
    # and a lapse starts a new one, so nothing of the old one is written again. "" in older bodies.
    epoch: str = ""
    # The box is draining: out of placement at once, but alive (it still writes its last
    # flushes) until the drain deletes the heartbeat.
    draining: bool = False
    # Random per router process, kept across lapses: which process of the box a peer hears and
    # holds an answer of (lchat.mesh.witness). "" in the bodies of an older lchat, which takes
    # part in no witnessing (judged by the bucket alone).
    process: str = ""

    def to_json(self) -> bytes:
        """Deterministic: the same heartbeat always gives the same bytes (and ETag)."""
        data: dict[str, Any] = {
            "url": self.url,
            "region": self.region,
            "version": self.version,
            "started_at": self.started_at,
        }
        if self.epoch:
            data["epoch"] = self.epoch
        if self.draining:
            data["draining"] = True
        if self.process:
            data["process"] = self.process
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, body: bytes) -> Heartbeat:
        """Strict (ValueError says why): every field present with its type; extra fields ignored."""
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("body is not JSON") from None
        if not isinstance(data, dict):
            raise ValueError("body is not a JSON object")
        url, region, version, started = (
            data.get("url"),
            data.get("region"),
            data.get("version"),
            data.get("started_at"),
        )
        if not (isinstance(url, str) and isinstance(region, str) and isinstance(version, str)):
            raise ValueError("url, region and version must be strings")
        if (
            not isinstance(started, int | float)
            or isinstance(started, bool)
            or not math.isfinite(started)
        ):
            raise ValueError("started_at must be a number")
        epoch, draining = data.get("epoch", ""), data.get("draining", False)
        process = data.get("process", "")
        if not isinstance(epoch, str) or not isinstance(draining, bool):
            raise ValueError("epoch must be a string and draining a boolean")
        if not isinstance(process, str):
            raise ValueError("process must be a string")
        return cls(
            url=url,
            region=region,
            version=version,
            started_at=float(started),
            epoch=epoch,
            draining=draining,
            process=process,
        )
