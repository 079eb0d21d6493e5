"""Tests for lchat.mesh.placement: scope, member URLs, the fixed score, and rendezvous ownership."""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from lchat import hosts
from lchat.mesh import placement
from lchat.mesh.placement import (
    in_scope,
    normalise_member_url,
    owner,
    ranked,
    score,
)

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The worked example of the module docstring, pinned here too: changing the score breaks this test.
EXAMPLE_URL = "https://box-1.example.net"
EXAMPLE_HOST = "chat.11ch.example.com"
EXAMPLE_SCORE = 0x4048325C79D4D38F


class Member(NamedTuple):
    """A minimal :class:`placement.Candidate` (read-only attributes, like a frozen record)."""

    url: str
    region: str = ""


# --- strategies ----------------------------------------------------------------------------------

_label = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=12)
_tld = st.text("abcdefghijklmnopqrstuvwxyz", min_size=2, max_size=6)
space_hosts = st.builds(
    lambda ls, t: ".".join([*ls, t]), st.lists(_label, min_size=1, max_size=3), _tld
)
member_urls = st.builds(
    lambda scheme, host, port: f"{scheme}://{host}" + ("" if port is None else f":{port}"),
    st.sampled_from(["http", "https"]),
    space_hosts,
    st.none() | st.integers(min_value=1, max_value=65535),
).map(normalise_member_url)
regions = st.sampled_from(["", "ie", "fi", "us"])
members_lists = st.lists(
    st.builds(Member, member_urls, regions), min_size=1, max_size=8, unique_by=lambda m: m.url
)


def _docstring() -> str:
    assert placement.__doc__ is not None
    return placement.__doc__


class ScoreSpecTests(unittest.TestCase):
    def test_worked_example(self) -> None:
        """The docstring's worked example is what the code computes, and what this test pins."""
        self.assertEqual(score(EXAMPLE_URL, EXAMPLE_HOST), EXAMPLE_SCORE)
        doc = _docstring()
        match = re.search(
            r"member_url ``(?P<url>[^`]+)`` and host ``(?P<host>[^`]+)`` give\s+"
            r"score ``0x(?P<hex>[0-9a-f]{16})`` \((?P<dec>[0-9]+)\)",
            doc,
        )
        assert match is not None, "the worked example is missing from the module docstring"
        self.assertEqual(match["url"], EXAMPLE_URL)
        self.assertEqual(match["host"], EXAMPLE_HOST)
        self.assertEqual(int(match["hex"], 16), EXAMPLE_SCORE)
        self.assertEqual(int(match["dec"]), EXAMPLE_SCORE)
        self.assertEqual(score(match["url"], match["host"]), int(match["hex"], 16))

    def test_worked_example_by_hand(self) -> None:
        """The example recomputed straight from hashlib, independent of the module."""
        digest = hashlib.sha256(b"https://box-1.example.net\nchat.11ch.example.com").digest()
        self.assertEqual(digest[:8].hex(), f"{EXAMPLE_SCORE:016x}")

    def test_normalisation_example(self) -> None:
        doc = _docstring()
        match = re.search(r"Example: ``(?P<raw>[^`]+)`` normalises to ``(?P<norm>[^`]+)``", doc)
        assert match is not None, "the normalisation example is missing from the module docstring"
        self.assertEqual(normalise_member_url(match["raw"]), match["norm"])
        self.assertEqual(match["norm"], EXAMPLE_URL)

    @PROPERTY
    @given(member_urls, space_hosts)
    def test_docstring_formula_is_the_code(self, url: str, host: str) -> None:
        """Evaluating the formula exactly as written in the docstring gives score()'s answer."""
        doc = _docstring()
        match = re.search(r"score\(member_url, host\) =\n(?P<expr>.*?)\n\n", doc, re.DOTALL)
        assert match is not None, "the score specification is missing from the module docstring"
        expr = " ".join(line.strip() for line in match["expr"].splitlines())
        env = {"hashlib": hashlib, "int": int, "member_url": url, "host": host}
        spec = eval(expr, {"__builtins__": {}}, env)  # noqa: S307 -- our own docstring
        self.assertEqual(spec, score(url, host))
        self.assertTrue(0 <= spec < 2**64)

    def test_inputs_are_hashed_as_given(self) -> None:
        """score() does not normalise: callers (and ranked) pass normalised names."""
        self.assertNotEqual(score(EXAMPLE_URL + "/", EXAMPLE_HOST), EXAMPLE_SCORE)
        self.assertNotEqual(score(EXAMPLE_URL, EXAMPLE_HOST.upper()), EXAMPLE_SCORE)
        self.assertRaises(UnicodeEncodeError, score, EXAMPLE_URL, "bücher.example.com")


