"""`flatwire health grpc HOST:PORT` or `flatwire health http URL`: exit 0 when healthy.

For container healthchecks: the gRPC form speaks the standard gRPC health protocol.
"""

import argparse
import sys
import urllib.request

from services.common.rpc import check_health


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="host:port for grpc, a URL for http")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.kind == "grpc":
        healthy = check_health(args.target, timeout=args.timeout)
    else:
        try:
            with urllib.request.urlopen(args.target, timeout=args.timeout) as reply:
                healthy = reply.status == 200
        except OSError:
            healthy = False
    sys.exit(0 if healthy else 1)
