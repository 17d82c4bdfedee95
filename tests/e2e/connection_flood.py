"""A flood of connections without a token, run as its own process: ``python -m tests.e2e.connection_flood PORT``.

It opens connections to 127.0.0.1:PORT at up to ``--rate`` a second, half of them silent and
half sending a request without a token, and keeps the newest ``--hold`` open, so that the
server stays at its connection cap and must close one for each newcomer. It prints
``flooding`` once the first ``--hold`` are open, and stops when its stdin closes or after
``--seconds``. Its last line is a JSON summary: what it opened, what failed, and how many of
those it let go the server had already closed (proof the cap was reached).

SIGUSR1 turns the flood to a sink of its own (a listener that only accepts) and back: a test
measures its baseline while the machine carries the same flood, with the server spared.
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Any


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed it (EOF or reset after any answer), without waiting."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass  # an answer (401) before the close
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


class Sink:
    """A listener that accepts and keeps the newest ``hold`` connections: what the flood hits when told to spare the server."""

    def __init__(self, hold: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.port = self.listener.getsockname()[1]
        self.hold = hold
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        held: deque[socket.socket] = deque()
        while True:
            held.append(self.listener.accept()[0])
            if len(held) > self.hold:
                held.popleft().close()


class Flood:
    """Openers in threads sharing the rate: one whose SYN a full accept queue dropped (sent again after 1 s)
    does not stop the others."""

    def __init__(self, port: int, rate: float, hold: int) -> None:
        self.server_port, self.rate, self.hold = port, rate, hold
        self.sink = Sink(hold)
        self.port = port
        self.request = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 2\r\n\r\n{}" % port
        self.held: deque[tuple[socket.socket, bool]] = deque()  # and whether it went to the server
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.opened = self.failed = self.let_go = self.seen_closed = 0
        self.started = time.monotonic()

    def turn(self, *_: Any) -> None:
        self.port = self.sink.port if self.port == self.server_port else self.server_port

    def opener(self, threads: int) -> None:
        """Opens one connection every ``threads / rate`` seconds; behind time (a dropped SYN, SIGSTOP), it does not
        catch up in a burst."""
        interval, due = threads / self.rate, time.monotonic()
        while not self.stop.is_set():
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            self.open_one(self.port, send=bool(self.opened % 2))
            due = max(due + interval, time.monotonic())

    def open_one(self, port: int, send: bool) -> None:
        sock = socket.socket()
        sock.settimeout(3.0)
        try:
            sock.connect(("127.0.0.1", port))
            if send:
                sock.sendall(self.request)
        except OSError:
            sock.close()
            with self.lock:
                self.failed += 1
            return
        with self.lock:
            self.opened += 1
            self.held.append((sock, port == self.server_port))
            if self.opened == self.hold:
                print("flooding", flush=True)
            oldest = self.held.popleft() if len(self.held) > self.hold else None
            if oldest is not None and oldest[1]:
                self.let_go += 1
                self.seen_closed += closed_by_server(oldest[0])
        if oldest is not None:
            oldest[0].close()

    def summary(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.started
        return {"opened": self.opened, "failed": self.failed, "seconds": round(elapsed, 2),
                "rate": round(self.opened / elapsed), "let_go": self.let_go, "closed_by_server": self.seen_closed}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--rate", type=float, default=2400.0)
    parser.add_argument("--hold", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    flood = Flood(args.port, args.rate, args.hold)
    signal.signal(signal.SIGUSR1, flood.turn)
    openers = [threading.Thread(target=flood.opener, args=(args.threads,), daemon=True) for _ in range(args.threads)]
    for opener in openers:
        opener.start()
    deadline = time.monotonic() + args.seconds
    while (left := deadline - time.monotonic()) > 0 and not select.select([sys.stdin], [], [], left)[0]:
        pass  # woken by SIGUSR1: wait on
    flood.stop.set()
    for opener in openers:
        opener.join(5)
    print(json.dumps(flood.summary()), flush=True)
    for sock, _ in flood.held:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
