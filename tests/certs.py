"""Throwaway PKI for TLS tests: a CA, a server certificate for localhost/127.0.0.1, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


class ThrowawayPKI:
    def __init__(self, directory: Path, ca_name: str = "specmesh test CA") -> None:
        self.dir = directory
        now = datetime.datetime.now(datetime.timezone.utc)
        self._validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca_cert = (x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
                        .public_key(self.ca_key.public_key()).serial_number(x509.random_serial_number())
                        .not_valid_before(self._validity[0]).not_valid_after(self._validity[1])
                        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                        .sign(self.ca_key, hashes.SHA256()))
        self.ca_path, _ = _write(directory / ca_name.replace(" ", "-"), self.ca_key, self.ca_cert)

    def issue(self, cn: str, server: bool) -> tuple[str, str]:
        """(cert path, key path) signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(self._validity[0]).not_valid_after(self._validity[1]))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return _write(self.dir / cn, key, builder.sign(self.ca_key, hashes.SHA256()))