class MemberUrlTests(unittest.TestCase):
    def test_examples(self) -> None:
        cases = {
            "https://box-1.example.net": "https://box-1.example.net",
            "https://box-1.example.net/": "https://box-1.example.net",
            "HTTPS://BOX-1.Example.Net:443/": "https://box-1.example.net",
            "http://10.0.0.5:80": "http://10.0.0.5",
            "http://10.0.0.5:443": "http://10.0.0.5:443",
            "https://box.example.net:80": "https://box.example.net:80",
            "https://box.example.net:8443/": "https://box.example.net:8443",
            "http://[FE80::1]:8080/": "http://[fe80::1]:8080",
            "http://[::1]:80": "http://[::1]",
        }
        for raw, expected in cases.items():
            self.assertEqual(normalise_member_url(raw), expected, raw)

    def test_refused(self) -> None:
        for raw in [
            "",
            "box.example.net",
            "ftp://box.example.net",
            "https://",
            "https://box.example.net/path",
            "https://box.example.net?q=1",
            "https://box.example.net#frag",
            "https://user:pw@box.example.net",
            "https://box.example.net:99999",
            "https://box.example.net:port",
        ]:
            self.assertRaises(ValueError, normalise_member_url, raw)

    @PROPERTY
    @given(member_urls)
    def test_idempotent(self, url: str) -> None:
        self.assertEqual(normalise_member_url(url), url)
        self.assertEqual(normalise_member_url(url.upper() + "/"), url)


class InScopeTests(unittest.TestCase):
    DOMAINS = ("example.com", "11ch.example.net")

    def test_equal(self) -> None:
        self.assertTrue(in_scope("example.com", self.DOMAINS))
        self.assertTrue(in_scope("11ch.example.net", self.DOMAINS))

    def test_directly_under(self) -> None:
        self.assertTrue(in_scope("chat.example.com", self.DOMAINS))
        self.assertTrue(in_scope("8oe.11ch.example.net", self.DOMAINS))

    def test_deeper(self) -> None:
        self.assertFalse(in_scope("a.chat.example.com", self.DOMAINS))
        self.assertFalse(in_scope("x.8oe.11ch.example.net", self.DOMAINS))

    def test_unrelated(self) -> None:
        self.assertFalse(in_scope("chat.example.org", self.DOMAINS))
        self.assertFalse(in_scope("example.net", self.DOMAINS))
        self.assertFalse(in_scope("com", self.DOMAINS))

    def test_suffix_trick(self) -> None:
        self.assertFalse(in_scope("evil-example.com", self.DOMAINS))
        self.assertFalse(in_scope("chat.evil-example.com", self.DOMAINS))
        self.assertFalse(in_scope("x11ch.example.net", self.DOMAINS))
        self.assertFalse(in_scope("example.com.evil.net", self.DOMAINS))

    def test_no_domains(self) -> None:
        self.assertFalse(in_scope("chat.example.com", ()))


