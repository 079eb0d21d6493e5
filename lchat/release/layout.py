"""Moved to :mod:`lchat.builds` (the base layer: the box's settings need it)."""

# moved to lchat.builds: importers outside configuration still use this
from lchat.builds import (  # noqa: F401
    DEFAULT_LINK,
    DEFAULT_OPT_DIR,
    SIDECAR_BINARY,
    SPACE_BINARY,
    BadVersion,
    BuildLayout,
    check_version,
    fall_back_to_default,
)
