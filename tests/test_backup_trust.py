"""``lchat backup restore --all`` trusts nothing the bucket says (issue 29, items 3 and 10).

Two attackers: whoever can write the backup bucket but holds no key (they can plant any object
under the prefix, and put back any object they once saw), and code running as the service user
(a compromised space: it writes the data dir a root-run restore writes into, so it can plant
links there and swap files between two of root's steps). The bucket is moto's S3
(tests/s3servers.py); replicas are written by the real replicator, env files sealed by the real
:mod:`lchat.backup.envfiles`; the restore is the real command's core, as tests/test_cli_backup.py
runs it. The link tests run as root (as the machine runs tests) and check a file standing in for
``/etc/passwd``, outside the data dir: its content, owner and mode never change.
"""

from __future__ import annotations

import base64
import os
import stat
import tempfile
import threading
import time

from twisted.trial.unittest import SkipTest

from lchat import files, hosts
from lchat.backup import envfiles
from lchat.backup.layout import Layout
from lchat.registry import Registry, Route
from tests import s3servers
from tests.test_cli_backup import BOX, HOST, PREFIX, BackupCliCase, bodies, make_db

KEY = b"k" * 32
OTHER_BOX = "boxb"
PASSWD = b"root:x:0:0:root:/root:/bin/bash\n"


def _there(directory: str, name: str) -> bool:
    return os.path.lexists(os.path.join(directory, name))


def _read(directory: str, name: str) -> bytes:
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


class TrustCase(BackupCliCase):
    timeout = 60

    async def setUpS3(self) -> None:
        self.server = await s3servers.shared_server("moto")
        self.s3_bucket = await self.server.new_bucket()
        self.configure(
            LCHAT_BACKUP_BUCKET=self.s3_bucket,
            LCHAT_BACKUP_ENDPOINT=self.server.endpoint,
            LCHAT_BACKUP_REGION=self.server.region,
            LCHAT_BACKUP_KEY=base64.b64encode(KEY).decode(),
            AWS_ACCESS_KEY_ID=self.server.credentials.access_key,
            AWS_SECRET_ACCESS_KEY=self.server.credentials.secret_key,
            AWS_EC2_METADATA_DISABLED="true",
        )
        self.store = s3servers.store_for(self.server, self.s3_bucket)
        self.addCleanup(self.store.close)
        self.into = os.path.join(self.root, "new")
        os.mkdir(self.into)

    async def a_box(self, *extra_rows: Route) -> None:
        """This box's registry (HOST, plus ``extra_rows``) and HOST's database, backed up."""
        self.add_row(HOST)
        for row in extra_rows:
            self.registry.insert(row)
        make_db(hosts.db_path(self.data_dir, HOST), HOST)
        await self.backed_up(self.registry.path)
        await self.backed_up(hosts.db_path(self.data_dir, HOST))

    async def put_env(
        self, name: str, content: bytes, generation: int, *, box: str = BOX, sealed_as: str = ""
    ) -> None:
        """Put ``name`` under this box's ``.env/``, sealed for ``sealed_as`` of ``box``."""
        place = Layout(PREFIX, box)
        blob = envfiles.seal(place, sealed_as or name, content, KEY, generation)
        await self.store.put(envfiles.key_for(Layout(PREFIX, BOX).box_path(), name), blob)

    async def put_manifest(self, files_: dict[str, int], generation: int = 10**18) -> None:
        place = Layout(PREFIX, BOX)
        blob = envfiles.seal_manifest(place, envfiles.Manifest(generation, files_), KEY)
        await self.store.put(envfiles.manifest_key(place.box_path()), blob)


