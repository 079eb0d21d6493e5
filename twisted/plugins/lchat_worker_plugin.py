"""twistd plugin: `twistd lchat-worker` (a box's data-plane worker, started by the router's
control process with LCHAT_WORKERS >= 2). Lazy, so `twistd --help` stays cheap."""

from twisted.application.service import ServiceMaker

lchat_worker = ServiceMaker(
    "lchat-worker",
    "lchat.worker_tap",
    "One data-plane worker of the lchat box router (started by `twistd lchat` itself).",
    "lchat-worker",
)
