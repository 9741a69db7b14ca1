"""A private certificate authority for the edge-cloud channel: one CA, the cloud's server
certificate (its host names and addresses as subject alternative names) and one client
certificate per edge (its identity is the subject, CN=<edge id>).

`python -m asymspec.certificates DIR --server-names cloud-verifier,localhost,127.0.0.1
--edges edge-a,edge-b` writes ca.pem, ca.key, cloud.pem, cloud.key and <edge>.pem /
<edge>.key into DIR; files already there are kept (a CA made on a first start is reused by
every later one). Keys are EC P-256: small handshakes on a slow uplink.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825  # the longest leaf lifetime clients such as Apple's still accept


@dataclass(frozen=True)
class Authority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew between hosts
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def make_authority(common_name: str = "asymspec private CA") -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(common_name)
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def issue(
    ca: Authority, common_name: str, server_names: list[str] | None = None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate: a server one when ``server_names`` (DNS names or IP addresses,
    what clients verify the host name against) is given, else a client one."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(_name(common_name), ca.cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        # Both key identifiers: Python 3.13's default context verifies strictly (RFC 5280)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
    )
    if server_names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in server_names]), critical=False
        )
    return builder.sign(ca.key, hashes.SHA256()), key


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def write_pair(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> None:
    key_path = directory / f"{stem}.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def read_authority(directory: Path) -> Authority:
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca.key'} is not an EC key")
    return Authority(cert, key)


def ensure(directory: Path, server_names: list[str], edges: list[str]) -> list[str]:
    """Create what is missing in ``directory``; returns the file stems written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    if (directory / "ca.pem").exists():
        ca = read_authority(directory)
    else:
        ca = make_authority()
        write_pair(directory, "ca", ca.cert, ca.key)
        written.append("ca")
    wanted = [("cloud", "cloud", server_names)] + [(e, e, None) for e in edges]
    for stem, common_name, names in wanted:
        if not (directory / f"{stem}.pem").exists():
            write_pair(directory, stem, *issue(ca, common_name, names))
            written.append(stem)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument(
        "--server-names",
        default="localhost,127.0.0.1",
        help="comma-separated DNS names / IP addresses the cloud is reached at",
    )
    parser.add_argument("--edges", default="edge", help="comma-separated edge ids (client certs)")
    args = parser.parse_args()
    split = [n.strip() for n in args.server_names.split(",") if n.strip()]
    edges = [e.strip() for e in args.edges.split(",") if e.strip()]
    written = ensure(args.directory, split, edges)
    print(f"certificates in {args.directory}: wrote {', '.join(written) or 'nothing (all there)'}")


if __name__ == "__main__":
    main()
