"""``Supervisor.restart`` (what the router's ``POST /restart?host=H`` runs for ``lchat deploy``)
on a fake clock with fake processes, and the admin endpoint's refusals."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import succeed
from twisted.trial import unittest
from twisted.web.test.requesthelper import DummyRequest

from lchat.admin import AdminAPI, _Json
from lchat.supervise import Supervisor
from tests.fakes import FakeReactor
from tests.test_supervise import States, spec


class RestartTests(unittest.TestCase):
    def setUp(self) -> None:
        self.r = FakeReactor()
        self.states = States()
        self.sup = Supervisor(self.r, self.states, new_session=False, kill_timeout=20.0)

    def test_a_running_child_is_stopped_then_started_again_at_once(self) -> None:
        self.sup.want({"a": spec("a")})
        self.sup.startService()
        first = self.r.processes[0]
        pids: list[Any] = []
        self.sup.restart("a").addCallback(pids.append)
        self.assertEqual((first.signals, pids), (["TERM"], []))  # answers once it is gone
        first.exit(None, sig=15)
        self.assertEqual(len(self.r.processes), 2)  # no backoff: started at once
        self.assertEqual(pids, [self.r.processes[1].pid])
        self.assertEqual(self.sup.status()["a"].restarts, 0)  # a restart asked for, not a crash

    def test_a_child_in_backoff_starts_now_and_its_backoff_is_forgotten(self) -> None:
        self.sup.want({"a": spec("a")})
        self.sup.startService()
        for _ in range(3):
            self.r.processes[-1].exit(1, stderr=b"broken\n")
            self.r.advance(60)
        self.r.processes[-1].exit(1, stderr=b"broken\n")  # now waiting out a long backoff
        n = len(self.r.processes)
        pids: list[Any] = []
        self.sup.restart("a").addCallback(pids.append)
        self.assertEqual(len(self.r.processes), n + 1)
        self.assertEqual(pids, [self.r.processes[-1].pid])

    def test_an_unknown_name_is_a_key_error(self) -> None:
        self.sup.startService()
        with self.assertRaises(KeyError):
            self.sup.restart("nope")


class AdminRestartTests(unittest.TestCase):
    def answer(self, admin: AdminAPI, host: str) -> tuple[int, dict[str, Any]]:
        request: Any = DummyRequest([b"restart"])
        request.method = b"POST"
        request.path = b"/restart"
        request.args = {b"host": [host.encode()]}
        body = _Json(admin).render(request)
        assert isinstance(body, bytes), body
        return request.responseCode or 200, json.loads(body)

    def admin(self, restart: Any) -> AdminAPI:
        return AdminAPI(FakeReactor(), routes=None, units="builtin", restart=restart)  # type: ignore[arg-type]

    def test_without_builtin_units_it_is_409(self) -> None:
        code, body = self.answer(self.admin(None), "a.example.com")
        self.assertEqual(code, 409)
        self.assertIn("does not run always-on spaces", body["error"])

    def test_unknown_host_is_404_and_bad_host_400(self) -> None:
        def restart(host: str) -> Any:
            raise KeyError(host)

        code, body = self.answer(self.admin(restart), "a.example.com")
        self.assertEqual(
            (code, body["error"]), (404, "a.example.com is not an always-on space run here")
        )
        code, _ = self.answer(self.admin(lambda h: succeed(1)), "not a host!")
        self.assertEqual(code, 400)
