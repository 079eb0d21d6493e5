"""What a box installed from the wheel needs to set itself up (``lchat bootstrap``), shipped as
package data: ``systemd/`` (the units, a link to the checkout's ``ops/systemd``) and
``router.env.example`` (a link to ``etc/router.env.example``). The links keep one copy of each
file in the source tree; the wheel build copies what they point to."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
UNITS_DIR = os.path.join(HERE, "systemd")
ENV_EXAMPLE = os.path.join(HERE, "router.env.example")