class RegistryTests(TrustCase):
    async def test_a_row_naming_the_admin_socket_or_another_path_gets_the_derived_paths(
        self,
    ) -> None:
        await self.setUpS3()
        admin = os.path.join(self.run_dir, "router.sock")
        elsewhere = os.path.join(self.root, "etc", "passwd")
        await self.a_box(
            Route(
                host="b.example.com",
                kind="instance",
                socket=admin,  # public requests for b would reach the admin API
                db_path=elsewhere,
                status="ready",
                hibernate=True,
            ),
            Route(host="svc.example.com", kind="service", socket=admin, status="ready"),
        )
        result = await self.lchat("backup", "restore", "--all", "--into", self.into)
        self.assertEqual(result.code, 0, result)
        rows = {
            r.host: r for r in Registry(os.path.join(self.into, "registry.db"), time.time).load()
        }
        self.assertEqual(sorted(rows), [HOST, "b.example.com"])  # the service row is gone
        for host, row in rows.items():
            self.assertEqual(row.socket, hosts.socket_path(self.run_dir, host))
            self.assertEqual(row.db_path, hosts.db_path(self.into, host))
        self.assertIn(f"b.example.com: the backup's row names socket {admin}", result.out)
        self.assertIn(f"b.example.com: the backup's row names database {elsewhere}", result.out)
        self.assertIn("svc.example.com: a service row", result.out)
        self.assertIn("lchat add-service svc.example.com --socket PATH", result.out)
        self.assertEqual(bodies(hosts.db_path(self.into, HOST)), [HOST])


class PlantedObjectTests(TrustCase):
    async def test_planted_env_and_pem_replicas_are_not_restored(self) -> None:
        await self.setUpS3()
        await self.a_box()
        planted = os.path.join(self.root, "planted.db")
        make_db(planted, "LCHAT_ADMIN_TOKEN=attacker")
        for name in (f"{HOST}.env", "evil.env", "default.pem", "x.pem"):
            await self.backed_up(planted, name)
        home = os.path.join(self.data_dir, "home.db")
        make_db(home, "home")
        await self.backed_up(home)  # an extra with a .db name still comes back

        result = await self.lchat("backup", "restore", "--all", "--into", self.into)
        self.assertEqual(result.code, 0, result)
        self.assertEqual(
            sorted(os.listdir(self.into)), sorted(["registry.db", f"{HOST}.db", "home.db"])
        )
        for name in (f"{HOST}.env", "evil.env", "default.pem", "x.pem"):
            self.assertIn(f"{name}: not restored (only .db names", result.out)
        self.assertEqual(bodies(os.path.join(self.into, "home.db")), ["home"])


class SealedEnvTests(TrustCase):
    async def test_an_env_file_swapped_from_another_file_or_box_does_not_open(self) -> None:
        await self.setUpS3()
        await self.a_box()
        env, bot = f"{HOST}.env", f"{HOST}-bot.env"
        await self.put_env(env, b"LCHAT_ADMIN_TOKEN=boxb\n", 5, box=OTHER_BOX)
        await self.put_env(bot, b"LCHAT_ADMIN_TOKEN=another\n", 5, sealed_as="c.example.com.env")
        await self.put_manifest({env: 5, bot: 5})

        result = await self.lchat("backup", "restore", "--all", "--into", self.into)
        for name in (env, bot):
            self.assertIn(
                f"note: {name} (box {BOX}, prefix {PREFIX}): cannot open it with "
                f"LCHAT_BACKUP_KEY: another key sealed it, or it was sealed for another file, "
                f"box or prefix and moved here",
                result.out,
            )
            self.assertFalse(_there(self.into, name))

    async def test_a_rolled_back_env_file_is_refused(self) -> None:
        await self.setUpS3()
        await self.a_box()
        env = f"{HOST}.env"
        old_gen, new_gen = 1_700_000_000 * 10**9, 1_700_000_100 * 10**9
        await self.put_env(env, b"LCHAT_ADMIN_TOKEN=new\n", new_gen)
        await self.put_manifest({env: new_gen})
        # What a bucket writer saw earlier, put back over the newest.
        await self.put_env(env, b"LCHAT_ADMIN_TOKEN=old\n", old_gen)

        result = await self.lchat("backup", "restore", "--all", "--into", self.into)
        self.assertIn(
            f"{env} (box {BOX}, prefix {PREFIX}): rolled back: this copy was sealed at "
            f"2023-11-14T22:13:20Z, but the box's env manifest names a newer one (sealed at "
            f"2023-11-14T22:15:00Z)",
            result.out,
        )
        self.assertFalse(_there(self.into, env))

        await self.put_env(env, b"LCHAT_ADMIN_TOKEN=new\n", new_gen)
        again = await self.lchat("backup", "restore", "--all", "--into", self.into, "--force")
        self.assertIn(f"{env}: restored (mode 0600; sealed at 2023-11-14T22:15:00Z)", again.out)
        self.assertEqual(_read(self.into, env), b"LCHAT_ADMIN_TOKEN=new\n")

    async def test_unpinned_and_first_format_seals_need_the_operators_word(self) -> None:
        await self.setUpS3()
        await self.a_box()
        env = f"{HOST}.env"
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = b"n" * 12
        legacy = envfiles.MAGIC_V1 + nonce + AESGCM(KEY).encrypt(nonce, b"T=1\n", env.encode())
        await self.store.put(envfiles.key_for(Layout(PREFIX, BOX).box_path(), env), legacy)

        result = await self.lchat("backup", "restore", "--all", "--into", self.into)
        self.assertIn(f"box {BOX} has no env manifest in the backup", result.out)
        self.assertIn("not restored without --accept-unpinned-env", result.out)
        self.assertFalse(_there(self.into, env))

        again = await self.lchat(
            "backup", "restore", "--all", "--into", self.into, "--force", "--accept-unpinned-env"
        )
        self.assertIn(f"{env}: restored (mode 0600; first-format seal, accepted)", again.out)
        self.assertEqual(_read(self.into, env), b"T=1\n")


