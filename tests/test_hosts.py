"""Tests for lchat.hosts: normalisation, Host headers, "covers", and host -> file names."""

from __future__ import annotations

import os
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial import unittest

from lchat import hosts
from lchat.hosts import InvalidHost

LABEL_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
DATA = "/var/lib/lchat-test/data"
RUN = "/run/lchat-test"

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_rfc1123(case: unittest.TestCase, name: str) -> None:
    labels = name.split(".")
    case.assertGreaterEqual(len(labels), 2, name)
    case.assertLessEqual(len(name), hosts.MAX_NAME, name)
    for label in labels:
        case.assertTrue(1 <= len(label) <= hosts.MAX_LABEL, (name, label))
        case.assertRegex(label, LABEL_RE)
    case.assertFalse(labels[-1].isdigit(), name)
    case.assertFalse(labels[-1].endswith("-bot"), name)


# --- strategies ----------------------------------------------------------------------------------

# Characters that matter to a hostname parser: separators, dots (ASCII and the ideographic /
# fullwidth ones IDNA maps to '.'), ports, brackets, controls, unicode letters that case-fold oddly.
_tricky = st.sampled_from(
    [
        ".",
        "..",
        "/",
        "\\",
        ":",
        "[",
        "]",
        "\x00",
        " ",
        "\t",
        "-",
        "_",
        "%",
        "\u3002",
        "\uff0e",
        "ü",
        "ß",
        "İ",
        "\u200d",
        "K",
        "xn--",
        "-bot",
        "0",
        "9",
        "a",
        "Z",
    ]
)
arbitrary_text = st.one_of(st.text(), st.lists(_tricky, max_size=24).map("".join))

_ldh = "abcdefghijklmnopqrstuvwxyz0123456789"


@st.composite
def ascii_label(draw: st.DrawFn, max_size: int = hosts.MAX_LABEL) -> str:
    """An RFC 1123 label, sometimes with mixed case; 1..max_size characters."""
    size = draw(st.integers(min_value=1, max_value=max_size))
    if size == 1:
        return draw(st.sampled_from(_ldh))
    inner = draw(
        st.text(alphabet=_ldh + "-", min_size=size - 2, max_size=size - 2),
    )
    label = draw(st.sampled_from(_ldh)) + inner + draw(st.sampled_from(_ldh))
    if draw(st.booleans()):
        label = label.upper()
    return label


unicode_label = st.text(
    alphabet=st.sampled_from(
        "abcxyz\u00e4\u00f6\u00fc\u00e9\u00e7\u00f1\u00df\u00f8\u00e5\u03b1\u03b2\u03b3\u0434\u043b\u044f\u0437\u0445\u043d\u4e2d\u6587\u65e5\u672c"
    ),
    min_size=1,
    max_size=12,
)


@st.composite
def hostname_like(draw: st.DrawFn) -> str:
    """Valid-looking names: 2..6 labels joined by dots, maybe a trailing dot and/or a port."""
    count = draw(st.integers(min_value=2, max_value=6))
    labels = [
        draw(st.one_of(ascii_label(), ascii_label(max_size=8), unicode_label)) for _ in range(count)
    ]
    # Keep the TLD mostly alphabetic so most names are accepted.
    labels[-1] = draw(
        st.one_of(st.sampled_from(["com", "net", "Example", "io", "xn--p1ai"]), *[unicode_label])
    )
    name = ".".join(labels)
    if draw(st.booleans()):
        name += "."
    if draw(st.booleans()):
        name += f":{draw(st.integers(min_value=0, max_value=65535))}"
    return name


def check_accepted(case: unittest.TestCase, raw: str) -> str | None:
    """Apply every property to one input; returns the accepted name or None if refused."""
    try:
        name = hosts.normalise(raw)
    except InvalidHost as e:
        case.assertTrue(str(e))  # a refusal always says why
        return None
    case.assertEqual(hosts.normalise(name), name)
    case.assertTrue(hosts.is_normal(name))
    assert_rfc1123(case, name)
    for make in (hosts.db_path, hosts.env_path, hosts.bot_env_path):
        path = make(DATA, name)
        case.assertEqual(os.path.dirname(path), os.path.abspath(DATA))
        case.assertNotIn("\x00", path)
        case.assertTrue(os.path.basename(path).startswith(name))
    sock = hosts.socket_path(RUN, name)
    case.assertEqual(os.path.dirname(sock), os.path.abspath(RUN))
    case.assertNotIn("\x00", sock)
    case.assertLessEqual(len(os.fsencode(sock)), hosts.MAX_SOCKET_PATH)
    return name


