"""Issue 44, item 2: a secret's value goes out only over TLS, and never comes back to the tool.

A real daemon in a network namespace of its own (loopback only). In that namespace this test
runs the secret's host as an HTTPS-only API is usually run: port 80 answers every request with
nginx's ``301 https://$host$request_uri``, port 443 is TLS (a CA made here, given to the daemon
as egress.ca_file) and redirects ``/v2/acts`` to ``/v2/acts/`` with the query, Apache-style, the
URL in its body too. Both ports sit behind a recorder that keeps every byte crossing the
namespace's loopback to them, both ways: what a capture there would show. The egress.secrets
entry names the host without a port, so it covers egress.ports, 80 included: the docs' example.

The hostile tool asks for ``http://host/v2/acts?token=<stand-in>``, ``http://host:443/...`` and
``https://host/v2/acts?token=<stand-in>`` without following redirects, then once following them.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import pytest

from sandboxd.rules.secrets import STAND_IN_PREFIX
from tests.e2e.conftest import Daemon, write_tool
from tests.tls_certs import make_ca

pytestmark = pytest.mark.docker

USER = "tls-only@example.com"
NAME = "OFFICER_APIFY_TOKEN"
REAL = "apify_api_REAL/44+tls=only"  # characters a URL must encode
FORMS = (REAL, quote(REAL, safe=""), quote(REAL), quote(REAL, safe="").lower())

# The host's two faces (ports 80 and 443, the recorder's) and the servers behind them.
HOST = r'''
import http.server, json, socket, ssl, sys, threading
cert, key, folder = sys.argv[1], sys.argv[2], sys.argv[3]
lock = threading.Lock()

def keep(name, data):
    with lock, open(f"{folder}/{name}", "ab") as f:
        f.write(data)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        keep("requests.jsonl", (json.dumps({"port": self.server.server_address[1], "path": self.path,
                                            "headers": dict(self.headers.items())}) + "\n").encode())
        path, _, query = self.path.partition("?")
        if self.server.server_address[1] == 8080:  # nginx: every plain request to its https URL
            self.moved("https://127.0.0.1" + self.path, b"")
        elif path == "/v2/acts":  # Apache's trailing-slash redirect, the query kept, the URL in the body
            url = "https://127.0.0.1/v2/acts/?" + query
            self.moved(url, f'<p>The document has moved <a href="{url}">here</a>.</p>'.encode())
        else:
            self.answer(200, [], b"acts")

    def moved(self, url, body):
        self.answer(301, [("Location", url)], body)

    def answer(self, status, headers, body):
        self.send_response(status)
        for name, value in headers + [("Content-Length", str(len(body))), ("Connection", "close")]:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

def serve(port, tls):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    server.handle_error = lambda *args: None  # plain HTTP on the TLS port, say
    threading.Thread(target=server.serve_forever, daemon=True).start()

def pump(src, dst):
    while data := src.recv(65536):
        keep("wire.bin", data)  # the loopback's bytes, both ways
        dst.sendall(data)
    dst.shutdown(socket.SHUT_WR)

def record(port, behind):
    listener = socket.create_server(("127.0.0.1", port))
    def run():
        while True:
            client, _ = listener.accept()
            server = socket.create_connection(("127.0.0.1", behind))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=lambda a=a, b=b: _safe(pump, a, b), daemon=True).start()
    threading.Thread(target=run, daemon=True).start()

def _safe(f, *args):
    try:
        f(*args)
    except OSError:
        pass

serve(8080, False)
serve(8443, True)
record(80, 8080)
record(443, 8443)
print("ready", flush=True)
threading.Event().wait()
'''

TOOL = r"""
async function get(url: string, token: string, redirect: "manual" | "follow") {
  try {
    const res = await fetch(url, { redirect, headers: { "X-Api-Key": token }, signal: AbortSignal.timeout(15_000) });
    return { status: res.status, location: res.headers.get("location"), url: res.url, body: await res.text() };
  } catch (e: any) {
    return { error: `${e?.message ?? e} ${e?.cause?.message ?? ""}` };
  }
}

