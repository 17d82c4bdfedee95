"""egress.secrets end to end: a hostile tool holds only a stand-in, whatever it tries.

A real daemon and sandbox; three servers on 127.0.0.1: the secret's own host (plain HTTP, named
``http://`` so that the value may go there in clear: allow_unsafe: [secrets_in_clear]),
another host the policy allows, and the secret's TLS host, whose certificate a CA made here
signed (the daemon is given it as egress.ca_file). The tool (tests/e2e/tools/secret_thief)
sends its OFFICER_APIFY_TOKEN every way it can: fetch and http/https, in headers, queries and
bodies, to its own hosts and elsewhere, spoofing Host, through a raw tunnel, from a python
child; writes it to a file, prints it. The real value must reach the own hosts' headers and
queries only (not a body, not a tunnel), and never the tool, its output or the daemon's log.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote, unquote

import pytest

from sandboxd.rules.secrets import STAND_IN_PREFIX
from tests.e2e.conftest import write_tool
from tests.tls_certs import make_ca

pytestmark = pytest.mark.docker

USER = "secrets@example.com"
NAME = "OFFICER_APIFY_TOKEN"
REAL = "apify_api_REAL/9f+x=1-e2e"  # characters a URL must encode
FORMS = (REAL, quote(REAL, safe=""), quote(REAL))  # as written, and percent-encoded either way


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def _record(self) -> None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while (size := int(self.rfile.readline().strip() or b"0", 16)):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append({"path": self.path, "headers": dict(self.headers.items()),
                                     "body": body.decode("utf-8", "replace")})
        reply = b"ok"  # never the request echoed: an API that reflects its key would hand it to the tool
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = _record  # noqa: N815 (the stdlib's names)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    requests: list[dict[str, Any]]

    def by_path(self, prefix: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"].split("?")[0] == prefix]

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a refused handshake, say: the test looks at what arrived


def _serve(tls_context: Any = None) -> _Server:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.requests = []
    if tls_context is not None:
        server.socket = tls_context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[_Server, _Server, _Server, Path]]:
    ca = make_ca(tmp_path / "ca")
    found = (_serve(), _serve(), _serve(ca.server_context()))
    yield *found, ca.ca_file
    for server in found:
        server.shutdown()
        server.server_close()


def holds_real(text: str) -> bool:
    return any(form in text for form in FORMS)


def test_a_hostile_tool_holds_a_stand_in_and_only_the_secrets_hosts_get_the_value(
        make_daemon: Any, servers: tuple[_Server, _Server, _Server, Path]) -> None:
    own, other, tls, ca_file = servers
    own_port, other_port, tls_port = (s.server_address[1] for s in (own, other, tls))
    daemon = make_daemon(env={
        "SANDBOXD_EGRESS_ALLOW": json.dumps([f"127.0.0.1:{p}" for p in (own_port, other_port, tls_port)]),
        "SANDBOXD_EGRESS_SECRETS": json.dumps({NAME: [f"http://127.0.0.1:{own_port}", f"127.0.0.1:{tls_port}"]}),
        "SANDBOXD_ALLOW_UNSAFE": "secrets_in_clear",
        "SANDBOXD_EGRESS_CA_FILE": str(ca_file),
    })
    with daemon.client() as client:
        result = client.call_tool(USER, "secret_thief", {"own": own_port, "other": other_port, "tls": tls_port},
                                  env={NAME: REAL}, timeoutMs=60_000)
    assert result["status"] == "ok", result
    seen = json.loads(result["content"][0]["text"])
    stand_in = seen["env"]

    # The tool: only the stand-in, in its env, its files, its output.
    assert stand_in.startswith(STAND_IN_PREFIX) and not holds_real(json.dumps(result)), result
    assert seen["file"] == stand_in and not holds_real(seen["environ"])
    for key in ("fetchOwn", "httpOwn", "fetchOther", "httpOther", "fetchTls", "httpsTls", "pythonTls"):
        assert seen[key] == "200 ok" or seen[key].strip() == "ok", (key, seen[key])

    # The own host: the value in every header and the query, never in a body.
    (api,) = own.by_path("/api")
    assert api["headers"]["Authorization"] == f"Bearer {REAL}" and api["headers"]["X-Api-Key"] == REAL
    assert unquote(api["path"].split("token=")[1]) == REAL
    assert json.loads(api["body"]) == {"token": stand_in}
    (module,) = own.by_path("/module")
    assert module["headers"]["X-Api-Key"] == REAL and unquote(module["path"].split("token=")[1]) == REAL
    assert module["body"] == f"token={stand_in}"
    (tunnelled,) = own.by_path("/tunnel")  # the proxy cannot read a tunnel: the stand-in, as it was sent
    assert stand_in in tunnelled["path"] and not holds_real(json.dumps(tunnelled))

    # Another allowed host never gets it, however the request names the secret's host.
    assert {r["path"].split("?")[0] for r in other.requests} == {"/steal", "/steal-module", "/spoof"}
    for request in other.requests:
        assert not holds_real(json.dumps(request)) and stand_in in json.dumps(request), request

    # HTTPS: the proxy made the TLS connection (verified against the CA it was given) and put the value in.
    (tls_fetch,) = tls.by_path("/tls")
    assert tls_fetch["headers"]["X-Api-Key"] == REAL and unquote(tls_fetch["path"].split("token=")[1]) == REAL
    assert json.loads(tls_fetch["body"]) == {"token": stand_in}
    (tls_module,) = tls.by_path("/tls-module")
    assert tls_module["headers"]["X-Api-Key"] == REAL and tls_module["body"] == f"token={stand_in}"
    (python_child,) = tls.by_path("/python-tls")  # a child's https is a tunnel: no substitution
    assert python_child["headers"]["X-Api-Key"] == stand_in

    # The log: the name of what was put in, and where a stand-in went astray; never the value.
    log = daemon.log_path.read_text(errors="replace")
    assert not holds_real(log)
    used = [e for e in daemon.events("egress", decision="allowed") if e.get("secrets") == [NAME]]
    assert {e["port"] for e in used} == {own_port, tls_port} and len(used) == 4, used
    # Only the request the proxy could read (the spoof, in absolute form): fetch and http to a host
    # no secret names tunnel, unread.
    astray = [e for e in daemon.events("egress") if e.get("stand_ins_misdirected") == [NAME]]
    assert [e["port"] for e in astray] == [other_port], astray


def test_a_secrets_https_host_with_a_certificate_the_daemon_does_not_trust_gets_nothing(
        make_daemon: Any, servers: tuple[_Server, _Server, _Server, Path]) -> None:
    own, other, tls, _ca_file = servers  # no egress.ca_file: the host's trust store alone
    tls_port = tls.server_address[1]
    daemon = make_daemon(env={"SANDBOXD_EGRESS_ALLOW": json.dumps([f"127.0.0.1:{tls_port}"]),
                              "SANDBOXD_EGRESS_SECRETS": json.dumps({NAME: [f"127.0.0.1:{tls_port}"]})})
    with daemon.client() as client:
        result = client.call_tool(USER, "secret_thief", {"own": 1, "other": 2, "tls": tls_port},
                                  env={NAME: REAL}, timeoutMs=60_000)
    seen = json.loads(result["content"][0]["text"])
    assert seen["fetchTls"].startswith("502") and "certificate was not accepted" in seen["fetchTls"], seen
    assert seen["httpsTls"].startswith("502"), seen
    assert tls.by_path("/tls") == [] and tls.by_path("/tls-module") == []
    assert not holds_real(daemon.log_path.read_text(errors="replace"))


LEAVER = r"""
export async function execute(_id: string, params: { port: number }) {
  // A request with the secret, never awaited: the tool returns while the host still holds it.
  (globalThis as any).left = fetch(`http://127.0.0.1:${params.port}/hold`, {
    headers: { "X-Api-Key": process.env.OFFICER_APIFY_TOKEN! } }).catch(() => {});
  await new Promise((resolve) => setTimeout(resolve, 1000));
  return { content: [{ type: "text", text: "left it open" }] };
}
"""


def test_a_request_carrying_the_value_ends_when_its_call_is_answered(make_daemon: Any) -> None:
    """Issue 36, item 3: a connection the proxy put the value into is the call's. The tool leaves one
    open past its answer (the host never answers it); the host sees it closed within a second."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: dict[str, Any] = {}

    def hold() -> None:
        conn, _ = listener.accept()
        head = b""
        while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
            head += chunk
        seen["head"] = head
        while conn.recv(4096):  # held, unanswered, until the proxy ends it
            pass
        seen["closed"] = time.monotonic()
        conn.close()

    threading.Thread(target=hold, daemon=True).start()
    daemon = make_daemon(env={"SANDBOXD_EGRESS_ALLOW": json.dumps([f"127.0.0.1:{port}"]),
                              "SANDBOXD_EGRESS_SECRETS": json.dumps({NAME: [f"http://127.0.0.1:{port}"]}),
                              "SANDBOXD_ALLOW_UNSAFE": "secrets_in_clear"}, start=False)
    write_tool(daemon.data / "tools", "leaver", LEAVER,
               inputs="  port:\n    type: number\n    description: The secret's host's port.\n")
    daemon.start()
    try:
        with daemon.client() as client:
            result = client.call_tool(USER, "leaver", {"port": port}, env={NAME: REAL}, timeoutMs=60_000)
        answered = time.monotonic()
        assert result["status"] == "ok", result
        assert REAL.encode() in seen.get("head", b""), seen  # the value went in: the connection is the call's
        while "closed" not in seen and time.monotonic() < answered + 5:
            time.sleep(0.02)
        assert "closed" in seen, "the request carrying the value is still open 5 s after the call's answer"
        assert seen["closed"] - answered < 1.0, f"closed {seen['closed'] - answered:.2f} s after the answer"
    finally:
        listener.close()
