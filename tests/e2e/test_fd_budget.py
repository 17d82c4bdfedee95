"""File descriptors are shared out (service/fds.py), end to end: a real daemon started with
systemd's default soft limit (1024), the default configuration, four users' tools holding every
egress tunnel they can and a client holding thousands of idle connections to the API socket;
meanwhile a bystander's calls, its egress and a new client are served, and the daemon never
meets EMFILE.

The daemon runs in a network namespace with only a loopback device; the tunnels go to a
server this test starts in that namespace, on 127.0.0.1, which egress.allow names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sandboxd.client import Client
from tests.e2e.conftest import Daemon, write_tool

pytestmark = pytest.mark.docker

PORT = 18099  # in the daemon's own network namespace, where nothing else listens
NOBODY = 65534
SOFT, HARD = 1024, 3072  # systemd's default soft limit; a hard one just above what the defaults need (2688)
FLOODERS = [f"flood{i}@example.com" for i in range(4)]
BYSTANDER = "bystander@example.com"
HOLD_S = 25

# Answers a GET, holds anything else (a tunnel) open and silent: as a slow origin would.
HOLDING_SERVER = """
import asyncio, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
held = []
async def serve(reader, writer):
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\\r\\n\\r\\n"), 2)
    except Exception:
        head = b""
    if head.startswith(b"GET "):
        writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 5\\r\\nConnection: close\\r\\n\\r\\nhello")
        await writer.drain()
        writer.close()
    else:
        held.append(writer)
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    print("listening", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""

# A client of another uid opening connection after connection and holding them all, idle.
HOSTILE_CLIENT = """
import json, os, resource, socket, sys, time
path, count, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
held, outcomes = [], {}
for _ in range(count):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    try:
        s.connect(path)
    except OSError as exc:
        outcomes["connect " + type(exc).__name__] = outcomes.get("connect " + type(exc).__name__, 0) + 1
        s.close()
        continue
    held.append(s)
time.sleep(hold)
messages = set()
for s in held:
    s.setblocking(False)
    try:
        data = s.recv(4096)
        key = "refused" if b"-32003" in data else ("closed" if not data else "other")
        if data:
            messages.add(json.loads(data.split(b"\\n")[0])["error"]["message"])
    except BlockingIOError:
        key = "served"  # open and unanswered: an idle connection the daemon keeps
    except OSError:
        key = "closed"
    outcomes[key] = outcomes.get(key, 0) + 1
print(json.dumps({"outcomes": outcomes, "messages": sorted(messages)}), flush=True)
"""

FLOOD_TOOL = """
import * as net from "node:net";

/** Open `count` CONNECT tunnels to `target` at once and hold every one that opens for `seconds`. */
export async function execute(_id: string, params: { target: string; count: number; seconds: number }) {
  const outcomes: Record<string, number> = {};
  const all: net.Socket[] = [];
  const one = () => new Promise<void>((resolve) => {
    const sock = net.connect({ path: "/officer/run/egress.sock" });
    all.push(sock);
    let head = "";
    let done = false;
    const finish = (outcome: string) => {
      if (!done) { done = true; outcomes[outcome] = (outcomes[outcome] ?? 0) + 1; resolve(); }
    };
    sock.on("connect", () => sock.write(`CONNECT ${params.target} HTTP/1.1\\r\\n\\r\\n`));
    sock.on("data", (d) => {
      head += d.toString("latin1");
      if (head.includes("\\r\\n\\r\\n")) finish(head.split("\\r\\n")[0]);
    });
    sock.on("error", (e: any) => finish(`error ${e?.code ?? e}`));
    sock.on("close", () => finish(head.split("\\r\\n")[0] || "closed"));
    setTimeout(() => finish("waiting"), params.seconds * 1000);
  });
  await Promise.all(Array.from({ length: params.count }, one));
  for (const sock of all) sock.destroy();
  return { content: [{ type: "text" as const, text: JSON.stringify(outcomes) }] };
}
"""


@pytest.fixture
def nobody_can_run_python() -> str:
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.fail("the hostile client runs as nobody under the system's python3 (stdlib only), which is missing")
    return python


def _in_namespace(daemon: Daemon, *command: str) -> subprocess.Popen[str]:
    assert daemon.proc is not None
    return subprocess.Popen(["nsenter", f"--net=/proc/{daemon.proc.pid}/ns/net", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_flooding_users_and_a_client_holding_thousands_of_connections_leave_a_bystander_served(
        make_daemon: Any, stopper: list[subprocess.Popen[str]], nobody_can_run_python: str) -> None:
    daemon: Daemon = make_daemon(
        config=f"socket_mode: '0666'\negress:\n  allow: ['127.0.0.1:{PORT}']\n",
        loopback_only=True, nofile=(SOFT, HARD), start=False)
    write_tool(daemon.data / "tools", "tunnel_flood", FLOOD_TOOL,
               inputs="  target:\n    type: string\n    description: host:port\n"
                      "  count:\n    type: number\n    description: tunnels\n"
                      "  seconds:\n    type: number\n    description: how long\n")
    os.chmod(daemon.socket.parent, 0o755)  # the hostile client is another uid
    daemon.start()
    assert daemon.proc is not None
    pid = daemon.proc.pid

    server = _in_namespace(daemon, sys.executable, "-c", HOLDING_SERVER, str(PORT))
    stopper.append(server)
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"

    def as_nobody() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    hostile = subprocess.Popen([nobody_can_run_python, "-c", HOSTILE_CLIENT, str(daemon.socket), "3000", str(HOLD_S)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=as_nobody)
    stopper.append(hostile)

    peak = [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            try:
                peak[0] = max(peak[0], _open_fds(pid))
            except OSError:
                return
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    floods: dict[str, Any] = {}

    def flood(user: str, index: int) -> None:
        with Client(daemon.socket, timeout=180) as client:
            floods[f"{user}#{index}"] = client.call_tool(
                user, "tunnel_flood", {"target": f"127.0.0.1:{PORT}", "count": 200, "seconds": HOLD_S},
                timeout_ms=150_000)

    threads = [threading.Thread(target=flood, args=(user, i)) for user in FLOODERS for i in range(4)]
    for thread in threads:
        thread.start()
    # Until the floods hold their tunnels: 16 sandboxes x 32.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(daemon.events("egress", decision="allowed")) < 16 * 32 * 0.9:
        time.sleep(0.5)
    tunnels = len(daemon.events("egress", decision="allowed"))

    # The bystander, meanwhile: a new client, answered; a call; its egress.
    started = time.monotonic()
    with Client(daemon.socket, timeout=60) as client:
        assert client.request("ping") == {}
        answered_s = time.monotonic() - started  # not behind the hostile's connections in the socket's backlog
        hello = client.call_tool(BYSTANDER, "hello", {"name": "neighbour"}, timeout_ms=60_000)
        assert hello["status"] == "ok", hello
        probe = client.call_tool(BYSTANDER, "egress_probe", {
            "mode": "raw", "request": f"GET http://127.0.0.1:{PORT}/ HTTP/1.1\r\nHost: 127.0.0.1:{PORT}\r\n\r\n"},
            timeout_ms=60_000)
    bystander_s = time.monotonic() - started
    assert probe["status"] == "ok", probe
    answer = json.loads(probe["content"][0]["text"])
    assert answer.get("answer", "").startswith("HTTP/1.1 200") and answer["answer"].endswith("hello"), answer

    for thread in threads:
        thread.join(180)
    out, _ = hostile.communicate(timeout=120)
    sampling.set()
    sampler.join()
    print(f"tunnels allowed {tunnels}; new client answered in {answered_s:.2f} s, bystander served in "
          f"{bystander_s:.1f} s; peak fds {peak[0]} of {HARD}")
    assert answered_s < 5, f"a new client waited {answered_s:.1f} s for its first answer"

    [budget] = daemon.events("fd_budget")
    assert (budget["soft_at_start"], budget["limit"]) == (SOFT, HARD), budget
    assert tunnels >= 16 * 32 * 0.9, "the floods held their tunnels: the daemon was under load"
    assert all(result["status"] == "ok" for result in floods.values()), floods
    hostile_seen = json.loads(out.strip().splitlines()[-1])
    print("hostile client", hostile_seen["outcomes"], "floods", [r["content"][0]["text"] for r in floods.values()][:2])
    # The hostile uid got its share, and its other connections a refusal naming the key, or closed.
    assert hostile_seen["outcomes"].get("served", 0) == budget["per_client"], hostile_seen
    assert any("max_client_connections" in message for message in hostile_seen["messages"]), hostile_seen
    assert peak[0] <= HARD - budget["reserved"] // 2, f"{peak[0]} descriptors open at the peak"
    log = daemon.log_path.read_text(errors="replace")
    for sign in ("EMFILE", "Errno 24", "Too many open files", "egress_accept_failed", "accept_failed"):
        assert sign not in log, f"{sign!r} in the daemon's log"
