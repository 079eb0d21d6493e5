"""The reference bot sidecar's settings (lchat.space.sidecar): its environment, read and checked
once at start; a bad one stops it with a message naming the variable (exit 2)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping

from attrs import frozen

from lchat import hosts

DEFAULT_EVERY = 3600
MAX_EVERY = 10 * 366 * 86400  # ten years; more is a typo
ROOM = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as lchat.space.api.ROOM

ENV_HELP = """\
environment:
  LCHAT_BOT_TOKEN    bearer token for POST /api/charter-next-due (required)
  LCHAT_DB           the space's SQLite path; the schedule is kept in $LCHAT_DB-bot.json (required)
  LCHAT_SOCKET       the space's unix socket (required unless LCHAT_SIDECAR_URL is set)
  LCHAT_SIDECAR_URL  http(s) base URL to reach the space through instead (e.g. the router)
  LCHAT_HOST         the space's hostname: the Host header, TLS name and log tag
                     (required with LCHAT_SIDECAR_URL)
  LCHAT_BOT_EVERY    seconds between runs (default 3600)
  LCHAT_BOT_ROOM     room a run posts to (unset: runs keep the schedule but post nothing)
  LCHAT_BOT_MESSAGE  text a run posts (default: "scheduled run <time>")
  LCHAT_BOT_LISTEN   1 to keep a WebSocket open to LCHAT_BOT_ROOM and log what is said (default 0)
"""


class ConfigError(Exception):
    """A variable is missing or malformed; the message names it."""


# -- configuration -----------------------------------------------------------------------------


@frozen
class BaseURL:
    scheme: str  # "http" or "https"
    hostname: str  # where to connect (the router), not the Host header
    port: int
    prefix: str  # path prefix without a trailing slash ("" for none)

    @classmethod
    def parse(cls, raw: str) -> BaseURL:
        try:
            url = urllib.parse.urlsplit(raw)
            port = url.port
        except ValueError as e:
            raise ConfigError(f"LCHAT_SIDECAR_URL is not a valid URL: {e}") from None
        if url.scheme not in ("http", "https"):
            raise ConfigError(f"LCHAT_SIDECAR_URL must be an http or https URL, not {raw!r}")
        if not url.hostname:
            raise ConfigError(f"LCHAT_SIDECAR_URL has no host: {raw!r}")
        if url.username is not None or url.password is not None or url.query or url.fragment:
            raise ConfigError("LCHAT_SIDECAR_URL must be a base URL (no credentials, query or #)")
        default = 443 if url.scheme == "https" else 80
        return cls(url.scheme, url.hostname, port or default, url.path.rstrip("/"))

    def __str__(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"


@frozen
class SidecarConfig:
    token: str
    db: str
    host: str = "space"
    socket: str | None = None
    url: BaseURL | None = None
    every: int = DEFAULT_EVERY
    room: str | None = None
    message: str | None = None
    listen: bool = False

    @property
    def state_path(self) -> str:
        return self.db + "-bot.json"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SidecarConfig:
        def get(name: str) -> str:
            return env.get(name, "").strip()

        token = env.get("LCHAT_BOT_TOKEN", "")
        if not token.strip():
            raise ConfigError(
                "LCHAT_BOT_TOKEN is not set: the sidecar needs the bot token to report its "
                "schedule; refusing to start"
            )
        db = get("LCHAT_DB")
        if not db:
            raise ConfigError("LCHAT_DB is not set (the schedule is kept beside the database)")

        url: BaseURL | None = None
        socket: str | None = None
        if get("LCHAT_SIDECAR_URL"):
            url = BaseURL.parse(get("LCHAT_SIDECAR_URL"))
        else:
            socket = get("LCHAT_SOCKET") or None
            if socket is None:
                raise ConfigError("LCHAT_SOCKET is not set (nor LCHAT_SIDECAR_URL)")

        host = "space"
        if get("LCHAT_HOST"):
            try:
                host = hosts.normalise(get("LCHAT_HOST"))
            except hosts.InvalidHost as e:
                raise ConfigError(f"LCHAT_HOST is not a valid hostname: {e}") from None
        elif url is not None:
            raise ConfigError("LCHAT_HOST is not set (required with LCHAT_SIDECAR_URL)")

        every = DEFAULT_EVERY
        if get("LCHAT_BOT_EVERY"):
            raw = get("LCHAT_BOT_EVERY")
            if re.fullmatch(r"[0-9]{1,12}", raw) is None or not 1 <= int(raw) <= MAX_EVERY:
                raise ConfigError(
                    f"LCHAT_BOT_EVERY must be a whole number of seconds from 1 to {MAX_EVERY}, "
                    f"not {raw!r}"
                )
            every = int(raw)

        room = get("LCHAT_BOT_ROOM") or None
        if room is not None and ROOM.fullmatch(room) is None:
            raise ConfigError(
                f"LCHAT_BOT_ROOM must be 1-64 letters, digits, '_' or '-', not {room!r}"
            )

        listen_raw = get("LCHAT_BOT_LISTEN").lower()
        if listen_raw in ("", "0", "off", "no", "false"):
            listen = False
        elif listen_raw in ("1", "on", "yes", "true"):
            listen = True
        else:
            raise ConfigError(f"LCHAT_BOT_LISTEN must be 1 or 0, not {listen_raw!r}")
        if listen and room is None:
            raise ConfigError("LCHAT_BOT_LISTEN=1 needs LCHAT_BOT_ROOM (the room to listen to)")

        message = env.get("LCHAT_BOT_MESSAGE") or None
        if message is not None and len(message.encode("utf-8", "surrogatepass")) > 64 * 1024:
            raise ConfigError("LCHAT_BOT_MESSAGE is longer than 64 KiB")

        return cls(
            token=token.strip(),
            db=db,
            host=host,
            socket=socket,
            url=url,
            every=every,
            room=room,
            message=message,
            listen=listen,
        )
