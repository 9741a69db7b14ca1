"""Who the cloud admits: a certificate's subject, an edge's own token (only its hash is
stored), the shared secret; revocation and reloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_verifier.identities import Credentials, EdgeIdentities, Refused, token_hash

TOKEN_A, TOKEN_B = "token-of-edge-a-0123456789", "token-of-edge-b-0123456789"


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    tokens, revoked = tmp_path / "tokens", tmp_path / "revoked"
    tokens.write_text(f"# edges\nedge-a {token_hash(TOKEN_A)}\nedge-b {token_hash(TOKEN_B)}\n")
    revoked.write_text("")
    return tokens, revoked


def test_the_tokens_file_holds_no_token(files: tuple[Path, Path]) -> None:
    assert TOKEN_A not in files[0].read_text()


def test_an_edge_is_admitted_by_its_own_token_only(files: tuple[Path, Path]) -> None:
    ids = EdgeIdentities(tokens_file=files[0], revoked_file=files[1])
    assert ids.admit(Credentials(None, "edge-a", TOKEN_A)) == "edge-a"
    with pytest.raises(Refused, match="bad token for edge edge-a"):
        ids.admit(Credentials(None, "edge-a", TOKEN_B))  # b's token does not make it a
    with pytest.raises(Refused, match="unknown edge"):
        ids.admit(Credentials(None, "edge-c", TOKEN_A))


def test_the_shared_secret_admits_under_the_claimed_id() -> None:
    ids = EdgeIdentities(shared_secret="s3cret-s3cret")
    assert ids.admit(Credentials(None, "site-1", "s3cret-s3cret")) == "site-1"
    with pytest.raises(Refused):
        ids.admit(Credentials(None, "site-1", "wrong-secret"))


def test_with_client_certificates_the_subject_is_the_identity() -> None:
    ids = EdgeIdentities(shared_secret="s3cret-s3cret", require_cert=True)
    assert ids.admit(Credentials("CN=edge-a", "claims-b", "")) == "CN=edge-a"
    with pytest.raises(Refused, match="requires a client certificate"):
        ids.admit(Credentials(None, "edge-a", "s3cret-s3cret"))  # the secret is not enough


def test_a_reload_revokes_and_rotates(files: tuple[Path, Path]) -> None:
    tokens, revoked = files
    ids = EdgeIdentities(tokens_file=tokens, revoked_file=revoked)
    a, b = Credentials(None, "edge-a", TOKEN_A), Credentials(None, "edge-b", TOKEN_B)
    revoked.write_text("edge-b\n")
    ids.admit(b)  # nothing changes before the reload
    ids.reload()
    with pytest.raises(Refused, match="edge edge-b is revoked"):
        ids.admit(b)
    assert ids.admit(a) == "edge-a"
    tokens.write_text(f"edge-a {token_hash('a-rotated-token-000')}\n")  # a's token rotated
    ids.reload()
    with pytest.raises(Refused):
        ids.admit(a)


def test_a_broken_file_keeps_the_previous_lists_on_reload(files: tuple[Path, Path]) -> None:
    tokens, revoked = files
    ids = EdgeIdentities(tokens_file=tokens, revoked_file=revoked)
    tokens.write_text("edge-a not-a-hash\n")
    ids.reload()
    assert ids.admit(Credentials(None, "edge-a", TOKEN_A)) == "edge-a"
    with pytest.raises(ValueError, match="expected"):
        EdgeIdentities(tokens_file=tokens)  # at start-up it is an error


def test_control_routes_take_the_secret_or_an_edge_token(files: tuple[Path, Path]) -> None:
    ids = EdgeIdentities(shared_secret="s3cret-s3cret", tokens_file=files[0])
    assert ids.admits_bearer("s3cret-s3cret") and ids.admits_bearer(TOKEN_B)
    assert not ids.admits_bearer("guess-guess-guess")