class _Swapper:
    """The compromised space's side of a race: whenever one of ``names`` appears in ``directory``
    as a regular file, it is moved aside and a symlink to ``target`` put in its place (what a
    process watching the data dir with inotify does)."""

    def __init__(self, directory: str, names: list[str], target: str) -> None:
        self.directory, self.names, self.target = directory, names, target
        self.swapped: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name in self.names:
                path = os.path.join(self.directory, name)
                try:
                    if stat.S_ISREG(os.lstat(path).st_mode):
                        os.rename(path, path + ".aside")
                        os.symlink(self.target, path)
                        self.swapped.append(name)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class LinkTests(TrustCase):
    """Run as root: the data dir belongs to the service user, who plants links in it."""

    def setUp(self) -> None:
        if os.geteuid() != 0:
            raise SkipTest("a root-run restore's file handling needs root")
        super().setUp()
        self.etc = tempfile.mkdtemp(prefix="etc-", dir=self.root)  # stands in for /etc
        os.chmod(self.etc, 0o755)
        self.passwd = os.path.join(self.etc, "passwd")
        with open(self.passwd, "wb") as f:
            f.write(PASSWD)
        os.chmod(self.passwd, 0o644)

    def assertUntouched(self) -> None:
        st = os.lstat(self.passwd)
        with open(self.passwd, "rb") as f:
            self.assertEqual(f.read(), PASSWD)
        self.assertEqual((st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)), (0, 0, 0o644))
        self.assertEqual(sorted(os.listdir(self.etc)), ["passwd"])

    async def a_box_with_env(self) -> str:
        await self.setUpS3()
        await self.a_box()
        env = f"{HOST}.env"
        await self.put_env(env, b"LCHAT_ADMIN_TOKEN=t\n", 5)
        await self.put_manifest({env: 5})
        os.chown(self.into, 4242, 4243)  # the service user's data dir
        return env

    def assertHanded(self, name: str, mode: int | None = None) -> None:
        st = os.lstat(os.path.join(self.into, name))
        self.assertTrue(stat.S_ISREG(st.st_mode), name)
        self.assertEqual((st.st_uid, st.st_gid), (4242, 4243), name)
        if mode is not None:
            self.assertEqual(stat.S_IMODE(st.st_mode), mode, name)

    async def test_links_planted_at_the_temp_names_are_not_followed(self) -> None:
        env = await self.a_box_with_env()
        # The temp names a restore used to open (predictable: <name>.restore-<pid>).
        for name in (env, f"{HOST}-bot.env", f"{HOST}.db", "registry.db"):
            os.symlink(self.passwd, os.path.join(self.into, f"{name}.restore-{os.getpid()}"))
        result = await self.lchat("backup", "restore", "--all", "--into", self.into)
        self.assertUntouched()
        self.assertEqual(result.code, 0, result)
        for name in ("registry.db", f"{HOST}.db"):
            self.assertHanded(name)
        self.assertHanded(env, 0o600)
        self.assertEqual(_read(self.into, env), b"LCHAT_ADMIN_TOKEN=t\n")

    async def test_a_file_swapped_for_a_link_right_after_it_is_restored(self) -> None:
        env = await self.a_box_with_env()
        swapper = _Swapper(self.into, ["registry.db", f"{HOST}.db", env], self.passwd)
        try:
            result = await self.lchat("backup", "restore", "--all", "--into", self.into)
        finally:
            swapper.stop()
        self.assertUntouched()
        self.assertEqual(result.code, 0, result)
        # Handed to the service user before it had its name (nothing is chowned by name after).
        for name in ("registry.db", f"{HOST}.db", env):
            self.assertHanded(name + (".aside" if name in swapper.swapped else ""))

    async def test_a_data_dir_that_is_a_link_is_refused(self) -> None:
        await self.setUpS3()
        await self.a_box()
        link = os.path.join(self.root, "linked")
        os.symlink(self.etc, link)
        result = await self.lchat("backup", "restore", "--all", "--into", link)
        self.assertUntouched()
        self.assertEqual(result.code, 1, result)
        self.assertIn("is a symbolic link", result.err)


