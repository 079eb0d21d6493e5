"""Tests for lchat.config: every refusal names its variable; defaults, precedence, env-file syntax."""

from __future__ import annotations

import base64
import os
import socket
from collections.abc import Mapping

from twisted.trial import unittest

from lchat import config
from lchat.builds import space_argv
from lchat.config import BoxConfig, ConfigError
from lchat.config.acme import LETS_ENCRYPT
from lchat.config.values import parse_size

STAGING = "https://acme-staging-v02.api.letsencrypt.org/directory"
MESH_OK = {
    "LCHAT_HIBERNATE_BUCKET": "my-hibernation-bucket",
    "LCHAT_MESH_SELF": "https://box-1.example.net",
    "LCHAT_MESH_DOMAINS": "11ch.example.com",
    "LCHAT_MESH_TOKEN": "s3cret-mesh-token-value-0123456789",
}


class Base(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = self.mktemp()
        os.makedirs(self.dir)
        self.env_file = self.write_env("")

    def write_env(self, text: str, name: str = "router.env") -> str:
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def load(
        self,
        environ: Mapping[str, str] | None = None,
        flags: Mapping[str, str | None] | None = None,
        env_file: str | None = None,
        systemd_present: bool = False,
    ) -> BoxConfig:
        return config.load(
            env_file=self.env_file if env_file is None else env_file,
            environ=environ or {},
            flags=flags,
            systemd_present=systemd_present,
        )

    def refuses(self, variable: str, environ: Mapping[str, str], *, where: str = "") -> str:
        """Assert that ``environ`` is refused with a message naming ``variable``; return it."""
        with self.assertRaises(ConfigError, msg=repr(environ)) as e:
            self.load(environ)
        message = str(e.exception)
        self.assertIn(variable, message)
        if where:
            self.assertIn(where, message)
        return message


class Refusals(Base):
    def test_hibernate_idle_not_positive(self) -> None:
        for value in ("0s", "0", "0m", "0h0m", "0.0s"):
            self.refuses("LCHAT_HIBERNATE_IDLE", {"LCHAT_HIBERNATE_IDLE": value})

    def test_hibernate_idle_not_a_duration(self) -> None:
        for value in ("15", "abc", "1x", "-5m", "15 m", "m", "1h30", "1.5.2s", "\x00"):
            self.refuses("LCHAT_HIBERNATE_IDLE", {"LCHAT_HIBERNATE_IDLE": value})

    def test_idle_is_checked_even_without_a_bucket(self) -> None:
        self.refuses("LCHAT_HIBERNATE_IDLE", {"LCHAT_HIBERNATE_IDLE": "soon"})
        self.refuses(
            "LCHAT_HIBERNATE_IDLE",
            {"LCHAT_HIBERNATE_IDLE": "soon", "LCHAT_HIBERNATE_BUCKET": "bkt"},
        )

    def test_hibernate_prefix(self) -> None:
        for value in ("a/../b", "..", "x\x00y"):
            self.refuses(
                "LCHAT_HIBERNATE_PREFIX",
                {"LCHAT_HIBERNATE_BUCKET": "bkt", "LCHAT_HIBERNATE_PREFIX": value},
            )

    def test_mesh_without_domains(self) -> None:
        env = {**MESH_OK, "LCHAT_MESH_DOMAINS": ""}
        self.refuses("LCHAT_MESH_DOMAINS", env, where="LCHAT_MESH_SELF")
        env = {**MESH_OK, "LCHAT_MESH_DOMAINS": " , "}
        self.refuses("LCHAT_MESH_DOMAINS", env)
        env = dict(MESH_OK)
        del env["LCHAT_MESH_DOMAINS"]
        self.refuses("LCHAT_MESH_DOMAINS", env)

    def test_mesh_without_token(self) -> None:
        env = dict(MESH_OK)
        del env["LCHAT_MESH_TOKEN"]
        self.refuses("LCHAT_MESH_TOKEN", env, where="LCHAT_MESH_SELF")
        self.refuses("LCHAT_MESH_TOKEN", {**MESH_OK, "LCHAT_MESH_TOKEN": "   "})

    def test_mesh_without_bucket(self) -> None:
        env = dict(MESH_OK)
        del env["LCHAT_HIBERNATE_BUCKET"]
        self.refuses("LCHAT_HIBERNATE_BUCKET", env, where="LCHAT_MESH_SELF")

    def test_mesh_self_not_a_base_url(self) -> None:
        for value in (
            "box-1.example.net",  # no scheme
            "box-1.example.net:8443",
            "//box-1.example.net",
            "ftp://box-1.example.net",  # wrong scheme
            "https://",  # no host
            "https://:8443",
            "https://box-1.example.net/mesh",  # a path
            "https://box-1.example.net/?x=1",  # a query
            "https://box-1.example.net?x=1",
            "https://box-1.example.net#frag",
            "https://box-1.example.net:99999",  # a bad port
            "https://box-1.example.net:port",
        ):
            message = self.refuses("LCHAT_MESH_SELF", {**MESH_OK, "LCHAT_MESH_SELF": value})
            self.assertNotIn(MESH_OK["LCHAT_MESH_TOKEN"], message)

    def test_cert_cache(self) -> None:
        self.refuses("LCHAT_CERT_CACHE", {"LCHAT_CERT_CACHE": "bogus"})
        self.refuses("LCHAT_CERT_CACHE", {"LCHAT_CERT_CACHE": "S3"})
        # s3 lives in the hibernation bucket and needs the key that encrypts private keys there
        message = self.refuses("LCHAT_HIBERNATE_BUCKET", {"LCHAT_CERT_CACHE": "s3"})
        self.assertIn("LCHAT_CERT_CACHE", message)
        with_bucket = {"LCHAT_CERT_CACHE": "s3", "LCHAT_HIBERNATE_BUCKET": "lchat-test"}
        self.refuses("LCHAT_CERT_CACHE_KEY", with_bucket)
        for key in ("not base64!", "c2hvcnQ=", "A" * 44 + "==", "\u00e9" * 44):
            message = self.refuses(
                "LCHAT_CERT_CACHE_KEY", {**with_bucket, "LCHAT_CERT_CACHE_KEY": key}
            )
            self.assertNotIn(key, message)  # a secret, even a wrong one, is never echoed
        self.refuses("LCHAT_CERT_CACHE_SYNC", {"LCHAT_CERT_CACHE_SYNC": "0s"})

    def test_cert_cache_s3(self) -> None:
        key = base64.b64encode(bytes(range(32))).decode()
        cfg = self.load(
            {
                "LCHAT_CERT_CACHE": "s3",
                "LCHAT_HIBERNATE_BUCKET": "lchat-test",
                "LCHAT_CERT_CACHE_KEY": key,
                "LCHAT_CERT_CACHE_SYNC": "5s",
            }
        )
        self.assertEqual(cfg.cert_cache, "s3")
        self.assertEqual(cfg.cert_cache_key, bytes(range(32)))
        self.assertEqual(cfg.cert_cache_sync, 5.0)
        self.assertNotIn(key, repr(cfg))
        urlsafe = base64.urlsafe_b64encode(b"\xfb" * 32).decode().rstrip("=")
        cfg = self.load(
            {
                "LCHAT_CERT_CACHE": "s3",
                "LCHAT_HIBERNATE_BUCKET": "lchat-test",
                "LCHAT_CERT_CACHE_KEY": urlsafe,
            }
        )
        self.assertEqual(cfg.cert_cache_key, b"\xfb" * 32)

    def test_acme(self) -> None:
        for value in (
            "letsencrypt",
            "ftp://ca.example/dir",
            "https://",
            "http://ca.example/dir",  # RFC 8555: TLS (plain http only to this machine)
            "https://c\u00e4.example/dir",
            "https://ca.example/a dir",
        ):
            self.refuses("LCHAT_ACME_DIRECTORY", {"LCHAT_ACME_DIRECTORY": value})
        for value in ("nobody", "a b@example.com", "x@y"):
            self.refuses("LCHAT_ACME_EMAIL", {"LCHAT_ACME_EMAIL": value})
        self.refuses("LCHAT_ACME_CA_FILE", {"LCHAT_ACME_CA_FILE": "/nonexistent/ca.pem"})
        self.refuses("LCHAT_DNS_PROVIDER", {"LCHAT_DNS_PROVIDER": "cloudflare"})
        # a wildcard needs DNS-01, and DNSimple (the default) needs its token
        message = self.refuses("LCHAT_DNSIMPLE_TOKEN", {"LCHAT_WILDCARD_DOMAINS": "example.com"})
        self.assertIn("LCHAT_WILDCARD_DOMAINS", message)
        for value in ("1.2.3.4:99999", "dns.example.com", "1.2.3", "[::1]:0", "::1", ":53"):
            self.refuses("LCHAT_DNS_RESOLVERS", {"LCHAT_DNS_RESOLVERS": value})
        self.refuses("LCHAT_DNS_PROPAGATION_TIMEOUT", {"LCHAT_DNS_PROPAGATION_TIMEOUT": "0s"})
        self.refuses("LCHAT_ROUTE53_ZONE_ID", {"LCHAT_ROUTE53_ZONE_ID": "zone; rm -rf"})
        self.refuses("LCHAT_DNSIMPLE_URL", {"LCHAT_DNSIMPLE_URL": "api.dnsimple.com"})
        # the token travels in every request: plain http only to this machine
        self.refuses("LCHAT_DNSIMPLE_URL", {"LCHAT_DNSIMPLE_URL": "http://api.dnsimple.com"})
        self.assertIsNotNone(self.load({"LCHAT_DNSIMPLE_URL": "http://127.0.0.1:8080"}).acme)
        self.refuses("LCHAT_DNSIMPLE_ACCOUNT", {"LCHAT_DNSIMPLE_ACCOUNT": "12a"})
        self.refuses("LCHAT_DNS_PROPAGATION_TIMEOUT", {"LCHAT_DNS_PROPAGATION_TIMEOUT": "10m"})
        self.refuses("LCHAT_ROUTE53_ENDPOINT", {"LCHAT_ROUTE53_ENDPOINT": "nope"})

    def test_acme_settings(self) -> None:
        cfg = self.load()
        assert cfg.acme is not None
        self.assertEqual(cfg.acme.directory, LETS_ENCRYPT)
        self.assertEqual(cfg.acme.dns_provider, "dnsimple")
        self.assertEqual(cfg.acme.dns_resolvers, ())
        self.assertIsNone(self.load({"LCHAT_ACME_DIRECTORY": "off"}).acme)
        # a wildcard with ACME off: files placed by hand, no token needed
        self.assertIsNone(
            self.load({"LCHAT_ACME_DIRECTORY": "off", "LCHAT_WILDCARD_DOMAINS": "example.com"}).acme
        )
        cfg = self.load(
            {
                "LCHAT_ACME_DIRECTORY": STAGING,
                "LCHAT_ACME_EMAIL": "ops@example.com",
                "LCHAT_WILDCARD_DOMAINS": "example.com",
                "LCHAT_DNS_PROVIDER": "route53",
                "LCHAT_ROUTE53_ZONE_ID": "/hostedzone/Z123ABC",
                "LCHAT_DNS_RESOLVERS": "127.0.0.1:8053, 9.9.9.9, [::1]:53",
                "LCHAT_DNS_PROPAGATION_TIMEOUT": "5m",
            }
        )
        assert cfg.acme is not None
        self.assertEqual(cfg.acme.directory, STAGING)
        self.assertEqual(cfg.acme.email, "ops@example.com")
        self.assertEqual(cfg.acme.dns_provider, "route53")
        self.assertEqual(cfg.acme.route53_zone_id, "Z123ABC")
        self.assertEqual(
            cfg.acme.dns_resolvers, (("127.0.0.1", 8053), ("9.9.9.9", 53), ("::1", 53))
        )
        self.assertEqual(cfg.acme.dns_timeout, 300.0)
        token = "dnsimple-secret-token"
        cfg = self.load({"LCHAT_WILDCARD_DOMAINS": "example.com", "LCHAT_DNSIMPLE_TOKEN": token})
        assert cfg.acme is not None
        self.assertEqual(cfg.acme.dnsimple_token, token)
        self.assertNotIn(token, repr(cfg))

    def test_units(self) -> None:
        for value in ("bogus", "Systemd", "", "none"):
            self.refuses("LCHAT_UNITS", {"LCHAT_UNITS": value})

    def test_addresses(self) -> None:
        for variable in ("LCHAT_HTTP_ADDR", "LCHAT_HTTPS_ADDR"):
            for value in (
                ":99999",
                "nonsense:::",
                "127.0.0.1:70000",
                "[::1]:99999",
                "tcp:notaport",
                "bogus:80",
                "myhost:8080",
                "[::1]",
                "1.2.3.4",
            ):
                self.refuses(variable, {variable: value})

    def test_fallback_url(self) -> None:
        for value in (
            "example.com",
            "/relative",
            "ftp://example.com/",
            "https://",
            "javascript:alert(1)",
            "https://exa mple.com/",
            "https://example.com/\x00",
            "https://b\u00fccher.example/",
        ):
            self.refuses("LCHAT_FALLBACK_URL", {"LCHAT_FALLBACK_URL": value})

    def test_domains(self) -> None:
        for variable in ("LCHAT_MESH_DOMAINS", "LCHAT_WILDCARD_DOMAINS"):
            for value in (
                "../x",
                "a/b",
                "a\x00b.com",
                "x" * 300 + ".com",
                "localhost",
                "good.example.com,../x",
                "127.0.0.1",
            ):
                self.refuses(variable, {**MESH_OK, variable: value})

    def test_paths_with_nul(self) -> None:
        for variable in (
            "LCHAT_DATA_DIR",
            "LCHAT_RUN_DIR",
            "LCHAT_REGISTRY",
            "LCHAT_ACME_CACHE",
            "LCHAT_SPACE_COMMAND",
        ):
            self.refuses(variable, {variable: "/tmp/a\x00b"})

    def test_empty_dirs(self) -> None:
        self.refuses("LCHAT_DATA_DIR", {"LCHAT_DATA_DIR": ""})
        self.refuses("LCHAT_RUN_DIR", {"LCHAT_RUN_DIR": "  "})

    def test_space_command(self) -> None:
        self.refuses("LCHAT_SPACE_COMMAND", {"LCHAT_SPACE_COMMAND": ""})
        self.refuses("LCHAT_SPACE_COMMAND", {"LCHAT_SPACE_COMMAND": "'/opt/x {host}"})

    def test_refusal_from_a_flag_or_the_file(self) -> None:
        with self.assertRaises(ConfigError) as e:
            self.load(flags={"LCHAT_UNITS": "bogus"})
        self.assertIn("LCHAT_UNITS", str(e.exception))
        env_file = self.write_env("LCHAT_CERT_CACHE=bogus\n", "s3.env")
        with self.assertRaises(ConfigError) as e:
            self.load(env_file=env_file)
        self.assertIn("LCHAT_CERT_CACHE", str(e.exception))


class EnvFileRefusals(Base):
    def test_explicit_file_missing(self) -> None:
        missing = os.path.join(self.dir, "nope.env")
        with self.assertRaises(ConfigError) as e:
            self.load(env_file=missing)
        self.assertIn("--env-file", str(e.exception))
        self.assertIn(missing, str(e.exception))

    def test_file_path_with_nul(self) -> None:
        with self.assertRaises(ConfigError) as e:
            self.load(env_file=os.path.join(self.dir, "a\x00b.env"))
        self.assertIn("--env-file", str(e.exception))

    def test_file_is_a_directory(self) -> None:
        with self.assertRaises(ConfigError) as e:
            self.load(env_file=self.dir)
        self.assertIn("--env-file", str(e.exception))

    def test_not_utf8(self) -> None:
        path = os.path.join(self.dir, "latin1.env")
        with open(path, "wb") as f:
            f.write(b"LCHAT_DATA_DIR=/d\xe9\n")
        with self.assertRaises(ConfigError) as e:
            self.load(env_file=path)
        self.assertIn("UTF-8", str(e.exception))

    def assert_line_refused(self, text: str, line: int, why: str) -> None:
        path = self.write_env(text, "bad.env")
        with self.assertRaises(ConfigError) as e:
            self.load(env_file=path)
        self.assertIn(f"{path}:{line}", str(e.exception))
        self.assertIn(why, str(e.exception))

    def test_malformed_line(self) -> None:
        self.assert_line_refused("# ok\nLCHAT_DATA_DIR=/d\njust words\n", 3, "NAME=VALUE")
        self.assert_line_refused("=value\n", 1, "NAME=VALUE")
        self.assert_line_refused("1LCHAT=x\n", 1, "NAME=VALUE")
        self.assert_line_refused("LCHAT-X=1\n", 1, "NAME=VALUE")
        self.assert_line_refused("export\n", 1, "NAME=VALUE")

    def test_unterminated_quote(self) -> None:
        self.assert_line_refused('LCHAT_DATA_DIR="/data\n', 1, "unterminated quote")
        self.assert_line_refused("\nLCHAT_DATA_DIR='/data\n", 2, "unterminated quote")

    def test_text_after_closing_quote(self) -> None:
        self.assert_line_refused('LCHAT_DATA_DIR="/data"x\n', 1, "after the closing quote")


class Defaults(Base):
    def test_space_commands_follow_the_build_tree(self) -> None:
        """LCHAT_OPT_DIR moves the default commands into its live/ (lchat deploy repoints there);
        it is no unknown variable, and a command given explicitly wins."""
        cfg = self.load({"LCHAT_OPT_DIR": "/srv/lchat builds/"})
        self.assertEqual(cfg.space_command, ("/srv/lchat builds/live/{host}",))
        self.assertEqual(cfg.sidecar_command, ("/srv/lchat builds/live/{host}-bot",))
        self.assertEqual(cfg.warnings, ())
        cfg = self.load({"LCHAT_OPT_DIR": "/srv/o", "LCHAT_SPACE_COMMAND": "/bin/x {host}"})
        self.assertEqual(cfg.space_command, ("/bin/x", "{host}"))
        self.assertEqual(cfg.sidecar_command, ("/srv/o/live/{host}-bot",))

    def test_a_host_without_a_live_link_runs_the_default_build(self) -> None:
        opt = self.mktemp()
        os.makedirs(os.path.join(opt, "live"))
        cfg = self.load({"LCHAT_OPT_DIR": opt})
        own = os.path.join(opt, "live", "a.example.com")
        self.assertEqual(space_argv(cfg.space_command, "a.example.com"), [own])  # as configured
        os.symlink("../versions/1/space", os.path.join(opt, "live", "_default"))
        default = os.path.join(opt, "live", "_default")
        self.assertEqual(space_argv(cfg.space_command, "a.example.com"), [default])
        bot = space_argv(cfg.sidecar_command, "a.example.com", sidecar=True)
        self.assertEqual(bot, [own + "-bot"])  # no default bot
        os.symlink("../versions/2/space", own)
        self.assertEqual(space_argv(cfg.space_command, "a.example.com"), [own])

    def test_defaults(self) -> None:
        cfg = self.load()
        self.assertEqual(cfg.env_file, self.env_file)
        self.assertEqual(cfg.data_dir, "/data")
        self.assertEqual(cfg.run_dir, "/run/lchat")
        self.assertEqual(cfg.registry, "/data/registry.db")
        self.assertEqual(cfg.acme_cache, "/data/acme")
        self.assertEqual(cfg.cert_cache, "dir")
        self.assertEqual(cfg.https_addr, "tcp:443")
        self.assertEqual(cfg.http_addr, "tcp:80")
        self.assertEqual(cfg.fallback_url, "")
        self.assertEqual(cfg.units, "builtin")
        self.assertEqual(cfg.space_command, ("/opt/lchat/live/{host}",))
        self.assertIsNone(cfg.hibernate)
        self.assertIsNone(cfg.mesh)
        self.assertEqual(cfg.wildcard_domains, ())
        self.assertEqual(cfg.warnings, ())
        self.assertEqual(cfg.admin_socket, "/run/lchat/router.sock")

    def test_units_auto(self) -> None:
        self.assertEqual(self.load(systemd_present=False).units, "builtin")
        self.assertEqual(self.load(systemd_present=True).units, "systemd")
        self.assertEqual(self.load({"LCHAT_UNITS": "auto"}, systemd_present=True).units, "systemd")

    def test_units_explicit(self) -> None:
        self.assertEqual(self.load({"LCHAT_UNITS": "systemd"}).units, "systemd")
        self.assertEqual(
            self.load({"LCHAT_UNITS": "builtin"}, systemd_present=True).units, "builtin"
        )

    def test_registry_follows_data_dir(self) -> None:
        cfg = self.load({"LCHAT_DATA_DIR": "/srv/lchat/"})
        self.assertEqual(cfg.data_dir, "/srv/lchat")
        self.assertEqual(cfg.registry, "/srv/lchat/registry.db")
        self.assertEqual(cfg.acme_cache, "/srv/lchat/acme")
        cfg = self.load({"LCHAT_DATA_DIR": "/srv/lchat", "LCHAT_REGISTRY": "/elsewhere/r.db"})
        self.assertEqual(cfg.registry, "/elsewhere/r.db")

    def test_relative_paths_become_absolute(self) -> None:
        cfg = self.load({"LCHAT_DATA_DIR": "data", "LCHAT_REGISTRY": "reg/r.db"})
        self.assertEqual(cfg.data_dir, os.path.abspath("data"))
        self.assertEqual(cfg.registry, os.path.abspath("reg/r.db"))

    def test_default_env_file_may_be_absent(self) -> None:
        # No explicit file: /data/router.env is read only if present; the test box has none,
        # or if it does, the call must still not fail for its absence.
        if os.path.exists(config.DEFAULT_ENV_FILE):
            raise unittest.SkipTest(f"{config.DEFAULT_ENV_FILE} exists on this machine")
        cfg = config.load(environ={}, systemd_present=False)
        self.assertEqual(cfg.env_file, config.DEFAULT_ENV_FILE)
        self.assertEqual(cfg.file_env, {})

    def test_example_env_file_loads(self) -> None:
        example = os.path.join(os.path.dirname(__file__), "..", "etc", "router.env.example")
        if not os.path.exists(example):
            raise unittest.SkipTest("etc/router.env.example not present")
        cfg = self.load(env_file=example)
        self.assertEqual(cfg.warnings, ())
        self.assertEqual(cfg.https_addr, "tcp:443")


class Precedence(Base):
    def test_file_then_environ_then_flags(self) -> None:
        env_file = self.write_env(
            "LCHAT_DATA_DIR=/from-file\nLCHAT_RUN_DIR=/run-file\nLCHAT_UNITS=systemd\n", "p.env"
        )
        cfg = self.load(env_file=env_file)
        self.assertEqual(
            (cfg.data_dir, cfg.run_dir, cfg.units), ("/from-file", "/run-file", "systemd")
        )
        cfg = self.load(
            {"LCHAT_DATA_DIR": "/from-environ", "LCHAT_UNITS": "builtin"}, env_file=env_file
        )
        self.assertEqual(
            (cfg.data_dir, cfg.run_dir, cfg.units), ("/from-environ", "/run-file", "builtin")
        )
        cfg = self.load(
            {"LCHAT_DATA_DIR": "/from-environ", "LCHAT_UNITS": "builtin"},
            flags={"LCHAT_DATA_DIR": "/from-flag", "LCHAT_UNITS": None},
            env_file=env_file,
        )
        # A flag left unset (None) does not mask the environment.
        self.assertEqual(
            (cfg.data_dir, cfg.run_dir, cfg.units), ("/from-flag", "/run-file", "builtin")
        )

    def test_only_lchat_names_are_settings(self) -> None:
        env_file = self.write_env(
            "PATH=/nowhere\nHOME=/home-only-in-env\nLCHAT_DATA_DIR=/d\n", "o.env"
        )
        cfg = self.load({"PATH": "/usr/bin", "SHELL": "/bin/sh"}, env_file=env_file)
        self.assertEqual(cfg.warnings, ())
        self.assertEqual(cfg.data_dir, "/d")
        # The whole file is kept for the children's environment.
        self.assertEqual(cfg.file_env["PATH"], "/nowhere")
        # The environment merged once: the file's values, the process environment winning.
        self.assertEqual(
            cfg.env,
            {
                "PATH": "/usr/bin",
                "HOME": "/home-only-in-env",
                "LCHAT_DATA_DIR": "/d",
                "SHELL": "/bin/sh",
            },
        )
        self.assertNotIn("/home-only-in-env", repr(cfg))  # (the temp path may hold "/x")

    def test_values_are_stripped(self) -> None:
        cfg = self.load({"LCHAT_UNITS": "  systemd \n", "LCHAT_HTTP_ADDR": " off "})
        self.assertEqual(cfg.units, "systemd")
        self.assertIsNone(cfg.http_addr)


class EnvFileSyntax(Base):
    def test_syntax(self) -> None:
        path = self.write_env(
            "\n".join(
                [
                    "# a comment",
                    "   # an indented comment",
                    "",
                    "   ",
                    "export LCHAT_DATA_DIR=/exported",
                    "export   LCHAT_RUN_DIR=/run/x",
                    'LCHAT_SPACE_COMMAND="/opt/space --host {host} # not a comment"',
                    "LCHAT_HIBERNATE_BUCKET='my-bucket' # trailing comment",
                    "LCHAT_HIBERNATE_REGION=eu-west-1                   # optional",
                    "LCHAT_HIBERNATE_PREFIX=prod\t# tab before the comment",
                    "LCHAT_HIBERNATE_ENDPOINT=http://127.0.0.1:9000/#frag",
                    "  LCHAT_HIBERNATE_IDLE = 90s  ",
                    "LCHAT_MESH_REGION=",
                    "OTHER=a=b=c",
                    'EMPTYQ=""',
                ]
            )
            + "\n",
            "syntax.env",
        )
        values = config.read_env_file(path)
        self.assertEqual(
            values,
            {
                "LCHAT_DATA_DIR": "/exported",
                "LCHAT_RUN_DIR": "/run/x",
                "LCHAT_SPACE_COMMAND": "/opt/space --host {host} # not a comment",
                "LCHAT_HIBERNATE_BUCKET": "my-bucket",
                "LCHAT_HIBERNATE_REGION": "eu-west-1",
                "LCHAT_HIBERNATE_PREFIX": "prod",
                "LCHAT_HIBERNATE_ENDPOINT": "http://127.0.0.1:9000/#frag",
                "LCHAT_HIBERNATE_IDLE": "90s",
                "LCHAT_MESH_REGION": "",
                "OTHER": "a=b=c",
                "EMPTYQ": "",
            },
        )
        cfg = self.load(env_file=path)
        self.assertEqual(cfg.data_dir, "/exported")
        self.assertEqual(
            cfg.space_command, ("/opt/space", "--host", "{host}", "#", "not", "a", "comment")
        )
        assert cfg.hibernate is not None
        self.assertEqual(cfg.hibernate.bucket, "my-bucket")
        self.assertEqual(cfg.hibernate.idle, 90.0)
        self.assertEqual(cfg.hibernate.endpoint, "http://127.0.0.1:9000/#frag")

    def test_seed_mesh_block(self) -> None:
        """The mesh guide's router.env lines, verbatim, including an empty value with a comment."""
        path = self.write_env(
            "LCHAT_HIBERNATE_BUCKET=my-hibernation-bucket # prerequisite: the mesh rides on the "
            "hibernation bucket\n"
            "LCHAT_MESH_SELF=https://box-1.example.net # this box\u2019s identity\n"
            "LCHAT_MESH_DOMAINS=11ch.example.com # comma-separated; ONLY hosts under these\n"
            "LCHAT_MESH_TOKEN= # authenticates route replication\n",
            "seed.env",
        )
        self.assertEqual(config.read_env_file(path)["LCHAT_MESH_TOKEN"], "")
        with self.assertRaises(ConfigError) as e:
            self.load(env_file=path)
        self.assertIn("LCHAT_MESH_TOKEN", str(e.exception))
        cfg = self.load({"LCHAT_MESH_TOKEN": "t0ken" * 7}, env_file=path)
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.self_url, "https://box-1.example.net")
        self.assertEqual(cfg.mesh.domains, ("11ch.example.com",))
        self.assertEqual(cfg.mesh.token, "t0ken" * 7)

    def test_hash_inside_an_unquoted_value(self) -> None:
        path = self.write_env("A=#not-a-comment\nB=x#y\nC= # comment only\n", "hash.env")
        self.assertEqual(config.read_env_file(path), {"A": "#not-a-comment", "B": "x#y", "C": ""})

    def test_later_line_wins(self) -> None:
        path = self.write_env("LCHAT_DATA_DIR=/a\nLCHAT_DATA_DIR=/b\n", "twice.env")
        self.assertEqual(self.load(env_file=path).data_dir, "/b")


