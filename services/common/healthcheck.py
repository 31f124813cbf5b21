"""`flatwire health grpc HOST:PORT...` or `flatwire health http URL...`: exit 0 when every target is healthy.

For container healthchecks: the gRPC form speaks the standard gRPC health protocol. Where the services use
TLS, so does the check, with their own FLATWIRE_SSL_* variables (services/common/tls.py): their certificate
on mutual-TLS ports, their CA to check the server's.
"""

import argparse
import os
import ssl
import sys
import urllib.error
import urllib.request

from services.common.rpc import health_problem
from services.common.tls import TlsFiles


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("targets", nargs="+", help="host:port for grpc, a URL (http:// or https://) for http")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each answer (default: 3)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout: must be positive")
    tls = TlsFiles.from_env(os.environ)
    if args.kind == "grpc":
        credentials = tls.checking_channel()
        problems = {target: health_problem(target, args.timeout, credentials, tls.server_name)
                    for target in args.targets}
    else:
        context = ssl.create_default_context(cafile=tls.ca_certs) if tls.ca_certs else None
        problems = {target: http_problem(target, args.timeout, context) for target in args.targets}
    for target, problem in problems.items():  # said, so that a container's health log shows why
        if problem is not None:
            print(f"{prog or 'flatwire health'}: {target}: {problem}", file=sys.stderr)
    sys.exit(1 if any(problems.values()) else 0)


def http_ok(url: str, timeout: float, context: ssl.SSLContext | None = None) -> bool:
    """Whether GET `url` answers 200 (`context`: how an https:// URL's certificate is checked)."""
    return http_problem(url, timeout, context) is None


def http_problem(url: str, timeout: float, context: ssl.SSLContext | None = None) -> str | None:
    """Why GET `url` does not answer 200 (its status, or the error); None when it does."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
            return None if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # refused, timed out, TLS; ValueError: not a URL
        return str(getattr(exc, "reason", None) or exc)
