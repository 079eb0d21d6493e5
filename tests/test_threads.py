"""lchat.threads: a component's own pool never holds the process up at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from twisted.trial.unittest import SynchronousTestCase

from tests.routerproc import ROOT


class DaemonThreadPoolTests(SynchronousTestCase):
    def test_a_pool_never_stopped_does_not_hang_the_exit(self) -> None:
        """A replica's pool its replicator never stopped kept a test module's process in the
        interpreter's exit for good (fc48, tests.test_bucket_loss: every test passed, the
        process never ended). A DaemonThreadPool's threads are daemons: the process ends."""
        program = textwrap.dedent(
            """
            import threading
            from lchat.threads import DaemonThreadPool

            pool = DaemonThreadPool(minthreads=0, maxthreads=1, name="replica x")
            pool.start()
            ran = threading.Event()
            pool.callInThread(ran.set)
            assert ran.wait(10)
            assert all(t.daemon for t in pool.threads), pool.threads
            print("left running")
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", program],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        self.assertEqual((done.returncode, done.stdout.strip()), (0, "left running"), done.stderr)
