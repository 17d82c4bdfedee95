"""An HTTP server on 127.0.0.1 whose every answer is an endless body, sent as fast as it is read:
what sandboxes download from in the noisy-neighbour figures (bench/neighbours.py) and tests
(tests/e2e/test_many_users.py). The proxy's allow list names it; nothing leaves 127.0.0.1."""

from __future__ import annotations

import socket
import threading
from typing import Any


class Source:
    """An HTTP server on 127.0.0.1 whose every answer is an endless body, sent as fast as it is read."""

    CHUNK = b"x" * (256 << 10)

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self.sent = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._listener.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/endless"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(4096)
                    if not data:
                        return
                    head += data
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                             b"Content-Length: 1099511627776\r\nConnection: close\r\n\r\n")
                while not self._stop.is_set():
                    conn.sendall(self.CHUNK)
                    self.sent += len(self.CHUNK)
            except OSError:
                return
