"""The build's optional native parts (docs/performance.md); everything else is setup.cfg:

- lchat/proxy/_oneread_c.pyx, the one-read recognisers as byte scanners in C;
- lchat/proxy/hot.py compiled in Cython's pure-Python mode (hot.pxd types it), with the digest of
  the two files it was built from written to lchat/proxy/_hot_digest.py (lchat/proxy/__init__.py
  runs hot.py as Python when a build does not match it).

Without Cython or a C compiler the build still succeeds and the Python of the same modules runs
(the reference the compiled ones are tested against): the same behaviour, a few µs more CPU per
proxied request. ``LCHAT_PURE_PYTHON=1`` skips them on purpose.
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
    write_hot_digest()
    return cythonize(
        [
            Extension("lchat.proxy._oneread_c", ["lchat/proxy/_oneread_c.pyx"]),
            Extension("lchat.proxy.hot", ["lchat/proxy/hot.py"]),
        ],
        # (annotation_typing off: hot.py's annotations are for mypy; hot.pxd says the C types.)
        compiler_directives={"language_level": 3, "annotation_typing": False},
        quiet=True,
    )


def write_hot_digest() -> None:
    """lchat/proxy/_hot_digest.py: what the compiled hot module is built from (the digest
    lchat.proxy.hot_digest computes; the package's __init__ imports nothing else at build time)."""
    import hashlib

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lchat", "proxy")
    digest = hashlib.sha256()
    for name in ("hot.py", "hot.pxd"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    with open(os.path.join(here, "_hot_digest.py"), "w") as f:
        f.write(
            '"""Written by setup.py: the digest of the hot.py and hot.pxd the compiled'
            f' lchat.proxy.hot was built from."""\n\nDIGEST = "{digest.hexdigest()}"\n'
        )


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
