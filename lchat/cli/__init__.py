"""The ``lchat`` command line: the operator's tool for one box's registry (docs/design.md §3).

Synchronous on purpose: it writes registry rows, env files and units, then asks the running router
to reload over its admin socket. Only the commands that talk to the bucket or to mesh peers
(``replica``, ``mesh``, ``mesh-seed``, and the mesh fan-out of ``add-instance``/``remove``) run a
reactor, for the length of their network calls.
"""
