"""Free loopback ports for the processes a test starts."""

from __future__ import annotations

import socket


def free_port(consecutive: int = 1) -> int:
    """A loopback port (and the ``consecutive - 1`` after it) that nothing listens on right now.

    Never 0: kopf reads port 0 in --liveness as "no port", i.e. 80.
    """
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + consecutive <= 65536 and _bindable(range(base + 1, base + consecutive)):
            return base
    raise RuntimeError(f"no {consecutive} consecutive free ports")


def _bindable(ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