class Durations(unittest.TestCase):
    def test_durations(self) -> None:
        for text, seconds in (
            ("15m", 900.0),
            ("90s", 90.0),
            ("1h30m", 5400.0),
            ("250ms", 0.25),
            ("1h", 3600.0),
            ("1d", 86400.0),
            ("1.5s", 1.5),
            ("2m30s", 150.0),
        ):
            self.assertAlmostEqual(config.parse_duration("X", text), seconds)

    def test_refusals_name_the_variable(self) -> None:
        for text in ("", "15", "abc", "1x", "m15", "15m ", "-1s"):
            with self.assertRaises(ConfigError) as e:
                config.parse_duration("LCHAT_SOMETHING", text)
            self.assertIn("LCHAT_SOMETHING", str(e.exception))


class Addresses(unittest.TestCase):
    def test_forms(self) -> None:
        for text, endpoint in (
            (":443", "tcp:443"),
            (":0", "tcp:0"),
            ("127.0.0.1:8080", "tcp:8080:interface=127.0.0.1"),
            ("0.0.0.0:80", "tcp:80:interface=0.0.0.0"),
            ("localhost:8080", "tcp:8080:interface=localhost"),
            ("[::1]:8443", r"tcp6:8443:interface=\:\:1"),
            ("[::]:443", r"tcp6:443:interface=\:\:"),
            ("tcp:8080:interface=127.0.0.1", "tcp:8080:interface=127.0.0.1"),
            ("tcp:8080", "tcp:8080"),
            ("tcp6:8080", "tcp6:8080"),
            ("unix:/run/lchat/x.sock", "unix:/run/lchat/x.sock"),
        ):
            self.assertEqual(config.parse_address("LCHAT_HTTP_ADDR", text), endpoint, text)

    def test_off(self) -> None:
        for text in ("off", "none", ""):
            self.assertIsNone(config.parse_address("LCHAT_HTTP_ADDR", text))

    def test_endpoint_type_is_never_an_interface(self) -> None:
        # "ssl:443" is an endpoint string; it must not turn into plain TCP on an interface "ssl".
        with self.assertRaises(ConfigError) as e:
            config.parse_address("LCHAT_HTTPS_ADDR", "ssl:443:privateKey=/nonexistent/key.pem")
        self.assertIn("LCHAT_HTTPS_ADDR", str(e.exception))


