"""The space's configuration: the environment the router (or an operator) gives the process."""

from __future__ import annotations

import re
from collections.abc import Mapping

from attrs import frozen

ENV_HELP = """\
environment:
  LCHAT_SOCKET       unix socket to listen on (required)
  LCHAT_DB           SQLite database path (required)
  LCHAT_HOST         the space's hostname (for logs)
  LCHAT_ADMIN_TOKEN  bearer token for GET /api/next-due (unset: always 403)
  LCHAT_BOT_TOKEN    bearer token for POST /api/charter-next-due (unset: always 403)
  LCHAT_BUILD        build label reported by GET /api/version (default: dev)
  LCHAT_SETUP_INVITE_SHA256
                     hex SHA-256 of the setup invite POST /api/setup accepts once
                     (unset: no setup endpoint, 404)
"""

SETUP_INVITE_VAR = "LCHAT_SETUP_INVITE_SHA256"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ConfigError(Exception):
    """A required variable is missing or empty."""


@frozen
class Config:
    socket: str
    db: str
    host: str = "space"
    admin_token: bytes | None = None
    bot_token: bytes | None = None
    build: str = "dev"
    # The hex SHA-256 of the setup invite (docs/hibernation.md, "the contract for a space"):
    # the space keeps only the hash, so its env file (which replicates) never holds the invite.
    setup_invite_sha256: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        def required(name: str) -> str:
            value = env.get(name, "")
            if not value:
                raise ConfigError(f"{name} is not set")
            return value

        def token(name: str) -> bytes | None:
            # An empty token counts as none: never let "Bearer " authenticate.
            return env.get(name, "").encode() or None

        return cls(
            socket=required("LCHAT_SOCKET"),
            db=required("LCHAT_DB"),
            host=env.get("LCHAT_HOST") or "space",
            admin_token=token("LCHAT_ADMIN_TOKEN"),
            bot_token=token("LCHAT_BOT_TOKEN"),
            build=env.get("LCHAT_BUILD") or "dev",
            setup_invite_sha256=_invite_hash(env.get(SETUP_INVITE_VAR, "")),
        )


def _invite_hash(value: str) -> str | None:
    """The setup invite's hash, lower-case; None when unset. A malformed one refuses the start
    (ConfigError) rather than leave a space nobody can ever set up."""
    if not value:
        return None
    value = value.strip().lower()
    if _SHA256_HEX.fullmatch(value) is None:
        raise ConfigError(f"{SETUP_INVITE_VAR} must be 64 hex digits (a SHA-256)")
    return value
