"""The running router as a hand-over command talks to it: reload, status, one host's entry.

The router may not run at all: a reload is then only a note (its 2 s registry poll catches up
when it starts), and a status is None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import frozen

from lchat import admin_client
from lchat.admin_client import Response, RouterAdmin

STATUS_TIMEOUT = 3.0


@frozen
class Say:
    """A command's three voices: stdout, and notes and warnings on stderr."""

    out: Callable[[str], None]
    note: Callable[[str], None]
    warn: Callable[[str], None]


def absent(e: admin_client.Unreachable) -> bool:
    """No router runs (no socket, or nothing listens on it), as opposed to one we cannot reach."""
    return isinstance(e.__cause__, FileNotFoundError | ConnectionRefusedError)


def json_body(response: Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


@frozen
class Router:
    admin: RouterAdmin
    say: Say

    def notify(self) -> None:
        """Ask the running router to reload now; its 2 s poll is the fallback, so never an error."""
        self.reload(absent_note="router not running; it will pick this up when it starts")

    def try_reload(self) -> None:
        """POST /reload; raises Unreachable when nothing listens. A bad answer is only a note."""
        try:
            response = self.admin.reload()
        except admin_client.ProtocolError as e:
            self.say.note(
                f"the router did not answer the reload ({e}); it will pick this up within seconds"
            )
            return
        if response.status != 200:
            self.say.note(
                f"the router answered {response.status} to the reload; it polls the registry anyway"
            )

    def reload(self, absent_note: str = "") -> bool:
        """POST /reload; False when the router is not running (``absent_note`` then, if any: its
        poll catches up when it does)."""
        try:
            self.try_reload()
        except admin_client.Unreachable as e:
            if not absent(e):
                self.say.note(f"cannot reach the router ({e}); it will pick this up within seconds")
            elif absent_note:
                self.say.note(absent_note)
            return False
        return True

    def status(self) -> dict[str, Any] | None:
        """The running router's ``GET /status``, or None when it cannot be asked."""
        try:
            response = self.admin.status(STATUS_TIMEOUT)
            doc = response.json() if response.status == 200 else None
        except admin_client.Unreachable as e:
            if not absent(e):
                self.say.note(f"cannot reach the router ({e}): STATE unknown")
            return None
        except (admin_client.ProtocolError, ValueError, AttributeError) as e:
            self.say.note(f"the router did not answer GET /status usefully ({e}): STATE unknown")
            return None
        return doc if isinstance(doc, dict) else None

    def entry(self, host: str) -> dict[str, Any] | None:
        """The running router's view of one host, or None when it has none or cannot be asked."""
        try:
            response = self.admin.status(STATUS_TIMEOUT)
            doc = response.json() if response.status == 200 else None
            entry = doc.get("hosts", {}).get(host) if doc is not None else None
        except (admin_client.Unreachable, admin_client.ProtocolError, ValueError, AttributeError):
            return None
        return entry if isinstance(entry, dict) else None