class OwnerTests(unittest.TestCase):
    FLEET = (
        Member("https://box-1.example.net", "ie"),
        Member("https://box-2.example.net", "ie"),
        Member("https://box-3.example.net", "fi"),
        Member("https://box-4.example.net", ""),
    )

    def test_no_members(self) -> None:
        self.assertIsNone(owner(EXAMPLE_HOST, []))
        self.assertIsNone(owner(EXAMPLE_HOST, [], "ie"))
        self.assertEqual(ranked(EXAMPLE_HOST, []), [])

    def test_single_member(self) -> None:
        only = Member(EXAMPLE_URL)
        self.assertIs(owner(EXAMPLE_HOST, [only]), only)
        self.assertIs(owner(EXAMPLE_HOST, [only], "fi"), only)  # no fi box: fallback

    @PROPERTY
    @given(space_hosts, members_lists, regions, st.randoms(use_true_random=False))
    def test_deterministic_in_any_order(self, host, members, region, rnd) -> None:
        expected = ranked(host, members, region)
        shuffled = list(members)
        rnd.shuffle(shuffled)
        self.assertEqual(ranked(host, shuffled, region), expected)
        self.assertEqual(owner(host, shuffled, region), expected[0])
        self.assertEqual(owner(host, tuple(reversed(members)), region), expected[0])

    @PROPERTY
    @given(space_hosts, members_lists)
    def test_highest_score_wins(self, host, members) -> None:
        order = ranked(host, members)
        self.assertEqual(sorted(order), sorted(members))
        scores = [score(m.url, host) for m in order]
        self.assertEqual(scores, sorted(scores, reverse=True))

    @PROPERTY
    @given(space_hosts, members_lists, regions)
    def test_region_scoping(self, host, members, region) -> None:
        in_region = [m for m in members if m.region == region]
        chosen = owner(host, members, region)
        order = ranked(host, members, region)
        if region and in_region:
            self.assertIn(chosen, in_region)
            self.assertEqual(sorted(order), sorted(in_region))
            self.assertEqual(chosen, owner(host, in_region))
        else:
            # Empty home_region, or no live member in it: the whole fleet, as without regions.
            self.assertEqual(order, ranked(host, members))
            self.assertEqual(chosen, owner(host, members))

    def test_region_examples(self) -> None:
        for i in range(50):
            host = f"s{i}.11ch.example.com"
            self.assertIn(owner(host, self.FLEET, "ie"), self.FLEET[:2])
            self.assertIs(owner(host, self.FLEET, "fi"), self.FLEET[2])
            self.assertEqual(owner(host, self.FLEET, "us"), owner(host, self.FLEET))
            self.assertEqual(owner(host, self.FLEET, ""), owner(host, self.FLEET))
        # A region-agnostic box ("" region) never matches a named home_region.
        self.assertEqual(owner(EXAMPLE_HOST, self.FLEET[3:], "ie"), self.FLEET[3])
        # Regions are opaque labels, compared exactly.
        self.assertEqual(ranked(EXAMPLE_HOST, self.FLEET, "IE"), ranked(EXAMPLE_HOST, self.FLEET))

    def test_region_fallback_uses_whole_fleet_spread(self) -> None:
        """With no live member in the home region, hosts spread over every live member."""
        owners = {owner(f"s{i}.11ch.example.com", self.FLEET, "us") for i in range(200)}
        self.assertEqual(owners, set(self.FLEET))

    def test_names_are_normalised(self) -> None:
        """ranked() normalises the host and member URLs, so sloppy input cannot split the fleet."""
        tidy = [Member(f"https://box-{i}.example.net") for i in range(5)]
        sloppy = [Member(f"HTTPS://Box-{i}.Example.NET:443/") for i in range(5)]
        for i in range(50):
            host = f"s{i}.11ch.example.com"
            expected = [tidy.index(m) for m in ranked(host, tidy)]
            self.assertEqual(
                [sloppy.index(m) for m in ranked(host.upper() + ".", sloppy)], expected
            )
        idn = hosts.normalise("bücher.example.com")
        self.assertEqual(ranked("Bücher.Example.com", tidy), ranked(idn, tidy))
        self.assertRaises(hosts.InvalidHost, owner, "localhost", tidy)
        self.assertRaises(ValueError, owner, EXAMPLE_HOST, [Member("box-1.example.net")])

    def test_tie_broken_by_larger_url(self) -> None:
        self.patch(placement, "score", lambda url, host: 7)
        members = [Member("https://b.example.net"), Member("https://c.example.net")]
        members.insert(1, Member("https://a.example.net"))
        order = ranked(EXAMPLE_HOST, members)
        self.assertEqual(
            [m.url for m in order],
            ["https://c.example.net", "https://b.example.net", "https://a.example.net"],
        )


