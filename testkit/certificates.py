"""A private certificate authority for TLS tests and benchmarks, made with ``cryptography``.

ECDSA P-256 keys (what a current ACME issuer hands out by default), certificates valid
for 127.0.0.1 and localhost, written as the PEM files tokend's ``tls_cert_file`` and
``tls_key_file`` name.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from testkit.net import LOOPBACK
from tokend.core import protocol as p
from tokend.ops.app import App

StartApp = Callable[..., Awaitable[App]]

HOSTS = (LOOPBACK, "localhost")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class Authority:
    """A CA: its key and self-signed certificate."""

    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @classmethod
    def create(cls, common_name: str = "tokend test CA") -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
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
        return cls(key, certificate)

    def write(self, path: Path) -> Path:
        """The CA certificate as a PEM file (what a client's CA file option names)."""
        path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        return path

    def issue(
        self, cert_file: Path, key_file: Path, *, serial: int | None = None
    ) -> tuple[Path, Path]:
        """A server certificate for :data:`HOSTS`, its chain (leaf, CA) written to
        ``cert_file`` and its key to ``key_file`` (mode 0600)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(LOOPBACK))]
        names += [x509.DNSName(host) for host in HOSTS if host != LOOPBACK]
        leaf = (
            x509.CertificateBuilder()
            .subject_name(_name("tokend"))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(serial or x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        chain = leaf.public_bytes(serialization.Encoding.PEM)
        chain += self.certificate.public_bytes(serialization.Encoding.PEM)
        cert_file.write_bytes(chain)
        key_file.touch(mode=0o600)
        key_file.write_bytes(_pem(key))
        return cert_file, key_file

    def client_context(self, ca_file: Path) -> ssl.SSLContext:
        """A client context that trusts this CA only, verification on (the defaults
        of ``ssl.create_default_context``: certificate and host name checked)."""
        return ssl.create_default_context(cafile=str(self.write(ca_file)))


def served_serial(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> int:
    """The serial number of the certificate a server presented on this connection."""
    der = ssl_object.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@dataclass(frozen=True)
class TlsNode:
    """tokend serving ``wss://`` itself, with a certificate of a CA made for the test."""

    app: App
    ca_file: Path  # the CA (PEM) a client must trust
    settings: dict[str, str]  # the certificate and key settings, for a restart

    @property
    def url(self) -> str:
        return f"wss://{LOOPBACK}:{self.app.port}{p.WS_PATH}"


async def tls_node(start_app: StartApp, directory: Path, **settings: Any) -> TlsNode:
    """A tokend with ``tls_cert_file`` and ``tls_key_file`` of a new CA's (testkit/certificates.py)
    certificate for 127.0.0.1, written in ``directory``."""
    authority = Authority.create()
    cert, key = authority.issue(directory / "cert.pem", directory / "key.pem")
    tls = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
    app = await start_app(**tls, **settings)
    return TlsNode(app, authority.write(directory / "ca.pem"), tls)
