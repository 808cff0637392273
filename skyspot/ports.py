"""A free TCP port on loopback: torchrun's rendezvous, the local metadata stand-in and the tests'
storage servers each need one, and this is the one place that asks the kernel for it."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now, chosen by the kernel (another process could take it before it is used)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