class ReachTheConfig(Base):
    def test_idle(self) -> None:
        for text, seconds in (("15m", 900.0), ("1h30m", 5400.0), ("250ms", 0.25)):
            cfg = self.load({"LCHAT_HIBERNATE_BUCKET": "bkt", "LCHAT_HIBERNATE_IDLE": text})
            assert cfg.hibernate is not None
            self.assertEqual(cfg.hibernate.idle, seconds)
        cfg = self.load({"LCHAT_HIBERNATE_BUCKET": "bkt", "LCHAT_HIBERNATE_PREFIX": "/prod/"})
        assert cfg.hibernate is not None
        self.assertEqual((cfg.hibernate.bucket, cfg.hibernate.prefix), ("bkt", "prod"))
        self.assertEqual(cfg.hibernate.idle, 900.0)

    def test_addresses(self) -> None:
        cfg = self.load({"LCHAT_HTTPS_ADDR": "off", "LCHAT_HTTP_ADDR": "[::1]:8080"})
        self.assertIsNone(cfg.https_addr)
        self.assertEqual(cfg.http_addr, r"tcp6:8080:interface=\:\:1")
        cfg = self.load(
            {
                "LCHAT_HTTPS_ADDR": "tcp:8443:interface=127.0.0.1",
                "LCHAT_HTTP_ADDR": "127.0.0.1:8080",
            }
        )
        self.assertEqual(cfg.https_addr, "tcp:8443:interface=127.0.0.1")
        self.assertEqual(cfg.http_addr, "tcp:8080:interface=127.0.0.1")

    def test_fallback_url(self) -> None:
        url = "https://example.com/where?x=1"
        self.assertEqual(self.load({"LCHAT_FALLBACK_URL": url}).fallback_url, url)


