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

    rpc.py --egress URL UID    as root: GET URL through the egress proxy socket of a running
                               sandbox (its socket directory under SOCKET's .shims folder) as
                               the sandbox's uid, as the sandbox's shim would; print the
                               response's status line and body as {"status": ..., "body": ...}

A connect() that fails prints {"connect_error": "EACCES", ...} and exits 3.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
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


def egress_get(url: str, uid: int) -> None:
    """Only the sandbox's uid may use its egress.sock; its folder's parent is the daemon's own
    (0700), so enter the folder as root, then drop to the uid and connect by a relative path."""
    shims = Path("/run/sandboxd/sandboxd.sock.shims")
    folder = next(d for d in sorted(shims.iterdir()) if (d / "egress.sock").exists())
    os.chdir(folder)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(120)
    sock.connect("egress.sock")
    host = url.split("/")[2]
    sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    response = b""
    while chunk := sock.recv(1 << 16):
        response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    print(json.dumps({"status": head.split(b"\r\n")[0].decode(errors="replace"), "body": body.decode(errors="replace")}))


def main(argv: list[str]) -> None:
    if argv[1] == "--egress":
        egress_get(argv[2], int(argv[3]))
        return
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
