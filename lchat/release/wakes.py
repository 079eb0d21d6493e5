"""Moved to :mod:`lchat.builds` (the base layer, beside the build tree it records)."""

# moved to lchat.builds: importers outside configuration still use this
from lchat.builds import read_wake as read  # noqa: F401
from lchat.builds import record, record_quietly  # noqa: F401
