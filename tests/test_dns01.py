"""DNS-01 providers and the propagation check, each against a real server on 127.0.0.1.

- DNSimple against ``tests/dnsimple_double.py`` (DNSimple's v2 API as a loopback HTTP server);
- Route53 against moto's server (started by ``tests/s3servers.py``'s machinery, in its open mode:
  see ``_OpenMoto``), through a botocore session given credentials;
- ``wait_for_txt`` against small DNS servers written here with dnspython (UDP and TCP, on
  127.0.0.x): explicit resolvers, and the authoritative servers it finds by itself.

The providers block (they run in the ACME issuer's worker thread), so these tests are synchronous.
"""

from __future__ import annotations

import atexit
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

import botocore.session  # type: ignore[import-untyped]
import dns.exception
import dns.flags
import dns.message
import dns.nameserver
import dns.query
import dns.rcode
import dns.rdatatype
import dns.resolver
import dns.rrset
from botocore.credentials import CredentialResolver  # type: ignore[import-untyped]
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from lchat.acme.dns01 import PropagationTimeout, wait_for_txt
from lchat.dns import DNSimple, DNSProviderError, Route53, TXTRecord, make_provider
from lchat.dns.records import normalise_fqdn, quote_txt, unquote_txt
from tests.dnsimple_double import DNSimpleDouble
from tests.s3servers import S3Server

TOKEN = "dnsimple_a_" + "s3cr3t" * 4
VALUE_A = "gfj9Xq-Rt5bPx3Wn2eK1s8cZ0mYvLhT4uIoA7dQwE6F"
VALUE_B = "LoqXcYV8q5ONbJQxbmR7SCTNo3tiAXDfowyjxAjEuX0"


