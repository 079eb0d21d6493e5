"""The release settings, read from the same env file (and process environment) as the rest of the
box's settings (:func:`lchat.config.load` keeps the file's values in ``BoxConfig.file_env``).

=============================  =====================================================================
``LCHAT_OPT_DIR``              the build tree (default ``/opt/lchat``: ``versions/``, ``live/``)
``LCHAT_RELEASE_URL``          the primary feed's base: ``https://...`` (``feed.json`` beneath it)
``LCHAT_RELEASE_MIRROR_URL``   the S3 mirror: ``s3://BUCKET[/PREFIX][?region=R&endpoint=URL]`` (the
                               box's AWS credential chain), or ``file:PATH``
``LCHAT_RELEASE_PUBKEY``       base64 of the raw 32-byte Ed25519 key that signs the feed
``LCHAT_RELEASE_FEED_VALIDITY`` (release host) how long a feed it signs stays valid: its signed
                               ``expires_at`` is this long after ``publish``/``refresh`` (default
                               ``7d``; at least ``1h``, at most ``365d``)
``LCHAT_RELEASE_CHANNEL``      ``stable`` or ``canary``: the release agent rolls out the version the
                               feed's channel names when it is newer than the box's default build;
                               empty (the default): manual deploys only
``LCHAT_RELEASE_WINDOW``       ``HH:MM-HH:MM`` (UTC; may span midnight): when a channel's rollout
                               may start; empty: any time
=============================  =====================================================================

The process environment wins over the file, as for every other setting.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from attrs import frozen

from lchat.builds import DEFAULT_OPT_DIR, BuildLayout
from lchat.config import ConfigError, parse_bucket_url, parse_duration
from lchat.objstore.where import Where
from lchat.release.feed import CHANNELS, DEFAULT_VALIDITY

VARIABLES = (
    "LCHAT_OPT_DIR",
    "LCHAT_RELEASE_URL",
    "LCHAT_RELEASE_MIRROR_URL",
    "LCHAT_RELEASE_PUBKEY",
    "LCHAT_RELEASE_FEED_VALIDITY",
    "LCHAT_RELEASE_CHANNEL",
    "LCHAT_RELEASE_WINDOW",
)
MIN_VALIDITY = datetime.timedelta(hours=1)  # shorter: a refresh timer's hiccup stops every fetch
MAX_VALIDITY = datetime.timedelta(days=365)  # longer: a frozen source keeps boxes back that long


class SettingsError(ValueError):
    """A release setting that cannot be used; one line naming the variable."""


@frozen
class ReleaseSettings:
    opt_dir: str
    url: str  # "" when unset
    mirror: Where | None
    mirror_url: str  # as given, for messages
    pubkey: str  # "" when unset
    feed_validity: datetime.timedelta = DEFAULT_VALIDITY  # what publish/refresh sign
    channel: str = ""  # "" (manual), "stable" or "canary"
    window: Window | None = None  # None: any time

    def in_window(self, now: datetime.datetime) -> bool:
        """Whether a channel's rollout may start at ``now`` (aware, any zone)."""
        return self.window is None or self.window.holds(now)

    @property
    def layout(self) -> BuildLayout:
        return BuildLayout(self.opt_dir)

    @property
    def state_file(self) -> str:
        """The newest feed this box accepted (anti-rollback): ``<opt>/release-state.json``."""
        return self.layout.release_state


@frozen
class Window:
    """A daily span of UTC time, ``start`` inclusive, ``end`` exclusive, in minutes after
    midnight; ``start > end`` spans midnight."""

    start: int
    end: int

    def holds(self, now: datetime.datetime) -> bool:
        utc = now.astimezone(datetime.UTC)
        minute = utc.hour * 60 + utc.minute
        if self.start <= self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    def __str__(self) -> str:
        return (
            f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"
        )


def parse_window(text: str) -> Window:
    """``HH:MM-HH:MM`` (UTC) as a :class:`Window`; SettingsError naming the variable."""
    match = re.fullmatch(r"([0-9]{2}):([0-9]{2})-([0-9]{2}):([0-9]{2})", text)
    if match is not None:
        h1, m1, h2, m2 = (int(g) for g in match.groups())
        if h1 < 24 and h2 < 24 and m1 < 60 and m2 < 60 and (h1, m1) != (h2, m2):
            return Window(h1 * 60 + m1, h2 * 60 + m2)
    raise SettingsError(
        f"LCHAT_RELEASE_WINDOW={text!r} must be HH:MM-HH:MM in UTC (e.g. 03:00-05:00), start "
        "and end different"
    )


def read(file_env: Mapping[str, str], environ: Mapping[str, str] | None = None) -> ReleaseSettings:
    environ = os.environ if environ is None else environ
    merged = {k: file_env[k] for k in VARIABLES if k in file_env}
    merged.update({k: environ[k] for k in VARIABLES if k in environ})

    def get(name: str) -> str:
        return merged.get(name, "").strip()

    opt_dir = get("LCHAT_OPT_DIR") or DEFAULT_OPT_DIR
    if not os.path.isabs(opt_dir) or "\x00" in opt_dir:
        raise SettingsError(f"LCHAT_OPT_DIR={opt_dir!r} must be an absolute path")
    url = get("LCHAT_RELEASE_URL").rstrip("/")
    if url:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
            raise SettingsError(
                f"LCHAT_RELEASE_URL={url!r} must be an http(s) URL without a query "
                "(the directory feed.json is in)"
            )
    mirror_url = get("LCHAT_RELEASE_MIRROR_URL")
    mirror = None
    if mirror_url:
        try:
            mirror = parse_bucket_url("LCHAT_RELEASE_MIRROR_URL", mirror_url)
        except ConfigError as e:
            raise SettingsError(str(e)) from None
    validity, given = DEFAULT_VALIDITY, get("LCHAT_RELEASE_FEED_VALIDITY")
    if given:
        try:
            validity = datetime.timedelta(
                seconds=parse_duration("LCHAT_RELEASE_FEED_VALIDITY", given)
            )
        except ConfigError as e:
            raise SettingsError(str(e)) from None
        if not MIN_VALIDITY <= validity <= MAX_VALIDITY:
            raise SettingsError(
                f"LCHAT_RELEASE_FEED_VALIDITY={given} must be between 1h and 365d (a feed's life "
                "after it is signed)"
            )
    channel = get("LCHAT_RELEASE_CHANNEL")
    if channel and channel not in CHANNELS:
        raise SettingsError(
            f"LCHAT_RELEASE_CHANNEL={channel!r} must be {' or '.join(CHANNELS)}, or empty "
            "(manual deploys only)"
        )
    window_text = get("LCHAT_RELEASE_WINDOW")
    return ReleaseSettings(
        opt_dir=os.path.normpath(opt_dir),
        url=url,
        mirror=mirror,
        mirror_url=mirror_url,
        pubkey=get("LCHAT_RELEASE_PUBKEY"),
        feed_validity=validity,
        channel=channel,
        window=parse_window(window_text) if window_text else None,
    )
