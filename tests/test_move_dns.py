"""``lchat relocate --move-dns``: :meth:`Route53.point_address` and :mod:`lchat.cli.move_dns`
against moto's real Route53 server (in its open mode, as ``tests/test_dns01.py``'s
``Route53Tests``: moto 5 refuses route53 GETs behind its IAM mode), and
:func:`destination_addresses` with an injected resolver.

Everything here blocks (botocore), as the relocate command does, so the tests are synchronous.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import time
import uuid
from typing import Any

import botocore.session  # type: ignore[import-untyped]
from twisted.trial.unittest import SynchronousTestCase

from lchat import config
from lchat.cli.move_dns import (
    MoveDNSError,
    destination_addresses,
    move_dns,
    require_route53,
    route53_from_config,
    system_resolve,
)
from lchat.config import BoxConfig
from lchat.dns import AddressChange, DNSProviderError, Route53, canonical_addresses
from tests.s3servers import S3Server
from tests.test_dns01 import _moto_server

Sets = dict[tuple[str, str], tuple[int, list[str]]]  # (name, type) -> (TTL, values)


class _Route53Case(SynchronousTestCase):
    server: S3Server

    def setUp(self) -> None:
        self.server = _moto_server()
        # Hosted zones live as long as the server: a fresh domain per test.
        self.base = f"m{secrets.token_hex(4)}.example"
        self.host = f"chat.{self.base}"
        self.r53 = self.server.client("route53")

    def zone(self, name: str) -> str:
        zone = self.r53.create_hosted_zone(Name=name, CallerReference=str(uuid.uuid4()))
        zone_id: str = zone["HostedZone"]["Id"].rsplit("/", 1)[-1]
        return zone_id

    def put(self, zone_id: str, name: str, rtype: str, *values: str, ttl: int = 300) -> None:
        self.r53.change_resource_record_sets(
            HostedZoneId=zone_id,
            ChangeBatch={
                "Changes": [
                    {
                        "Action": "UPSERT",
                        "ResourceRecordSet": {
                            "Name": name,
                            "Type": rtype,
                            "TTL": ttl,
                            "ResourceRecords": [{"Value": v} for v in values],
                        },
                    }
                ]
            },
        )

    def sets(self, zone_id: str) -> Sets:
        """Every record set of the zone but its SOA and NS."""
        listing = self.r53.list_resource_record_sets(HostedZoneId=zone_id, MaxItems="300")
        return {
            (r["Name"].rstrip("."), r["Type"]): (
                r.get("TTL", 0),
                [v["Value"] for v in r.get("ResourceRecords", [])],
            )
            for r in listing["ResourceRecordSets"]
            if r["Type"] not in ("SOA", "NS")
        }

    def provider(self, **kwargs: Any) -> Route53:
        # The box's credentials come from botocore's chain; here, from a session told them.
        session = botocore.session.Session()
        session.set_credentials("AKIDLCHATTEST", "lchat-test-secret")
        return Route53(
            endpoint_url=self.server.endpoint,
            session=session,
            timeout=10.0,
            sleep=time.sleep,
            clock=time.monotonic,
            **kwargs,
        )


class PointAddressTests(_Route53Case):
    def test_a_host_without_a_record_gets_its_a_set(self) -> None:
        zone_id = self.zone(self.base)
        change = self.provider().point_address(self.host, ["10.0.0.9", "10.0.0.10", "10.0.0.9"])
        self.assertEqual(change.fqdn, self.host)
        self.assertEqual(change.zone_id, zone_id)
        self.assertEqual(change.before, ())
        self.assertEqual(change.after, ("10.0.0.9", "10.0.0.10"))  # numeric order, deduplicated
        self.assertEqual(change.ttl, 60)
        self.assertTrue(change.changed)
        self.assertEqual(self.sets(zone_id), {(self.host, "A"): (60, ["10.0.0.9", "10.0.0.10"])})

    def test_an_existing_a_set_is_replaced(self) -> None:
        zone_id = self.zone(self.base)
        self.put(zone_id, self.host, "A", "10.0.0.1", "10.0.0.2", ttl=3600)
        change = self.provider().point_address(self.host.upper() + ".", ["10.0.0.9"], ttl=120)
        self.assertEqual((change.before, change.after), (("10.0.0.1", "10.0.0.2"), ("10.0.0.9",)))
        self.assertEqual(change.ttl, 120)
        self.assertEqual(self.sets(zone_id), {(self.host, "A"): (120, ["10.0.0.9"])})

    def test_an_aaaa_set_the_new_addresses_lack_is_deleted(self) -> None:
        zone_id = self.zone(self.base)
        self.put(zone_id, self.host, "A", "10.0.0.1")
        self.put(zone_id, self.host, "AAAA", "2001:db8::1", ttl=900)
        self.put(zone_id, self.host, "TXT", '"v=keep"')  # not an address record: left alone
        change = self.provider().point_address(self.host, ["10.0.0.9"])
        self.assertEqual(change.before, ("10.0.0.1", "2001:db8::1"))
        self.assertEqual(change.after, ("10.0.0.9",))
        self.assertEqual(
            self.sets(zone_id),
            {(self.host, "A"): (60, ["10.0.0.9"]), (self.host, "TXT"): (300, ['"v=keep"'])},
        )

    def test_ipv6_addresses_make_an_aaaa_set(self) -> None:
        zone_id = self.zone(self.base)
        change = self.provider().point_address(
            self.host, ["2001:DB8:0::a", "10.0.0.9", "2001:db8::9"]
        )
        self.assertEqual(change.after, ("10.0.0.9", "2001:db8::9", "2001:db8::a"))
        self.assertEqual(
            self.sets(zone_id),
            {
                (self.host, "A"): (60, ["10.0.0.9"]),
                (self.host, "AAAA"): (60, ["2001:db8::9", "2001:db8::a"]),
            },
        )

    def test_ipv6_only_deletes_the_a_set(self) -> None:
        zone_id = self.zone(self.base)
        self.put(zone_id, self.host, "A", "10.0.0.1")
        self.put(zone_id, self.host, "AAAA", "2001:db8::1")
        change = self.provider().point_address(self.host, ["2001:db8::9"])
        self.assertEqual(change.before, ("10.0.0.1", "2001:db8::1"))
        self.assertEqual(self.sets(zone_id), {(self.host, "AAAA"): (60, ["2001:db8::9"])})

    def test_a_rerun_is_a_no_op(self) -> None:
        zone_id = self.zone(self.base)
        r53 = self.provider()
        first = r53.point_address(self.host, ["10.0.0.9", "2001:db8::9"])
        written = self.sets(zone_id)
        calls: list[str] = []
        real = r53._client_call

        def counting(what: str, method: str, **kwargs: Any) -> Any:
            calls.append(method)
            return real(what, method, **kwargs)

        r53._client_call = counting  # type: ignore[method-assign]
        again = r53.point_address(self.host, ["2001:db8::9", "10.0.0.9"])
        self.assertEqual(
            again,
            AddressChange(self.host, zone_id, first.after, first.after, 60, ""),
        )
        self.assertFalse(again.changed)
        self.assertNotIn("change_resource_record_sets", calls)
        self.assertEqual(self.sets(zone_id), written)

    def test_a_different_ttl_alone_is_a_change(self) -> None:
        zone_id = self.zone(self.base)
        self.put(zone_id, self.host, "A", "10.0.0.9", ttl=3600)
        change = self.provider().point_address(self.host, ["10.0.0.9"])
        self.assertTrue(change.changed)
        self.assertEqual((change.before, change.after), (("10.0.0.9",), ("10.0.0.9",)))
        self.assertEqual(self.sets(zone_id), {(self.host, "A"): (60, ["10.0.0.9"])})

    def test_the_zones_wildcard_is_left_unchanged(self) -> None:
        zone_id = self.zone(self.base)
        wildcard = f"*.{self.base}"
        self.put(zone_id, wildcard, "A", "10.0.0.1")
        self.put(zone_id, wildcard, "AAAA", "2001:db8::1")
        before = self.sets(zone_id)
        wildcard_sets = {k: v for k, v in before.items() if k[0] != self.host}
        self.assertEqual(len(wildcard_sets), 2)
        change = self.provider().point_address(self.host, ["10.0.0.9"])
        self.assertEqual(change.before, ())  # what the wildcard serves is not the host's record
        after = self.sets(zone_id)
        self.assertEqual({k: v for k, v in after.items() if k[0] != self.host}, wildcard_sets)
        self.assertEqual(after[(self.host, "A")], (60, ["10.0.0.9"]))
        # And the wildcard itself is never a name to repoint.
        e = self.assertRaises(
            DNSProviderError, self.provider().point_address, wildcard, ["10.0.0.9"]
        )
        self.assertIn("wildcard", str(e))
        self.assertEqual(self.sets(zone_id), after)

    def test_the_longest_zone_or_the_configured_one(self) -> None:
        outer = self.zone(self.base)
        inner = self.zone(f"eu.{self.base}")
        host = f"chat.eu.{self.base}"
        self.assertEqual(self.provider().point_address(host, ["10.0.0.9"]).zone_id, inner)
        told = self.provider(zone_id=f"/hostedzone/{outer}").point_address(host, ["10.0.0.8"])
        self.assertEqual(told.zone_id, outer)
        self.assertEqual(self.sets(outer), {(host, "A"): (60, ["10.0.0.8"])})

    def test_a_host_outside_every_zone_is_an_error(self) -> None:
        e = self.assertRaises(
            DNSProviderError, self.provider().point_address, self.host, ["10.0.0.9"]
        )
        self.assertIn(f"route53: no public hosted zone holds {self.host}", str(e))

    def test_bad_input_is_refused_before_any_write(self) -> None:
        zone_id = self.zone(self.base)
        self.put(zone_id, self.host, "A", "10.0.0.1")
        before = self.sets(zone_id)
        r53 = self.provider()
        for addresses, words in (
            ([], "no address given"),
            (["10.0.0.9", "chat.example.com"], "'chat.example.com' is not an IP address"),
            (["10.0.0.300"], "'10.0.0.300' is not an IP address"),
            (["0.0.0.0"], "not a host's address"),  # noqa: S104 (an address, not a bind)
            (["ff02::1"], "not a host's address"),
            (["fe80::1%eth0"], "zone index"),
        ):
            e = self.assertRaises(DNSProviderError, r53.point_address, self.host, addresses)
            self.assertIn(words, str(e))
            self.assertTrue(str(e).startswith("route53: "), str(e))
        for ttl in (-1, 2**31):
            e = self.assertRaises(DNSProviderError, r53.point_address, self.host, ["10.0.0.9"], ttl)
            self.assertIn("TTL", str(e))
        e = self.assertRaises(DNSProviderError, r53.point_address, "bad name.example", ["10.0.0.9"])
        self.assertIn("is not a DNS name", str(e))
        self.assertEqual(self.sets(zone_id), before)

    def test_a_cname_or_a_weighted_set_is_not_replaced(self) -> None:
        zone_id = self.zone(self.base)
        self.put(zone_id, self.host, "CNAME", f"elsewhere.{self.base}")
        other = f"weighted.{self.base}"
        self.r53.change_resource_record_sets(
            HostedZoneId=zone_id,
            ChangeBatch={
                "Changes": [
                    {
                        "Action": "CREATE",
                        "ResourceRecordSet": {
                            "Name": other,
                            "Type": "A",
                            "SetIdentifier": "ie",
                            "Weight": 10,
                            "TTL": 60,
                            "ResourceRecords": [{"Value": "10.0.0.1"}],
                        },
                    }
                ]
            },
        )
        before = self.sets(zone_id)
        r53 = self.provider()
        e = self.assertRaises(DNSProviderError, r53.point_address, self.host, ["10.0.0.9"])
        self.assertIn(f"{self.host} is a CNAME in zone {zone_id}", str(e))
        e = self.assertRaises(DNSProviderError, r53.point_address, other, ["10.0.0.9"])
        self.assertIn("a routing-policy set", str(e))
        self.assertIn("change it by hand", str(e))
        self.assertEqual(self.sets(zone_id), before)

    def test_canonical_addresses(self) -> None:
        self.assertEqual(
            canonical_addresses(["2001:DB8::1", " 10.0.0.10", "10.0.0.9", "10.0.0.10", "::1"]),
            ("10.0.0.9", "10.0.0.10", "::1", "2001:db8::1"),
        )


# -- move_dns: the box's configuration ---------------------------------------------------------


class MoveDNSTests(_Route53Case):
    def setUp(self) -> None:
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix="lchat-movedns-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def config(self, **env: str) -> BoxConfig:
        """The box's configuration from an env file, as ``lchat`` loads it. The AWS keys are in
        the file, where the seeds put them (moto's open mode takes any)."""
        settings = {
            "LCHAT_DATA_DIR": self.dir,
            "LCHAT_RUN_DIR": self.dir,
            "LCHAT_ACME_DIRECTORY": "http://127.0.0.1:9/directory",
            "LCHAT_DNS_PROVIDER": "route53",
            "LCHAT_ROUTE53_ENDPOINT": self.server.endpoint,
            "AWS_ACCESS_KEY_ID": "AKIDLCHATTEST",
            "AWS_SECRET_ACCESS_KEY": "lchat-test-secret",
            **env,
        }
        path = os.path.join(self.dir, "router.env")
        with open(path, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in settings.items() if v)
        return config.load(env_file=path, environ={}, systemd_present=False)

    def test_repoints_through_the_configured_route53(self) -> None:
        zone_id = self.zone(self.base)
        self.put(zone_id, self.host, "A", "8.8.4.1")
        self.put(zone_id, self.host, "AAAA", "2a00:1450::1")
        moved = move_dns(self.config(), self.host, ["8.8.4.9"])
        self.assertEqual(moved.change.before, ("8.8.4.1", "2a00:1450::1"))
        self.assertEqual(moved.change.after, ("8.8.4.9",))
        self.assertEqual(moved.warnings, ())
        self.assertEqual(
            moved.line,
            f"dns: {self.host} A 8.8.4.1 → 8.8.4.9; AAAA 2a00:1450::1 → (none) "
            f"(Route53 zone {zone_id}, TTL 60s)",
        )
        self.assertEqual(
            moved.as_json(),
            {
                "host": self.host,
                "provider": "route53",
                "zone_id": zone_id,
                "before": ["8.8.4.1", "2a00:1450::1"],
                "after": ["8.8.4.9"],
                "ttl": 60,
                "changed": True,
                "change_id": moved.change.change_id,
                "warnings": [],
            },
        )
        self.assertEqual(self.sets(zone_id), {(self.host, "A"): (60, ["8.8.4.9"])})
        again = move_dns(self.config(), self.host, ["8.8.4.9"])
        self.assertFalse(again.change.changed)
        self.assertEqual((again.change.before, again.change.after), (("8.8.4.9",), ("8.8.4.9",)))
        self.assertEqual(
            again.line,
            f"dns: {self.host} A 8.8.4.9 already (Route53 zone {zone_id}): nothing to change",
        )

    def test_the_configured_zone_id_is_used(self) -> None:
        outer = self.zone(self.base)
        self.zone(self.host)  # a longer zone that discovery would pick
        moved = move_dns(self.config(LCHAT_ROUTE53_ZONE_ID=outer), self.host, ["8.8.4.9"])
        self.assertEqual(moved.change.zone_id, outer)
        self.assertEqual(self.sets(outer), {(self.host, "A"): (60, ["8.8.4.9"])})

    def test_private_addresses_are_written_with_a_warning(self) -> None:
        self.zone(self.base)
        moved = move_dns(self.config(), self.host, ["10.0.0.9", "8.8.4.9"])
        self.assertEqual(moved.change.after, ("8.8.4.9", "10.0.0.9"))
        self.assertEqual(len(moved.warnings), 1)
        self.assertIn("10.0.0.9 is not a public address", moved.warnings[0])
        self.assertIn("LCHAT_MESH_SELF", moved.warnings[0])

    def test_provider_errors_are_move_dns_errors(self) -> None:
        cfg = self.config()
        e = self.assertRaises(MoveDNSError, move_dns, cfg, self.host, ["8.8.4.9"])
        self.assertIn(f"route53: no public hosted zone holds {self.host}", str(e))
        self.zone(self.base)
        e = self.assertRaises(MoveDNSError, move_dns, cfg, self.host, [])
        self.assertIn("no address given", str(e))
        e = self.assertRaises(MoveDNSError, move_dns, cfg, self.host, ["not-an-address"])
        self.assertIn("'not-an-address' is not an IP address", str(e))
        e = self.assertRaises(MoveDNSError, move_dns, cfg, f"*.{self.base}", ["8.8.4.9"])
        self.assertIn("--move-dns", str(e))

    def test_only_route53(self) -> None:
        built: list[BoxConfig] = []

        def factory(cfg: BoxConfig) -> Route53:
            built.append(cfg)
            return route53_from_config(cfg)

        dnsimple = self.config(LCHAT_DNS_PROVIDER="dnsimple", LCHAT_DNSIMPLE_TOKEN="t0ken")
        e = self.assertRaises(
            MoveDNSError, move_dns, dnsimple, self.host, ["8.8.4.9"], provider_factory=factory
        )
        self.assertIn("Route53 only", str(e))
        self.assertIn("LCHAT_DNS_PROVIDER=dnsimple", str(e))
        acme_off = self.config(LCHAT_ACME_DIRECTORY="off")
        e = self.assertRaises(
            MoveDNSError, move_dns, acme_off, self.host, ["8.8.4.9"], provider_factory=factory
        )
        self.assertIn("LCHAT_DNS_PROVIDER=route53", str(e))
        self.assertIn("LCHAT_ACME_DIRECTORY=off", str(e))
        self.assertEqual(built, [])  # refused before any AWS credentials or call
        # The same check, alone, for the relocate command to refuse before it moves anything.
        for cfg in (dnsimple, acme_off):
            self.assertRaises(MoveDNSError, require_route53, cfg, self.host)
        require_route53(self.config(), self.host)


# -- destination_addresses -------------------------------------------------------------------------


def _no_lookup(name: str) -> list[str]:
    raise AssertionError(f"an IP literal was looked up: {name}")


class DestinationAddressesTests(SynchronousTestCase):
    def test_ip_literals_are_used_as_they_are(self) -> None:
        urls = [
            "https://10.0.0.9:8443",
            "http://[2001:DB8::9]:7000",
            "https://10.0.0.8",
            "https://10.0.0.9:9443",  # a second box on one address: one record value
        ]
        self.assertEqual(
            destination_addresses(urls, _no_lookup), ["10.0.0.8", "10.0.0.9", "2001:db8::9"]
        )

    def test_a_name_is_resolved(self) -> None:
        table = {
            "fi-1.mesh.example": ["2001:db8::2", "10.1.0.2"],
            "fi-2.mesh.example": ["10.1.0.1"],
        }
        asked: list[str] = []

        def resolve(name: str) -> list[str]:
            asked.append(name)
            return table[name]

        self.assertEqual(
            destination_addresses(
                ["https://FI-1.mesh.example:8443", "https://fi-2.mesh.example", "https://10.1.0.2"],
                resolve,
            ),
            ["10.1.0.1", "10.1.0.2", "2001:db8::2"],
        )
        self.assertEqual(asked, ["fi-1.mesh.example", "fi-2.mesh.example"])

    def test_a_name_that_does_not_resolve_is_named(self) -> None:
        def resolve(name: str) -> list[str]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        e = self.assertRaises(
            MoveDNSError,
            destination_addresses,
            ["https://10.1.0.1", "https://fi-9.mesh.example:8443"],
            resolve,
        )
        self.assertIn("fi-9.mesh.example", str(e))
        self.assertIn("does not resolve", str(e))
        self.assertIn("Name or service not known", str(e))
        e = self.assertRaises(
            MoveDNSError, destination_addresses, ["https://fi-9.mesh.example"], lambda name: []
        )
        self.assertIn("fi-9.mesh.example", str(e))
        self.assertIn("no address", str(e))

    def test_no_box_or_a_bad_url_is_an_error(self) -> None:
        e = self.assertRaises(MoveDNSError, destination_addresses, [], _no_lookup)
        self.assertIn("no live box", str(e))
        e = self.assertRaises(
            MoveDNSError, destination_addresses, ["https://10.0.0.9/path"], _no_lookup
        )
        self.assertIn("must not have a path", str(e))
        e = self.assertRaises(
            MoveDNSError,
            destination_addresses,
            ["https://fi-1.mesh.example"],
            lambda name: ["not-an-ip"],
        )
        self.assertIn("'not-an-ip' is not an IP address", str(e))

    def test_the_system_resolver_answers_from_the_hosts_file(self) -> None:
        # localhost is in /etc/hosts: no query leaves the machine.
        self.assertIn("127.0.0.1", system_resolve("localhost"))
        self.assertEqual(destination_addresses(["https://127.0.0.1:8443"]), ["127.0.0.1"])
