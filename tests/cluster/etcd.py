"""A real etcd for a test: Debian's ``etcd`` on free 127.0.0.1 ports with a temporary data directory.

``pause`` and ``resume`` (SIGSTOP, SIGCONT) make the store stop answering without closing a connection:
what a host does when etcd hangs. Always stopped and its data directory removed after.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Etcd:
    def __init__(self) -> None:
        if shutil.which("etcd") is None:
            pytest.fail("etcd is missing: scripts/ci-deps.sh installs Debian's etcd-server")
        self.data = Path(tempfile.mkdtemp(prefix="etcd-"))
        self.port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.data.parent / f"{self.data.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> Etcd:
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "test", "--data-dir", str(self.data / "member"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"test={peer}", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited with {self.proc.returncode}:\n{self.log()}")
            if self.ctl("endpoint", "health", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise AssertionError(f"etcd did not answer within {timeout} s:\n{self.log()}")

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``etcdctl`` against this etcd (API v3)."""
        return subprocess.run(["etcdctl", "--endpoints", self.url, "--command-timeout=3s", *args], check=check,
                              capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"})

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped etcd would not see the SIGTERM until then
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)


@pytest.fixture
def etcd() -> Iterator[Etcd]:
    server = Etcd().start()
    try:
        yield server
    finally:
        server.stop()
