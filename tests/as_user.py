"""Talk to a unix socket as another user: the peer-credential tests need a real foreign uid.

A forked child drops to ``uid``/``gid``/``groups`` *before* connecting (the kernel
records credentials at connect()), sends its lines, half-closes and reads to EOF.
Forking rather than exec-ing keeps it independent of whether that user may run
this Python. Needs root.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

PING = b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n'


def exchange_as(path: str, uid: int, gid: int | None = None, groups: tuple[int, ...] = (),
                payload: bytes = PING, timeout: float = 20.0, half_close: bool = True) -> list[dict[str, Any]]:
    """Every JSON line the daemon sent before closing; raises if the child could not talk at all.

    ``half_close=False``: the child keeps its side open after the payload, as a peer that stalls would."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        status = 0
        try:
            os.close(read_end)
            os.setgroups(list(groups))
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(path)
            try:
                sock.sendall(payload)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # a refused peer may be gone before we finish; its answer is still buffered
            received = b""
            try:
                while chunk := sock.recv(1 << 16):
                    received += chunk
            except ConnectionResetError:
                pass  # a unix socket closed with our bytes unread resets after its last line
            os.write(write_end, received)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
            os.write(write_end, f"CHILD-ERROR {exc!r}".encode())
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    output = b""
    while chunk := os.read(read_end, 1 << 16):
        output += chunk
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(output.decode(errors="replace"))
    return [json.loads(line) for line in output.splitlines() if line.strip()]
