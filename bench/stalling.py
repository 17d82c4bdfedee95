"""A TCP server on 127.0.0.1 that never reads and sends to each connection until it takes no more:
the upstream of tunnels stalled both ways (issue 44, item 4), for the noisy-neighbour figures
(bench/neighbours.py) and tests/e2e/test_egress_stalled.py. Nothing leaves 127.0.0.1.

``python -m bench.stalling PORT`` serves in the foreground (the e2e test runs it inside the daemon's
network namespace) and prints ``listening`` once it does; ``Stalling()`` serves from a thread.
"""

from __future__ import annotations

import resource
import selectors
import socket
import sys
import threading
from typing import Any

CHUNK = b"z" * (256 << 10)
# Small socket buffers keep the kernel's share of each tunnel small; the stall is the same.
BUFFER_BYTES = 64 << 10


def listener(port: int) -> socket.socket:
    """A non-blocking listener on 127.0.0.1:``port`` (0: any free port) whose connections get small buffers."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # inherited by each accepted connection
        sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def serve(server: socket.socket, stop: threading.Event) -> None:
    """Accept on ``server``; write to every connection while it takes more, read nothing, until ``stop``."""
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    try:
        while not stop.is_set():
            for key, _ in selector.select(timeout=0.5):
                if key.fileobj is server:
                    _accept(server, selector)
                else:
                    _send(key.fileobj, selector)  # type: ignore[arg-type]
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()


def _accept(server: socket.socket, selector: selectors.BaseSelector) -> None:
    try:
        conn, _ = server.accept()
    except OSError:  # gone before it was accepted, or out of descriptors for now
        return
    conn.setblocking(False)
    selector.register(conn, selectors.EVENT_WRITE)


def _send(conn: socket.socket, selector: selectors.BaseSelector) -> None:
    try:
        while conn.send(CHUNK):
            pass
    except BlockingIOError:
        pass  # full: the selector says when it takes more
    except OSError:
        selector.unregister(conn)
        conn.close()


class Stalling:
    """The server in a thread, on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        self._server = listener(0)
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=serve, args=(self._server, self._stop), daemon=True)
        self._thread.start()

    def __enter__(self) -> Stalling:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)


def main() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))  # a connection per tunnel, hundreds of them
    server = listener(int(sys.argv[1]))
    print("listening", flush=True)
    serve(server, threading.Event())


if __name__ == "__main__":
    main()
