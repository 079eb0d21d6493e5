"""The reference space server (docs/design.md §8): `lchat space`, or `python -m lchat.space`."""

from lchat.space.server import main

__all__ = ["main"]
