"""The reverse proxy: moves bytes between a client and the target the router chose."""
