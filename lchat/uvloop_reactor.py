"""The reactor the router runs on: Twisted's asyncio reactor driving a uvloop event loop.

The control plane (registry, activator, lease, replication, mesh, ACME, admin) is Twisted code and
runs on it unchanged; the data plane (:mod:`lchat.proxy`) is asyncio Protocols on the very same
loop, so that the bytes of every proxied request move on uvloop's C transports. One loop, one
thread: a Deferred from the control plane and a callback from the data plane never race.

Installed by ``twistd --reactor=uvloop`` and ``trial --reactor=uvloop`` (the plugin in
``twisted/plugins/lchat_reactors.py``), and by ``twistd lchat`` itself when no reactor was chosen.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

FIX = "run it as `twistd lchat ...` (or `twistd --reactor=uvloop lchat ...`)"


def install() -> None:
    """Install the asyncio reactor on a new uvloop loop (before anything imports the reactor)."""
    import uvloop
    from twisted.internet.main import installReactor

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    installReactor(_reactor_class()(loop))


def _reactor_class() -> type:
    from twisted.internet import process
    from twisted.internet.asyncioreactor import AsyncioSelectorReactor

    class UvloopReactor(AsyncioSelectorReactor):
        """Twisted's asyncio reactor, reaping its children by pidfd.

        Twisted learns that a child exited from SIGCHLD through the signal wakeup fd, which uvloop
        takes for itself while it runs: a child would never be reaped, its ``processEnded`` never
        called (a space that stopped would look alive forever). So each spawned child gets a
        pidfd (Linux ≥ 5.3), readable once the child has exited: then Twisted reaps."""

        def spawnProcess(self, *args: Any, **kwargs: Any) -> Any:
            transport = super().spawnProcess(*args, **kwargs)
            pid = getattr(transport, "pid", None)
            if pid is not None:
                self._watch_exit(pid)
            return transport

        def _watch_exit(self, pid: int) -> None:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                # Gone already (and maybe reaped): reap whatever is left to reap.
                self.callLater(0, process.reapAllProcesses)
                return
            loop = self._asyncioEventloop

            def exited() -> None:
                loop.remove_reader(pidfd)
                os.close(pidfd)
                process.reapAllProcesses()

            loop.add_reader(pidfd, exited)

    return UvloopReactor


def installed() -> bool:
    """A reactor has been installed (importing ``twisted.internet.reactor`` installs the default)."""
    return "twisted.internet.reactor" in sys.modules


def running_on_uvloop(reactor: object) -> bool:
    """``reactor`` is an asyncio reactor whose loop is a uvloop loop."""
    loop = getattr(reactor, "_asyncioEventloop", None)
    if loop is None:
        return False
    return type(loop).__module__.split(".")[0] == "uvloop"


def ensure() -> None:
    """Make sure the router will run on uvloop: install it if no reactor is installed yet, refuse
    (naming the fix) if another one is."""
    if not installed():
        install()
        return
    from twisted.internet import reactor

    if not running_on_uvloop(reactor):
        raise SystemExit(
            f"lchat: the router's data plane runs on uvloop, but twistd installed "
            f"{type(reactor).__module__}.{type(reactor).__name__}: {FIX}"
        )


def loop_of(reactor: object) -> asyncio.AbstractEventLoop:
    """The asyncio loop under ``reactor``, where the data plane runs; an error naming the fix
    when the reactor is not an asyncio one."""
    loop = getattr(reactor, "_asyncioEventloop", None)
    if not isinstance(loop, asyncio.AbstractEventLoop):
        raise RuntimeError(
            f"the router's data plane needs the asyncio reactor on uvloop, not "
            f"{type(reactor).__module__}.{type(reactor).__name__}: {FIX}"
        )
    return loop
