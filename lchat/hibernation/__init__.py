"""Hibernation: spaces that sleep in the bucket and wake on the next request (docs/design.md §7,
docs/hibernation.md). One module per noun:

- :mod:`~lchat.hibernation.activator`: the state machine (asleep, waking, awake, stopping), the
  router's branch for hibernating hosts;
- :mod:`~lchat.hibernation.space`: one space as the activator tracks it (and the proxy's in-flight
  ticket), its states' transition table, its budgets, a failed wake;
- :mod:`~lchat.hibernation.capacity`: ``LCHAT_MAX_INSTANCES`` and the operator's holds;
- :mod:`~lchat.hibernation.outage`: writes that cannot ship now (a fenced or stale space);
- :mod:`~lchat.hibernation.lifecycle`: the steps of a wake and of a stand-down, and the one writer
  of a row's ``next_due``;
- :mod:`~lchat.hibernation.localdb`: the local database, its clean-sleep marker, moved-aside
  copies, and the wake's database step;
- :mod:`~lchat.hibernation.contract`: what the activator asks a running space;
- :mod:`~lchat.hibernation.sidecars`: bot sidecars beside awake spaces;
- :mod:`~lchat.hibernation.sweeper`: the idle and due sweeps.

The lease (:mod:`lchat.lease`) and replication (:mod:`lchat.replica`) are lower layers, shared with
the certificate cache and the CLI; the router wires all of it in :mod:`lchat.tap`.
"""