class SafeWriteTests(TrustCase):
    """lchat.files: the writers a root-run command uses in a directory another user writes."""

    def setUp(self) -> None:
        super().setUp()
        self.dir = tempfile.mkdtemp(dir=self.root)
        self.outside = os.path.join(self.root, "outside")
        with open(self.outside, "wb") as f:
            f.write(PASSWD)

    def test_write_atomic_replaces_a_planted_link_and_never_writes_through_it(self) -> None:
        fd = files.open_directory(self.dir)
        self.addCleanup(os.close, fd)
        os.symlink(self.outside, os.path.join(self.dir, "a.env"))
        files.write_atomic("a.env", b"X=1\n", 0o600, dir_fd=fd)
        self.assertFalse(os.path.islink(os.path.join(self.dir, "a.env")))
        with open(self.outside, "rb") as f:
            self.assertEqual(f.read(), PASSWD)
        with self.assertRaises(ValueError):
            files.write_atomic("../x", b"", dir_fd=fd)

    def test_install_file_refuses_a_hard_linked_source_and_never_clobbers(self) -> None:
        fd = files.open_directory(self.dir)
        self.addCleanup(os.close, fd)
        stage = tempfile.mkdtemp(dir=self.root)
        source = os.path.join(stage, "x.db")
        with open(source, "wb") as f:
            f.write(b"db")
        os.link(source, os.path.join(stage, "second-name"))
        with self.assertRaises(files.UnsafePath):
            files.install_file(source, fd, "x.db", overwrite=True)
        os.unlink(os.path.join(stage, "second-name"))
        open(os.path.join(self.dir, "x.db"), "wb").close()
        with self.assertRaises(FileExistsError):
            files.install_file(source, fd, "x.db", overwrite=False)
        with open(source, "wb") as f:  # consumed either way
            f.write(b"db")
        files.install_file(source, fd, "x.db", overwrite=True, mode=0o640)
        st = os.stat(os.path.join(self.dir, "x.db"))
        self.assertEqual((stat.S_IMODE(st.st_mode), st.st_size), (0o640, 2))
        with self.assertRaises(files.UnsafePath):
            link = os.path.join(self.root, "dirlink")
            os.symlink(self.dir, link)
            files.open_directory(link)