class Warnings(Base):
    def test_unknown_variable_warns(self) -> None:
        cfg = self.load({"LCHAT_FOO": "1", "LCHAT_ADMIN_TOKEN": "secret", "LCHAT_HOST": "x"})
        self.assertEqual(len(cfg.warnings), 1)
        self.assertIn("LCHAT_FOO", cfg.warnings[0])
        self.assertNotIn("LCHAT_ADMIN_TOKEN", " ".join(cfg.warnings))

    def test_unknown_in_file_and_flags(self) -> None:
        env_file = self.write_env("LCHAT_TYPO_DIR=/x\n", "w.env")
        cfg = self.load(flags={"LCHAT_BAR": "1"}, env_file=env_file)
        self.assertEqual(len(cfg.warnings), 2)
        self.assertIn("LCHAT_BAR", cfg.warnings[0])
        self.assertIn("LCHAT_TYPO_DIR", cfg.warnings[1])


class Secrets(Base):
    def test_mesh_token_not_in_repr(self) -> None:
        env_file = self.write_env(
            f"LCHAT_MESH_TOKEN={MESH_OK['LCHAT_MESH_TOKEN']}\nLCHAT_ADMIN_TOKEN=admin-secret-x\n",
            "secret.env",
        )
        environ = {k: v for k, v in MESH_OK.items() if k != "LCHAT_MESH_TOKEN"}
        cfg = self.load(environ, env_file=env_file)
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.token, MESH_OK["LCHAT_MESH_TOKEN"])
        for text in (repr(cfg), str(cfg), repr(cfg.mesh)):
            self.assertNotIn(MESH_OK["LCHAT_MESH_TOKEN"], text)
            self.assertNotIn("admin-secret-x", text)
        self.assertIn("box-1.example.net", repr(cfg))

    def test_mesh_ok(self) -> None:
        cfg = self.load({**MESH_OK, "LCHAT_MESH_SELF": "https://Box-1.example.net:8443/"})
        assert cfg.mesh is not None and cfg.hibernate is not None
        self.assertEqual(cfg.mesh.self_url, "https://Box-1.example.net:8443")
        self.assertEqual(cfg.hibernate.bucket, "my-hibernation-bucket")

    def test_domains_are_normalised(self) -> None:
        cfg = self.load(
            {
                **MESH_OK,
                "LCHAT_MESH_DOMAINS": " 11CH.Example.com., b\u00fccher.example ,",
                "LCHAT_WILDCARD_DOMAINS": "Example.NET",
                "LCHAT_DNSIMPLE_TOKEN": "t",
            }
        )
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.domains, ("11ch.example.com", "xn--bcher-kva.example"))
        self.assertEqual(cfg.wildcard_domains, ("example.net",))


