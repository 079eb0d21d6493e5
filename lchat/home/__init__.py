"""lchat home: the fleet's account service (``twistd lchat-home``), see docs/home.md."""
