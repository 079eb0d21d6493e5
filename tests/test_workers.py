"""A box with worker processes (``LCHAT_WORKERS`` >= 2): what the admin API and ``lchat
instances`` say about them (in process), and the promises of issue 33 item 2 on real routers
(further down)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.trial.unittest import TestCase
from twisted.web.test.requesthelper import DummyRequest

from lchat.admin import AdminAPI, metrics_site
from lchat.cli.instances import _workers_summary
from lchat.reactors import installed
from lchat.registry import Registry
from lchat.routesource import RouteSource
from lchat.threads import thread_runner


def _request(method: bytes, path: bytes) -> Any:
    request: Any = DummyRequest([path[1:]])
    request.method = method
    request.path = path
    return request


async def _render(resource: Any, request: Any) -> tuple[int, bytes]:
    """Render ``request`` through ``resource`` and wait for it to finish."""
    result = resource.render(request)
    if isinstance(result, bytes):
        return request.responseCode or 200, result
    if not request.finished:
        await request.notifyFinish()
    return request.responseCode or 200, b"".join(request.written)


class AdminWithWorkersTests(TestCase):
    """The admin API's reload, metrics and status with the callables a control process gives."""

    def setUp(self) -> None:
        d = tempfile.mkdtemp(prefix="aw", dir="/tmp")
        self.addCleanup(shutil.rmtree, d, True)
        registry = Registry(os.path.join(d, "registry.db"), clock=time.time)
        registry.migrate()
        self.routes = RouteSource(
            reactor, registry, registry.load(), run_in_thread=thread_runner(installed())
        )

    def admin(self, **options: Any) -> Any:
        return AdminAPI(reactor, self.routes, "builtin", **options).site().resource

    async def test_reload_answers_what_the_reload_callable_says(self) -> None:
        asked: list[str] = []

        def reload(reason: str) -> Deferred[dict[str, Any]]:
            asked.append(reason)
            return succeed({"routes": 0, "workers": {"current": 2, "of": 2, "behind": []}})

        code, body = await _render(self.admin(reload=reload), _request(b"POST", b"/reload"))
        self.assertEqual(code, 200)
        self.assertEqual(
            json.loads(body), {"routes": 0, "workers": {"current": 2, "of": 2, "behind": []}}
        )
        self.assertEqual(asked, ["admin API"])

    async def test_one_process_reload_is_its_table(self) -> None:
        code, body = await _render(self.admin(), _request(b"POST", b"/reload"))
        self.assertEqual((code, json.loads(body)), (200, {"routes": 0}))

    async def test_metrics_from_a_deferred_and_a_failure_is_a_500(self) -> None:
        resource = self.admin(metrics=lambda: succeed(b"merged 1\n"))
        request = _request(b"GET", b"/metrics")
        code, body = await _render(resource, request)
        self.assertEqual((code, body), (200, b"merged 1\n"))
        self.assertEqual(
            request.responseHeaders.getRawHeaders(b"content-type"), [CONTENT_TYPE_LATEST.encode()]
        )
        resource = self.admin(metrics=lambda: fail(RuntimeError("worker 2 garbled")))
        code, body = await _render(resource, _request(b"GET", b"/metrics"))
        self.assertEqual(code, 500)
        self.assertIn(b"worker 2 garbled", body)
        # LCHAT_METRICS_ADDR's site serves the same callable.
        site = metrics_site(lambda: succeed(b"merged 2\n"))
        code, body = await _render(site.resource, _request(b"GET", b"/metrics"))
        self.assertEqual((code, body), (200, b"merged 2\n"))

    def test_status_has_workers_only_when_given(self) -> None:
        workers = {"wanted": 2, "serving": 2, "list": []}
        with_workers = AdminAPI(reactor, self.routes, "builtin", workers=lambda: workers)
        self.assertEqual(with_workers.status()["workers"], workers)
        self.assertNotIn("workers", AdminAPI(reactor, self.routes, "builtin").status())


class WorkersLineTests(TestCase):
    """``lchat instances``' stderr line about the workers."""

    def entry(self, slot: int, state: str = "ready", **extra: Any) -> dict[str, Any]:
        return {
            "slot": slot,
            "state": state,
            "restarts": 0,
            "last_error": None,
            "routes_current": True,
            "certificates_current": None,
            **extra,
        }

    def test_all_serving(self) -> None:
        status = {"workers": {"wanted": 2, "serving": 2, "list": [self.entry(1), self.entry(2)]}}
        self.assertEqual(
            _workers_summary(status),
            "workers: 2 of 2 serving (LCHAT_WORKERS=2), on the current routes and certificates",
        )

    def test_what_is_wrong_is_named(self) -> None:
        down = self.entry(2, "backoff", restarts=3, last_error="killed by SIGKILL")
        behind = self.entry(1, routes_current=False)
        status = {"workers": {"wanted": 2, "serving": 1, "list": [behind, down]}}
        self.assertEqual(
            _workers_summary(status),
            "workers: 1 of 2 serving (LCHAT_WORKERS=2) \N{EM DASH} worker 1 behind on routes; "
            "worker 2 backoff (killed by SIGKILL; 3 restarts)",
        )

    def test_one_process_says_nothing(self) -> None:
        self.assertIsNone(_workers_summary({"hosts": {}}))
        self.assertIsNone(_workers_summary(None))
