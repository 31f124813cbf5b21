"""TLS on the gateway's public ports, and mutual TLS on the internal hops.

Each service has one key pair (--ssl-keyfile, --ssl-certfile, SGLang's and uvicorn's names). On the gateway
it serves HTTPS and TLS on the public gRPC port. With --ssl-ca-certs, the CA that signed every service's
certificate, the internal hops are mutual TLS: the scheduler and the detokenizer serve only peers whose
certificate that CA signed, and every channel checks the server's certificate against it (its name must be
the address dialled, or --ssl-server-name where one name stands for all of them: pods dialled by IP). The
internal secret stays in force as well
(auth.py): TLS decides who may connect, the secret which calls a connection may make.
"""

from dataclasses import dataclass
from pathlib import Path

import grpc

TLS_ENV = {"keyfile": "FLATWIRE_SSL_KEYFILE", "certfile": "FLATWIRE_SSL_CERTFILE",
           "ca_certs": "FLATWIRE_SSL_CA_CERTS", "server_name": "FLATWIRE_SSL_SERVER_NAME"}  # the services' variables


@dataclass(frozen=True)
class TlsFiles:
    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    server_name: str | None = None  # what internal servers' certificates must name (default: the host dialled)

    def __post_init__(self):
        if bool(self.keyfile) != bool(self.certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile: give both (a key and its certificate) or neither")
        if self.ca_certs and not self.keyfile:
            raise ValueError("--ssl-ca-certs: mutual TLS on the internal hops needs this service's own "
                             "--ssl-keyfile and --ssl-certfile too")

    @classmethod
    def from_env(cls, environ) -> "TlsFiles":
        """From the FLATWIRE_SSL_* variables (the services' own), for the command-line checks."""
        return cls(**{name: environ.get(variable) or None for name, variable in TLS_ENV.items()})

    @property
    def public(self) -> bool:
        return bool(self.keyfile)

    @property
    def internal(self) -> bool:
        return bool(self.ca_certs)

    def _pair(self) -> tuple[bytes, bytes]:
        assert self.keyfile and self.certfile
        return Path(self.keyfile).read_bytes(), Path(self.certfile).read_bytes()

    def _ca(self) -> bytes:
        assert self.ca_certs
        return Path(self.ca_certs).read_bytes()

    def public_server(self) -> grpc.ServerCredentials | None:
        """The gateway's public gRPC port: TLS with this service's key pair; None: plaintext."""
        return grpc.ssl_server_credentials([self._pair()]) if self.public else None

    def internal_server(self) -> grpc.ServerCredentials | None:
        """A scheduler's or detokenizer's port: mutual TLS (client certificates signed by the CA); None: plaintext."""
        if not self.internal:
            return None
        return grpc.ssl_server_credentials([self._pair()], root_certificates=self._ca(), require_client_auth=True)

    def internal_channel(self) -> grpc.ChannelCredentials | None:
        """A channel to a scheduler or detokenizer: this service's certificate shown, the server's checked."""
        if not self.internal:
            return None
        key, cert = self._pair()
        return grpc.ssl_channel_credentials(root_certificates=self._ca(), private_key=key, certificate_chain=cert)

    def checking_channel(self) -> grpc.ChannelCredentials | None:
        """For probes of any port of a TLS deployment: the internal identity if there is one, else the CA alone."""
        if self.internal:
            return self.internal_channel()
        return grpc.ssl_channel_credentials(root_certificates=self._ca()) if self.ca_certs else None
