"""A TCP proxy on loopback that throttles what flows back to its clients: a slow hub or store for tests.

    proxy = ThrottledProxy(port_of_the_real_server)          # unthrottled until a rate is set
    proxy.rate = 8_000                                       # bytes per second, shared by all connections
    client points at proxy.url ... ; proxy.stop()

Only the server-to-client direction is paced (downloads, and the small responses to uploads); what
clients send passes at full speed, so a test's uploads stay quick while its downloads take as long as
the bytes divided by the rate, however many connections share them. It relays bytes and knows
nothing of HTTP, so it serves moto's S3 server and the fake hub alike.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

HOST = "127.0.0.1"
CHUNK = 2048  # small, so parallel connections interleave finely and each sees bytes every few seconds


class ThrottledProxy:
    def __init__(self, target_port: int, rate: Optional[float] = None):
        self.target_port = target_port
        self.rate = rate
        """Bytes per second back to the clients, all connections together; None: unthrottled."""
        self._next_free = 0.0
        self._lock = threading.Lock()
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="throttled-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        for sock in list(self._sockets):
            try:
                sock.close()
            except OSError:
                pass

    def _pace(self, nbytes: int) -> None:
        """Wait for this chunk's slot: the shared rate decides when it may go."""
        rate = self.rate
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / rate
        time.sleep(max(0.0, start - now))

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((HOST, self.target_port))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, True), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, paced: bool) -> None:
        try:
            while True:
                data = source.recv(CHUNK)
                if not data:
                    break
                if paced:
                    self._pace(len(data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
                if sock in self._sockets:
                    self._sockets.remove(sock)
