"""egress.secrets over HTTPS: what a request costs in absolute form (the egress proxy makes the
TLS connection and puts the secret's value in) beside a CONNECT tunnel (the sandbox does TLS
itself), to the same TLS server on 127.0.0.1 (docs/performance.md, "Secrets over HTTPS").

One daemon of its own, whose egress.secrets names the server for OFFICER_APIFY_TOKEN, whose
egress.ca_file is the CA that signed the server's certificate, and whose egress.connect_rate is
out of the way. The tool
(bench/tools/bench_https) makes sequential GETs with https.request, each on a new
connection: with the call's env holding the secret, the shim sends them in absolute form;
without it, they tunnel. Per request: the tool's wall time, and the daemon's CPU.
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import Any

from bench import daemon as d
from bench.load import process_cpu
from bench.stats import summarize
from tests.tls_certs import make_ca

TOKEN_NAME = "OFFICER_APIFY_TOKEN"
ROUNDS = 3  # the two paths alternate this many times


class _Ok(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b"ok")
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def _call(daemon: d.BenchDaemon, user: str, url: str, count: int, env: dict[str, str]) -> tuple[list[float], float]:
    """(each request's seconds, the daemon's CPU seconds over the call)."""
    conn = daemon.connect()
    try:
        cpu0 = process_cpu(daemon.pid)
        result = conn.request("tools/call", {"user": user, "name": "bench_https", "arguments": {"url": url, "count": count},
                                             "env": env, "timeoutMs": 600_000})
        cpu = process_cpu(daemon.pid) - cpu0
    finally:
        conn.close()
    if result.get("status") != "ok":
        raise RuntimeError(f"bench_https failed: {result}")
    return [ms / 1000 for ms in json.loads(result["content"][0]["text"])], cpu


def secrets_over_https(root: Path, run_id: str, image: str, requests: int) -> dict[str, Any]:
    ca = make_ca(root / "ca")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    server.socket = ca.server_context().wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    url = f"https://127.0.0.1:{port}/"
    # connect_rate raised: at its default (50 a second) sequential requests would measure the limit, not the path.
    config = (f"egress:\n  allow: ['127.0.0.1:{port}']\n  secrets:\n    {TOKEN_NAME}: ['127.0.0.1:{port}']\n"
              f"  ca_file: {ca.ca_file}\n  connect_rate: 100000\nsandbox:\n  image: {image}\n")
    daemon = d.BenchDaemon(root / "daemon", config, fresh_tools=0)
    user = f"https-{run_id}@bench.example"
    samples: dict[str, list[float]] = {"tunnel": [], "absolute": []}
    cpu: dict[str, float] = {"tunnel": 0.0, "absolute": 0.0}
    envs = {"tunnel": {}, "absolute": {TOKEN_NAME: f"bench-secret-{run_id}"}}
    try:
        daemon.start()
        for path in ("tunnel", "absolute"):  # warm: the sandbox, the tool, undici and TLS code loaded
            _call(daemon, user, url, 20, envs[path])
        per_round = max(1, requests // ROUNDS)
        for _ in range(ROUNDS):
            for path in ("tunnel", "absolute"):
                seconds, spent = _call(daemon, user, url, per_round, envs[path])
                samples[path] += seconds
                cpu[path] += spent
    finally:
        daemon.stop(timeout=60)
        server.shutdown()
        server.server_close()
    return {path: {**summarize(samples[path]), "daemon_cpu_us_per_request": 1e6 * cpu[path] / len(samples[path])}
            for path in samples}
