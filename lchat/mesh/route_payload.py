"""The body of ``POST /api/mesh/route`` (lchat.mesh.api), checked field by field: what a peer may
make this box write (the API's docstring says what each field may hold). Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from attrs import Factory, frozen

from lchat import envfile, hosts
from lchat.config import MeshConfig
from lchat.config.mesh import REGION_LABEL
from lchat.mesh.client import (
    ENV_KEY,
    MAX_GEN,
    MAX_NEXT_DUE,
    PAYLOAD_FIELDS,
    REQUIRED_FIELDS,
    RESERVED_ENV,
    check_peer_url,
)
from lchat.mesh.placement import normalise_member_url
from lchat.registry import REPLICATIONS

MAX_ENV_KEYS = 64
MAX_ENV_VALUE = 4096
MAX_VERSION = 256


class PayloadError(ValueError):
    """A payload that is not acceptable; the message says which field and why."""


@frozen
class RoutePayload:
    """A validated ``POST /api/mesh/route`` body (kind ``instance`` and hibernate true, always)."""

    host: str
    version: str
    replication: str
    home_region: str
    env: Mapping[str, str]
    next_due: int | None = None  # None: absent, keep this box's value
    # Non-empty: the "lives elsewhere" shape (hibernate false): the normalised URL of the box
    # that runs the space always-on; this box forwards to it and never wakes the space.
    lives_at: str = ""
    # The sender's settings generation (lchat.mesh.settings); None: an older peer's payload.
    gen: int | None = None
    # The bot sidecar's replicable env values (``<host>-bot.env``); empty: the space has none.
    bot_env: Mapping[str, str] = Factory(dict)
    # The generation of the sender's last home_region change (lchat.mesh.settings.region_newer);
    # None: an older peer's payload (its home region follows the whole row's order).
    region_gen: int | None = None


def parse_payload(data: object) -> RoutePayload:
    """Check a decoded JSON body field by field; :class:`PayloadError` names the first problem."""
    if not isinstance(data, dict):
        raise PayloadError("the body must be a JSON object")
    unknown = sorted(set(data) - set(PAYLOAD_FIELDS))
    if unknown:
        raise PayloadError(f"unknown fields: {', '.join(unknown)[:200]}")
    missing = [f for f in REQUIRED_FIELDS if f not in data]
    if missing:
        raise PayloadError(f"missing fields: {', '.join(missing)}")
    host = data["host"]
    if not isinstance(host, str):
        raise PayloadError("host must be a string")
    try:
        host = hosts.normalise(host)
    except hosts.InvalidHost as e:
        raise PayloadError(f"host: {e}") from None
    if data["kind"] != "instance":
        raise PayloadError("kind must be 'instance': services do not replicate")
    hibernate = data["hibernate"]
    if not isinstance(hibernate, bool):
        raise PayloadError("hibernate must be true or false")
    lives_at = data.get("lives_at", "")
    if hibernate and lives_at != "":
        raise PayloadError("lives_at must be absent or empty on a hibernating route")
    if not hibernate:
        lives_at = _check_lives_at(lives_at)
        if "next_due" in data:
            raise PayloadError("next_due: a lives-elsewhere route never wakes here")
        if "bot_env" in data:
            raise PayloadError("bot_env: a lives-elsewhere route never runs a sidecar here")
    version = data["version"]
    if not _text(version) or len(version) > MAX_VERSION or not _printable(version):
        raise PayloadError(f"version must be printable text of at most {MAX_VERSION} characters")
    replication = data["replication"]
    if not isinstance(replication, str) or replication not in REPLICATIONS:
        raise PayloadError(f"replication must be one of {', '.join(REPLICATIONS)}")
    home_region = data["home_region"]
    if not isinstance(home_region, str) or (
        home_region and not REGION_LABEL.fullmatch(home_region)
    ):
        raise PayloadError("home_region must be empty or letters, digits, '.', '_' or '-'")
    next_due = data.get("next_due")  # absent: None (keep this box's value); null is refused
    if "next_due" in data and (
        not isinstance(next_due, int)
        or isinstance(next_due, bool)
        or not 0 <= next_due < MAX_NEXT_DUE
    ):
        raise PayloadError("next_due must be an integer of unix seconds, 0 (none) up to 2**53")
    gen = data.get("gen")
    if "gen" in data and (
        not isinstance(gen, int) or isinstance(gen, bool) or not 0 < gen < MAX_GEN
    ):
        raise PayloadError("gen must be a positive integer (a settings generation) below 2**53")
    region_gen = data.get("region_gen")
    if "region_gen" in data and (
        not isinstance(region_gen, int)
        or isinstance(region_gen, bool)
        or not 0 <= region_gen < MAX_GEN
    ):
        raise PayloadError(
            "region_gen must be an integer from 0 below 2**53 (the generation of the home "
            "region's last change)"
        )
    return RoutePayload(
        host=host,
        version=version,
        replication=replication,
        home_region=home_region,
        env=_check_env(data["env"]),
        next_due=next_due,
        lives_at=lives_at,
        gen=gen,
        region_gen=region_gen,
        bot_env=_check_env(data["bot_env"], "bot_env") if "bot_env" in data else {},
    )


def _check_lives_at(value: object) -> str:
    """A route with ``hibernate`` false must say where it lives: a box's ``LCHAT_MESH_SELF``
    (``http(s)://host[:port]``, no path), returned normalised."""
    if not isinstance(value, str) or not value:
        raise PayloadError(
            "hibernate must be true, or false with lives_at (the URL of the box that runs the "
            "space always-on): only hibernating spaces and lives-elsewhere routes replicate"
        )
    try:
        return normalise_member_url(check_peer_url(value))
    except ValueError as e:
        raise PayloadError(f"lives_at: {e}"[:300]) from None


def _check_env(env: object, field: str = "env") -> dict[str, str]:
    if not isinstance(env, dict):
        raise PayloadError(f"{field} must be an object of names to strings")
    if len(env) > MAX_ENV_KEYS:
        raise PayloadError(f"{field} has more than {MAX_ENV_KEYS} entries")
    checked: dict[str, str] = {}
    for name, value in env.items():
        if not ENV_KEY.fullmatch(name) or name in RESERVED_ENV:
            raise PayloadError(
                f"{field}: {name[:80]!r} is not a replicable name (LCHAT_[A-Z0-9_]{{1,64}}, not "
                f"{', '.join(sorted(RESERVED_ENV))})"
            )
        if not _text(value):
            raise PayloadError(f"{field}: {name} must be a string (of UTF-8 text)")
        if len(value.encode("utf-8")) > MAX_ENV_VALUE:
            raise PayloadError(f"{field}: {name} is longer than {MAX_ENV_VALUE} bytes")
        try:
            envfile.env_line(name, value)
        except ValueError as e:
            raise PayloadError(f"{field}: {name}: {e}") from None
        checked[name] = value
    return checked


def in_scope(mesh: MeshConfig, host: str, home_region: str) -> bool:
    """Is ``host`` one of the mesh's: equal to or directly under a mesh domain, or homed in this
    box's region *and* under a mesh domain at any depth? Never a name outside the mesh's
    domains: a replicated route makes this box serve, and order a certificate for, its host."""
    if any(hosts.covers(domain, host) for domain in mesh.domains):
        return True
    return (
        bool(home_region)
        and home_region == mesh.region
        and any(host.endswith("." + domain) for domain in mesh.domains)
    )


def decode_payload(body: bytes) -> RoutePayload:
    """A body's JSON (no duplicate keys, no NaN or Infinity), checked by :func:`parse_payload`."""
    try:
        data = json.loads(
            body.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PayloadError(f"the body is not JSON: {e}"[:300]) from None
    return parse_payload(data)


def _text(value: object) -> bool:
    """A string that is valid unicode all through (JSON can smuggle in lone surrogates)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> bool:
    return not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key[:80]!r}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