class DisruptionTests(unittest.TestCase):
    """Rendezvous hashing's point: membership changes move only the hosts they must."""

    HOSTS = [f"space{i}.11ch.example.com" for i in range(10_000)]
    POOL = [f"https://box-{i}.example.net" for i in range(11)]

    # scores[h][m]: every (member, host) score, computed once for the class; owners are argmaxes.
    _scores: list[list[int]] | None = None

    @property
    def scores(self) -> list[list[int]]:
        if DisruptionTests._scores is None:
            DisruptionTests._scores = [[score(u, h) for u in self.POOL] for h in self.HOSTS]
        return DisruptionTests._scores

    def assertNear(self, actual: float, expected: float, tolerance: float) -> None:
        self.assertLessEqual(abs(actual - expected), tolerance, (actual, expected))

    def owners(self, members: list[int]) -> list[int]:
        return [max(members, key=row.__getitem__) for row in self.scores]

    def test_fast_path_agrees_with_owner(self) -> None:
        members = list(range(7))
        fast = self.owners(members)
        candidates = [Member(self.POOL[i]) for i in members]
        for h in range(0, len(self.HOSTS), 50):
            chosen = owner(self.HOSTS[h], candidates)
            assert chosen is not None
            self.assertEqual(self.POOL.index(chosen.url), fast[h])

    def test_each_member_gets_a_fair_share(self) -> None:
        for n in (3, 7, 10):
            counts = [0] * n
            for o in self.owners(list(range(n))):
                counts[o] += 1
            for count in counts:
                self.assertNear(count / len(self.HOSTS), 1 / n, 0.25 / n)

    def test_adding_a_member_moves_only_to_it(self) -> None:
        for n in range(3, 11):
            before = self.owners(list(range(n)))
            after = self.owners(list(range(n + 1)))
            moved = [h for h in range(len(self.HOSTS)) if before[h] != after[h]]
            self.assertTrue(all(after[h] == n for h in moved), n)
            self.assertEqual(len(moved), after.count(n))
            expected = 1 / (n + 1)
            self.assertNear(len(moved) / len(self.HOSTS), expected, 0.2 * expected)

    def test_removing_a_member_moves_exactly_its_hosts(self) -> None:
        for n in range(3, 11):
            members = list(range(n))
            gone = n // 2
            before = self.owners(members)
            after = self.owners([m for m in members if m != gone])
            moved = {h for h in range(len(self.HOSTS)) if before[h] != after[h]}
            owned = {h for h in range(len(self.HOSTS)) if before[h] == gone}
            self.assertEqual(moved, owned, n)
            expected = 1 / n
            self.assertNear(len(moved) / len(self.HOSTS), expected, 0.2 * expected)

    @settings(PROPERTY, max_examples=50)
    @given(st.lists(member_urls, min_size=2, max_size=8, unique=True), st.data())
    def test_membership_change_property(self, urls, data) -> None:
        """For any fleet: a new member only takes hosts; a lost member only gives up its own."""
        hosts_ = [f"h{i}.example.com" for i in range(100)]
        newcomer = data.draw(member_urls.filter(lambda u: u not in urls))
        fleet = [Member(u) for u in urls]
        grown = [*fleet, Member(newcomer)]
        for host in hosts_:
            before = owner(host, fleet)
            after = owner(host, grown)
            self.assertIn(after, (before, grown[-1]))
            shrunk = owner(host, fleet[1:])
            if before != fleet[0]:
                self.assertEqual(shrunk, before)
