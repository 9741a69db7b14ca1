"""What the edge presents to the cloud, and over what: its id and token (the shared secret or
its own), its client certificate, and the TLS context that checks the cloud's.

A `wss://` URL is verified like a browser would: the cloud's certificate must chain to
`cloud_ca_certs` (the system's roots by default) and name the URL's host. A `ws://` URL is
plaintext: the Hello's token would cross the network readable, so the edge refuses one whose
host is not loopback unless `allow_plaintext` says the network is private.

TLS failures are turned into the reason `/health` reports (`refusal`): an untrusted cloud,
a cloud that wants a client certificate, one that does not trust ours. A server on asyncio
(uvicorn) that refuses a client certificate closes the connection without a TLS alert, so
the edge sees only a connection closed before the upgrade's answer: it names the likely
cause, which nothing else produces (a cloud that is up but not ready answers the upgrade).
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from websockets.exceptions import InvalidMessage

if TYPE_CHECKING:
    from edge_gateway.settings import EdgeSettings

# OpenSSL's names of the alerts a server sends when it refuses our certificate
_ALERT_REASONS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the cloud requires a client certificate "
    "(set ASYMSPEC_EDGE_CLOUD_CERTFILE and _KEYFILE)",
    "TLSV1_ALERT_UNKNOWN_CA": "the cloud does not trust this edge's certificate "
    "(signed by a CA it does not accept)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the cloud rejected this edge's certificate",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "the cloud revoked this edge's certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the cloud says this edge's certificate expired",
    "WRONG_VERSION_NUMBER": "the cloud does not speak TLS at this port (a ws:// URL?)",
}


@dataclass(frozen=True)
class CloudCredentials:
    token: str  # sent in the Hello: the shared secret or this edge's own token
    edge_id: str = "edge"
    ca_certs: str = ""  # empty: the system's roots
    certfile: str = ""
    keyfile: str = ""
    allow_plaintext: bool = False

    @classmethod
    def from_settings(cls, s: EdgeSettings) -> CloudCredentials:
        return cls(
            token=s.cloud_token or s.shared_secret,
            edge_id=s.edge_id,
            ca_certs=s.cloud_ca_certs,
            certfile=s.cloud_certfile,
            keyfile=s.cloud_keyfile,
            allow_plaintext=s.allow_plaintext,
        )

    def ssl_context(self, url: str) -> ssl.SSLContext | None:
        """The client context for a wss:// URL (None for ws://)."""
        if urlsplit(url).scheme != "wss":
            return None
        # create_default_context: CERT_REQUIRED and check_hostname, TLS 1.2 at least
        context = ssl.create_default_context(cafile=self.ca_certs or None)
        if self.certfile:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context

    def plaintext_refusal(self, url: str) -> str | None:
        """Why the edge will not connect to ``url`` in plaintext; None when it may."""
        parts = urlsplit(url)
        if parts.scheme != "ws" or self.allow_plaintext or _is_loopback(parts.hostname or ""):
            return None
        return (
            f"refusing to send this edge's credentials in plaintext to {parts.hostname}: use "
            "wss:// (TLS), or set ASYMSPEC_EDGE_ALLOW_PLAINTEXT=1 on a private network"
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: where it resolves to is not ours to trust


def refusal(exc: BaseException, tls: bool, presented_cert: bool) -> str | None:
    """The reason a failed connection gives, when TLS refused it; None if it was not TLS."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"the cloud's certificate is not trusted: {seen.verify_message}"
        if isinstance(seen, ssl.SSLError):
            reason = str(getattr(seen, "reason", "") or "")
            return _ALERT_REASONS.get(reason, f"TLS with the cloud failed: {reason or seen}")
        seen = seen.__cause__ or seen.__context__
    if tls and isinstance(exc, InvalidMessage) and isinstance(exc.__cause__, EOFError):
        if presented_cert:
            return (
                "the cloud closed the TLS connection before answering: it does not trust "
                "this edge's certificate (signed by a CA it does not accept?)"
            )
        return (
            "the cloud closed the TLS connection before answering: it may require a client "
            "certificate (set ASYMSPEC_EDGE_CLOUD_CERTFILE and _KEYFILE)"
        )
    return None
