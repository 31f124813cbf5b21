"""`flatwire health grpc HOST:PORT...` or `flatwire health http URL...`: exit 0 when every target is healthy.

For container healthchecks: the gRPC form speaks the standard gRPC health protocol. Where the services use
TLS, so does the check, with their own FLATWIRE_SSL_* variables (services/common/tls.py): their certificate
on mutual-TLS ports, their CA to check the server's.
"""

import argparse
import os
import ssl
import sys
import urllib.request

from services.common.rpc import check_health
from services.common.tls import TlsFiles


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("targets", nargs="+", help="host:port for grpc, a URL (http:// or https://) for http")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    tls = TlsFiles.from_env(os.environ)
    if args.kind == "grpc":
        credentials = tls.checking_channel()
        healthy = all(check_health(target, args.timeout, credentials, tls.server_name) for target in args.targets)
    else:
        context = ssl.create_default_context(cafile=tls.ca_certs) if tls.ca_certs else None
        healthy = all(http_ok(target, args.timeout, context) for target in args.targets)
    sys.exit(0 if healthy else 1)


def http_ok(url: str, timeout: float, context: ssl.SSLContext | None = None) -> bool:
    """Whether GET `url` answers 200 (`context`: how an https:// URL's certificate is checked)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
            return reply.status == 200
    except OSError:
        return False
