"""Certificates without an operator: ACME issuance, renewal and the shared certificate cache.

- ``client.py``: the ACME account and one order, on certbot's ``acme`` library. Blocking: it runs
  only in worker threads, never on the reactor.
- ``http01.py``: the HTTP-01 responder behind ``/.well-known/acme-challenge/`` on port 80.
- ``dns01.py``: DNS-01 for wildcards: the TXT through :mod:`lchat.dns`, the propagation check.
- ``cache.py``: writing certificates into ``LCHAT_ACME_CACHE`` (what :mod:`lchat.tls` serves) and
  the shared cache in the bucket (``LCHAT_CERT_CACHE=s3``, private keys encrypted).
- ``issuer.py``: the service that decides what to issue and when: the host policy, one order per
  name however many handshakes ask, backoff, renewals, wildcards every 12 h.

The TLS listener never waits for any of this: a handshake for a name being issued gets the default
certificate (or fails at once), and the next handshake after the file lands gets the new one.
"""