class SpaceArgv(Base):
    def test_substitutes_host(self) -> None:
        cfg = self.load({"LCHAT_SPACE_COMMAND": "/opt/space --host={host} --db '/data/{host}.db'"})
        self.assertEqual(
            space_argv(cfg.space_command, "Chat.Example.com"),
            ["/opt/space", "--host=chat.example.com", "--db", "/data/chat.example.com.db"],
        )
        default = space_argv(self.load().space_command, "a.example.com")
        self.assertEqual(default, ["/opt/lchat/live/a.example.com"])

    def test_refuses_hostile_host(self) -> None:
        cfg = self.load()
        from lchat.hosts import InvalidHost

        for bad in ("../x", "a/b", "a\x00b.com", "x" * 300 + ".com"):
            self.assertRaises(InvalidHost, space_argv, cfg.space_command, bad)

    def test_config_is_immutable(self) -> None:
        cfg = self.load()
        with self.assertRaises(AttributeError):
            cfg.data_dir = "/elsewhere"  # type: ignore[misc]


class FrontDoor(Base):
    def test_defaults(self) -> None:
        cfg = self.load()
        self.assertEqual(cfg.proxy.dial_retry, 13.0)
        self.assertEqual(cfg.proxy.header_timeout, 10.0)
        self.assertEqual(cfg.proxy.keepalive_timeout, 60.0)
        self.assertEqual(cfg.proxy.upstream_timeout, 300.0)
        self.assertEqual(cfg.proxy.send_timeout, 60.0)
        self.assertEqual((cfg.proxy.max_header_bytes, cfg.proxy.max_headers), (65536, 100))
        self.assertEqual(cfg.proxy.tunnel_idle_timeout, 600.0)
        self.assertEqual(cfg.proxy.max_body, 100 * 1024 * 1024)
        self.assertFalse(cfg.proxy.access_log)
        self.assertTrue(cfg.http_redirect)
        self.assertIsNone(cfg.metrics_addr)

    def test_settings(self) -> None:
        cfg = self.load(
            {
                "LCHAT_DIAL_RETRY": "0s",
                "LCHAT_HEADER_TIMEOUT": "2s",
                "LCHAT_KEEPALIVE_TIMEOUT": "1m",
                "LCHAT_UPSTREAM_TIMEOUT": "1h",
                "LCHAT_SEND_TIMEOUT": "2m",
                "LCHAT_MAX_HEADER_BYTES": "8192",
                "LCHAT_MAX_HEADERS": "50",
                "LCHAT_TUNNEL_IDLE_TIMEOUT": "90s",
                "LCHAT_MAX_BODY": "8MiB",
                "LCHAT_TLS_FIRST_CONTACT_WAIT": "3s",
                "LCHAT_ACCESS_LOG": "on",
                "LCHAT_HTTP_REDIRECT": "off",
                "LCHAT_METRICS_ADDR": "127.0.0.1:9100",
            }
        )
        self.assertEqual(cfg.proxy.dial_retry, 0.0)
        self.assertEqual(cfg.proxy.header_timeout, 2.0)
        self.assertEqual(cfg.proxy.upstream_timeout, 3600.0)
        self.assertEqual(cfg.proxy.send_timeout, 120.0)
        self.assertEqual((cfg.proxy.max_header_bytes, cfg.proxy.max_headers), (8192, 50))
        self.assertEqual(cfg.proxy.tunnel_idle_timeout, 90.0)
        self.assertEqual(cfg.proxy.max_body, 8 * 1024 * 1024)
        self.assertEqual(cfg.proxy.first_contact_wait, 3.0)
        self.assertEqual(self.load({}).proxy.first_contact_wait, 10.0)
        self.assertEqual(
            self.load({"LCHAT_TLS_FIRST_CONTACT_WAIT": "0s"}).proxy.first_contact_wait, 0.0
        )
        self.assertTrue(cfg.proxy.access_log)
        self.assertFalse(cfg.http_redirect)
        self.assertEqual(cfg.metrics_addr, "tcp:9100:interface=127.0.0.1")

    def test_refusals_name_the_variable(self) -> None:
        for name, value in (
            ("LCHAT_HEADER_TIMEOUT", "0s"),
            ("LCHAT_KEEPALIVE_TIMEOUT", "soon"),
            ("LCHAT_UPSTREAM_TIMEOUT", "-1s"),
            ("LCHAT_SEND_TIMEOUT", "0s"),
            ("LCHAT_SEND_TIMEOUT", "1 minute"),
            ("LCHAT_DIAL_RETRY", "13"),
            ("LCHAT_MAX_HEADER_BYTES", "10"),
            ("LCHAT_MAX_HEADER_BYTES", "lots"),
            ("LCHAT_MAX_HEADERS", "100000"),
            ("LCHAT_TUNNEL_IDLE_TIMEOUT", "0s"),
            ("LCHAT_TUNNEL_IDLE_TIMEOUT", "600"),
            ("LCHAT_MAX_BODY", "lots"),
            ("LCHAT_MAX_BODY", "-1"),
            ("LCHAT_MAX_BODY", "100MB"),
            ("LCHAT_MAX_BODY", "1.5M"),
            ("LCHAT_MAX_BODY", "100 MiB"),
            ("LCHAT_MAX_BODY", "99999999999G"),
            ("LCHAT_TLS_FIRST_CONTACT_WAIT", "10"),
            ("LCHAT_ACCESS_LOG", "yes"),
            ("LCHAT_HTTP_REDIRECT", "maybe"),
            ("LCHAT_METRICS_ADDR", ":99999"),
        ):
            self.refuses(name, {name: value})

    def test_max_body_sizes(self) -> None:
        """Plain bytes or binary multiples, as nginx's client_max_body_size; 0 = no limit."""
        for text, size in (
            ("0", 0),
            ("1048576", 1 << 20),
            ("512k", 512 << 10),
            ("512K", 512 << 10),
            ("512KiB", 512 << 10),
            ("100m", 100 << 20),
            ("100M", 100 << 20),
            ("100MiB", 100 << 20),
            ("2g", 2 << 30),
            ("2G", 2 << 30),
            ("2GiB", 2 << 30),
        ):
            self.assertEqual(self.load({"LCHAT_MAX_BODY": text}).proxy.max_body, size, text)

    def test_new_front_door_variables_are_known(self) -> None:
        cfg = self.load(
            {
                "LCHAT_TUNNEL_IDLE_TIMEOUT": "10m",
                "LCHAT_MAX_BODY": "100MiB",
                "LCHAT_TLS_FIRST_CONTACT_WAIT": "10s",
            }
        )
        self.assertEqual(cfg.warnings, ())


