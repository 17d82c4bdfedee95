"""egress.secrets: the stand-ins a sandbox holds, and the proxy putting the real values in (rules/secrets.py).

The rewriting alone first (headers, query, percent-encoding, split and repeated stand-ins,
which host a secret belongs to), then the proxy over real sockets to servers on 127.0.0.1,
plain and TLS (a CA made here, given to the proxy as egress.ca_file).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from sandboxd.config import ConfigError, EgressConfig, load_config
from sandboxd.egress.contract import EgressCall
from sandboxd.egress.proxy import EgressProxy
from sandboxd.logging import configure_logging, secret_values
from sandboxd.rules.secrets import STAND_IN_PREFIX, StandIns
from sandboxd.sandbox.backend import CallRequest
from tests.tls_certs import make_ca
from tests.unit.test_server import USER, Harness, serving

TOKEN = "real-token/with+odd=chars&more"
PORTS = frozenset({80, 443})


def stand_ins(hosts: list[str], value: str = TOKEN, name: str = "OFFICER_APIFY_TOKEN") -> tuple[str, StandIns]:
    env, found = StandIns.for_call({name: value, "PI_SEARXNG_URL": "http://searx:8080"}, {name: hosts})
    assert env["PI_SEARXNG_URL"] == "http://searx:8080"  # names egress.secrets does not list stay as they are
    return env[name], found


def head(target: str, *headers: str) -> bytes:
    return "\r\n".join([f"GET {target} HTTP/1.1", *headers, "Connection: close", "", ""]).encode()


def test_a_call_gets_a_fresh_stand_in_never_the_value() -> None:
    first, _ = stand_ins(["api.example.com"])
    second, _ = stand_ins(["api.example.com"])
    assert first.startswith(STAND_IN_PREFIX) and TOKEN not in first and first != second


def test_the_value_goes_into_any_header_and_the_query_on_its_own_host() -> None:
    stand_in, found = stand_ins(["api.example.com"])
    rewrite = found.rewrite(head(f"/v2/acts?token={stand_in}&x=1", "Host: api.example.com",
                                 f"Authorization: Bearer {stand_in}", f"X-Api-Key: {stand_in}"),
                            "api.example.com", 443, PORTS, tls=True)
    lines = rewrite.head.decode().split("\r\n")
    assert lines[0] == "GET /v2/acts?token=real-token%2Fwith%2Bodd%3Dchars%26more&x=1 HTTP/1.1"  # encoded in a URL
    assert f"Authorization: Bearer {TOKEN}" in lines and f"X-Api-Key: {TOKEN}" in lines
    assert stand_in not in rewrite.head.decode()
    assert rewrite.substituted == ("OFFICER_APIFY_TOKEN",) and rewrite.misdirected == ()


def test_a_request_to_a_secrets_host_asks_for_an_answer_the_proxy_can_read() -> None:
    """An answer is scrubbed of the values (egress/echoes.py): not compressed, or a value in it goes unseen."""
    stand_in, found = stand_ins(["api.example.com"])
    request = head("/", "Accept-Encoding: gzip, deflate, br", f"X-Api-Key: {stand_in}")
    assert b"\r\nAccept-Encoding: identity\r\n" in found.rewrite(request, "api.example.com", 443, PORTS, tls=True).head
    elsewhere = found.rewrite(request, "other.example.com", 443, PORTS, tls=True).head  # no value goes there
    assert b"Accept-Encoding: gzip, deflate, br" in elsewhere


def test_a_percent_encoded_stand_in_is_found_and_gets_the_value_encoded() -> None:
    stand_in, found = stand_ins(["api.example.com"])
    lower = "".join(f"%{ord(c):02x}" if i % 2 else c for i, c in enumerate(stand_in))  # every other one
    upper = "".join(f"%{ord(c):02X}" for c in stand_in)
    rewrite = found.rewrite(head(f"/?key={lower}", f"Cookie: k={upper}; v={stand_in.upper()}"),
                            "api.example.com", 443, PORTS, tls=True)
    text = rewrite.head.decode()
    assert "/?key=real-token%2Fwith%2Bodd%3Dchars%26more " in text
    assert f"Cookie: k=real-token%2Fwith%2Bodd%3Dchars%26more; v={stand_in.upper()}" in text  # not the stand-in
    assert rewrite.substituted == ("OFFICER_APIFY_TOKEN",)


def test_repeated_stand_ins_are_all_replaced_and_a_split_one_is_none() -> None:
    stand_in, found = stand_ins(["api.example.com"])
    half = len(stand_in) // 2
    rewrite = found.rewrite(head(f"/?a={stand_in}&b={stand_in}", f"X-Twice: {stand_in},{stand_in}",
                                 f"X-First-Half: {stand_in[:half]}", f"X-Second-Half: {stand_in[half:]}"),
                            "api.example.com", 443, PORTS, tls=True)
    text = rewrite.head.decode()
    assert text.count("real-token%2Fwith") == 2 and f"X-Twice: {TOKEN},{TOKEN}" in text
    assert f"X-First-Half: {stand_in[:half]}" in text and f"X-Second-Half: {stand_in[half:]}" in text


def test_the_path_is_left_alone() -> None:
    stand_in, found = stand_ins(["api.example.com"])
    rewrite = found.rewrite(head(f"/users/{stand_in}"), "api.example.com", 443, PORTS, tls=True)
    assert stand_in in rewrite.head.decode() and rewrite.substituted == ()


def test_basic_credentials_get_the_value_inside_their_base64() -> None:
    stand_in, found = stand_ins(["api.example.com"])
    basic = base64.b64encode(f"user:{stand_in}".encode()).decode()
    rewrite = found.rewrite(head("/", f"Authorization: Basic {basic}"), "api.example.com", 443, PORTS, tls=True)
    sent = rewrite.head.decode().split("\r\n")[1].split(" ")[-1]
    assert base64.b64decode(sent).decode() == f"user:{TOKEN}" and rewrite.substituted == ("OFFICER_APIFY_TOKEN",)


@pytest.mark.parametrize(("entry", "host", "port", "belongs"), [
    ("api.example.com", "api.example.com", 443, True),
    ("api.example.com", "api.example.com", 80, True),  # no port: the ports in egress.ports
    ("api.example.com", "api.example.com", 8443, False),
    ("api.example.com", "api.example.com.evil.test", 443, False),
    ("api.example.com", "evil.test", 443, False),
    ("api.example.com:8443", "api.example.com", 8443, True),
    ("api.example.com:8443", "api.example.com", 443, False),
    ("*.example.com", "eu.api.example.com", 443, True),
    ("*.example.com", "example.com", 443, False),
    ("127.0.0.1:18091", "127.0.0.1", 18091, True),
    ("127.0.0.1:18091", "127.0.0.1", 18092, False),
    ("127.0.0.1:18091", "localhost", 18091, False),  # names are not matched through their addresses
    ("10.1.2.0/24", "10.1.2.9", 443, True),
    ("[fd00::5]:8080", "fd00::5", 8080, True),
    ("[fd00::5]:8080", "fd00::6", 8080, False),
])
def test_which_host_a_secret_belongs_to(entry: str, host: str, port: int, belongs: bool) -> None:
    stand_in, found = stand_ins([entry])
    rewrite = found.rewrite(head(f"/?k={stand_in}", f"Authorization: Bearer {stand_in}"), host, port, PORTS, tls=True)
    assert (TOKEN in rewrite.head.decode()) is belongs
    assert rewrite.substituted == (("OFFICER_APIFY_TOKEN",) if belongs else ())
    assert rewrite.misdirected == (() if belongs else ("OFFICER_APIFY_TOKEN",))


def test_each_secret_goes_only_to_its_own_hosts() -> None:
    env, found = StandIns.for_call({"A_TOKEN": "value-of-a", "B_TOKEN": "value-of-b"},
                                   {"A_TOKEN": ["a.example.com"], "B_TOKEN": ["b.example.com"]})
    rewrite = found.rewrite(head("/", f"X-A: {env['A_TOKEN']}", f"X-B: {env['B_TOKEN']}"), "a.example.com", 443, PORTS,
                            tls=True)
    text = rewrite.head.decode()
    assert "X-A: value-of-a" in text and f"X-B: {env['B_TOKEN']}" in text and "value-of-b" not in text
    assert rewrite.substituted == ("A_TOKEN",) and rewrite.misdirected == ("B_TOKEN",)



@pytest.mark.parametrize(("entry", "port", "in_clear"), [
    ("api.example.com", 80, False),  # no port: egress.ports, 80 too, but over TLS only
    ("api.example.com", 443, False),  # plain HTTP to the TLS port is still plain
    ("api.example.com:8080", 8080, False),  # a port named without http:// is a TLS port
    ("http://api.example.com", 80, True),  # http:// without a port: 80 only
    ("http://api.example.com", 443, False),
    ("http://api.example.com:8080", 8080, True),
    ("http://10.1.2.0/24:8080", 8080, False),  # a network entry matches an IP literal, not a name
])
def test_the_value_goes_in_plain_http_only_to_an_http_entry(entry: str, port: int, in_clear: bool) -> None:
    stand_in, found = stand_ins([entry])
    request = head(f"/v2/acts?token={stand_in}", f"X-Api-Key: {stand_in}")
    rewrite = found.rewrite(request, "api.example.com", port, PORTS, tls=False)
    named = ("OFFICER_APIFY_TOKEN",)
    assert (TOKEN.encode() in rewrite.head) is in_clear and rewrite.substituted == (named if in_clear else ())
    held = found.held_back(request, "api.example.com", port, PORTS)
    belongs = found.secrets[0].belongs_to("api.example.com", port, PORTS)
    assert held == (named if belongs and not in_clear else ()), held
    assert found.held_back(head("/v2/acts"), "api.example.com", port, PORTS) == ()  # no stand-in: nothing held


def test_the_shim_is_told_the_hosts_not_the_values() -> None:
    _, found = stand_ins(["api.example.com", "*.apify.com:8443", "10.1.2.0/24", "http://searx.internal"])
    hosts = found.shim_hosts()
    assert hosts == [{"port": None, "host": "api.example.com"}, {"port": 8443, "host": "*.apify.com"},
                     {"port": None, "network": "10.1.2.0/24"}, {"port": 80, "host": "searx.internal"}]
    assert TOKEN not in json.dumps(hosts)


def test_the_configuration_names_the_problem() -> None:
    config = load_config(None, environ={"SANDBOXD_EGRESS_SECRETS": '{"OFFICER_APIFY_TOKEN": ["127.0.0.1:18091"]}'})
    assert config.egress.secrets == {"OFFICER_APIFY_TOKEN": ["127.0.0.1:18091"]}
    with pytest.raises(ConfigError, match="calls.allowed_env does not list"):
        load_config(None, environ={"SANDBOXD_EGRESS_SECRETS": '{"MY_TOKEN": ["a.example.com"]}'})
    with pytest.raises(ConfigError, match="OFFICER_APIFY_TOKEN: entry 'a b' is not a host name"):
        load_config(None, environ={"SANDBOXD_EGRESS_SECRETS": '{"OFFICER_APIFY_TOKEN": ["a b"]}'})
    with pytest.raises(ConfigError, match="name at least one host"):
        load_config(None, environ={"SANDBOXD_EGRESS_SECRETS": '{"OFFICER_APIFY_TOKEN": []}'})
    clear = '{"OFFICER_APIFY_TOKEN": ["api.apify.com", "http://searx.internal:8080"]}'
    with pytest.raises(ConfigError, match=r"http://searx.internal:8080 let a secret's value cross the network in plain "
                                          r"HTTP.*allow_unsafe: \[secrets_in_clear\]"):
        load_config(None, environ={"SANDBOXD_EGRESS_SECRETS": clear})
    accepted = load_config(None, environ={"SANDBOXD_EGRESS_SECRETS": clear,
                                          "SANDBOXD_ALLOW_UNSAFE": "secrets_in_clear"})
    assert accepted.egress.secrets["OFFICER_APIFY_TOKEN"][1] == "http://searx.internal:8080"
    with pytest.raises(ConfigError, match="OFFICER_APIFY_TOKEN: entry 'a b' is not a host name"):
        load_config(None, environ={"SANDBOXD_EGRESS_SECRETS": '{"OFFICER_APIFY_TOKEN": ["http://a b"]}'})
    with pytest.raises(ConfigError, match="not a readable PEM file"):
        load_config(None, environ={"SANDBOXD_EGRESS_CA_FILE": "/nonexistent/ca.pem"})


# --- the proxy, over real sockets ----------------------------------------------------------------

class Origin:
    """An HTTP server on 127.0.0.1 (TLS with ``tls``) that keeps each request, head and body, and answers 200
    (or what ``answer`` makes of the head)."""

    def __init__(self, tls: ssl.SSLContext | None = None, answer: Any = None) -> None:
        self.tls = tls
        self.answer = answer or (lambda _head: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        self.requests: list[tuple[bytes, bytes]] = []
        self.port = 0

    async def start(self) -> Origin:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        writer.write(self.answer(head))
        await writer.drain()
        writer.close()


async def send(session: Any, *parts: bytes) -> bytes:
    """``parts`` to a session over a socketpair, each in a write of its own; the answer, to the end."""
    ours, theirs = socket.socketpair()
    task = asyncio.ensure_future(session.handle(theirs))
    reader, writer = await asyncio.open_connection(sock=ours)
    for part in parts:
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.01)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await asyncio.wait_for(task, 10)
    return answer


def test_the_proxy_puts_the_value_in_the_head_never_the_body_and_logs_the_name(tmp_path: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)

    async def scenario() -> None:
        own, other = await Origin().start(), await Origin().start()
        entry = f"127.0.0.1:{own.port}"  # named http://: the value may go in clear (allow_unsafe: [secrets_in_clear])
        proxy = EgressProxy(EgressConfig(allow=[entry, f"127.0.0.1:{other.port}"], secrets={"T": [f"http://{entry}"]}))
        env, found = StandIns.for_call({"T": TOKEN}, {"T": [f"http://{entry}"]})
        stand_in = env["T"]
        with secret_values([TOKEN]):  # as CallRunner registers a call's env values
            session = proxy.session("a@b.c", "s", lambda: EgressCall("t", frozenset({TOKEN}), found))
        body = f'{{"token": "{stand_in}"}}'.encode()
        request = (f"POST http://{entry}/run?token={stand_in} HTTP/1.1\r\nHost: {entry}\r\n"
                   f"Authorization: Bearer {stand_in}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        cut = request.index(stand_in.encode()) + 10  # the head arrives in two pieces, the stand-in cut in two
        assert (await send(session, request[:cut], request[cut:], body)).endswith(b"ok")
        (sent_head, sent_body), = own.requests
        assert f"Authorization: Bearer {TOKEN}".encode() in sent_head and b"token=real-token%2F" in sent_head
        assert sent_body == body and TOKEN.encode() not in sent_body
        # Another host named in Host gets nowhere: the URL says where the request goes, and its Host too.
        other_request = (f"GET http://127.0.0.1:{other.port}/?token={stand_in} HTTP/1.1\r\nHost: {entry}\r\n"
                         f"Authorization: Bearer {stand_in}\r\n\r\n").encode()
        assert (await send(session, other_request)).endswith(b"ok")
        (other_head, _), = other.requests
        assert stand_in.encode() in other_head and TOKEN.encode() not in other_head
        assert f"\r\nHost: 127.0.0.1:{other.port}\r\n".encode() in other_head and entry.encode() not in other_head
        assert proxy.secret_uses == {"T": 1}

    asyncio.run(scenario())
    events = [json.loads(line) for line in stream.getvalue().splitlines() if '"egress"' in line]
    assert TOKEN not in stream.getvalue()
    assert [e.get("secrets") for e in events] == [["T"], None]
    assert [e.get("stand_ins_misdirected") for e in events] == [None, ["T"]]


def test_https_in_absolute_form_is_made_by_the_proxy_verifying_the_origin(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    stranger = make_ca(tmp_path / "stranger", name="someone else's CA")

    async def scenario() -> None:
        own = await Origin(ca.server_context()).start()
        impostor = await Origin(stranger.server_context()).start()
        entries = [f"127.0.0.1:{own.port}", f"127.0.0.1:{impostor.port}"]
        proxy = EgressProxy(EgressConfig(allow=entries, secrets={"T": entries}, ca_file=ca.ca_file))
        env, found = StandIns.for_call({"T": TOKEN}, {"T": entries})
        session = proxy.session("a@b.c", "s", lambda: EgressCall("t", frozenset({TOKEN}), found))
        # A Host of the tool's choosing (domain fronting: another site behind the same server) is replaced.
        answer = await send(session, (f"GET https://127.0.0.1:{own.port}/?k={env['T']} HTTP/1.1\r\n"
                                      f"Host: attacker.example\r\nX-Key: {env['T']}\r\n\r\n").encode())
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"ok"), answer
        (sent, _), = own.requests
        assert f"X-Key: {TOKEN}".encode() in sent and b"?k=real-token%2F" in sent
        assert f"\r\nHost: 127.0.0.1:{own.port}\r\n".encode() in sent and b"attacker" not in sent
        refused = await send(session, f"GET https://127.0.0.1:{impostor.port}/ HTTP/1.1\r\nX-Key: {env['T']}\r\n\r\n"
                             .encode())
        assert refused.startswith(b"HTTP/1.1 502") and b"certificate was not accepted" in refused, refused
        assert impostor.requests == []
        # A host no secret names keeps https end to end: CONNECT, not the proxy's own TLS.
        plain = EgressProxy(EgressConfig(allow=entries, ca_file=ca.ca_file))
        answer = await send(plain.session("a@b.c", "s", lambda: EgressCall("t", frozenset(), StandIns())),
                            f"GET https://127.0.0.1:{own.port}/ HTTP/1.1\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 400") and b"https goes through CONNECT" in answer
        assert len(own.requests) == 1

    asyncio.run(scenario())


def test_a_stand_in_in_plain_http_to_its_host_is_refused_before_anything_is_sent() -> None:
    """Issue 44, item 2: an entry without a port covers egress.ports, 80 included; the value still goes only
    over TLS. ``http://host/`` and ``http://host:443/`` with the stand-in: 403 naming the fix, no connect."""

    async def scenario() -> None:
        origin = await Origin().start()
        proxy = EgressProxy(EgressConfig(allow=["127.0.0.1"], ports=[origin.port, 443], secrets={"T": ["127.0.0.1"]}))
        env, found = StandIns.for_call({"T": TOKEN}, {"T": ["127.0.0.1"]})
        session = proxy.session("a@b.c", "s", lambda: EgressCall("t", frozenset({TOKEN}), found))
        for port in (origin.port, 443):
            answer = await send(session, f"GET http://127.0.0.1:{port}/v2/acts?token={env['T']} HTTP/1.1\r\n\r\n"
                                .encode())
            assert answer.startswith(b"HTTP/1.1 403") and b"whose value goes only over TLS" in answer, answer
            assert f"name http://127.0.0.1:{port} in egress.secrets".encode() in answer and TOKEN.encode() not in answer
        assert origin.requests == [] and proxy.secret_uses == {}
        # Without the stand-in the host is reached as any allowed one.
        assert (await send(session, f"GET http://127.0.0.1:{origin.port}/ HTTP/1.1\r\n\r\n".encode())).endswith(b"ok")
        assert len(origin.requests) == 1

    asyncio.run(scenario())


