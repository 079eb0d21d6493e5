"""The box's certificates, wired from its config: the TLS listener's store, the ACME issuer with
its HTTP-01 responder and DNS-01 provider, and the certificate cache shared in the hibernation
bucket (``LCHAT_CERT_CACHE=s3``). A builder of ``lchat.tap``'s, in a module of its own because
it is the largest."""

from __future__ import annotations

import os
import time

from attrs import frozen
from twisted.application.service import MultiService
from twisted.internet.endpoints import UNIXServerEndpoint
from twisted.logger import Logger

from lchat import tls
from lchat.acme.cache import CacheSync, LocalCache, SharedCache
from lchat.acme.client import AcmeAccount
from lchat.acme.http01 import ChallengeResponder
from lchat.acme.issuer import Issuer
from lchat.admin import clear_stale_socket
from lchat.config import BoxConfig
from lchat.dns import make_provider
from lchat.listener import listen
from lchat.objstore.aws import ResolvedCredentials
from lchat.reactors import Reactor
from lchat.routesource import RouteSource
from lchat.shutdown import HibernationService
from lchat.threads import RunInThread
from lchat.webutil import QuietSite

_log = Logger(namespace="lchat.tap")


@frozen
class Certificates:
    store: tls.CertStore | None = None  # the TLS listener's certificates (HTTPS on)
    issuer: Issuer | None = None  # ACME (LCHAT_ACME_DIRECTORY not off)
    responder: ChallengeResponder | None = None  # HTTP-01, on the HTTP listener
    challenge_socket: str | None = None  # the responder's socket, when HTTP proxies


def certificates(
    top: MultiService,
    reactor: Reactor,
    cfg: BoxConfig,
    routes: RouteSource,
    hibernation: HibernationService | None,
    run: RunInThread,
    aws: ResolvedCredentials | None,
) -> Certificates:
    """The TLS certificate store, the ACME issuer and its HTTP-01 responder, and the shared
    certificate cache (LCHAT_CERT_CACHE=s3) in the hibernation bucket."""
    if cfg.https_addr is None:
        return Certificates()
    own = (cfg.mesh.self_host,) if cfg.mesh is not None else ()
    wanted = tls.CertificateWanted()  # the store's cue to the issuer (which connects itself)
    store = tls.CertStore(reactor, cfg.acme_cache, tls.known_hosts(routes, own), run, wanted=wanted)
    shared = None
    if cfg.cert_cache == "s3":
        assert cfg.hibernate is not None and hibernation is not None  # config refuses s3 without
        shared = SharedCache(
            hibernation.store,
            cfg.cert_cache_key,
            monotonic=time.monotonic,
            prefix=cfg.hibernate.prefix,
            box_id=cfg.box_id,
            previous_key=cfg.cert_cache_previous_key,
        )
    if cfg.acme is not None or shared is not None:
        LocalCache(cfg.acme_cache).ensure_directory()
    store.load_initial()
    store.setServiceParent(top)
    issuer = responder = challenge_socket = None
    if cfg.acme is not None:
        if cfg.http_addr is not None:
            responder = ChallengeResponder(
                lookup=shared.get_challenge if shared is not None else None,
                may_lookup=tls.known_hosts(routes, own),
                pending=shared.challenge_tokens if shared is not None else None,
                clock=reactor,
            )
        issuer = _issuer(reactor, cfg, routes, store, wanted, responder, shared, own, aws)
        issuer.setName("acme")
        if hibernation is not None and shared is not None:
            hibernation.add_bucket_user(issuer)
        else:
            issuer.setServiceParent(top)
    if shared is not None:
        assert hibernation is not None
        sync = CacheSync(
            reactor,
            shared,
            LocalCache(cfg.acme_cache),
            store.certificates,
            store.rescan,
            run,
            interval=cfg.cert_cache_sync,
            directory=cfg.acme.directory if cfg.acme is not None else "",
        )
        sync.setName("cert-cache")
        hibernation.add_bucket_user(sync)
    if responder is not None and not cfg.http_redirect:
        # Plain HTTP proxies: the proxy hands challenge paths to the responder's own socket.
        challenge_socket = os.path.join(cfg.run_dir, "acme.sock")
        clear_stale_socket(challenge_socket)
        site = QuietSite(responder.site_root())
        listen(top, UNIXServerEndpoint(reactor, challenge_socket, mode=0o600), site)
    return Certificates(store, issuer, responder, challenge_socket)


def _issuer(
    reactor: Reactor,
    cfg: BoxConfig,
    routes: RouteSource,
    store: tls.CertStore,
    wanted: tls.CertificateWanted,
    responder: ChallengeResponder | None,
    shared: SharedCache | None,
    own: tuple[str, ...],
    aws: ResolvedCredentials | None,
) -> Issuer:
    """The ACME issuer, with the host policy: registered and ready hosts, and this box's own name."""
    acme = cfg.acme
    assert acme is not None
    dns = None
    if cfg.wildcard_domains:
        dns = make_provider(
            acme.dns_provider,
            dnsimple_token=acme.dnsimple_token,
            dnsimple_url=acme.dnsimple_url,
            dnsimple_account=acme.dnsimple_account,
            route53_zone_id=acme.route53_zone_id,
            route53_endpoint=acme.route53_endpoint,
            route53_session=aws.session if aws is not None else None,
            sleep=time.sleep,  # the providers block in the issuer's worker threads
            clock=time.monotonic,
            now=reactor.seconds,
        )

    def may_issue(host: str) -> bool:
        if host in own:
            return True
        route = routes.table.get(host)
        return route is not None and route.serveable

    issuer = Issuer(
        reactor,
        store=store,
        local=LocalCache(cfg.acme_cache),
        account=AcmeAccount(acme.directory, cfg.acme_cache, email=acme.email, ca_file=acme.ca_file),
        may_issue=may_issue,
        http01=responder,
        dns=dns,
        wildcard_domains=cfg.wildcard_domains,
        dns_resolvers=acme.dns_resolvers,
        dns_timeout=acme.dns_timeout,
        shared=shared,
        own_hosts=own,
        monotonic=time.monotonic,
        wanted=wanted,
    )
    if responder is None:
        _log.warn(
            "acme: LCHAT_HTTP_ADDR is off, so per-host certificates cannot be issued (HTTP-01 "
            "needs port 80); only wildcards (DNS-01) are"
        )
    _log.info(
        "acme: issuing certificates from {directory} (per-host: {per_host}, wildcards: "
        "{wildcards}, cache: {cache})",
        directory=acme.directory,
        per_host="HTTP-01" if responder is not None else "off",
        wildcards=", ".join("*." + d for d in cfg.wildcard_domains) or "none",
        cache=cfg.cert_cache,
    )
    return issuer
