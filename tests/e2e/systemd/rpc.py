"""A client of sandboxd's socket for tests/e2e/test_systemd.py, run inside the systemd
container as whichever user the test picks (`runuser -u USER -- python3 rpc.py ...`).
Standard library only: it must not depend on the sandboxd being tested.

    rpc.py SOCKET < REQUESTS   send each JSON-RPC request (one JSON object a line, read
                               from stdin: a command line is visible to every process, and
                               journald records it) on one connection; print each response
                               as one JSON line
    rpc.py SOCKET --pings N --every S
                               N connections, one every S seconds, each sending a ping and
                               printing {"connected": t, "answer": ...} as soon as it is
                               answered, t being the time of connect() (Unix seconds, the
                               clock of the daemon's log timestamps)

A connect() that fails prints {"connect_error": "EACCES", ...} and exits 3.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import threading
import time
from typing import Any


def connect(path: str) -> tuple[socket.socket, float]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(120)
    sock.connect(path)
    return sock, time.time()


def connect_error(exc: OSError) -> dict[str, Any]:
    return {"connect_error": errno.errorcode.get(exc.errno or 0, str(exc.errno)), "message": str(exc)}


def answers(sock: socket.socket, wanted: set[Any]) -> list[dict[str, Any]]:
    """The responses to the ids in ``wanted`` (notifications skipped), in arrival order."""
    reader = sock.makefile("rb")
    found = []
    while wanted:
        try:
            line = reader.readline()
        except ConnectionResetError:
            line = b""  # the listening socket was closed with this connection in its queue
        if not line:
            found.append({"closed": True, "waiting_for": sorted(map(str, wanted))})
            break
        message = json.loads(line)
        if "id" in message and "method" not in message:
            wanted.discard(message["id"])
            found.append(message)
    return found


def ping_once(path: str, lock: threading.Lock) -> None:
    try:
        sock, connected = connect(path)
    except OSError as exc:
        result = {"connected": time.time(), **connect_error(exc)}
    else:
        try:
            sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n')
            result = {"connected": connected, "answer": answers(sock, {1})[0]}
        except OSError as exc:
            result = {"connected": connected, "error": str(exc)}
        sock.close()
    with lock:
        print(json.dumps(result), flush=True)


def main(argv: list[str]) -> None:
    path = argv[1]
    if argv[2:3] == ["--pings"]:
        count, every = int(argv[3]), float(argv[5])
        lock = threading.Lock()
        threads = []
        for _ in range(count):  # each on its own thread: a queued connection must not hold up the next
            threads.append(threading.Thread(target=ping_once, args=(path, lock)))
            threads[-1].start()
            time.sleep(every)
        for thread in threads:
            thread.join()
        return
    requests = [json.loads(line) for line in sys.stdin if line.strip()]
    try:
        sock, _ = connect(path)
    except OSError as exc:
        print(json.dumps(connect_error(exc)))
        sys.exit(3)
    for request in requests:
        sock.sendall(json.dumps(request).encode() + b"\n")
    for message in answers(sock, {r["id"] for r in requests}):
        print(json.dumps(message))


if __name__ == "__main__":
    main(sys.argv)
