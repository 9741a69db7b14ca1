"""The channel across an untrusted network: TLS with mutual certificates, the refusals each
side makes, revocation without a restart, and what a listener on the path reads.

Real processes on loopback and real TLS handshakes; the certificates are made here: a
private CA (the cloud for localhost/127.0.0.1, edges edge-a and edge-b) and a second,
unrelated CA whose edge-a certificate the cloud must refuse. The edges that should be
admitted reach the cloud through a wiretap (a relay that keeps every byte), as does one
edge of a plaintext pair, so the test can tell that it would see a prompt and a secret.
"""

from __future__ import annotations

import asyncio
import signal
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
from transformers import AutoTokenizer

from asymspec.certificates import ensure
from cloud_verifier.identities import token_hash
from edge_gateway.text import encode_prompt
from loadtest.processes import (
    Service,
    cloud_env,
    edge_env,
    free_port,
    wait_for_reason,
)
from loadtest.tiny_models import save_tiny_pair
from tests.services.wiretap import WireTap, websocket_payloads

PROMPT = "the secret plans of the quick brown fox"
EDGE_SECRET = "an-edge-secret-that-must-not-leak"
EDGE_TOKEN = "the-own-token-of-edge-t-0123456789"


class Bed:
    """The TLS cloud, its edges and the plaintext pair, started once for the module."""

    def __init__(self, root: Path, stack: ExitStack) -> None:
        self.target, self.draft = save_tiny_pair(root / "pair")
        self.certs, self.other_ca = root / "certs", root / "other-ca"
        ensure(self.certs, ["localhost", "127.0.0.1"], ["edge-a", "edge-b"])
        ensure(self.other_ca, ["localhost"], ["edge-a"])
        self.revoked = root / "revoked"
        self.revoked.write_text("# revoked edges\n")
        self.logs = root / "logs"
        self.logs.mkdir()
        self.stack = stack
        self.edges: dict[str, Service] = {}
        self.cloud_port = free_port()
        self.cloud = self.service(
            "cloud_verifier",
            self.cloud_port,
            cloud_env(
                self.target,
                self.cloud_port,
                shared_secret="",
                ssl_certfile=str(self.certs / "cloud.pem"),
                ssl_keyfile=str(self.certs / "cloud.key"),
                ssl_ca_certs=str(self.certs / "ca.pem"),
                revoked_edges_file=str(self.revoked),
            ),
            ca_certs=self.certs / "ca.pem",
        )
        self.tap = stack.enter_context(WireTap(self.cloud_port))
        self.plain_port = free_port()
        tokens = root / "tokens"
        tokens.write_text(f"edge-t {token_hash(EDGE_TOKEN)}\n")
        self.plain_cloud = self.service(
            "cloud_verifier",
            self.plain_port,
            cloud_env(
                self.target,
                self.plain_port,
                shared_secret=EDGE_SECRET,
                edge_tokens_file=str(tokens),
            ),
        )
        self.plain_tap = stack.enter_context(WireTap(self.plain_port))

    def service(self, module: str, port: int, env: dict[str, str], **kw: Path) -> Service:
        service = Service(module, port, env, self.logs / f"{module}-{port}.log", **kw)
        self.stack.callback(service.stop)
        return service

    def edge(self, url: str, edge_id: str = "edge", https: bool = False, **extra: str) -> Service:
        """An edge dialing ``url``; with ``https``, its API serves https (the certificate
        made for localhost and 127.0.0.1 by the same CA)."""
        port = free_port()
        env = edge_env(self.draft, port, 0, "asymspec", max_model_len="256", **extra)
        env |= {"ASYMSPEC_EDGE_CLOUD_URL": url, "ASYMSPEC_EDGE_ID": edge_id}
        if not https:
            return self.service("edge_gateway", port, env)
        env |= {
            "ASYMSPEC_EDGE_SSL_CERTFILE": str(self.certs / "cloud.pem"),
            "ASYMSPEC_EDGE_SSL_KEYFILE": str(self.certs / "cloud.key"),
        }
        return self.service("edge_gateway", port, env, ca_certs=self.certs / "ca.pem")

    def mtls_edge(
        self, name: str, certs: Path | None = None, https: bool = False, **extra: str
    ) -> Service:
        certs = certs or self.certs
        return self.edge(
            f"wss://127.0.0.1:{self.tap.port}/v1/channel",
            https=https,
            shared_secret=EDGE_SECRET,  # sent inside TLS: the capture must not show it
            edge_id=name,
            cloud_ca_certs=str(self.certs / "ca.pem"),
            cloud_certfile=str(certs / f"{name}.pem"),
            cloud_keyfile=str(certs / f"{name}.key"),
            **extra,
        )


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with ExitStack() as stack:
        bed = Bed(tmp_path_factory.mktemp("tls"), stack)
        bed.edges = {
            "a": bed.mtls_edge("edge-a"),
            "b": bed.mtls_edge("edge-b", https=True),  # its API on https too
            "plain": bed.edge(
                f"ws://127.0.0.1:{bed.plain_tap.port}/v1/channel", shared_secret=EDGE_SECRET
            ),
            "token": bed.edge(
                f"ws://127.0.0.1:{bed.plain_port}/v1/channel",
                shared_secret="",
                cloud_token=EDGE_TOKEN,
                edge_id="edge-t",
            ),
            "no-cert": bed.edge(
                f"wss://127.0.0.1:{bed.cloud_port}/v1/channel",
                shared_secret=EDGE_SECRET,
                cloud_ca_certs=str(bed.certs / "ca.pem"),
            ),
            "other-ca": bed.mtls_edge("edge-a", certs=bed.other_ca),
            "untrusting": bed.edge(  # no CA given: the system's roots, which do not know ours
                f"wss://127.0.0.1:{bed.cloud_port}/v1/channel",
                cloud_certfile=str(bed.certs / "edge-a.pem"),
                cloud_keyfile=str(bed.certs / "edge-a.key"),
            ),
            "remote-plain": bed.edge(  # TEST-NET-1: not loopback (never reached anyway)
                "ws://192.0.2.1:8001/v1/channel", shared_secret=EDGE_SECRET
            ),
        }
        for service in (bed.cloud, bed.plain_cloud):
            service.wait_healthy()
        for name in ("a", "b", "plain", "token"):
            bed.edges[name].wait_healthy()
        yield bed


