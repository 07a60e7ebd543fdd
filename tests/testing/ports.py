"""Free loopback ports for the multi-process tests (the Python side of tests/testing/ports.h)."""
import socket


def free_ports(n):
    """n distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
