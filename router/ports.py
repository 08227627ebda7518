"""Binding the router's ports, and the one-line error when one is taken. Imports only the
standard library and `router.config`, so the CLI can check the ports before torch loads."""

from __future__ import annotations

import socket

from router.config import RouterConfig


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound to host:port (0 picks a free port). SO_REUSEADDR, so a
    port in TIME_WAIT is not taken; one another server listens on is."""
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def port_taken(key: str, host: str, port: int, e: OSError) -> str:
    flag = "--http-port" if key == "http.port" else "--grpc-port"
    return (
        f"router.{key}: cannot listen on {host}:{port} ({e.strerror or e}); another server "
        f"holds it? Choose another port with {flag} (0 picks a free one)"
    )


def check_ports(cfg: RouterConfig, keep_http: bool) -> socket.socket | None:
    """Raise ValueError naming every taken port (one line each, so that a user with both
    taken learns it at once, not one start at a time); port 0 needs no check. `keep_http`:
    return the bound HTTP socket for the server, so nothing can take the port meanwhile;
    the gRPC port is only probed (grpc binds its own socket)."""
    ports = [("grpc.port", cfg.grpc.port)]
    if cfg.http.enabled:
        ports.append(("http.port", cfg.http.port))
    kept = None
    taken: list[str] = []
    for key, port in ports:
        if not port:
            continue
        try:
            sock = bind_socket(cfg.host, port)
        except OSError as e:
            taken.append(port_taken(key, cfg.host, port, e))
            continue
        if keep_http and key == "http.port":
            kept = sock
        else:
            sock.close()
    if taken:
        if kept is not None:
            kept.close()
        raise ValueError("\n".join(taken))
    return kept
