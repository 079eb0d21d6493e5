"""lchat.malloc: large reads come from the heap, not a fresh mmap each."""

from __future__ import annotations

import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

# In a fresh interpreter: how many chunks glibc serves by mmap before and while 1 MiB is held
# (mallinfo2's hblks), with or without the tuning.
_PROBE = """
import ctypes, ctypes.util, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    from lchat import malloc
    assert malloc.tune_for_streaming()
before = libc.mallinfo2().hblks
held = bytes(1024 * 1024)
print(libc.mallinfo2().hblks - before)
"""


class TuneForStreamingTests(SynchronousTestCase):
    def probe(self, mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())

    def test_a_large_read_comes_from_the_heap(self) -> None:
        """Untuned, glibc maps 1 MiB on its own (the cost every large read paid); tuned, it is
        served from the heap."""
        self.assertEqual(self.probe("default"), 1)
        self.assertEqual(self.probe("tuned"), 0)
