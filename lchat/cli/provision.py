"""Creating a space beyond its row: ``lchat probe`` (can it boot?) and ``lchat invite`` (the
setup invite), also run by ``lchat add-instance --probe`` / ``--invite``.

The probe asks the running router (``POST /probe?host=H`` on its admin socket,
lchat.readiness), which wakes the space on the box that would run it, reads its version and puts
it back to sleep; the registry row is never touched, so a failed probe leaves the space
registered and says so.

The setup invite is minted here and needs no running space (docs/hibernation.md, "the contract
for a space"): 32 random bytes, base64url, printed once as ``https://<host>/setup#<invite>``;
only its SHA-256 (hex, of the invite's text) is kept, as ``LCHAT_SETUP_INVITE_SHA256`` in the
space's env file, which replicates with the route. The space accepts it once
(``POST /api/setup``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import secrets
import urllib.parse
from collections.abc import Callable
from typing import Any

from lchat import admin_client, config, envfile
from lchat.config import BoxConfig

PROBE_SUMMARY = "wake a hibernating space where it would run, read its version, sleep it again"
INVITE_SUMMARY = "mint a space's setup invite (only its hash is kept, in the space's env file)"
DEFAULT_PROBE_TIMEOUT = 150.0  # seconds: above the router's wait on a peer (readiness.PEER_TIMEOUT)
INVITE_VAR = "LCHAT_SETUP_INVITE_SHA256"  # the contract's name (lchat.space.config)
INVITE_BYTES = 32

Out = Callable[[str], None]


class ProvisionError(Exception):
    """A refusal or failure of ``probe`` or ``invite``; one ``lchat: error:`` line."""


# --- the setup invite ---------------------------------------------------------------------------


def add_invite_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("host", help="the space's hostname")
    parser.add_argument(
        "--rotate",
        action="store_true",
        help="replace the space's invite: the old one stops working at its next wake",
    )


def mint_invite(env_path: str) -> str:
    """Mint a setup invite, store its hash in the env file at ``env_path`` (every other line
    kept, mode 0600) and return the invite (base64url, no padding). The invite itself is
    written nowhere."""
    invite = base64.urlsafe_b64encode(secrets.token_bytes(INVITE_BYTES)).rstrip(b"=").decode()
    set_env_value(env_path, INVITE_VAR, invite_hash(invite))
    return invite


def invite_hash(invite: str) -> str:
    """What the env file keeps: the hex SHA-256 of the invite's text."""
    return hashlib.sha256(invite.encode()).hexdigest()


def invite_url(host: str, invite: str) -> str:
    """The link handed to the space's creator: the invite rides in the fragment, which browsers
    never send to a server (nor into its access log)."""
    return f"https://{host}/setup#{invite}"


def has_invite(env_path: str) -> bool:
    return bool(config.read_env_file(env_path).get(INVITE_VAR))


def set_env_value(path: str, name: str, value: str) -> None:
    """Set ``name`` in the env file at ``path`` (lchat.envfile.edit: every other line kept, its
    owner too), or write a new one holding it."""
    try:
        envfile.edit(path, {name: value})
    except FileNotFoundError:
        envfile.write_lines(path, [envfile.env_line(name, value)])


# --- the readiness probe ------------------------------------------------------------------------


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("host", help="the space's hostname")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_PROBE_TIMEOUT,
        metavar="SECONDS",
        help=f"how long to wait for the whole probe (default {DEFAULT_PROBE_TIMEOUT:g})",
    )
    parser.add_argument("--json", action="store_true", help="print the router's JSON answer")


def probe(
    cfg: BoxConfig, host: str, timeout: float, out: Out, *, as_json: bool = False, created: bool
) -> int:
    """Ask the router to probe ``host`` (the module docstring); print the outcome. 0 when it
    answered ready; raises :class:`ProvisionError` (exit 1) with the wake's reason otherwise.
    ``created``: the row was just written by add-instance (the message says it stays)."""
    path = "/probe?" + urllib.parse.urlencode({"host": host})
    stays = f"{host} stays registered (asleep)" if created else f"{host}'s row is unchanged"
    try:
        response = admin_client.request(cfg.admin_socket, "POST", path, timeout=timeout)
    except admin_client.Unreachable as e:
        raise ProvisionError(
            f"no router answers on {cfg.admin_socket} ({e}): only a running router wakes a "
            f"space; {stays}"
        ) from e
    except admin_client.ProtocolError as e:
        raise ProvisionError(
            f"the probe of {host} got no answer (within --timeout {timeout:g}s): {e}; {stays}"
        ) from e
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if response.status == 404 and not (isinstance(body, dict) and "reason" in body):
        # Every 404 of the probe names its reason (unknown_host): a bare one is an older router.
        raise ProvisionError(
            f"the router on {cfg.admin_socket} has no POST /probe: it runs an older lchat "
            f"(restart it on this version); {stays}"
        )
    if not isinstance(body, dict):
        raise ProvisionError(f"the router answered {response.status} without JSON; {stays}")
    if as_json:
        out(json.dumps(body, indent=2, sort_keys=True))
    box = body.get("box") or "this box"
    if response.status == 200:
        if not as_json:
            left = " (it was awake: left awake)" if body.get("was_awake") else ", asleep again"
            out(
                f"{host}: ready in {float(body.get('seconds', 0)):.2f}s on {box}, build "
                f"{body.get('build') or '?'} (lchat {body.get('version') or '?'}){left}"
            )
        return 0
    reason = body.get("reason") or f"status {response.status}"
    error = body.get("error") or "no reason given"
    raise ProvisionError(f"{host} is not ready on {box}: {reason}: {error}; {stays}")
