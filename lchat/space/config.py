"""The space's configuration: the environment the router (or an operator) gives the process."""

from __future__ import annotations

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
"""


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
        )