class NormaliseProperties(unittest.TestCase):
    @PROPERTY
    @given(arbitrary_text)
    def test_arbitrary_text_is_refused_or_canonical(self, raw: str) -> None:
        check_accepted(self, raw)

    @PROPERTY
    @given(hostname_like())
    def test_valid_looking_names(self, raw: str) -> None:
        check_accepted(self, raw)

    @PROPERTY
    @given(st.lists(ascii_label(), min_size=2, max_size=5))
    def test_pure_ascii_ldh_names_are_accepted_lowercased(self, labels: list[str]) -> None:
        """A name built only from RFC 1123 labels is accepted iff its length and TLD rules allow."""
        raw = ".".join(labels)
        lowered = raw.lower()
        last = labels[-1].lower()
        expect_ok = (
            len(lowered) <= hosts.MAX_NAME and not last.isdigit() and not last.endswith("-bot")
        )
        if expect_ok:
            self.assertEqual(check_accepted(self, raw), lowered)
        else:
            self.assertRaises(InvalidHost, hosts.normalise, raw)

    @PROPERTY
    @given(st.lists(ascii_label(), min_size=2, max_size=5), st.integers(0, 65535))
    def test_port_and_trailing_dot_do_not_change_the_name(
        self, labels: list[str], port: int
    ) -> None:
        raw = ".".join(labels)
        try:
            name = hosts.normalise(raw)
        except InvalidHost:
            return
        self.assertEqual(hosts.normalise(raw + "."), name)
        self.assertEqual(hosts.normalise(f"{raw}:{port}"), name)
        self.assertEqual(hosts.normalise(f"{raw}.:{port}"), name)

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(hostname_like(), min_size=2, max_size=6))
    def test_distinct_hosts_get_distinct_socket_paths(self, raws: list[str]) -> None:
        names = set()
        for raw in raws:
            try:
                names.add(hosts.normalise(raw))
            except InvalidHost:
                pass
        for run in (RUN, "/tmp/" + "r" * 40):
            paths = {hosts.socket_path(run, n) for n in names}
            self.assertEqual(len(paths), len(names))

    @PROPERTY
    @given(st.lists(ascii_label(), min_size=2, max_size=5))
    def test_file_names_of_different_hosts_never_collide(self, labels: list[str]) -> None:
        """<a>.env, <a>-bot.env, <a>.db of one host are never another host's file."""
        try:
            a = hosts.normalise(".".join(labels))
            b = hosts.normalise(".".join(labels) + "-bot")
        except InvalidHost:
            return
        self.fail(f"{a} and {b} would share {hosts.bot_env_path(DATA, a)}")  # pragma: no cover


