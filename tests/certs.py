"""Certificates made at test time: two unrelated CAs, a server cert and client certs.

EC P-256 keys, so a whole set takes milliseconds. The server cert names
127.0.0.1, ::1 and localhost (SAN), as the daemon under test listens on
loopback. Nothing here is fit for production: keys are unencrypted and the
validity window is one day.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()


@dataclass(frozen=True)
class Certs:
    """ca signed server and client; other_ca signed other_client only."""

    ca: Path
    server: Pair
    client: Pair
    other_ca: Path
    other_client: Pair


class _Authority:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            _builder(self.name, self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(cert_sign=True), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def issue(self, common_name: str, *, server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = (
            _builder(subject, self.name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(cert_sign=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        )
        if server:
            names: list[x509.GeneralName] = [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_pair(folder: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    key_path = folder / f"{name}.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return Pair(_write_cert(folder / f"{name}.crt", cert), key_path)


def make_certs(folder: Path) -> Certs:
    """Writes a CA, a server and a client cert from it, and an unrelated CA with its own client."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = _Authority("checkpointd test CA"), _Authority("unrelated test CA")
    return Certs(
        ca=_write_cert(folder / "ca.crt", ca.cert),
        server=_write_pair(folder, "server", *ca.issue("checkpointd", server=True)),
        client=_write_pair(folder, "client", *ca.issue("trainer", server=False)),
        other_ca=_write_cert(folder / "other-ca.crt", other.cert),
        other_client=_write_pair(folder, "other-client", *other.issue("stranger", server=False)),
    )
