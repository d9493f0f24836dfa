"""TLS contexts for the node: the server side of its API, and the client side of its peer traffic.

This module owns how the config's `tls_certfile`, `tls_keyfile` and
`tls_ca_certs` become `ssl.SSLContext`s, read once at startup. It guarantees
TLS 1.2 or newer both ways, and that a peer's certificate is always verified:
- with `tls_ca_certs` (a private CA that signs only the cluster's nodes), the
  chain is checked and the host name is not, because nodes reach each other by
  pod or VM address, which a shared node certificate seldom names;
- without it (the system's CAs, where anyone can get a certificate for some
  name), the host name must match as well.
It does no I/O after startup and never imports trio or the HTTP framework.
"""

from __future__ import annotations

import ssl

from openrld.config import ConfigError, NodeConfig


def server_context(config: NodeConfig) -> ssl.SSLContext | None:
    """The API's server context; None when TLS is off."""
    if config.tls_certfile is None or config.tls_keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(config.tls_certfile, config.tls_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_certfile/tls_keyfile: cannot load the certificate and key: {exc}") from exc
    return context


def peer_context(config: NodeConfig) -> ssl.SSLContext | bool:
    """What the node's HTTP clients verify peers with: a context under TLS, else httpx's default (True)."""
    if not config.is_tls:
        return True
    try:
        context = ssl.create_default_context(cafile=str(config.tls_ca_certs) if config.tls_ca_certs else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_ca_certs: cannot load {config.tls_ca_certs}: {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if config.tls_ca_certs is not None:
        context.check_hostname = False  # the private CA's chain is the proof; see the module docstring
    return context
