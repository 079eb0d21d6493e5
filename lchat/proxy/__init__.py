"""The reverse proxy: moves bytes between a client and the target the router chose.

Before any of its modules is imported, this picks how :mod:`lchat.proxy.hot` runs: the module
compiled from ``hot.py`` by Cython when it was built from this very ``hot.py`` and ``hot.pxd``
(setup.py writes their digest beside it: ``_hot_digest.py``), else ``hot.py`` as Python. A build
of an older version (a checkout updated without ``make install``) would run other code than the
file says; ``LCHAT_PURE_PYTHON=1`` asks for the Python one (the tests run both).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).parent


def hot_digest(directory: Path = _HERE) -> str:
    """What a compiled ``hot`` must have been built from (setup.py writes it at build time)."""
    digest = hashlib.sha256()
    for name in ("hot.py", "hot.pxd"):
        path = directory / name
        digest.update(path.read_bytes() if path.exists() else b"")
    return digest.hexdigest()


def hot_choice(built: bool, pure: bool, built_from: str, source: str) -> tuple[bool, str]:
    """Whether to use the compiled hot module, and what the start line says of it: ``built``,
    a compiled module is there; ``pure``, LCHAT_PURE_PYTHON is set; ``built_from``, the digest
    it was built from (empty if unknown); ``source``, the digest of the files here now."""
    if not built:
        return False, "Python (lchat/proxy/hot not compiled: ~1 µs more CPU per request)"
    if pure:
        return False, "Python (LCHAT_PURE_PYTHON is set)"
    if built_from != source:
        return False, (
            "Python (the compiled lchat/proxy/hot is a build of another version of hot.py: "
            "rebuild it with `make install` or `pip install .`; ~1 µs more CPU per request)"
        )
    return True, "compiled (lchat/proxy/hot)"


def _choose_hot(
    import_compiled: Callable[[str], ModuleType] = importlib.import_module,
) -> str:
    """Load lchat.proxy.hot (see the module docstring) and say which it is. A compiled module
    that fails to load (built for another Python, say) is a warning in the start line and the
    Python build, never a router that cannot start."""
    name = __name__ + ".hot"
    spec = importlib.util.find_spec(name)
    built = spec is not None and spec.origin is not None and not spec.origin.endswith(".py")
    try:
        from lchat.proxy._hot_digest import DIGEST as built_from
    except ImportError:
        built_from = ""
    compiled, said = hot_choice(
        built, bool(os.environ.get("LCHAT_PURE_PYTHON")), built_from, hot_digest() if built else ""
    )
    if compiled:
        try:
            import_compiled(name)
            return said
        except Exception as e:
            sys.modules.pop(name, None)
            said = (
                f"Python (the compiled lchat/proxy/hot did not load: {e}; rebuild it with "
                "`make install` or `pip install .`; ~1 µs more CPU per request)"
            )
    if built:
        source = importlib.util.spec_from_file_location(name, _HERE / "hot.py")
        assert source is not None and source.loader is not None
        module = importlib.util.module_from_spec(source)
        sys.modules[name] = module
        source.loader.exec_module(module)
    return said


HOT = _choose_hot()
