"""`flatwire health grpc HOST:PORT...` or `flatwire health http URL...`: exit 0 when every target is healthy.

For container healthchecks: the gRPC form speaks the standard gRPC health protocol.
"""

import argparse
import sys
import urllib.request

from services.common.rpc import check_health


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("targets", nargs="+", help="host:port for grpc, a URL for http")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    check = (lambda target: check_health(target, timeout=args.timeout)) if args.kind == "grpc" else (
        lambda target: _http_ok(target, args.timeout))
    sys.exit(0 if all(check(target) for target in args.targets) else 1)


def _http_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False
