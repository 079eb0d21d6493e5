"""Every use lchat makes of Twisted's private API, in one place.

Twisted keeps its compatibility promise for public names only: anything spelt with a leading
underscore, or living in an underscore module (``twisted.web._newclient``,
``twisted.internet._sslverify``), may change in any release without a deprecation cycle. The code
below needs a few such names because no public API does the job; each function says exactly which
private name it touches and why. Nothing else in ``lchat`` may reach into Twisted's privates.

The private names touched, all of them:

- ``twisted.web._newclient.RequestNotSent`` and ``.WrongBodyLength``: error types the S3 client
  tells apart (re-exported here); the S3 client also relies on the subclasses of
  ``twisted.web._newclient._WrapperException`` being the three public ones it lists
  (``lchat.objstore.s3.exchange.WRAPPERS``; checked by the tests, not touched);
- ``twisted.web.client.HTTPConnectionPool._factory`` and
  ``twisted.web.client._HTTP11ClientFactory``: :func:`quiet_pool`;
- ``twisted.internet._sslverify.IOpenSSLTrustRoot`` and its ``_addCACertsToContext``:
  :func:`platform_trust_plus` (the mesh's client TLS, lchat.mesh.client);
- ``treq._types._ITreqReactor``: :func:`treq_reactor`.

``tests/test_twisted_internals.py`` drives each of these against the installed Twisted over real
loopback TCP and TLS connections, and fails naming the internal if one has changed. ``setup.cfg``
pins Twisted to the releases those tests passed on: run them before widening the pin.
"""

from __future__ import annotations

from typing import Any, cast

from treq._types import _ITreqReactor
from twisted.internet._sslverify import IOpenSSLTrustRoot
from twisted.internet.interfaces import IReactorTime
from twisted.web._newclient import RequestNotSent, WrongBodyLength
from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory
from zope.interface import implementer

__all__ = [
    "RequestNotSent",
    "TrustRoot",
    "WrongBodyLength",
    "platform_trust_plus",
    "quiet_pool",
    "treq_reactor",
]

# --- HTTP client errors defined only in twisted.web._newclient ---------------------------------
#
# The S3 client (lchat.objstore.s3) tells "never sent, safe to retry" and "the body was wrong"
# apart from other failures by type. Their siblings (ResponseFailed, ResponseNeverReceived,
# RequestTransmissionFailed, RequestGenerationFailed) are public in twisted.web.client; these two
# are defined only in the private twisted.web._newclient, and twisted.web.client does not export
# them (RequestNotSent is imported there for its own retry logic, outside ``__all__``):
#
# - ``RequestNotSent``: ``HTTP11ClientProtocol.request`` was called on a connection that can no
#   longer send (lost while idle in the pool, or busy): nothing reached the server, so even a
#   non-idempotent request may be retried.
# - ``WrongBodyLength``: a body producer wrote more or fewer bytes than its ``length``; Twisted
#   wraps it in the public ``RequestGenerationFailed``, whose ``reasons`` the S3 client unwraps.

# --- an HTTP client pool that does not log every connection ----------------------------------


class _QuietClientFactory(_HTTP11ClientFactory):
    noisy = False  # one per connection: "Starting factory" lines would drown the log


def quiet_pool(reactor: IReactorTime, persistent: bool) -> HTTPConnectionPool:
    """An HTTP client connection pool whose per-connection factories do not log.

    Private names touched: ``HTTPConnectionPool._factory`` (the factory class the pool builds for
    each new connection) and ``twisted.web.client._HTTP11ClientFactory`` (its default, subclassed
    here only to set ``noisy = False``). No public API: the pool takes no factory argument, and a
    ``Factory`` logs "Starting factory" / "Stopping factory" at info level whenever ``noisy`` is
    true, once per connection here. Filtering those events out of the global log would hide them
    for every other factory too.
    """
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    pool._factory = _QuietClientFactory
    return pool


# --- the reactor treq times a request out on ---------------------------------------------------


def treq_reactor(reactor: IReactorTime) -> _ITreqReactor:
    """``reactor`` as treq's ``request(reactor=...)`` types it.

    Private name touched: ``treq._types._ITreqReactor``, the interface treq's signatures name: an
    intersection (TCP, time, name resolver) that no reactor declares, so no reactor is one to mypy
    (lchat.reactors). treq calls only ``callLater`` on it, for its ``timeout=``; given none, it
    imports the global reactor, which a CLI command's own reactor never runs. Pinned by
    ``tests/test_twisted_internals.py``: a request's timeout runs on the given clock.
    """
    return cast(_ITreqReactor, reactor)


# --- the platform's CAs plus a private one -----------------------------------------------------

TrustRoot = IOpenSSLTrustRoot  # what ``optionsForClientTLS(trustRoot=...)`` accepts


@implementer(IOpenSSLTrustRoot)
class _PlatformPlusFile:
    def __init__(self, ca_file: str) -> None:
        self._ca_file = ca_file

    def _addCACertsToContext(self, context: Any) -> None:
        context.set_default_verify_paths()
        context.load_verify_locations(self._ca_file)


def platform_trust_plus(ca_file: str) -> IOpenSSLTrustRoot:
    """Trust the platform's CAs *and* those in ``ca_file`` (``LCHAT_MESH_CA_FILE``): a private CA
    for the mesh's own names without giving up ordinary verification.

    Private names touched: ``twisted.internet._sslverify.IOpenSSLTrustRoot`` and its one method,
    ``_addCACertsToContext(context)``, which ``optionsForClientTLS`` calls to load the trusted CAs
    into the OpenSSL context. No public API: ``twisted.internet.ssl`` offers ``platformTrust()``
    (the platform's CAs only) and ``trustRootFromCertificates()`` (the given certificates only), and
    no way to combine the two; the interface itself is not exported by ``twisted.internet.ssl``.
    """
    return _PlatformPlusFile(ca_file)
