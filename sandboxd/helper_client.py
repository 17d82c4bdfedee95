"""The daemon's side of the privileged helper (storage/helper.py): one JSON line out, one back.

An unprivileged daemon asks it for what needs root: a user's folders under their quota
(storage/provision.py), and the SIGKILL that ends a condemned gVisor sandbox at once
(sandbox/docker/sentry.py). Here so that both layers can ask without importing each other.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

HELPER_TIMEOUT_S = 10.0


def ask_helper(path: Path, request: dict[str, Any], timeout: float = HELPER_TIMEOUT_S) -> dict[str, Any]:
    """One request to the privileged helper, one answer; OSError or ValueError on failure."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise ValueError("the privileged helper's answer is not an object")
    if "error" in answer:
        raise ValueError(str(answer["error"]))
    return answer