class NormaliseUnits(unittest.TestCase):
    def test_lowercases(self) -> None:
        self.assertEqual(hosts.normalise("Chat-A.Example.COM"), "chat-a.example.com")

    def test_strips_one_trailing_dot(self) -> None:
        self.assertEqual(hosts.normalise("chat.example.com."), "chat.example.com")
        self.assertRaises(InvalidHost, hosts.normalise, "chat.example.com..")

    def test_strips_port(self) -> None:
        self.assertEqual(hosts.normalise("chat.example.com:8443"), "chat.example.com")
        self.assertEqual(hosts.normalise("chat.example.com.:443"), "chat.example.com")
        for bad in ("chat.example.com:", "chat.example.com:99999", "chat.example.com:x"):
            self.assertRaises(InvalidHost, hosts.normalise, bad)

    def test_idna(self) -> None:
        self.assertEqual(hosts.normalise("bücher.example"), "xn--bcher-kva.example")
        self.assertEqual(hosts.normalise("BÜCHER.example"), "xn--bcher-kva.example")
        self.assertEqual(hosts.normalise("xn--bcher-kva.example"), "xn--bcher-kva.example")
        # Ideographic full stop is a dot under UTS 46.
        self.assertEqual(hosts.normalise("bücher\u3002example"), "xn--bcher-kva.example")

    def test_invalid_idna_is_refused(self) -> None:
        self.assertRaises(InvalidHost, hosts.normalise, "a\u200db.example")
        self.assertRaises(InvalidHost, hosts.normalise, "☃\u0300.example")

    def test_hostile_names(self) -> None:
        for bad in (
            "../x",
            "..",
            ".",
            "a/b",
            "a/b.com",
            "a\\b.com",
            "a\x00b.com",
            "a.com\x00",
            "\x00",
            "a b.com",
            "a\tb.com",
            "a\nb.com",
            "/etc/passwd",
            "x/../../etc.com",
            ".example.com",
            "a..example.com",
            "_dmarc.example.com",
            "-a.example.com",
            "a-.example.com",
            "a.b:c:d",
            "",
        ):
            with self.assertRaises(InvalidHost, msg=repr(bad)) as e:
                hosts.normalise(bad)
            self.assertTrue(str(e.exception))

    def test_label_length(self) -> None:
        ok = "a" * 63 + ".example.com"
        self.assertEqual(hosts.normalise(ok), ok)
        with self.assertRaises(InvalidHost) as e:
            hosts.normalise("a" * 64 + ".example.com")
        self.assertIn("63", str(e.exception))
        self.assertRaises(InvalidHost, hosts.normalise, "a" * 300 + ".example.com")
        self.assertRaises(InvalidHost, hosts.normalise, "chat." + "b" * 300)

    def test_name_length(self) -> None:
        # 4 labels of 63 + 3 dots = 255; trim to exactly 253 and 254.
        labels = ["a" * 63, "b" * 63, "c" * 63, "d" * 61]
        name253 = ".".join(labels)
        self.assertEqual(len(name253), 253)
        self.assertEqual(hosts.normalise(name253), name253)
        name254 = ".".join([*labels[:3], "d" * 62])
        self.assertEqual(len(name254), 254)
        self.assertRaises(InvalidHost, hosts.normalise, name254)
        self.assertRaises(InvalidHost, hosts.normalise, "a." * 400 + "com")

    def test_single_label(self) -> None:
        for name in ("localhost", "com", "LOCALHOST.", "localhost:8080"):
            with self.assertRaises(InvalidHost) as e:
                hosts.normalise(name)
            self.assertIn("two labels", str(e.exception))

    def test_ip_literals(self) -> None:
        for literal in (
            "127.0.0.1",
            "127.0.0.1:80",
            "10.1.2.3.",
            "[::1]",
            "[::1]:443",
            "::1",
            "[2001:db8::1]",
            "[not-an-ip]",
            "1.2.3",
            "1.2.3.999",
        ):
            self.assertRaises(InvalidHost, hosts.normalise, literal)

    def test_bot_suffix_is_reserved(self) -> None:
        self.assertRaises(InvalidHost, hosts.normalise, "chat.example-bot")
        self.assertRaises(InvalidHost, hosts.normalise, "chat.EXAMPLE-BOT.")
        # Only the last label is reserved.
        self.assertEqual(hosts.normalise("my-bot.example.com"), "my-bot.example.com")
        self.assertEqual(hosts.normalise("chat.bot"), "chat.bot")

    def test_numeric_tld(self) -> None:
        self.assertRaises(InvalidHost, hosts.normalise, "chat.example.123")
        self.assertEqual(hosts.normalise("123.example.com"), "123.example.com")

    def test_non_text(self) -> None:
        self.assertRaises(InvalidHost, hosts.normalise, b"chat.example.com")
        self.assertRaises(InvalidHost, hosts.normalise, None)

    def test_is_normal(self) -> None:
        self.assertTrue(hosts.is_normal("chat.example.com"))
        self.assertFalse(hosts.is_normal("Chat.example.com"))
        self.assertFalse(hosts.is_normal("chat.example.com."))
        self.assertFalse(hosts.is_normal("../x"))