def test_a_value_the_host_sends_back_reaches_the_sandbox_as_its_stand_in(tmp_path: Path) -> None:
    """The host's ordinary 301 to its https URL repeats the query the value went into, in Location and in
    its body: the sandbox gets the stand-in in the head and stars of the same length in the body."""
    ca = make_ca(tmp_path / "ca")

    def moved(head: bytes) -> bytes:
        target = head.split(b" ")[1]
        body = b'<a href="https://127.0.0.1' + target + b'">moved</a>'
        return (b"HTTP/1.1 301 Moved Permanently\r\nLocation: https://127.0.0.1" + target + b"\r\nSet-Cookie: k=" +
                TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def scenario() -> bytes:
        origin = await Origin(ca.server_context(), moved).start()
        entry = f"127.0.0.1:{origin.port}"
        proxy = EgressProxy(EgressConfig(allow=[entry], secrets={"T": [entry]}, ca_file=ca.ca_file))
        env, found = StandIns.for_call({"T": TOKEN}, {"T": [entry]})
        session = proxy.session("a@b.c", "s", lambda: EgressCall("t", frozenset({TOKEN}), found))
        answer = await send(session, f"GET https://{entry}/v2/acts?token={env['T']} HTTP/1.1\r\n\r\n".encode())
        assert b"token=real-token%2F" in origin.requests[0][0]  # the value went in, over TLS
        head, _, body = answer.partition(b"\r\n\r\n")
        assert f"Location: https://127.0.0.1/v2/acts?token={env['T']}\r\n".encode() in head, head
        assert f"Set-Cookie: k={env['T']}".encode() in head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert len(body) == length and body.count(b"*") == len(quote(TOKEN, safe="")), body
        return answer

    answer = asyncio.run(scenario())
    assert TOKEN.encode() not in answer and quote(TOKEN, safe="").encode() not in answer


def test_a_call_sends_its_sandbox_stand_ins_and_the_hosts_and_a_bad_value_is_refused(tmp_path: Path) -> None:
    sent: list[CallRequest] = []

    async def record(request: CallRequest, on_progress: Any, aborted: asyncio.Event) -> dict[str, Any]:
        sent.append(request)
        return {"status": "ok", "content": [{"type": "text", "text": "hi"}], "isError": False}

    @serving(tmp_path, record, egress={"secrets": {"OFFICER_APIFY_TOKEN": ["api.example.com"]}})
    async def _(h: Harness) -> None:
        conn = await h.connect()
        call = {"user": USER, "name": "hello", "arguments": {"name": "x"},
                "env": {"OFFICER_APIFY_TOKEN": TOKEN, "PI_SEARXNG_URL": "http://searx:8080"}}
        assert (await conn.request("tools/call", call))["result"]["status"] == "ok"
        (request,) = sent
        params = request.to_params()
        assert params["env"]["OFFICER_APIFY_TOKEN"].startswith(STAND_IN_PREFIX)
        assert params["env"]["PI_SEARXNG_URL"] == "http://searx:8080" and TOKEN not in json.dumps(params)
        assert params["egressSecretHosts"] == [{"port": None, "host": "api.example.com"}]
        assert request.stand_ins is not None and request.stand_ins.secrets[0].value == TOKEN
        bad = await conn.request("tools/call", {**call, "env": {"OFFICER_APIFY_TOKEN": "tok\r\nX-Evil: 1"}},
                                 request_id=2)
        assert bad["error"]["code"] == -32602 and "OFFICER_APIFY_TOKEN is an egress secret" in bad["error"]["message"]
        assert "tok" not in bad["error"]["message"] and len(sent) == 1
