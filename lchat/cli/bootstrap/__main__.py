"""``python -m lchat.cli.bootstrap --probe ENV``: the router's boot checks on ``ENV``
(:func:`lchat.cli.bootstrap.probe.probe`) as JSON on stdout; bootstrap runs it as the service user."""

import json
import sys

from lchat.cli.bootstrap.probe import probe

if len(sys.argv) == 3 and sys.argv[1] == "--probe":
    ok, left = probe(sys.argv[2])
    print(json.dumps({"ok": ok, "left": left}))
    sys.exit(0)
sys.exit("usage: lchat bootstrap ... (this module's own entry point is for its probes)")