class Covers(unittest.TestCase):
    def test_equal(self) -> None:
        self.assertTrue(hosts.covers("example.com", "example.com"))

    def test_direct_child(self) -> None:
        self.assertTrue(hosts.covers("example.com", "chat.example.com"))

    def test_grandchild(self) -> None:
        self.assertFalse(hosts.covers("example.com", "a.chat.example.com"))

    def test_suffix_trick(self) -> None:
        self.assertFalse(hosts.covers("example.com", "evilexample.com"))
        self.assertFalse(hosts.covers("example.com", "chat.evilexample.com"))
        self.assertFalse(hosts.covers("example.com", ".example.com"))

    def test_unrelated_and_parent(self) -> None:
        self.assertFalse(hosts.covers("example.com", "example.net"))
        self.assertFalse(hosts.covers("chat.example.com", "example.com"))

    @PROPERTY
    @given(st.lists(ascii_label(max_size=10), min_size=1, max_size=4), ascii_label(max_size=10))
    def test_covers_is_one_label_deep(self, domain_labels: list[str], head: str) -> None:
        domain = ".".join(domain_labels).lower()
        head = head.lower()
        self.assertTrue(hosts.covers(domain, domain))
        self.assertTrue(hosts.covers(domain, f"{head}.{domain}"))
        self.assertFalse(hosts.covers(domain, f"x.{head}.{domain}"))
        self.assertFalse(hosts.covers(domain, f"{head}{domain}"))


class ParseHostHeader(unittest.TestCase):
    def test_valid_names(self) -> None:
        self.assertEqual(hosts.parse_host_header("chat.example.com"), "chat.example.com")
        self.assertEqual(hosts.parse_host_header("Chat.Example.com:443"), "chat.example.com")
        self.assertEqual(hosts.parse_host_header("chat.example.com."), "chat.example.com")
        self.assertEqual(hosts.parse_host_header("xn--bcher-kva.example"), "xn--bcher-kva.example")
        self.assertEqual(hosts.parse_host_header("XN--BCHER-KVA.example"), "xn--bcher-kva.example")

    def test_only_printable_ascii(self) -> None:
        """Nothing outside printable ASCII is decoded, folded or IDNA-mapped onto a name: read as
        Latin-1 (as the proxy reads header bytes) "\xaa" is "ª", which NFKC maps to "a", and a soft
        hyphen vanishes; each of these reached chat.example.com. An IDN travels as its A-label."""
        for bad in (
            "ch\xaat.example.com",  # ª -> a
            "\xaa.test",
            "chat\xad.example.com",  # soft hyphen: mapped to nothing
            "cha\u1d57.example.com",  # modifier letter small t -> t
            "\u212a.example.com",  # Kelvin sign -> k
            "chat\uff0eexample.com",  # fullwidth full stop -> "."
            "chat.example.com\xff",
            "bücher.example",  # a U-label: the client must send xn--bcher-kva.example
            "b\xc3\xbccher.example",  # the same in UTF-8 bytes read as Latin-1
            "chat.example.com\x85",  # NEL
            "chat.example.com\xa0",  # no-break space
            "a\x01.test",
            "a\x1f.test",
            "a\x7f.test",
            "localhost\n",  # "$" in a regex matches before a final newline
            "chat.example.com\n",
            "chat.example.com\r",
            "\tchat.example.com",
        ):
            self.assertRaises(InvalidHost, hosts.parse_host_header, bad)

    def test_non_space_names_pass_through_lowercased(self) -> None:
        self.assertEqual(hosts.parse_host_header("127.0.0.1:8080"), "127.0.0.1")
        self.assertEqual(hosts.parse_host_header("127.0.0.1"), "127.0.0.1")
        self.assertEqual(hosts.parse_host_header("[::1]:80"), "[::1]")
        self.assertEqual(hosts.parse_host_header("[::1]"), "[::1]")
        self.assertEqual(hosts.parse_host_header("localhost:8080"), "localhost")
        self.assertEqual(hosts.parse_host_header("LOCALHOST"), "localhost")
        # None of those can be a registry key.
        for value in ("127.0.0.1", "[::1]", "localhost"):
            self.assertFalse(hosts.is_normal(value))

    def test_garbage(self) -> None:
        for bad in (
            "a b",
            "a/b",
            "a:b:c",
            "",
            "x:99999",
            "x:",
            "chat.example.com:99999",
            "../x",
            "a\x00b.com",
            "a\r\nb.com",
            "[::1",
            "[::1]x",
            "_x",
            "a..b",
            "[foo]",
            "[1..2]",
            "[::1]:99999",
            "x" * 600,
        ):
            self.assertRaises(InvalidHost, hosts.parse_host_header, bad)

    @PROPERTY
    @given(
        st.sampled_from(["chat.example.com", "a.test", "localhost:8080", "127.0.0.1", "[::1]"]),
        st.integers(min_value=0, max_value=20),
        st.characters().filter(lambda c: not 0x21 <= ord(c) <= 0x7E),
    )
    def test_one_character_outside_printable_ascii_is_refused(
        self, name: str, at: int, extra: str
    ) -> None:
        """Wherever it is, whatever it would fold to, the header is refused."""
        value = name[:at] + extra + name[at:]
        self.assertRaises(InvalidHost, hosts.parse_host_header, value)

    @PROPERTY
    @given(arbitrary_text)
    def test_result_never_contains_a_separator(self, value: str) -> None:
        try:
            result = hosts.parse_host_header(value)
        except InvalidHost:
            return
        for bad in ("/", "\\", "\x00", " ", ".."):
            self.assertNotIn(bad, result)
        self.assertEqual(result, result.lower())


