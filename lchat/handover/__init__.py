"""Hand-over commands: a space handed between its unit and the activator (``lchat hibernate
--on/--off``), and an always-on space started (``add-instance``), each a small class over four
seams (:mod:`lchat.handover.seams`: router admin, units, peers, bucket) so that every branch is
tested on in-memory fakes; the CLI only parses arguments and wires the real adapters in."""


class HandoverError(Exception):
    """A refusal or failure; the CLI prints it as one ``lchat: error:`` line (exit status 1)."""