export async function execute(_id: string, _params: {}) {
  const token = process.env.OFFICER_APIFY_TOKEN!;
  const query = `/v2/acts?token=${encodeURIComponent(token)}`;
  const seen = {
    token,
    plain: await get(`http://127.0.0.1${query}`, token, "manual"),
    plainOnTlsPort: await get(`http://127.0.0.1:443${query}`, token, "manual"),
    https: await get(`https://127.0.0.1${query}`, token, "manual"),
    followed: await get(`https://127.0.0.1${query}`, token, "follow"),
  };
  return { content: [{ type: "text", text: JSON.stringify(seen) }] };
}
"""


def holds_real(data: str | bytes) -> bool:
    text = data.decode("latin-1") if isinstance(data, bytes) else data
    return any(form in text for form in FORMS)


@pytest.fixture
def secret_host(make_daemon: Any, tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    ca = make_ca(tmp_path / "ca")
    daemon = make_daemon(env={"SANDBOXD_EGRESS_ALLOW": json.dumps(["127.0.0.1"]),
                              "SANDBOXD_EGRESS_SECRETS": json.dumps({NAME: ["127.0.0.1"]}),  # no port: 80 and 443
                              "SANDBOXD_EGRESS_CA_FILE": str(ca.ca_file)},
                         loopback_only=True, start=False)
    write_tool(daemon.data / "tools", "redirected", TOOL)
    daemon.start()
    folder = tmp_path / "wire"
    folder.mkdir()
    (tmp_path / "host.py").write_text(HOST)
    assert daemon.proc is not None
    host = subprocess.Popen(["nsenter", f"--net=/proc/{daemon.proc.pid}/ns/net", "--", sys.executable,
                             str(tmp_path / "host.py"), str(ca.cert_file), str(ca.key_file), str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert host.stdout is not None
        ready = select.select([host.stdout], [], [], 30)[0] and host.stdout.readline()
        assert ready == b"ready\n", f"the secret's host did not start: {ready!r}"
        yield daemon, folder
    finally:
        host.kill()
        host.wait()


def test_the_value_goes_only_over_tls_and_a_redirect_never_hands_it_back(
        secret_host: tuple[Daemon, Path]) -> None:
    daemon, folder = secret_host
    with daemon.client() as client:
        result = client.call_tool(USER, "redirected", {}, env={NAME: REAL}, timeoutMs=90_000)
    assert result["status"] == "ok", result
    seen = json.loads(result["content"][0]["text"])
    stand_in = seen["token"]
    time.sleep(0.5)  # the recorder's last writes
    wire = (folder / "wire.bin").read_bytes() if (folder / "wire.bin").exists() else b""
    requests = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]

    # The namespace's loopback to the host, both ways: TLS only, never a value in clear.
    assert wire, "the recorder saw nothing: the test would prove nothing"
    assert not holds_real(wire), f"a real value crossed the loopback in clear: {wire[:600]!r}"

    # Plain HTTP, on port 80 or 443: refused at the proxy naming the fix; nothing reached the host.
    for key in ("plain", "plainOnTlsPort"):
        answer = seen[key]
        assert answer.get("status") == 403 and "whose value goes only over TLS" in answer["body"], (key, answer)
        assert "allow_unsafe: [secrets_in_clear]" in answer["body"], answer
    assert [r for r in requests if r["port"] == 8080] == [], requests

    # HTTPS: the value went in (the host got it, decrypted), and its 301 came back with the stand-in.
    https = seen["https"]
    assert https["status"] == 301 and https["location"] == f"https://127.0.0.1/v2/acts/?token={stand_in}", https
    assert stand_in.startswith(STAND_IN_PREFIX) and not holds_real(json.dumps(seen)), seen
    assert seen["followed"]["status"] == 200 and seen["followed"]["body"] == "acts", seen["followed"]
    got = [r for r in requests if r["port"] == 8443]
    assert got and all(holds_real(r["path"]) and r["headers"]["X-Api-Key"] == REAL for r in got), got
    assert all(r["headers"]["Accept-Encoding"] == "identity" for r in got), got  # an answer the proxy can read

    log = daemon.log_path.read_text(errors="replace")
    assert not holds_real(log)
    refused = daemon.events("egress", decision="refused")
    assert [(e["port"], e["reason"]) for e in refused] == [(80, "secret in clear"), (443, "secret in clear")], refused
    echoed = daemon.events("egress_secret_echoed")
    assert echoed and all(e["secrets"] == [NAME] for e in echoed), echoed