class Sizes(unittest.TestCase):
    def test_refusals_name_the_variable(self) -> None:
        for text in ("", "k", "1KB", "1 k", "0x10", "1e6", "\u0661\u0660", "-5", "5.0"):
            with self.assertRaises(ConfigError, msg=text) as e:
                parse_size("LCHAT_X", text)
            self.assertIn("LCHAT_X", str(e.exception))


class Bucket(Base):
    def test_file_bucket_and_s3_names(self) -> None:
        cfg = self.load({"LCHAT_HIBERNATE_BUCKET": "file:rel/dir", "LCHAT_HIBERNATE_PREFIX": "p"})
        assert cfg.hibernate is not None
        self.assertTrue(cfg.hibernate.where.is_file)
        self.assertEqual(cfg.hibernate.bucket, "file:" + os.path.abspath("rel/dir"))
        self.assertEqual(
            cfg.hibernate.key("a.example.com", "lock.json"), "p/a.example.com/lock.json"
        )
        self.assertEqual(cfg.hibernate.lease_ttl, 900.0)
        cfg = self.load({"LCHAT_HIBERNATE_BUCKET": "my.bucket-1", "LCHAT_LEASE_TTL": "30s"})
        assert cfg.hibernate is not None
        self.assertFalse(cfg.hibernate.where.is_file)
        self.assertEqual(cfg.hibernate.key("x"), "x")
        self.assertEqual(cfg.hibernate.lease_ttl, 30.0)

    def test_refusals(self) -> None:
        for env, variable in (
            ({"LCHAT_HIBERNATE_BUCKET": "Bad_Bucket"}, "LCHAT_HIBERNATE_BUCKET"),
            ({"LCHAT_HIBERNATE_BUCKET": "file:"}, "LCHAT_HIBERNATE_BUCKET"),
            (
                {"LCHAT_HIBERNATE_BUCKET": "bkt", "LCHAT_HIBERNATE_ENDPOINT": "s3.local"},
                "LCHAT_HIBERNATE_ENDPOINT",
            ),
            ({"LCHAT_LEASE_TTL": "2s"}, "LCHAT_LEASE_TTL"),
            ({"LCHAT_LEASE_TTL": "forever"}, "LCHAT_LEASE_TTL"),
        ):
            self.refuses(variable, env)