class FileNames(unittest.TestCase):
    def test_names(self) -> None:
        self.assertEqual(hosts.db_path("/data", "a.example.com"), "/data/a.example.com.db")
        self.assertEqual(hosts.env_path("/data", "a.example.com"), "/data/a.example.com.env")
        self.assertEqual(
            hosts.bot_env_path("/data", "a.example.com"), "/data/a.example.com-bot.env"
        )
        self.assertEqual(
            hosts.socket_path("/run/lchat", "a.example.com"), "/run/lchat/a.example.com.sock"
        )

    def test_relative_dir_is_made_absolute(self) -> None:
        path = hosts.db_path("data", "a.example.com")
        self.assertEqual(path, os.path.join(os.path.abspath("data"), "a.example.com.db"))

    def test_refuses_non_normalised(self) -> None:
        for make in (hosts.db_path, hosts.env_path, hosts.bot_env_path, hosts.socket_path):
            for bad in ("A.com", "a.example.com.", "a.example.com:80", "bücher.example"):
                with self.assertRaises(InvalidHost, msg=(make, bad)) as e:
                    make("/data", bad)
                self.assertIn("not normalised", str(e.exception))

    def test_refuses_hostile(self) -> None:
        for make in (hosts.db_path, hosts.env_path, hosts.bot_env_path, hosts.socket_path):
            for bad in ("../x", "a/b", "a\x00b.com", "x" * 300 + ".com", "", "localhost"):
                self.assertRaises(InvalidHost, make, "/data", bad)

    def test_long_name_gets_hashed_socket(self) -> None:
        name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
        sock = hosts.socket_path("/run/lchat", name)
        self.assertEqual(os.path.dirname(sock), "/run/lchat")
        self.assertRegex(os.path.basename(sock), r"^h-[0-9a-f]{32}\.sock$")
        self.assertLessEqual(len(os.fsencode(sock)), hosts.MAX_SOCKET_PATH)
        self.assertEqual(hosts.socket_path("/run/lchat", name), sock)  # stable
        other = ".".join(["a" * 63, "b" * 63, "c" * 63, "e" * 61])
        self.assertNotEqual(hosts.socket_path("/run/lchat", other), sock)

    def test_socket_path_boundary(self) -> None:
        run = "/run/lchat"
        # "/run/lchat/" + name + ".sock" = 16 + len(name) bytes.
        fits = "a" * 40 + "." + "b" * 39 + ".com"
        self.assertEqual(len(fits), hosts.MAX_SOCKET_PATH - 16)
        self.assertEqual(hosts.socket_path(run, fits), f"{run}/{fits}.sock")
        self.assertEqual(len(hosts.socket_path(run, fits)), hosts.MAX_SOCKET_PATH)
        over = "a" + fits
        self.assertRegex(os.path.basename(hosts.socket_path(run, over)), r"^h-")

    def test_run_dir_too_long_for_any_socket(self) -> None:
        with self.assertRaises(InvalidHost) as e:
            hosts.socket_path("/" + "r" * 120, "a.example.com")
        self.assertIn("too long", str(e.exception))
