"""Small twisted.web pieces shared by the router's HTTP listeners."""

from __future__ import annotations

from twisted.web.http import Request
from twisted.web.server import Site


class QuietSite(Site):
    """A Site that writes no per-request access log (the router's own metrics and logs say more)."""

    noisy = False
    displayTracebacks = False

    def log(self, request: Request) -> None:
        pass