class AwsCredentialsInTheEnvFile(Base):
    def test_aws_variables_of_the_env_file_are_kept_for_the_s3_client(self) -> None:
        self.env_file = self.write_env(
            "LCHAT_HIBERNATE_BUCKET=b-1\nAWS_ACCESS_KEY_ID=AKIA1\nAWS_SECRET_ACCESS_KEY=s\nOTHER=x\n"
        )
        cfg = self.load()
        self.assertEqual(cfg.aws_env, {"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s"})
        self.assertEqual(cfg.warnings, ())


class MeshTiming(Base):
    def test_dead_after_must_cover_two_beats(self) -> None:
        base = {
            "LCHAT_HIBERNATE_BUCKET": "b-1",
            "LCHAT_MESH_SELF": "https://box-1.example.net",
            "LCHAT_MESH_DOMAINS": "example.com",
            "LCHAT_MESH_TOKEN": "t" * 32,
        }
        cfg = self.load(base)
        assert cfg.mesh is not None
        self.assertEqual((cfg.mesh.heartbeat, cfg.mesh.dead_after), (15.0, 45.0))
        self.assertEqual(cfg.mesh.self_host, "box-1.example.net")
        self.refuses(
            "LCHAT_MESH_DEAD_AFTER",
            {**base, "LCHAT_MESH_HEARTBEAT": "10s", "LCHAT_MESH_DEAD_AFTER": "15s"},
        )
        self.refuses("LCHAT_MESH_CA_FILE", {**base, "LCHAT_MESH_CA_FILE": "/nonexistent.pem"})

    def test_region_failover_is_off_unless_consented_and_never_before_dead_after(self) -> None:
        base = {
            "LCHAT_HIBERNATE_BUCKET": "b-1",
            "LCHAT_MESH_SELF": "https://box-1.example.net",
            "LCHAT_MESH_DOMAINS": "example.com",
            "LCHAT_MESH_TOKEN": "t" * 32,
        }
        for given, after in (("", None), ("off", None), ("OFF", None), ("5m", 300.0)):
            env = {**base, "LCHAT_REGION_FAILOVER_AFTER": given} if given else base
            cfg = self.load(env)
            assert cfg.mesh is not None
            self.assertEqual(cfg.mesh.region_failover_after, after, given)
        cfg = self.load({**base, "LCHAT_REGION_FAILOVER_AFTER": "45s"})  # equal: allowed
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.region_failover_after, 45.0)
        with self.assertRaises(ConfigError) as e:
            self.load({**base, "LCHAT_REGION_FAILOVER_AFTER": "30s"})
        self.assertIn("LCHAT_REGION_FAILOVER_AFTER=30s", str(e.exception))
        self.assertIn("LCHAT_MESH_DEAD_AFTER=45s", str(e.exception))
        self.refuses("LCHAT_REGION_FAILOVER_AFTER", {**base, "LCHAT_REGION_FAILOVER_AFTER": "soon"})
        # Consent where it can do nothing is said at start: no foreign-bucket region, no mesh.
        (warning,) = self.load({**base, "LCHAT_REGION_FAILOVER_AFTER": "5m"}).warnings
        self.assertIn("LCHAT_REGION_FAILOVER_AFTER=5m has no effect: LCHAT_REGION_BUCKETS", warning)
        (warning,) = self.load(
            {"LCHAT_HIBERNATE_BUCKET": "b-1", "LCHAT_REGION_FAILOVER_AFTER": "5m"}
        ).warnings
        self.assertIn("without the mesh", warning)
        cfg = self.load(
            {
                **base,
                "LCHAT_MESH_REGION": "ie",
                "LCHAT_REGION_BUCKETS": "fi=s3://fi-bucket/prod",
                "LCHAT_REGION_FAILOVER_AFTER": "5m",
            }
        )
        self.assertEqual(cfg.warnings, ())
        self.assertEqual(self.load(base).warnings, ())


class MeshChecks(Base):
    base = {
        "LCHAT_HIBERNATE_BUCKET": "b-1",
        "LCHAT_MESH_SELF": "HTTPS://Box-1.Example.NET:443/",
        "LCHAT_MESH_DOMAINS": "example.com",
        "LCHAT_MESH_TOKEN": "t" * 32,
    }

    def test_box_id_is_the_normalised_self_url(self) -> None:
        self.assertEqual(self.load(self.base).box_id, "https://box-1.example.net")

    def test_region_is_checked(self) -> None:
        self.refuses("LCHAT_MESH_REGION", {**self.base, "LCHAT_MESH_REGION": "eu west"})
        cfg = self.load({**self.base, "LCHAT_MESH_REGION": "eu-west-1"})
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.region, "eu-west-1")

    def test_plain_http_self_needs_the_redirect_off(self) -> None:
        plain = {**self.base, "LCHAT_MESH_SELF": "http://10.0.0.5:8080"}
        self.refuses("LCHAT_HTTP_REDIRECT", plain)
        self.assertIsNotNone(self.load({**plain, "LCHAT_HTTP_REDIRECT": "off"}).mesh)
        self.refuses("LCHAT_MESH_SELF", {**self.base, "LCHAT_MESH_SELF": "https://u:p@box"})


