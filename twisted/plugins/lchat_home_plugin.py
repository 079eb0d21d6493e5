"""twistd plugin: `twistd lchat-home`. Lazy, so `twistd --help` stays cheap."""

from twisted.application.service import ServiceMaker

lchat_home = ServiceMaker(
    "lchat-home",
    "lchat.home.tap",
    "lchat's home service: passkeys, link tokens and each user's encrypted vault.",
    "lchat-home",
)
