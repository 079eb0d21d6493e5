"""Reactor plugin: ``twistd --reactor=uvloop`` / ``trial --reactor=uvloop`` (lchat.uvloop_reactor)."""

from twisted.application.reactors import Reactor

uvloop = Reactor(
    "uvloop",
    "lchat.uvloop_reactor",
    "Twisted's asyncio reactor on a uvloop event loop (lchat's data plane runs on it)",
)
