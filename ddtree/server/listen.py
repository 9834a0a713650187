"""The listening sockets of `ddtree serve`, bound before anything else starts.

uvicorn binds only once it runs, and a failure there (a port in use, a host that does not resolve)
ends in a traceback, or an abort while the model loads in its thread. Bound first, a failure is one
line and exit code 2, like every other bad setting.
"""
from __future__ import annotations

import socket

from ddtree.config import DDTreeError


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address `host` resolves to, as uvicorn would
    listen on them; raises DDTreeError naming the address and the reason."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not 0 <= port <= 65535:  # the OS would silently take the port modulo 65536
        raise DDTreeError(f"cannot listen on {where}: a port is 0..65535")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError, OverflowError, ValueError) as exc:
        raise DDTreeError(f"cannot listen on {where}: the address does not resolve ({exc})") from None
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its IPv4 twin binds separately
            sock.bind(address)
            sock.set_inheritable(True)
    except (OSError, OverflowError) as exc:
        for sock in sockets:
            sock.close()
        raise DDTreeError(f"cannot listen on {where}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}") from None
    return sockets
