"""The home service's settings (lchat.home.config): defaults, the order of sources, and every
refusal naming its variable."""

from __future__ import annotations

import os
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from lchat.config import ConfigError
from lchat.home import config


def load(**env: str) -> config.HomeConfig:
    return config.load(env_file=os.devnull, environ=env)


class HomeConfigTests(SynchronousTestCase):
    def test_zero_config_is_sqlite_on_the_data_dir(self) -> None:
        cfg = load(LCHAT_DATA_DIR="/srv/d", LCHAT_RUN_DIR="/srv/r")
        self.assertEqual(cfg.store, "sqlite")
        self.assertEqual(cfg.db, "/srv/d/home.db")
        self.assertEqual(
            (cfg.socket, cfg.admin_socket), ("/srv/r/home.sock", "/srv/r/home-admin.sock")
        )
        self.assertIsNone(cfg.tcp)
        self.assertEqual((cfg.origins, cfg.rp_id), (("https://home.localhost",), "home.localhost"))
        self.assertEqual(cfg.session_key, "")

    def test_sources_in_order_file_environment_flags(self) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".env") as f:
            f.write("LCHAT_HOME_TCP=127.0.0.1:9001\nLCHAT_HOME_RP_NAME=from-file\nAWS_REGION=x\n")
            f.flush()
            cfg = config.load(
                env_file=f.name,
                environ={"LCHAT_HOME_TCP": "127.0.0.1:9002"},
                flags={"LCHAT_HOME_TCP": ":9003", "LCHAT_HOME_STORE": None},
            )
        self.assertEqual(cfg.tcp, ("127.0.0.1", 9003))
        self.assertEqual(cfg.rp_name, "from-file")
        self.assertEqual(cfg.aws_env, {"AWS_REGION": "x"})

    def test_s3_settings(self) -> None:
        cfg = load(
            LCHAT_HOME_STORE="S3",
            LCHAT_HOME_S3_BUCKET="home-bucket",
            LCHAT_HOME_S3_REGION="eu-west-1",
            LCHAT_HOME_S3_PREFIX="/prod/home/",
            LCHAT_HOME_S3_ENDPOINT="http://127.0.0.1:9000/",
        )
        assert cfg.s3 is not None
        self.assertEqual(
            (cfg.store, cfg.s3.bucket, cfg.s3.s3_region, cfg.s3.prefix, cfg.s3.endpoint),
            ("s3", "home-bucket", "eu-west-1", "prod/home", "http://127.0.0.1:9000"),
        )

    def test_origins_and_the_relying_party(self) -> None:
        cfg = load(
            LCHAT_HOME_ORIGINS="https://home.example.com, https://app.example.com/",
            LCHAT_HOME_RP_ID="Example.com",
        )
        self.assertEqual(cfg.origins, ("https://home.example.com", "https://app.example.com"))
        self.assertEqual(cfg.rp_id, "example.com")
        self.assertEqual(load(LCHAT_HOME_ORIGINS="http://localhost:8080").rp_id, "localhost")

    def refused(self, fragment: str, **env: str) -> None:
        with self.assertRaises(ConfigError) as e:
            load(**env)
        self.assertIn(fragment, str(e.exception))

    def test_refusals_name_the_variable(self) -> None:
        self.refused("LCHAT_HOME_STORE='postgres'", LCHAT_HOME_STORE="postgres")
        self.refused("needs LCHAT_HOME_S3_BUCKET and LCHAT_HOME_S3_REGION", LCHAT_HOME_STORE="s3")
        self.refused(
            "LCHAT_HOME_S3_BUCKET='Bad_Bucket'",
            LCHAT_HOME_STORE="s3",
            LCHAT_HOME_S3_BUCKET="Bad_Bucket",
            LCHAT_HOME_S3_REGION="r",
        )
        self.refused(
            "LCHAT_HOME_S3_ENDPOINT",
            LCHAT_HOME_STORE="s3",
            LCHAT_HOME_S3_BUCKET="home-bucket",
            LCHAT_HOME_S3_REGION="r",
            LCHAT_HOME_S3_ENDPOINT="ftp://x",
        )
        self.refused("LCHAT_HOME_TCP='nonsense'", LCHAT_HOME_TCP="nonsense")
        self.refused("LCHAT_HOME_TCP=':70000'", LCHAT_HOME_TCP=":70000")
        self.refused("LCHAT_DATA_DIR='relative'", LCHAT_DATA_DIR="relative")
        self.refused("LCHAT_HOME_DB='home.db'", LCHAT_HOME_DB="home.db")
        self.refused(
            "must differ", LCHAT_HOME_SOCKET="/r/a.sock", LCHAT_HOME_ADMIN_SOCKET="/r/a.sock"
        )
        self.refused("at most 107 bytes", LCHAT_HOME_SOCKET="/" + "x" * 120)
        self.refused("LCHAT_HOME_ORIGINS is empty", LCHAT_HOME_ORIGINS=" , ")
        self.refused("is not an origin", LCHAT_HOME_ORIGINS="https://home.example.com/path")
        self.refused("only on localhost", LCHAT_HOME_ORIGINS="http://home.example.com")
        self.refused(
            "not 'home.example.com' or a parent domain",
            LCHAT_HOME_ORIGINS="https://home.example.com",
            LCHAT_HOME_RP_ID="other.example",
        )

    def test_revocation_poll(self) -> None:
        self.assertEqual(load().revocation_poll, 5.0)
        self.assertEqual(load(LCHAT_HOME_REVOCATION_POLL="0.5").revocation_poll, 0.5)
        for bad in ("0", "-1", "soon", "301", "nan"):
            self.refused(f"LCHAT_HOME_REVOCATION_POLL={bad!r}", LCHAT_HOME_REVOCATION_POLL=bad)
