"""A throwaway CA and service certificates for the TLS tests: made in the test, valid for loopback."""

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Certificates:
    ca: Path  # the CA's certificate (PEM)
    key: Path  # a service key (PEM), and its certificate signed by the CA, for 127.0.0.1 and localhost
    cert: Path

    def env(self, internal: bool = True) -> dict[str, str]:
        """The FLATWIRE_SSL_* variables of a service that uses them (internal: mutual TLS on its hops too)."""
        env = {"FLATWIRE_SSL_KEYFILE": str(self.key), "FLATWIRE_SSL_CERTFILE": str(self.cert)}
        return {**env, "FLATWIRE_SSL_CA_CERTS": str(self.ca)} if internal else env


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certificates(directory: Path, name: str = "flatwire-test") -> Certificates:
    """A CA, and one key pair it signed, written under `directory`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    paths = Certificates(directory / "ca.pem", directory / "key.pem", directory / "cert.pem")
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.key.write_bytes(_pem(key))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return paths
