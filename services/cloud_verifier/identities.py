"""Who an edge is: the credentials the cloud admits on the channel, and their revocation.

An edge is admitted by the first of these that the cloud is configured for:

- a client certificate (mutual TLS, `ssl_ca_certs` set): the TLS layer has verified it
  against the CA; the identity is its subject (`CN=edge-a`). Required when configured.
- its own token (`edge_tokens_file`): the Hello's edge id must be listed, and the SHA-256 of
  the Hello's token must equal the hash listed for it; the identity is that edge id. The
  file holds hashes only: the cloud never stores a token it could leak. Tokens are random
  (`new-token` below makes 32 bytes), so a plain hash is as strong as a slow one.
- the shared secret: the identity is the edge id the Hello claims (unverified: every edge
  with the secret can claim any id, which is why this is the one-edge mode).

`reload` re-reads both files (SIGHUP); `admit` run again on a connection's credentials
says whether it still stands, so a revoked edge's channels are cut and nobody else's.

`python -m cloud_verifier.identities new-token edge-a` prints a token for the edge and the
line for the cloud's tokens file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("asymspec.cloud")


class Refused(Exception):
    """The edge is not admitted; the message says why (the edge reports it on /health)."""


@dataclass(frozen=True)
class Credentials:
    """What one channel connection presented."""

    cert_name: str | None  # the verified client certificate's subject, if any
    edge_id: str  # as the Hello claims it
    token: str  # the Hello's auth token (a shared secret or the edge's own token)


def token_hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def read_tokens(path: Path) -> dict[str, str]:
    """edge id -> 'sha256:<hex>' from a tokens file (# comments and blank lines allowed)."""
    tokens = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("sha256:") or len(parts[1]) != 71:
            raise ValueError(f"{path}:{number}: expected '<edge id> sha256:<64 hex digits>'")
        tokens[parts[0]] = parts[1].lower()
    return tokens


def read_revoked(path: Path) -> frozenset[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return frozenset(line for line in lines if line)


class EdgeIdentities:
    def __init__(
        self,
        shared_secret: str = "",
        require_cert: bool = False,
        tokens_file: Path | None = None,
        revoked_file: Path | None = None,
    ) -> None:
        self.shared_secret, self.require_cert = shared_secret, require_cert
        self.tokens_file, self.revoked_file = tokens_file, revoked_file
        self.tokens: dict[str, str] = {}
        self.revoked: frozenset[str] = frozenset()
        self.reload(initial=True)

    def reload(self, initial: bool = False) -> None:
        """Re-read the tokens and revocation files. A file that does not parse fails the
        start-up, but on a later reload it is logged and the previous lists stay (a typo
        must not open the door or lock every edge out)."""
        try:
            tokens = read_tokens(self.tokens_file) if self.tokens_file else {}
            revoked = read_revoked(self.revoked_file) if self.revoked_file else frozenset()
        except (OSError, ValueError) as exc:
            if initial:
                raise
            log.error("edge identities not reloaded, the previous ones stay: %s", exc)
            return
        self.tokens, self.revoked = tokens, revoked
        log.info("edge identities: %d tokens, %d revoked", len(tokens), len(revoked))

    def admit(self, credentials: Credentials) -> str:
        """The edge's identity, or Refused with the reason."""
        identity = self._identify(credentials)
        if identity in self.revoked:
            raise Refused(f"edge {identity} is revoked")
        return identity

    def _identify(self, c: Credentials) -> str:
        if self.require_cert:
            if c.cert_name is None:
                raise Refused("the cloud requires a client certificate (mutual TLS)")
            return c.cert_name
        if self.tokens_file is not None and c.edge_id in self.tokens:
            if hmac.compare_digest(token_hash(c.token), self.tokens[c.edge_id]):
                return c.edge_id
            raise Refused(f"bad token for edge {c.edge_id}")
        if self.shared_secret and hmac.compare_digest(
            c.token.encode(), self.shared_secret.encode()
        ):
            return c.edge_id
        raise Refused("unknown edge or bad secret")

    def admits_bearer(self, token: str) -> bool:
        """The control routes: the shared secret or any listed edge's token."""
        if self.shared_secret and hmac.compare_digest(token.encode(), self.shared_secret.encode()):
            return True
        digest = token_hash(token)
        # every entry is compared, so the time taken does not say which edge matched
        return any([hmac.compare_digest(digest, h) for h in self.tokens.values()])


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] != "new-token":
        raise SystemExit("usage: python -m cloud_verifier.identities new-token <edge id>")
    edge_id = sys.argv[2]
    token = secrets.token_urlsafe(32)
    print(f"edge ({edge_id}):  ASYMSPEC_EDGE_ID={edge_id} ASYMSPEC_EDGE_CLOUD_TOKEN={token}")
    print(f"cloud tokens file line:  {edge_id} {token_hash(token)}")


if __name__ == "__main__":
    main()