def complete(edge: Service, prompt: str = PROMPT) -> str:
    body = {"model": "asymspec", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{edge.url}/v1/completions", json=body, timeout=60, verify=edge.verify)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def prompt_on_the_wire(bed: Bed) -> bytes:
    """The prompt as an OpenSession carries it (the edge's token ids, zlib-compressed)."""
    tokenizer = AutoTokenizer.from_pretrained(bed.draft)
    ids = np.asarray(encode_prompt(tokenizer, PROMPT), dtype="<u4")
    return zlib.compress(ids.tobytes(), 6)


def test_requests_complete_over_wss_with_mutual_tls(bed: Bed) -> None:
    assert complete(bed.edges["a"]) == complete(bed.edges["plain"])  # same pair, greedy
    metrics = httpx.get(f"{bed.cloud.url}/metrics", verify=bed.cloud.verify).text
    assert 'asymspec_cloud_edge_sessions_opened_total{edge="CN=edge-a"' in metrics


def test_the_edge_api_serves_https(bed: Bed) -> None:
    edge = bed.edges["b"]
    assert edge.url.startswith("https://")
    assert complete(edge)
    with pytest.raises(httpx.HTTPError):  # plain http at the https port
        httpx.get(f"http://127.0.0.1:{edge.port}/health", timeout=5)


def test_an_edge_with_its_own_token_is_admitted_under_its_id(bed: Bed) -> None:
    complete(bed.edges["token"])
    metrics = httpx.get(f"{bed.plain_cloud.url}/metrics").text
    assert 'asymspec_cloud_edge_sessions_opened_total{edge="edge-t"' in metrics


def test_a_listener_reads_prompt_and_secret_in_plaintext_but_not_under_tls(bed: Bed) -> None:
    complete(bed.edges["a"])
    complete(bed.edges["plain"])
    prompt = prompt_on_the_wire(bed)
    # the plaintext capture shows both (the test can see what it looks for) ...
    readable = b"".join(websocket_payloads(bytes(up)) for up, _ in bed.plain_tap.connections)
    assert EDGE_SECRET.encode() in readable
    assert prompt in readable
    assert b"GET /v1/channel" in bed.plain_tap.uplink
    # ... under TLS nothing does, not even the upgrade, though the same edge sent it all
    assert len(bed.tap.uplink) > 2000
    assert b"GET /v1/channel" not in bed.tap.captured
    assert EDGE_SECRET.encode() not in bed.tap.captured
    assert prompt not in bed.tap.captured
    assert PROMPT.encode() not in bed.tap.captured


def test_an_edge_without_a_client_certificate_is_refused(bed: Bed) -> None:
    reason = wait_for_reason(bed.edges["no-cert"], "requires a client certificate")
    assert "refused this edge" in reason


def test_an_edge_certificate_from_another_ca_is_refused(bed: Bed) -> None:
    wait_for_reason(bed.edges["other-ca"], "it does not trust this edge's certificate")


def test_an_edge_that_does_not_trust_the_cloud_refuses_it(bed: Bed) -> None:
    reason = wait_for_reason(bed.edges["untrusting"], "certificate is not trusted")
    assert "self-signed" in reason or "issuer" in reason


def test_an_edge_refuses_plaintext_to_a_remote_host(bed: Bed) -> None:
    edge = bed.edges["remote-plain"]
    wait_for_reason(edge, "refusing to send this edge's credentials in plaintext to 192.0.2.1")
    assert "ASYMSPEC_EDGE_ALLOW_PLAINTEXT" in edge.logs()


def test_a_plain_websocket_client_at_the_tls_port_fails(bed: Bed) -> None:
    async def connect() -> None:
        async with websockets.connect(f"ws://127.0.0.1:{bed.cloud_port}/v1/channel") as ws:
            await ws.recv()

    with pytest.raises((websockets.InvalidHandshake, ConnectionError, EOFError)):
        asyncio.run(asyncio.wait_for(connect(), 10))


def test_revoking_an_edge_cuts_it_alone_without_a_restart(bed: Bed) -> None:
    a, b = bed.edges["a"], bed.edges["b"]
    complete(b)
    connections_of_a = a.logs().count("connected to the cloud")
    bed.revoked.write_text("CN=edge-b\n")
    bed.cloud.proc.send_signal(signal.SIGHUP)
    reason = wait_for_reason(b, "edge CN=edge-b is revoked")
    assert "refused this edge" in reason
    complete(a)  # the other edge carries on, on the connection it had
    assert a.logs().count("connected to the cloud") == connections_of_a
    assert bed.cloud.proc.poll() is None
    # reinstated by the next reload
    bed.revoked.write_text("")
    bed.cloud.proc.send_signal(signal.SIGHUP)
    b.wait_healthy(30)
    complete(b)
