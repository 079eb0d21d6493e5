import os

# Test routers run spaces as the router's own user, as on a developer's machine: these tests run
# as root, where isolation would otherwise be on (each space its own uid, lchat/isolation.py).
# The isolation tests set LCHAT_ISOLATION=on themselves, on directories other users can reach.
os.environ.setdefault("LCHAT_ISOLATION", "off")
