"""Hibernation: spaces that sleep in the bucket and wake on the next request (docs/design.md §7,
docs/hibernation.md). One module per noun (README.md, "Code layout"); the state machine is
:mod:`~lchat.hibernation.activator`.

The lease (:mod:`lchat.lease`) and replication (:mod:`lchat.replica`) are lower layers, shared with
the certificate cache and the CLI; the router wires all of it in :mod:`lchat.tap`.
"""
