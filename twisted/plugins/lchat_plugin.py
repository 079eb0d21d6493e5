"""twistd plugin: `twistd lchat`. Lazy, so `twistd --help` stays cheap."""

from twisted.application.service import ServiceMaker

lchat = ServiceMaker(
    "lchat",
    "lchat.tap",
    "The lchat box router: routes each hostname to its space, supervises spaces.",
    "lchat",
)
