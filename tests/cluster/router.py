"""A real `sandboxd router` for tests, in front of real hosts with mutual-TLS listeners, and the pieces the
router's tests share: two hosts (``node:a``, ``node:b``) of one test etcd, and a frozen etcd link."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from sandboxd.client import Client
from tests.cluster.certs import Cert
from tests.cluster.etcd import Etcd, free_port
from tests.e2e.conftest import REPO, Daemon, wait_answering


def host_config(node: str, etcd_url: str, cert: Cert, *, lease_s: int = 2, extra: str = "",
                base: str = "pool:\n  min_idle: 0\n") -> tuple[str, str]:
    """(config, address) of a host ``node`` whose cluster listener is on a free 127.0.0.1 port: ``base`` (the
    pool's settings), ``extra``, then its cluster section."""
    address = f"127.0.0.1:{free_port()}"
    return (f"{base}{extra}cluster:\n  node: {node}\n  etcd: ['{etcd_url}']\n  lease_s: {lease_s}\n"
            f"  listen: {address}\n" + cert.tls_yaml()), address


def start_host(tmp: Path, node: str, etcd_url: str, cert: Cert, *, tools: Path | None = None,
               **kwargs: Any) -> Daemon:
    """A host ``node`` started; ``tools``: global tools copied into its data path besides the tests' own."""
    config, address = host_config(node, etcd_url, cert, **kwargs)
    host = Daemon(tmp / f"host-{node}", config=config)
    host.address = address  # type: ignore[attr-defined]
    if tools is not None:
        shutil.copytree(tools, host.data / "tools", dirs_exist_ok=True)
    return host.start()


class Router:
    """`sandboxd router --config FILE --socket PATH` as a process; ``stop`` checks it stopped cleanly."""

    def __init__(self, tmp: Path, etcd_url: str, cert: Cert, *, extra: str = "") -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="sbd-"))  # a unix socket's path is at most 108 bytes
        self.socket = self.folder / "router.sock"
        self.log_path = tmp / "router.log"
        self.config_path = tmp / "router.yaml"
        self.config_path.write_text(f"{extra}cluster:\n  etcd: ['{etcd_url}']\n" + cert.tls_yaml())
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> Router:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandboxd", "router", "--config", str(self.config_path),
                 "--socket", str(self.socket)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                # Only what the test says: a SANDBOXD_* of the caller's would change the router's config.
                env={key: value for key, value in os.environ.items() if not key.startswith("SANDBOXD_")})
        wait_answering(self.proc, self.socket, timeout, "router", self.log)
        return self

    def client(self, timeout: float = 60) -> Client:
        return Client(self.socket, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise AssertionError(f"router did not stop within 10 s:\n{self.log()}") from None
            assert code == 0, f"router stopped with {code}:\n{self.log()}"
        shutil.rmtree(self.folder, ignore_errors=True)


class FreezableLink:
    """A TCP relay on 127.0.0.1 in front of ``target``; ``freeze`` holds what ``target`` sends (a stale watch)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(near, far, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(far, near, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, held: bool) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if held:
                    self._flowing.wait()
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def etcd_target(etcd: Etcd) -> tuple[str, int]:
    return "127.0.0.1", etcd.port
