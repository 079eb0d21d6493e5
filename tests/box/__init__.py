"""The box tests (``make test-box``): lchat's units under a real systemd, in a container.

Not collected by ``make test`` (tests/parallel.py runs ``tests/test_*.py`` only): they need root,
``systemd-nspawn`` and ``debootstrap``, and take a few minutes (tests/systembox.py).
"""