class _FakeTime:
    """An injected clock and sleep: sleeping advances the clock (and does not wait), and the n-th
    sleep runs what :meth:`at` scheduled for it (the world changing while we wait)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self._actions: dict[int, list[Callable[[], object]]] = {}

    def at(self, n: int, action: Callable[[], object]) -> None:
        self._actions.setdefault(n, []).append(action)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        for action in self._actions.pop(len(self.sleeps), []):
            action()


class _LogCapture:
    def __init__(self, case: SynchronousTestCase) -> None:
        self.events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, self.events.append)
        globalLogPublisher.addObserver(observer)
        case.addCleanup(globalLogPublisher.removeObserver, observer)

    def text(self) -> str:
        return "\n".join(
            f"{formatEvent(e)} {sorted((k, repr(v)) for k, v in e.items() if not k.startswith('log_'))}"
            for e in self.events
        )


# -- helpers ---------------------------------------------------------------------------------------


class HelpersTests(SynchronousTestCase):
    def test_normalise(self) -> None:
        self.assertEqual(
            normalise_fqdn("_ACME-Challenge.Example.COM."), "_acme-challenge.example.com"
        )
        for bad in ("", ".", "a..b", "bad label.com", "é.com", "a-.com", "x" * 64 + ".com"):
            self.assertRaises(ValueError, normalise_fqdn, bad)

    def test_quoting_round_trips(self) -> None:
        self.assertEqual(quote_txt(VALUE_A), f'"{VALUE_A}"')
        for value in (VALUE_A, 'say "hi" \\ bye', "x" * 600, "caf\u00e9", ""):
            self.assertEqual(unquote_txt(quote_txt(value), octal=True), value)
        self.assertEqual(quote_txt("x" * 300).count('"'), 4)  # two strings of <= 255 bytes
        self.assertEqual(unquote_txt('"ab" "cd"'), "abcd")
        self.assertEqual(unquote_txt("bare"), "bare")
        self.assertEqual(unquote_txt('"\\065\\"x"'), 'A"x')  # RFC 1035 \DDD is decimal


# -- DNSimple --------------------------------------------------------------------------------------


class DNSimpleTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.changes: list[tuple[str, str, bool]] = []
        self.double = DNSimpleDouble(
            token=TOKEN,
            zones=["example.com", "sub.example.com", "other.org"],
            on_change=lambda fqdn, value, present: self.changes.append((fqdn, value, present)),
        ).start()
        self.addCleanup(self.double.stop)
        self.time = _FakeTime()
        self.dns = self.provider()

    def provider(self, token: str = TOKEN, **kwargs: Any) -> DNSimple:
        kwargs.setdefault("sleep", self.time.sleep)
        kwargs.setdefault("now", time.time)
        kwargs.setdefault("timeout", 5.0)
        provider = DNSimple(token, base_url=self.double.url, **kwargs)
        self.addCleanup(provider.close)
        return provider

    def txt_records(self, zone: str) -> list[dict[str, Any]]:
        return [r for r in self.double.records(zone) if r["type"] == "TXT"]

    def test_add_then_remove(self) -> None:
        record = self.dns.add_txt("_acme-challenge.www.example.com", VALUE_A)
        self.assertEqual(record.fqdn, "_acme-challenge.www.example.com")
        self.assertEqual(record.value, VALUE_A)
        [stored] = self.txt_records("example.com")
        self.assertEqual(record.provider_id, f"example.com/{stored['id']}")
        self.assertEqual(stored["name"], "_acme-challenge.www")
        self.assertEqual(stored["content"], f'"{VALUE_A}"')  # DNSimple answers TXT quoted
        self.assertEqual(stored["ttl"], 60)
        self.dns.remove_txt(record)
        self.assertEqual(self.txt_records("example.com"), [])
        self.assertIn(
            ("DELETE", f"/v2/1010/zones/example.com/records/{stored['id']}"),
            self.double.request_log,
        )
        self.assertEqual(
            self.changes,
            [
                ("_acme-challenge.www.example.com", VALUE_A, True),
                ("_acme-challenge.www.example.com", VALUE_A, False),
            ],
        )
        self.assertEqual(self.double.sink_errors, [])

    def test_account_looked_up_once(self) -> None:
        self.dns.add_txt("_acme-challenge.example.com", VALUE_A)
        self.dns.add_txt("_acme-challenge.example.com", VALUE_B)
        self.assertEqual(self.double.calls("GET").count("/v2/whoami"), 1)
        given = self.provider(account_id="1010")
        given.add_txt("_acme-challenge.other.org", VALUE_A)
        self.assertEqual(self.double.calls("GET").count("/v2/whoami"), 1)

    def test_longest_zone_wins(self) -> None:
        record = self.dns.add_txt("_acme-challenge.a.sub.example.com.", VALUE_A)
        self.assertEqual(self.txt_records("example.com"), [])
        [stored] = self.txt_records("sub.example.com")
        self.assertEqual(stored["name"], "_acme-challenge.a")
        self.assertTrue(record.provider_id.startswith("sub.example.com/"))

    def test_zone_matches_at_a_label_boundary(self) -> None:
        # "e.myexample.com" ends "te.myexample.com" in characters, not in labels.
        self.double.add_zone("myexample.com")
        self.double.add_zone("e.myexample.com")
        self.dns.add_txt("_acme-challenge.te.myexample.com", VALUE_A)
        self.assertEqual(self.txt_records("e.myexample.com"), [])
        [stored] = self.txt_records("myexample.com")
        self.assertEqual(stored["name"], "_acme-challenge.te")

    def test_apex_relative_name(self) -> None:
        self.dns.add_txt("_acme-challenge.example.com", VALUE_A)
        [stored] = self.txt_records("example.com")
        self.assertEqual(stored["name"], "_acme-challenge")

    def test_two_values_coexist(self) -> None:
        fqdn = "_acme-challenge.example.com"
        self.double.add_record("example.com", "_acme-challenge", "TXT", "v=unrelated")
        a = self.dns.add_txt(fqdn, VALUE_A)
        b = self.dns.add_txt(fqdn, VALUE_B)
        self.assertNotEqual(a.provider_id, b.provider_id)
        self.assertEqual(
            sorted(self.double.txt_values(fqdn)), sorted([VALUE_A, VALUE_B, "v=unrelated"])
        )
        self.dns.remove_txt(a)
        self.assertEqual(sorted(self.double.txt_values(fqdn)), sorted([VALUE_B, "v=unrelated"]))
        self.dns.remove_txt(b)
        self.assertEqual(self.double.txt_values(fqdn), ["v=unrelated"])

    def test_add_of_a_present_value_is_a_no_op(self) -> None:
        fqdn = "_acme-challenge.example.com"
        first = self.dns.add_txt(fqdn, VALUE_A)
        again = self.dns.add_txt(fqdn, VALUE_A)
        self.assertEqual(first, again)
        self.assertEqual(self.double.txt_values(fqdn), [VALUE_A])

    def test_remove_is_idempotent(self) -> None:
        fqdn = "_acme-challenge.example.com"
        record = self.dns.add_txt(fqdn, VALUE_A)
        self.dns.remove_txt(record)
        self.dns.remove_txt(record)  # second remove: 404, fine
        gone = TXTRecord(fqdn, VALUE_B, "example.com/999999")  # never existed
        self.dns.remove_txt(gone)
        self.assertEqual(self.double.txt_values(fqdn), [])
        deletes = self.double.calls("DELETE")
        self.assertEqual(len(deletes), 3)

    def test_remove_sweeps_duplicates_of_a_lost_create(self) -> None:
        # The first POST is carried out but its answer is lost (502): the retry creates a second
        # record with our value; remove takes both away.
        fqdn = "_acme-challenge.example.com"
        self.double.fail_next(1, 502, after_apply=True, method="POST")
        record = self.dns.add_txt(fqdn, VALUE_A)
        self.assertEqual(self.double.txt_values(fqdn), [VALUE_A, VALUE_A])
        self.dns.remove_txt(record)
        self.assertEqual(self.double.txt_values(fqdn), [])

    def test_wrong_token(self) -> None:
        logs = _LogCapture(self)
        wrong = "dnsimple_a_" + "WRONG" * 5
        bad = self.provider(token=wrong)
        e = self.assertRaises(DNSProviderError, bad.add_txt, "_acme-challenge.example.com", VALUE_A)
        self.assertIn("dnsimple", str(e))
        self.assertIn("401", str(e))
        self.assertIn("Authentication failed", str(e))
        self.assertNotIn(wrong, str(e))
        self.assertNotIn(wrong, repr(e.args))
        self.assertNotIn(wrong, repr(bad))
        self.assertNotIn(wrong, logs.text())
        self.assertEqual(self.double.request_log, [("GET", "/v2/whoami")])  # 401 is not retried

    def test_500_burst_within_budget_succeeds(self) -> None:
        self.double.fail_next(3, 500)
        record = self.dns.add_txt("_acme-challenge.example.com", VALUE_A)
        self.assertEqual(self.double.txt_values(record.fqdn), [VALUE_A])
        self.assertEqual(len(self.time.sleeps), 3)
        self.assertTrue(all(0 < s <= 5.0 for s in self.time.sleeps), self.time.sleeps)

    def test_retry_after_is_honoured_and_capped(self) -> None:
        self.double.fail_next(1, 429, retry_after="3")
        self.double.fail_next(1, 503, retry_after="3600")
        self.dns.add_txt("_acme-challenge.example.com", VALUE_A)
        self.assertEqual(self.time.sleeps, [3.0, 10.0])

    def test_persistent_500_fails_clearly(self) -> None:
        self.double.fail_always(500)
        e = self.assertRaises(
            DNSProviderError, self.dns.add_txt, "_acme-challenge.example.com", VALUE_A
        )
        self.assertIn("dnsimple: whoami failed after 5 attempts: HTTP 500", str(e))
        self.assertEqual(len(self.double.request_log), 5)
        self.assertNotIn(TOKEN, str(e))
        self.double.fail_always(None)
        self.dns.add_txt("_acme-challenge.example.com", VALUE_A)

    def test_connection_refused_fails_clearly(self) -> None:
        url = self.double.url
        self.double.stop()
        dead = DNSimple(
            TOKEN, base_url=url, retries=1, sleep=self.time.sleep, timeout=2.0, now=time.time
        )
        self.addCleanup(dead.close)
        e = self.assertRaises(
            DNSProviderError, dead.add_txt, "_acme-challenge.example.com", VALUE_A
        )
        self.assertIn("failed after 2 attempts: ConnectionError", str(e))

    def test_no_zone(self) -> None:
        e = self.assertRaises(
            DNSProviderError, self.dns.add_txt, "_acme-challenge.example.net", VALUE_A
        )
        self.assertIn("no zone in account 1010 holds _acme-challenge.example.net", str(e))
        # A zone that is a suffix in characters but not at a label boundary does not count.
        self.double.add_zone("e.example.net")
        e = self.assertRaises(
            DNSProviderError, self.dns.add_txt, "_acme-challenge.the.example.net", VALUE_A
        )
        self.assertIn(
            "holds _acme-challenge.the.example.net (zones like example.net: e.example.net)", str(e)
        )

    def test_zone_listing_is_paged(self) -> None:
        double = DNSimpleDouble(
            token=TOKEN, zones=[f"z{i:02d}.example.com" for i in range(7)], max_per_page=2
        ).start()
        self.addCleanup(double.stop)
        double.add_zone("example.com")
        provider = DNSimple(TOKEN, base_url=double.url, sleep=self.time.sleep, now=time.time)
        self.addCleanup(provider.close)
        provider.add_txt("_acme-challenge.x.z05.example.com", VALUE_A)
        self.assertEqual(double.txt_values("_acme-challenge.x.z05.example.com"), [VALUE_A])
        self.assertEqual(double.calls("GET").count("/v2/1010/zones"), 4)  # 8 zones, 2 a page

    def test_plain_http_only_to_loopback(self) -> None:
        clocks = {"sleep": time.sleep, "now": time.time}
        self.assertRaises(ValueError, DNSimple, TOKEN, base_url="http://api.dnsimple.com", **clocks)
        self.assertRaises(ValueError, DNSimple, "", base_url=self.double.url, **clocks)
        DNSimple(TOKEN, base_url="http://[::1]:9", sleep=time.sleep, now=time.time).close()


# -- Route53 ---------------------------------------------------------------------------------------


class _OpenMoto(S3Server):
    """moto's server left in its open mode (credentials are not checked). ``S3Server`` switches
    moto to IAM authentication once provisioned, and behind it moto 5 refuses every route53 GET
    (ListHostedZones, GetHostedZone, ListResourceRecordSets, GetChange) with
    ``SignatureDoesNotMatch`` while accepting the POSTs, so route53 cannot be tested there."""

    def _provision_moto(self) -> None:
        pass


_moto: _OpenMoto | None = None
_moto_lock = threading.Lock()


def _moto_server() -> _OpenMoto:
    """One open moto server per test process, started on first use, killed at exit."""
    global _moto
    with _moto_lock:
        if _moto is None:
            _moto = _OpenMoto("moto")
            atexit.register(_moto.destroy_sync)
        _moto.start_sync()
        return _moto


class Route53Tests(SynchronousTestCase):
    server: S3Server

    def setUp(self) -> None:
        self.server = _moto_server()
        # Hosted zones live as long as the server: a fresh domain per test.
        self.base = f"r{secrets.token_hex(4)}.example"
        self.r53 = self.server.client("route53")

    def zone(self, name: str, private: bool = False) -> str:
        kwargs: dict[str, Any] = {}
        if private:
            kwargs = {
                "HostedZoneConfig": {"PrivateZone": True, "Comment": "private"},
                "VPC": {"VPCRegion": "us-east-1", "VPCId": "vpc-12345678"},
            }
        zone = self.r53.create_hosted_zone(Name=name, CallerReference=str(uuid.uuid4()), **kwargs)
        zone_id: str = zone["HostedZone"]["Id"].rsplit("/", 1)[-1]
        return zone_id

    def provider(self, **kwargs: Any) -> Route53:
        kwargs.setdefault("sleep", time.sleep)
        kwargs.setdefault("clock", time.monotonic)
        # The box's credentials come from botocore's chain; here, from a session told them.
        session = botocore.session.Session()
        session.set_credentials("AKIDLCHATTEST", "lchat-test-secret")
        return Route53(endpoint_url=self.server.endpoint, session=session, timeout=10.0, **kwargs)

    def values(self, zone_id: str, fqdn: str) -> list[str] | None:
        """The TXT values at ``fqdn`` (unquoted, in order), or None when there is no set."""
        listing = self.r53.list_resource_record_sets(
            HostedZoneId=zone_id, StartRecordName=fqdn, StartRecordType="TXT", MaxItems="1"
        )
        for rrset in listing["ResourceRecordSets"]:
            if rrset["Name"].rstrip(".") == fqdn and rrset["Type"] == "TXT":
                return [unquote_txt(r["Value"], octal=True) for r in rrset["ResourceRecords"]]
        return None

    def put_txt(self, zone_id: str, fqdn: str, *quoted: str, ttl: int = 300) -> None:
        self.r53.change_resource_record_sets(
            HostedZoneId=zone_id,
            ChangeBatch={
                "Changes": [
                    {
                        "Action": "UPSERT",
                        "ResourceRecordSet": {
                            "Name": fqdn,
                            "Type": "TXT",
                            "TTL": ttl,
                            "ResourceRecords": [{"Value": q} for q in quoted],
                        },
                    }
                ]
            },
        )

    def test_merge_keeps_other_values(self) -> None:
        zone_id = self.zone(self.base)
        fqdn = f"_acme-challenge.{self.base}"
        self.put_txt(zone_id, fqdn, '"v=unrelated"', ttl=3600)
        r53 = self.provider()
        a = r53.add_txt(fqdn, VALUE_A)
        self.assertEqual(a, TXTRecord(fqdn, VALUE_A, zone_id))
        self.assertEqual(self.values(zone_id, fqdn), ["v=unrelated", VALUE_A])
        b = r53.add_txt(fqdn.upper() + ".", VALUE_B)
        self.assertEqual(self.values(zone_id, fqdn), ["v=unrelated", VALUE_A, VALUE_B])
        self.assertEqual(r53.add_txt(fqdn, VALUE_B), b)  # already there: nothing changes
        self.assertEqual(self.values(zone_id, fqdn), ["v=unrelated", VALUE_A, VALUE_B])
        r53.remove_txt(a)
        self.assertEqual(self.values(zone_id, fqdn), ["v=unrelated", VALUE_B])
        r53.remove_txt(b)
        self.assertEqual(self.values(zone_id, fqdn), ["v=unrelated"])
        r53.remove_txt(b)  # idempotent
        self.assertEqual(self.values(zone_id, fqdn), ["v=unrelated"])

    def test_last_value_deletes_the_set(self) -> None:
        zone_id = self.zone(self.base)
        fqdn = f"_acme-challenge.{self.base}"
        r53 = self.provider()
        a = r53.add_txt(fqdn, VALUE_A)
        b = r53.add_txt(fqdn, VALUE_B)
        self.assertEqual(self.values(zone_id, fqdn), [VALUE_A, VALUE_B])
        listing = self.r53.list_resource_record_sets(
            HostedZoneId=zone_id, StartRecordName=fqdn, StartRecordType="TXT", MaxItems="1"
        )
        self.assertEqual(listing["ResourceRecordSets"][0]["TTL"], 60)
        self.assertEqual(
            listing["ResourceRecordSets"][0]["ResourceRecords"],
            [{"Value": f'"{VALUE_A}"'}, {"Value": f'"{VALUE_B}"'}],
        )
        r53.remove_txt(b)
        r53.remove_txt(a)
        self.assertIsNone(self.values(zone_id, fqdn))
        r53.remove_txt(a)  # the set is gone: still fine

    def test_zone_discovery_longest_public_suffix(self) -> None:
        outer = self.zone(self.base)
        inner = self.zone(f"sub.{self.base}")
        private = self.zone(f"a.sub.{self.base}", private=True)
        self.zone(f"b.sub.{self.base}")  # a sibling, not a suffix
        fqdn = f"_acme-challenge.a.sub.{self.base}"
        record = self.provider().add_txt(fqdn, VALUE_A)
        self.assertEqual(record.provider_id, inner)
        self.assertEqual(self.values(inner, fqdn), [VALUE_A])
        self.assertIsNone(self.values(outer, fqdn))
        self.assertIsNone(self.values(private, fqdn))
        record2 = self.provider().add_txt(f"_acme-challenge.{self.base}", VALUE_B)
        self.assertEqual(record2.provider_id, outer)

    def test_explicit_zone_id(self) -> None:
        outer = self.zone(self.base)
        inner = self.zone(f"sub.{self.base}")
        fqdn = f"_acme-challenge.x.sub.{self.base}"
        # Told the outer zone, it writes there even though a longer one exists.
        r53 = self.provider(zone_id=f"/hostedzone/{outer}")
        record = r53.add_txt(fqdn, VALUE_A)
        self.assertEqual(record.provider_id, outer)
        self.assertEqual(self.values(outer, fqdn), [VALUE_A])
        self.assertIsNone(self.values(inner, fqdn))
        e = self.assertRaises(
            DNSProviderError, r53.add_txt, "_acme-challenge.elsewhere.example", VALUE_A
        )
        self.assertIn(f"not in hosted zone {outer}", str(e))
        r53.remove_txt(record)
        self.assertIsNone(self.values(outer, fqdn))

    def test_missing_zone(self) -> None:
        e = self.assertRaises(
            DNSProviderError, self.provider().add_txt, f"_acme-challenge.{self.base}", VALUE_A
        )
        self.assertIn(f"route53: no public hosted zone holds _acme-challenge.{self.base}", str(e))
        e = self.assertRaises(
            DNSProviderError,
            self.provider(zone_id="ZNOSUCHZONE").add_txt,
            f"_acme-challenge.{self.base}",
            VALUE_A,
        )
        self.assertIn("route53: get hosted zone ZNOSUCHZONE failed: NoSuchHostedZone", str(e))

    def test_no_credentials(self) -> None:
        self.zone(self.base)
        session = botocore.session.Session()
        # A chain with no providers: as on a box with no environment, profile or role.
        session.register_component("credential_provider", CredentialResolver(providers=[]))
        r53 = Route53(
            endpoint_url=self.server.endpoint,
            session=session,
            retries=0,
            sleep=time.sleep,
            clock=time.monotonic,
        )
        e = self.assertRaises(
            DNSProviderError, r53.add_txt, f"_acme-challenge.{self.base}", VALUE_A
        )
        self.assertIn("route53: list hosted zones failed: no AWS credentials found", str(e))

    def test_errors_name_the_operation(self) -> None:
        zone_id = self.zone(self.base)
        # A name Route53 refuses (moto checks the zone suffix in the change batch): the
        # provider's own checks pass it, the API's error comes back named.
        r53 = self.provider(zone_id=zone_id)
        e = self.assertRaises(
            DNSProviderError, r53.remove_txt, TXTRecord("x.elsewhere.example", VALUE_A, "ZNOSUCH")
        )
        self.assertIn("route53: remove TXT x.elsewhere.example failed: NoSuchHostedZone", str(e))


# -- wait_for_txt ------------------------------------------------------------------------------------


class TinyDNS:
    """A DNS server (UDP, and TCP with ``tcp``) on ``host`` answering from what it is told.

    ``txt`` maps a name to its TXT values (an empty list: the name exists with no TXT); ``records``
    maps ``(name, type)`` to presentation-format data (``("example.com", "NS")`` ->
    ``["ns1.example.com."]``); ``zones`` are the zones it serves, each with an SOA at its apex that
    also goes into the authority section of negative answers below it (as ``zone_for_name``
    expects). Names it does not know are NXDOMAIN. With ``silent`` it answers nothing at all (a
    timeout); with ``truncate`` a UDP answer is empty with TC set (the client must ask over TCP).
    ``questions`` records ``(name, type, rd, "udp" | "tcp")`` for each query."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, tcp: bool = False) -> None:
        self.txt: dict[str, list[str]] = {}
        self.records: dict[tuple[str, str], list[str]] = {}
        self.zones: set[str] = set()
        self.silent = False
        self.truncate = False
        self.queries = 0
        self.questions: list[tuple[str, str, bool, str]] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._tcp: socket.socket | None = None
        try:
            self._sock.bind((host, port))
            self.address: tuple[str, int] = self._sock.getsockname()
            if tcp:
                self._tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._tcp.bind(self.address)
                self._tcp.listen(8)
                self._tcp.settimeout(0.05)
        except OSError:
            self._close()
            raise
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, name="tiny-dns", daemon=True)]
        if self._tcp is not None:
            self._threads.append(
                threading.Thread(target=self._serve_tcp, name="tiny-dns-tcp", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._close()

    def _close(self) -> None:
        self._sock.close()
        if self._tcp is not None:
            self._tcp.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            self.queries += 1
            if self.silent:
                continue
            response = self._answer(dns.message.from_wire(wire), "udp")
            if self.truncate:
                response.answer.clear()
                response.authority.clear()
                response.flags |= dns.flags.TC
            self._sock.sendto(response.to_wire(), peer)

    def _serve_tcp(self) -> None:
        assert self._tcp is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._tcp.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    query, _ = dns.query.receive_tcp(conn)
                except (OSError, EOFError, dns.exception.DNSException):
                    continue
                self.queries += 1
                if self.silent:
                    continue
                dns.query.send_tcp(conn, self._answer(query, "tcp"))

    def _answer(self, query: dns.message.Message, transport: str) -> dns.message.Message:
        response = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        self.questions.append((name, rdtype, bool(query.flags & dns.flags.RD), transport))
        zone = max(
            (z for z in self.zones if name == z or name.endswith("." + z)), key=len, default=""
        )
        if rdtype == "TXT" and self.txt.get(name):
            data = [f'"{v}"' for v in self.txt[name]]
        elif rdtype == "SOA" and name in self.zones:
            data = [self._soa(name)]
        else:
            data = self.records.get((name, rdtype), [])
        if data:
            response.answer.append(dns.rrset.from_text(question.name, 60, "IN", rdtype, *data))
            return response
        known = name in self.txt or name in self.zones or any(n == name for n, _ in self.records)
        if not known:
            response.set_rcode(dns.rcode.NXDOMAIN)
        if zone:
            response.authority.append(
                dns.rrset.from_text(zone + ".", 60, "IN", "SOA", self._soa(zone))
            )
        return response

    @staticmethod
    def _soa(zone: str) -> str:
        # An hour of negative TTL: a recursive resolver would keep an early NXDOMAIN that long.
        return f"ns1.{zone}. hostmaster.{zone}. 1 7200 3600 1209600 3600"


def _on_one_port(hosts: Sequence[str], *, tcp: bool = False) -> list[TinyDNS]:
    """A TinyDNS on each of ``hosts`` (127.0.0.x), all on one free port: discovered servers are
    asked at one port (``authoritative_port``), as port 53 is in real life."""
    for _ in range(50):
        servers = [TinyDNS(hosts[0], tcp=tcp)]
        try:
            for host in hosts[1:]:
                servers.append(TinyDNS(host, servers[0].address[1], tcp=tcp))
        except OSError:
            for server in servers:
                server.stop()
            continue
        return servers
    raise RuntimeError(f"no port free on all of {hosts}")


class WaitForTXTTests(SynchronousTestCase):
    fqdn = "_acme-challenge.example.com"

    def setUp(self) -> None:
        self.dns = TinyDNS()
        self.addCleanup(self.dns.stop)
        self.time = _FakeTime()

    def wait(self, values: list[str], **kwargs: Any) -> None:
        kwargs.setdefault("resolvers", [self.dns.address])
        wait_for_txt(
            self.fqdn,
            values,
            timeout=kwargs.pop("timeout", 20.0),
            interval=2.0,
            sleep=self.time.sleep,
            clock=self.time.clock,
            query_timeout=kwargs.pop("query_timeout", 1.0),
            **kwargs,
        )

    def test_already_visible(self) -> None:
        self.dns.txt[self.fqdn] = [VALUE_A, "v=unrelated"]
        self.wait([VALUE_A])
        self.assertEqual(self.time.sleeps, [])

    def test_appears_after_a_few_polls(self) -> None:
        self.time.at(1, lambda: self.dns.txt.update({self.fqdn: []}))  # the name, no TXT yet
        self.time.at(3, lambda: self.dns.txt.update({self.fqdn: [VALUE_A]}))
        self.wait([VALUE_A])
        self.assertEqual(self.time.sleeps, [2.0, 2.0, 2.0])
        self.assertEqual(self.dns.queries, 4)

    def test_never_appears(self) -> None:
        e = self.assertRaises(PropagationTimeout, self.wait, [VALUE_A], timeout=9.0)
        self.assertIsInstance(e, DNSProviderError)
        self.assertIn(f"TXT {self.fqdn} not visible after 9s", str(e))
        self.assertIn(f"127.0.0.1:{self.dns.address[1]}: NXDOMAIN", str(e))
        self.assertEqual(self.time.sleeps, [2.0, 2.0, 2.0, 2.0, 1.0])  # bounded by the timeout

    def test_one_of_two_missing_keeps_waiting(self) -> None:
        self.dns.txt[self.fqdn] = [VALUE_A]
        self.time.at(4, lambda: self.dns.txt.update({self.fqdn: [VALUE_A, VALUE_B]}))
        self.wait([VALUE_A, VALUE_B])
        self.assertEqual(len(self.time.sleeps), 4)
        self.dns.txt[self.fqdn] = [VALUE_B]
        e = self.assertRaises(PropagationTimeout, self.wait, [VALUE_A, VALUE_B], timeout=4.0)
        self.assertIn("1 TXT values seen, 1 of ours missing", str(e))

    def test_every_resolver_must_see_everything(self) -> None:
        lagging = TinyDNS()
        self.addCleanup(lagging.stop)
        self.dns.txt[self.fqdn] = [VALUE_A]
        lagging.txt[self.fqdn] = []
        resolvers = [self.dns.address, lagging.address]
        self.time.at(2, lambda: lagging.txt.update({self.fqdn: [VALUE_A]}))
        self.wait([VALUE_A], resolvers=resolvers)
        self.assertEqual(self.dns.queries, 1)  # satisfied at once, not asked again
        self.assertEqual(lagging.queries, 3)
        lagging.txt[self.fqdn] = []
        e = self.assertRaises(
            PropagationTimeout, self.wait, [VALUE_A], resolvers=resolvers, timeout=2.0
        )
        self.assertIn(f"127.0.0.1:{lagging.address[1]}: no TXT records", str(e))
        self.assertNotIn(f"127.0.0.1:{self.dns.address[1]}:", str(e))

    def test_timeouts_mean_not_yet(self) -> None:
        self.dns.silent = True
        self.time.at(1, lambda: setattr(self.dns, "silent", False))
        self.time.at(1, lambda: self.dns.txt.update({self.fqdn: [VALUE_A]}))
        self.wait([VALUE_A], query_timeout=0.2)
        self.assertEqual(len(self.time.sleeps), 1)


class AuthoritativeWaitTests(SynchronousTestCase):
    """``wait_for_txt`` with no resolvers: it finds the zone's authoritative servers through the
    discovery resolver (here ``recursive``, a stand-in for the system's recursive resolver, on
    127.0.0.1) and asks them (on 127.0.0.2 and 127.0.0.3, at one port) directly."""

    fqdn = "_acme-challenge.example.com"

    def setUp(self) -> None:
        self.recursive = TinyDNS()
        self.addCleanup(self.recursive.stop)
        self.ns1, self.ns2 = _on_one_port(["127.0.0.2", "127.0.0.3"])
        self.addCleanup(self.ns1.stop)
        self.addCleanup(self.ns2.stop)
        self.port = self.ns1.address[1]
        self.time = _FakeTime()
        self.logs = _LogCapture(self)

    def delegate(self, *servers: tuple[str, list[str], list[str]]) -> None:
        """The recursive resolver knows zone example.com with these (NS name, A, AAAA) servers.
        It has no TXT for our name, ever: its cache holds the NXDOMAIN of an early look."""
        self.recursive.zones.add("example.com")
        self.recursive.records[("example.com", "NS")] = [f"{name}." for name, _, _ in servers]
        for name, a, aaaa in servers:
            if a:
                self.recursive.records[(name, "A")] = a
            if aaaa:
                self.recursive.records[(name, "AAAA")] = aaaa

    def discovery(self, cache: dns.resolver.Cache | None = None) -> dns.resolver.Resolver:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(*self.recursive.address)]
        resolver.timeout = resolver.lifetime = 1.0
        resolver.cache = cache
        return resolver

    def wait(self, values: list[str], **kwargs: Any) -> None:
        kwargs.setdefault("discovery", self.discovery())
        wait_for_txt(
            self.fqdn,
            values,
            timeout=kwargs.pop("timeout", 20.0),
            interval=2.0,
            sleep=self.time.sleep,
            clock=self.time.clock,
            query_timeout=kwargs.pop("query_timeout", 1.0),
            authoritative_port=self.port,
            **kwargs,
        )

    def warnings(self) -> list[str]:
        return [formatEvent(e) for e in self.logs.events if e.get("log_level") == LogLevel.warn]

    def infos(self) -> list[str]:
        return [formatEvent(e) for e in self.logs.events if e.get("log_level") == LogLevel.info]

    def test_discovers_and_polls_the_authoritative_server(self) -> None:
        self.delegate(("ns1.example.com", ["127.0.0.2"], []))
        self.ns1.zones.add("example.com")
        self.time.at(1, lambda: self.ns1.txt.update({self.fqdn: []}))
        self.time.at(2, lambda: self.ns1.txt.update({self.fqdn: [VALUE_A, "v=unrelated"]}))
        self.wait([VALUE_A])
        self.assertEqual(self.time.sleeps, [2.0, 2.0])
        # Discovery went to the recursive resolver, never for the TXT; the polls to ns1, RD off.
        asked = {(name, rdtype) for name, rdtype, _, _ in self.recursive.questions}
        self.assertIn(("example.com", "NS"), asked)
        self.assertIn(("ns1.example.com", "A"), asked)
        self.assertIn(("ns1.example.com", "AAAA"), asked)
        self.assertNotIn((self.fqdn, "TXT"), asked)
        self.assertEqual(self.ns1.questions, [(self.fqdn, "TXT", False, "udp")] * 3)
        self.assertEqual(self.ns2.queries, 0)
        where = f"ns1.example.com (127.0.0.2:{self.port})"
        self.assertEqual(
            self.infos(),
            [
                f"acme: dns TXT {self.fqdn}: polling the authoritative servers of zone "
                f"example.com: {where}",
                f"acme: dns TXT {self.fqdn} visible at {where} after 3 polls",
            ],
        )
        self.assertEqual(self.warnings(), [])

    def test_a_cached_nxdomain_at_the_discovery_resolver_does_not_matter(self) -> None:
        self.delegate(("ns1.example.com", ["127.0.0.2"], []))
        cache = dns.resolver.Cache()
        discovery = self.discovery(cache)
        # The early look: NXDOMAIN, now cached by the discovery resolver for the negative TTL.
        self.assertRaises(
            dns.resolver.NXDOMAIN, discovery.resolve, self.fqdn + ".", "TXT", search=False
        )
        self.ns1.txt[self.fqdn] = [VALUE_A]
        self.recursive.txt[self.fqdn] = [VALUE_A]  # the resolver's upstream has it too by now
        self.assertRaises(
            dns.resolver.NXDOMAIN, discovery.resolve, self.fqdn + ".", "TXT", search=False
        )
        self.wait([VALUE_A], discovery=discovery)
        self.assertEqual(self.time.sleeps, [])
        self.assertEqual(self.ns1.questions, [(self.fqdn, "TXT", False, "udp")])

    def test_every_authoritative_server_must_see_everything(self) -> None:
        self.delegate(
            ("ns1.example.com", ["127.0.0.2"], ["::1"]),
            ("ns2.example.com", ["127.0.0.3"], []),
            ("ns3.example.net", [], []),  # no address: skipped
        )
        self.recursive.txt["ns3.example.net"] = []  # the name exists, with no A or AAAA
        self.ns1.txt[self.fqdn] = [VALUE_A, VALUE_B]
        self.ns2.txt[self.fqdn] = [VALUE_A]
        self.time.at(2, lambda: self.ns2.txt.update({self.fqdn: [VALUE_B, VALUE_A]}))
        self.wait([VALUE_A, VALUE_B])
        self.assertEqual(self.time.sleeps, [2.0, 2.0])
        self.assertEqual(self.ns1.queries, 1)  # satisfied at once, not asked again (nor at ::1)
        self.assertEqual(self.ns2.queries, 3)
        ns1 = f"ns1.example.com (127.0.0.2:{self.port}, [::1]:{self.port})"
        ns2 = f"ns2.example.com (127.0.0.3:{self.port})"
        self.assertEqual(
            self.infos()[0],
            f"acme: dns TXT {self.fqdn}: polling the authoritative servers of zone example.com: "
            f"{ns1}, {ns2} (skipped, no address: ns3.example.net: no A or AAAA records)",
        )
        self.assertEqual(
            self.infos()[1], f"acme: dns TXT {self.fqdn} visible at {ns1}, {ns2} after 3 polls"
        )
        # ns2 loses one: the wait goes on until the timeout, naming only the lagging server.
        self.ns2.txt[self.fqdn] = [VALUE_A]
        e = self.assertRaises(PropagationTimeout, self.wait, [VALUE_A, VALUE_B], timeout=5.0)
        self.assertEqual(self.time.sleeps[2:], [2.0, 2.0, 1.0])
        self.assertEqual(
            str(e),
            f"TXT {self.fqdn} not visible after 5s (4 polls): "
            f"{ns2}: 1 TXT values seen, 1 of ours missing",
        )
        self.assertEqual(self.warnings(), [])

    def test_truncated_answers_are_asked_again_over_tcp(self) -> None:
        (ns,) = _on_one_port(["127.0.0.4"], tcp=True)
        self.addCleanup(ns.stop)
        self.port = ns.address[1]
        self.delegate(("ns.example.com", ["127.0.0.4"], []))
        ns.truncate = True
        ns.txt[self.fqdn] = [VALUE_A]
        self.wait([VALUE_A])
        self.assertEqual(self.time.sleeps, [])
        self.assertEqual(
            ns.questions, [(self.fqdn, "TXT", False, "udp"), (self.fqdn, "TXT", False, "tcp")]
        )

    def test_no_zone_falls_back_to_the_discovery_resolver(self) -> None:
        # The recursive resolver knows no zone (every SOA up to the root is NXDOMAIN).
        self.time.at(1, lambda: self.recursive.txt.update({self.fqdn: [VALUE_A]}))
        self.wait([VALUE_A])
        self.assertEqual(self.time.sleeps, [2.0])
        self.assertEqual(self.ns1.queries + self.ns2.queries, 0)
        (warning,) = self.warnings()
        self.assertIn(
            f"acme: dns TXT {self.fqdn}: cannot find the authoritative name servers", warning
        )
        self.assertIn("finding the zone: no SOA record at the name or any name above it", warning)
        self.assertIn("polling the discovery resolver instead", warning)
        self.assertIn("set LCHAT_DNS_RESOLVERS", warning)
        self.assertEqual(
            self.infos(),
            [f"acme: dns TXT {self.fqdn} visible at the discovery resolver after 2 polls"],
        )

    def test_name_servers_without_addresses_fall_back(self) -> None:
        self.delegate(("ns1.example.net", [], []))  # NXDOMAIN for its A and AAAA
        self.recursive.txt[self.fqdn] = [VALUE_A]
        self.wait([VALUE_A])
        (warning,) = self.warnings()
        self.assertIn(
            "no address for the name servers of zone example.com "
            "(ns1.example.net: A NXDOMAIN, AAAA NXDOMAIN)",
            warning,
        )
        self.recursive.records.pop(("example.com", "NS"))  # the zone, with no NS set
        self.wait([VALUE_A])
        self.assertIn("zone example.com has no NS records", self.warnings()[1])

    def test_a_dead_discovery_resolver_ends_in_propagation_timeout(self) -> None:
        self.recursive.silent = True
        e = self.assertRaises(
            PropagationTimeout, self.wait, [VALUE_A], timeout=3.0, query_timeout=0.2
        )
        self.assertIn(f"TXT {self.fqdn} not visible after 3s (3 polls)", str(e))
        self.assertIn("the discovery resolver: timed out", str(e))
        (warning,) = self.warnings()  # once, not once a poll
        self.assertIn("finding the zone: timed out", warning)

    def test_explicit_resolvers_skip_discovery(self) -> None:
        self.delegate(("ns1.example.com", ["127.0.0.2"], []))
        self.ns2.txt[self.fqdn] = [VALUE_A]
        self.wait([VALUE_A], resolvers=[self.ns2.address])
        self.assertEqual(self.recursive.queries, 0)
        self.assertEqual(self.ns1.queries, 0)
        self.assertEqual(self.ns2.questions, [(self.fqdn, "TXT", True, "udp")])


# -- make_provider -----------------------------------------------------------------------------------


# What the router passes make_provider (lchat.tap): the providers block in worker threads.
CLOCKS: dict[str, Any] = {"sleep": time.sleep, "clock": time.monotonic, "now": time.time}


class MakeProviderTests(SynchronousTestCase):
    def test_dnsimple_is_the_default(self) -> None:
        for name in ("", "dnsimple", " DNSimple "):
            provider = make_provider(name, dnsimple_token=TOKEN, **CLOCKS)
            self.assertIsInstance(provider, DNSimple)
            self.assertEqual(provider.name, "dnsimple")
            self.assertNotIn(TOKEN, repr(provider))

    def test_dnsimple_needs_a_token(self) -> None:
        e = self.assertRaises(ValueError, make_provider, "dnsimple", **CLOCKS)
        self.assertIn("LCHAT_DNSIMPLE_TOKEN", str(e))

    def test_route53(self) -> None:
        session = botocore.session.Session()  # the router's, with the credentials it resolved
        provider = make_provider(
            "route53",
            route53_zone_id="Z1",
            route53_endpoint="http://127.0.0.1:1",
            route53_session=session,
            **CLOCKS,
        )
        assert isinstance(provider, Route53)
        self.assertEqual(provider.name, "route53")
        self.assertIs(provider._session, session)

    def test_unknown(self) -> None:
        e = self.assertRaises(
            ValueError, make_provider, "cloudflare", dnsimple_token=TOKEN, **CLOCKS
        )
        self.assertIn("LCHAT_DNS_PROVIDER", str(e))
        self.assertIn("cloudflare", str(e))