class Backup(Base):
    def test_absent_means_no_backup(self) -> None:
        self.assertIsNone(self.load({}).backup)

    def test_settings_and_defaults(self) -> None:
        cfg = self.load(
            {
                "LCHAT_BACKUP_BUCKET": "fleet-backup",
                "LCHAT_BACKUP_PREFIX": "/boxes/",
                "LCHAT_BACKUP_REGION": "eu-west-1",
                "LCHAT_BACKUP_ENDPOINT": "https://s3.example.net/",
                "LCHAT_BACKUP_EXTRA": "home.db, services/*.db",
            }
        )
        backup = cfg.backup
        assert backup is not None
        self.assertEqual(
            (backup.bucket, backup.prefix, backup.region, backup.endpoint),
            ("fleet-backup", "boxes", "eu-west-1", "https://s3.example.net"),
        )
        self.assertEqual(backup.interval, 10.0)
        self.assertEqual(backup.extra, ("*.db", "home.db", "services/*.db"))
        self.assertEqual(backup.box, socket.gethostname())
        self.assertEqual(backup.key("b", "x.db"), "boxes/b/x.db")

    def test_every_top_level_database_unless_none(self) -> None:
        for given, extra in (
            ("", ("*.db",)),
            ("none", ()),
            ("none, services/*.db", ("services/*.db",)),
            ("*.db services/*.db", ("*.db", "services/*.db")),
        ):
            backup = self.load({"LCHAT_BACKUP_BUCKET": "b-1", "LCHAT_BACKUP_EXTRA": given}).backup
            assert backup is not None
            self.assertEqual(backup.extra, extra, given)

    def test_the_env_policy_has_one_value(self) -> None:
        backup = self.load({"LCHAT_BACKUP_BUCKET": "b-1"}).backup
        assert backup is not None
        self.assertFalse(backup.env_unprotected)
        backup = self.load({"LCHAT_BACKUP_BUCKET": "b-1", "LCHAT_BACKUP_ENV": "unprotected"}).backup
        assert backup is not None
        self.assertTrue(backup.env_unprotected)
        with self.assertRaises(ConfigError) as e:
            self.load({"LCHAT_BACKUP_BUCKET": "b-1", "LCHAT_BACKUP_ENV": "off"})
        self.assertIn("LCHAT_BACKUP_ENV='off'", str(e.exception))

    def test_the_box_is_the_mesh_host_or_named(self) -> None:
        mesh = {
            "LCHAT_HIBERNATE_BUCKET": "hib",
            "LCHAT_MESH_SELF": "https://box7.example.net",
            "LCHAT_MESH_DOMAINS": "example.net",
            "LCHAT_MESH_TOKEN": "t" * 32,
            "LCHAT_BACKUP_BUCKET": "fleet-backup",
        }
        cfg = self.load(mesh)
        assert cfg.backup is not None
        self.assertEqual(cfg.backup.box, "box7.example.net")
        cfg = self.load({**mesh, "LCHAT_BACKUP_BOX": "rack-3"})
        assert cfg.backup is not None
        self.assertEqual(cfg.backup.box, "rack-3")

    def test_a_shared_bucket_needs_a_prefix_of_its_own(self) -> None:
        shared = {"LCHAT_HIBERNATE_BUCKET": "one", "LCHAT_BACKUP_BUCKET": "one"}
        for prefix in ("", "spaces", "spaces/backup"):
            with self.assertRaises(ConfigError, msg=prefix) as e:
                self.load(
                    {**shared, "LCHAT_HIBERNATE_PREFIX": "spaces", "LCHAT_BACKUP_PREFIX": prefix}
                )
            self.assertIn("LCHAT_BACKUP_PREFIX", str(e.exception))
        cfg = self.load(
            {**shared, "LCHAT_HIBERNATE_PREFIX": "spaces", "LCHAT_BACKUP_PREFIX": "backup"}
        )
        assert cfg.backup is not None
        self.assertEqual(cfg.backup.prefix, "backup")
        # Another endpoint is another bucket, whatever its name.
        other = {**shared, "LCHAT_BACKUP_ENDPOINT": "http://127.0.0.1:9000"}
        self.assertIsNotNone(self.load(other).backup)

    def test_refusals_name_the_variable(self) -> None:
        for env, variable in (
            ({"LCHAT_BACKUP_BUCKET": "Bad_Bucket"}, "LCHAT_BACKUP_BUCKET"),
            ({"LCHAT_BACKUP_BUCKET": "file:"}, "LCHAT_BACKUP_BUCKET"),
            (
                {"LCHAT_BACKUP_BUCKET": "b-1", "LCHAT_BACKUP_ENDPOINT": "s3.local"},
                "LCHAT_BACKUP_ENDPOINT",
            ),
            (
                {"LCHAT_BACKUP_BUCKET": "b-1", "LCHAT_BACKUP_PREFIX": "a/../b"},
                "LCHAT_BACKUP_PREFIX",
            ),
            ({"LCHAT_BACKUP_BUCKET": "b-1", "LCHAT_BACKUP_BOX": "a/b"}, "LCHAT_BACKUP_BOX"),
            ({"LCHAT_BACKUP_BUCKET": "b-1", "LCHAT_BACKUP_BOX": ".lchat"}, "LCHAT_BACKUP_BOX"),
            ({"LCHAT_BACKUP_INTERVAL": "0s"}, "LCHAT_BACKUP_INTERVAL"),
            ({"LCHAT_BACKUP_INTERVAL": "often"}, "LCHAT_BACKUP_INTERVAL"),
            ({"LCHAT_BACKUP_EXTRA": "/etc/*.db"}, "LCHAT_BACKUP_EXTRA"),
            ({"LCHAT_BACKUP_EXTRA": "../other/*.db"}, "LCHAT_BACKUP_EXTRA"),
        ):
            with self.assertRaises(ConfigError, msg=str(env)) as e:
                self.load(env)
            self.assertIn(variable, str(e.exception))


class Workers(Base):
    """LCHAT_WORKERS: how many data-plane processes a box runs (1: one process, as before)."""

    def test_auto_is_one_per_core_this_process_may_use(self) -> None:
        cores = len(os.sched_getaffinity(0))
        self.assertEqual(self.load().workers, min(cores, 64))
        self.assertEqual(self.load({"LCHAT_WORKERS": "auto"}).workers, min(cores, 64))
        self.assertEqual(self.load({"LCHAT_WORKERS": " AUTO "}).workers, min(cores, 64))

    def test_auto_is_capped(self) -> None:
        from lchat.config.box import MAX_AUTO_WORKERS, _workers

        self.assertEqual(MAX_AUTO_WORKERS, 64)
        self.assertEqual(_workers("auto", cores=200), 64)
        self.assertEqual(_workers("auto", cores=3), 3)
        self.assertEqual(_workers("auto", cores=0), 1)  # never none at all

    def test_a_number(self) -> None:
        for text, n in (("1", 1), ("2", 2), ("4", 4), ("256", 256), ("07", 7)):
            self.assertEqual(self.load({"LCHAT_WORKERS": text}).workers, n, text)
        self.assertEqual(self.load(flags={"LCHAT_WORKERS": "3"}).workers, 3)

    def test_refused_naming_the_variable(self) -> None:
        for value in ("0", "-1", "x", "1000", "257", "1.5", "", "2 workers", "\x00"):
            message = self.refuses("LCHAT_WORKERS", {"LCHAT_WORKERS": value})
            self.assertIn("auto", message)

    def test_a_config_built_by_hand_is_one_process(self) -> None:
        field = next(f for f in BoxConfig.__attrs_attrs__ if f.name == "workers")
        self.assertEqual(field.default, 1)

    def test_not_an_unknown_variable(self) -> None:
        self.assertEqual(self.load({"LCHAT_WORKERS": "2"}).warnings, ())


class Settings(Base):
    """BoxConfig.settings: every LCHAT_* value as merged, what a worker process is handed."""

    def test_merged_with_precedence_and_flags(self) -> None:
        env_file = self.write_env(
            "LCHAT_DATA_DIR=/from-file\nLCHAT_RUN_DIR=/run-file\nAWS_REGION=eu-west-1\n", "s.env"
        )
        cfg = self.load(
            {"LCHAT_DATA_DIR": "/from-environ", "LCHAT_UNITS": "builtin", "HOME": "/root"},
            flags={"LCHAT_UNITS": "systemd", "LCHAT_HTTPS_ADDR": None, "LCHAT_WORKERS": "2"},
            env_file=env_file,
        )
        self.assertEqual(
            dict(cfg.settings),
            {
                "LCHAT_DATA_DIR": "/from-environ",
                "LCHAT_RUN_DIR": "/run-file",
                "LCHAT_UNITS": "systemd",
                "LCHAT_WORKERS": "2",
            },
        )

    def test_loading_the_settings_again_gives_the_same_config(self) -> None:
        """What a worker does with them: load them with no env file of its own."""
        env_file = self.write_env("LCHAT_HTTP_ADDR=:8080\nLCHAT_MAX_BODY=1MiB\n", "w.env")
        cfg = self.load({"LCHAT_WORKERS": "3", **MESH_OK}, env_file=env_file)
        again = config.load(env_file=os.devnull, environ=cfg.settings, systemd_present=False)
        self.assertEqual(again.settings, cfg.settings)
        self.assertEqual((again.workers, again.http_addr), (3, "tcp:8080"))
        self.assertEqual(again.proxy, cfg.proxy)
        self.assertEqual(again.mesh, cfg.mesh)

    def test_never_in_a_repr(self) -> None:
        cfg = self.load({**MESH_OK})
        self.assertEqual(cfg.settings["LCHAT_MESH_TOKEN"], MESH_OK["LCHAT_MESH_TOKEN"])
        self.assertNotIn(MESH_OK["LCHAT_MESH_TOKEN"], repr(cfg))
        self.assertNotIn("settings", repr(cfg))
