"""The build's one optional native part: lchat/proxy/_oneread_c.pyx, the one-read recognisers as
byte scanners in C (docs/performance.md). Everything else is setup.cfg.

Without Cython or a C compiler the build still succeeds and lchat.proxy.oneread uses its patterns
(the reference the compiled ones are tested against): the same behaviour, ~2 µs more CPU per
proxied request. ``LCHAT_PURE_PYTHON=1`` skips the extension on purpose.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install (oneread.py falls back)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # (no compiler, no Python headers)
            print(
                f"warning: lchat's C recognisers not built ({e}); using oneread.py's patterns",
                file=sys.stderr,
            )

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            print(
                f"warning: {ext.name} not built ({e}); using oneread.py's patterns", file=sys.stderr
            )


def extensions() -> list[Extension]:
    if os.environ.get("LCHAT_PURE_PYTHON"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("warning: Cython missing: lchat's C recognisers not built", file=sys.stderr)
        return []
    return cythonize(
        [Extension("lchat.proxy._oneread_c", ["lchat/proxy/_oneread_c.pyx"])],
        compiler_directives={"language_level": 3},
        quiet=True,
    )


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
