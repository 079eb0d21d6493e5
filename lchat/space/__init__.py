"""The reference space server (DESIGN §8): `lchat space`, or `python -m lchat.space`."""

from lchat.space.server import main

__all__ = ["main"]
