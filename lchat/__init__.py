"""lchat: the one process on every box of a chat fleet (`twistd lchat`)."""

__version__ = "0.1.0"
