"""Whether a server could listen where it is told to, said before it starts rather than once it binds."""

import socket


def port_taken(host: str, port: int) -> bool:
    """Whether a socket listens on host:port (binding it fails as a server's would; SO_REUSEADDR, as uvicorn
    sets it, so that connections of an earlier run still closing do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
